"""The durable replay buffer, split by caller (``rollout.RolloutBuffer``,
``trainer.TrainerBuffer``, ``control.ControlPlaneBuffer`` over ``base.BufferBase``), and the
values that cross its boundary."""
