"""From a step's groups to every rank's work: advantages, then the partition into micro-batches (rank 0).

The same code plans a step of a live run (``Coordinator``, groups from the replay stream) and of a replay
(``Replayer``, groups from the run's record), so that a replay without overrides plans exactly what the run did.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from streamrl.config import Config
from streamrl.learner import batching
from streamrl.learner.partition import attention_cost, plan_micro_batches
from streamrl.learner.policy import Policy


@dataclass
class Plan:
    """What rank 0 plans for a policy version: per minibatch, a payload per rank (None on the other ranks, which
    receive theirs); the groups trained, in order; each minibatch's group ids and partition (per rank, per micro-batch: sequence indices), the
    ledger outcome of the groups read and not trained, and the version's figures for its metrics line."""

    payloads: list[list[bytes] | None]
    groups: list = field(default_factory=list)
    members: list[list[str]] = field(default_factory=list)
    partition: list[list[list[list[int]]]] = field(default_factory=list)
    outcomes: dict[str, str] = field(default_factory=dict)
    read: dict[str, tuple[float, float]] = field(default_factory=dict)  # every group read: (seconds, mean reward)
    info: dict = field(default_factory=dict)


class Planner:
    """Advantages and partition of a step's groups; with ``learner.kl_in_reward`` the reference whose KL goes into
    the rewards (rank 0 alone: whole, never sharded)."""

    def __init__(self, cfg: Config, policy: Policy, world: int):
        self.cfg, self.world = cfg, world
        self.hidden = policy.module.config.hidden_size
        learner = cfg.learner
        # A sequence with zero advantages adds nothing to a step unless the loss has terms of its own: PPO's
        # critic advantages (made later, per token), an entropy bonus, KL to the reference in the loss
        self.zero_advantage_is_inert = (learner.algorithm != "ppo" and learner.entropy_coef == 0
                                        and (learner.kl_coef == 0 or learner.kl_in_reward))
        self.reference = None
        if learner.kl_in_reward and learner.kl_coef > 0:
            from streamrl.learner.reference import Reference

            temperature = cfg.rollout.sampling.temperature
            self.reference = (Reference.base_of(policy.model, temperature) if learner.lora else
                              Reference.load(cfg.model.path, policy.device, policy.module.dtype, temperature))

    def advantages(self, groups: list, version: int, plan: Plan) -> list[tuple[list, list[batching.TrainSequence]]]:
        """The groups as ``learner.minibatches`` minibatches of whole groups, each with its sequences carrying
        their advantages (the reference's KL subtracted from the rewards first, with kl_in_reward)."""
        learner, info = self.cfg.learner, plan.info
        penalties = None
        if self.reference is not None:
            penalties = self.reference.kl_penalties(groups, learner.kl_coef, learner.kl_estimator,
                                                    learner.micro_batch_tokens)
            info["kl_penalty_mean"] = float(np.mean(np.concatenate(penalties)))
        turns = batching.TurnCredit(learner.turn_gamma, learner.turn_lam) if learner.credit == "turn" else None
        out = []
        for part in np.array_split(np.arange(len(groups)), learner.minibatches):
            mine = [groups[i] for i in part]
            out.append((mine, batching.sequences(mine, version, learner.algorithm,
                                                 None if penalties is None else [penalties[i] for i in part], turns)))
        if turns is not None:  # samples whose turns could not be told apart were scored as one turn
            info["turn_credit_fallbacks"] = sum(batching.turn_spans(s) is None for g in groups for s in g.samples)
        rewards = [s.reward for g in groups for s in g.samples]
        staleness = np.array([s.staleness for _, seqs in out for s in seqs])
        info.update(reward_mean=float(np.mean(rewards)), reward_std=float(np.std(rewards)), groups=len(groups),
                    staleness_hist={str(k): int(v) for k, v in zip(*np.unique(staleness, return_counts=True))},
                    group_ids=[g.group_id for g in groups], staleness_max=int(staleness.max()))
        return out

    def partition(self, parts: list[tuple[list, list[batching.TrainSequence]]], plan: Plan) -> None:
        """Each minibatch's sequences packed into micro-batches, the same number on every rank and balanced over
        them (``partition``), as one msgpack payload per rank. Sequences without a gradient are left out
        (``learner.skip_zero_advantage``); a rank left with nothing steps on a zero loss."""
        learner = self.cfg.learner
        imbalance, per_rank, tokens_global, skipped = 0.0, 0, 0, 0
        for groups, seqs in parts:
            tokens, count = int(sum(s.mask.sum() for s in seqs)), len(seqs)  # the loss's mean counts all of them
            if learner.skip_zero_advantage and self.zero_advantage_is_inert:
                seqs = [s for s in seqs if batching.has_gradient(s)]
                skipped += count - len(seqs)
            lengths = [len(s) for s in seqs]
            costs = [attention_cost(n, self.hidden) for n in lengths] if learner.balance == "flops" else None
            split = plan_micro_batches(lengths, self.world, learner.micro_batch_tokens, costs)
            plan.payloads.append([batching.encode_shard([[seqs[i] for i in mb] for mb in rank], tokens, count)
                                  for rank in split.ranks])
            plan.members.append([g.group_id for g in groups])
            plan.partition.append([[[int(i) for i in mb] for mb in rank] for rank in split.ranks])
            loads = [sum(lengths[i] for i in mb) for rank in split.ranks for mb in rank]
            imbalance = max(imbalance, max(loads) / max(sum(loads) / len(loads), 1e-9))
            per_rank += split.per_rank
            tokens_global += tokens
        plan.info.update(micro_batch_imbalance=imbalance, micro_batches_per_rank=per_rank,
                         tokens_global=tokens_global, zero_advantage_skipped=skipped)
