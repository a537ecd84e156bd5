"""The learner: partitioning, advantages and losses, the DeepSpeed engine, checkpoints, weight push."""
