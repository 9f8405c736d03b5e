"""Running a model on its mesh: pipeline stages and schedules, the training step, mixed precision,
loss scaling, offload."""
