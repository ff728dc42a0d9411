"""The trainer: GRPO loss, sequence packing, FSDP ranks, checkpoints, weight publishing."""
