"""The two roles of a RefitJob's ranks: ``policy`` (training, sends) and ``rollout``
(inference, receives).  Names, labels, rendezvous keys and the worker config all use these.
"""

from __future__ import annotations

from typing import Literal

Role = Literal["policy", "rollout"]
#: In rank-numbering order: policy ranks first, then rollout ranks.
ROLES: tuple[Role, Role] = ("policy", "rollout")


def check_role(role: str) -> Role:
    """``role`` as a Role; ValueError naming it otherwise."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} is neither 'policy' nor 'rollout'")
    return role
