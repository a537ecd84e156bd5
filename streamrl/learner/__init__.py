"""The learner: packing and partitioning, advantages and losses, the policy and its reference under DeepSpeed,
checkpoints, the weight push."""
