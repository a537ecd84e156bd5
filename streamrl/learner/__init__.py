"""The learner: rank 0 coordinates each policy version (``coordinator``: the plan from the replay stream, and its
commit), every rank trains (the policy and its reference under DeepSpeed, the critic, losses, packed forwards),
checkpoints, the weight push."""
