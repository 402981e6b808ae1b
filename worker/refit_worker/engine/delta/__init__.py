"""Delta refits: the element codec, and the blocks of sharded senders."""
