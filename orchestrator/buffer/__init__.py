"""The durable replay buffer (``Buffer``) and the values that cross its boundary."""
