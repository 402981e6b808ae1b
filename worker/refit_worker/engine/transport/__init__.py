"""The NIXL transport: the agent, memory registrations, the peers, what both roles share."""
