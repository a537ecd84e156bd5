"""``streamrl launch-learner``: the training loop, one process per data-parallel rank (torchrun).

Rank 0 owns the replay-stream cursor: it reads ``groups_per_step`` groups, applies
the staleness guard, computes advantages, partitions the sequences and sends each
rank its micro-batches (msgpack bytes over the DP group — no pickle). Every rank
steps; rank 0 bumps the policy version in Redis and writes a metrics line.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from streamrl.buffer import Admission, Ledger, Namespace, PolicyVersion, ReplayStream, ServerRegistry, StreamReader
from streamrl.config import Config
from streamrl.learner import batch as batching
from streamrl.learner import checkpoint
from streamrl.learner.metrics import MetricsSink
from streamrl.learner.partition import attention_cost, plan_micro_batches
from streamrl.learner.policy import Policy, init_distributed
from streamrl.learner.push import WeightPusher
from streamrl.learner.staleness import AutoBound
from streamrl.learner.updates import train
from streamrl.models import load_tokenizer

log = logging.getLogger("streamrl.learner")


def _send(payloads: list[bytes] | None, device: torch.device) -> bytes:
    """Rank 0 sends payload r to rank r (sizes first, then one padded byte tensor) through tensors on
    ``device`` (NCCL carries only CUDA tensors)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = torch.zeros(world, dtype=torch.long, device=device)
    if rank == 0:
        sizes = torch.tensor([len(p) for p in payloads], dtype=torch.long, device=device)
    dist.broadcast(sizes, 0)
    buf = torch.zeros(int(sizes.max()), dtype=torch.uint8, device=device)
    mine = None
    for r in range(world):  # one broadcast per rank keeps it simple and backend-agnostic
        if rank == 0:
            buf[: sizes[r]] = torch.frombuffer(bytearray(payloads[r]), dtype=torch.uint8).to(device)
        dist.broadcast(buf, 0)
        if r == rank:
            mine = bytes(buf[: sizes[r]].cpu().numpy())
    return mine


@dataclass
class Work:
    """What rank 0 plans for a step: a payload per minibatch (one per rank), each minibatch's group ids, the
    ledger outcome of the groups read and not trained, and the step's figures. Other ranks keep the Nones."""

    minibatches: int
    payloads: list = field(default_factory=list)
    members: list[list[str]] = field(default_factory=list)
    outcomes: dict[str, str] = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.payloads = [None] * self.minibatches  # what the other ranks pass to the scatter; rank 0 replaces it


class Learner:
    def __init__(self, cfg: Config, redis_url: str):
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.policy = Policy(cfg, cfg.model.path)
        self.vocab_size = self.policy.module.config.vocab_size
        self.hidden = self.policy.module.config.hidden_size
        self.critic = None
        if cfg.learner.algorithm == "ppo":
            from streamrl.learner.critic import Critic

            self.critic = Critic(cfg, cfg.learner.critic_path or cfg.model.path)
        self.ptx = None
        if cfg.learner.ptx_dataset and cfg.learner.ptx_coef > 0:
            from streamrl.learner.ptx import PtxData

            tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
            self.ptx = PtxData(cfg.learner.ptx_dataset, tokenizer, max_len=cfg.learner.micro_batch_tokens)
        self.checkpoints = Path(cfg.run.path) / "checkpoints"
        critic = self.critic.model if self.critic else None
        adapter_only = cfg.learner.lora is not None
        resumed = (checkpoint.load(self.policy.model, self.checkpoints, critic, adapter_only)
                   if cfg.learner.resume == "auto" else None)
        self.version = resumed["version"] if resumed else 0
        learner = cfg.learner
        # A sequence with zero advantages adds nothing to a step unless the loss has terms of its own: PPO's
        # critic advantages (made later, per token), an entropy bonus, KL to the reference in the loss
        self.zero_advantage_is_inert = (learner.algorithm != "ppo" and learner.entropy_coef == 0
                                        and (learner.kl_coef == 0 or learner.kl_in_reward))
        self.reference = None
        if self.rank == 0 and cfg.learner.kl_in_reward and cfg.learner.kl_coef > 0:
            from streamrl.learner.reference import Reference

            temperature = cfg.rollout.sampling.temperature
            self.reference = (Reference.base_of(self.policy.model, temperature) if cfg.learner.lora else
                              Reference.load(cfg.model.path, self.policy.device, self.policy.module.dtype,
                                             temperature))  # rank 0 alone: whole, never sharded
        if self.rank == 0:
            ns = Namespace.open(redis_url, cfg.run.name, **cfg.redis.retry())
            self.stream = ReplayStream(ns)
            self.pusher = WeightPusher(cfg, ServerRegistry(ns, ttl_s=cfg.server.registry_ttl_s))
            self.reader = StreamReader(ns, cursor=resumed["cursor"] if resumed else "0-0")
            self.versions = PolicyVersion(ns)
            if resumed:
                log.info("resumed from %s: version %d, cursor %s", resumed["path"], self.version, self.reader.cursor)
            self.admission = Admission(ns, max_staleness=cfg.admission_bound,
                                       groups_per_step=cfg.learner.groups_per_step)
            self.auto = AutoBound(cfg.off_policy.auto, self.admission) if cfg.off_policy.adaptive else None
            self.versions.set(self.version)
            self.published, self.publish_lock = self.version, threading.Lock()
            self.ledger = Ledger(ns)
            forgotten = self.ledger.rollback(self.version, self.reader.cursor)  # gone with the lost weights
            if forgotten:
                log.info("ledger: %d outcomes of steps after version %d forgotten; they are replayed", forgotten,
                         self.version)
            self.metrics = MetricsSink(Path(cfg.run.path), tensorboard=cfg.learner.tensorboard,
                                       wandb_project=cfg.learner.wandb_project, run_name=cfg.run.name,
                                       config=cfg.redacted())

    def pull(self, work: Work) -> list:
        """Rank 0: ``groups_per_step`` fresh groups from the stream; stale ones dropped (and counted) or kept,
        and with ``learner.drop_no_signal`` groups whose rewards are all equal left out (and counted). The
        ledger outcome of every group read and not trained goes into ``work.outcomes``."""
        want, groups, dropped, silent_dropped, outcomes = self.cfg.learner.groups_per_step, [], 0, 0, {}
        refused = self.admission.refusals()  # the bound starves the learner if it turns workers away meanwhile
        t0 = last_catch_up = time.perf_counter()
        while len(groups) < want:
            entries = self.reader.read(want - len(groups), block_ms=1000)
            fresh_drops = silent = 0
            for entry in entries:
                verdict = self._verdict(entry)
                if verdict is None:
                    groups.append(entry.group)
                    continue
                outcomes[entry.group.group_id] = verdict
                fresh_drops += verdict == "dropped:stale"
                silent += verdict == "dropped:no_signal"
            if fresh_drops:  # at once: a dropped group gives its admission slot back
                self.admission.count_dropped_stale(fresh_drops)
                dropped += fresh_drops
            if silent:
                self.admission.count_dropped_no_signal(silent)
                silent_dropped += silent
            # No data, or only stale data (a server behind the learner can keep the stream full of it,
            # and the learner pushes only after a step): bring lagging servers up to date.
            if (not entries or fresh_drops) and time.perf_counter() - last_catch_up > 2.0:
                self._catch_up()
                last_catch_up = time.perf_counter()
        silent_kept = sum(batching.no_signal(g) for g in groups)  # trained, for no gradient under rloo and grpo
        bound = max(map(self._bound_for, groups))  # the loosest the step's groups were judged under
        work.outcomes = outcomes
        work.info.update(wait_s=time.perf_counter() - t0, admission_refused=self.admission.refusals() - refused,
                         dropped_stale=dropped, dropped_no_signal=silent_dropped,
                         groups_no_signal=silent_kept + silent_dropped, staleness_bound=bound)
        return groups

    def _bound_for(self, group) -> int:
        """The staleness bound ``group`` is judged under: the one given, or with ``auto`` the learner's, which
        keeps the bound before an easing or a revert for the groups that may have been admitted under it."""
        return self.auto.bound_for(group.version_range()[0]) if self.auto else self.cfg.staleness_bound

    def _verdict(self, entry) -> str | None:
        """None to train on the entry's group, else the ledger outcome it gets instead."""
        top = max(int(s.tokens.max()) for s in entry.group.samples)
        if top >= self.vocab_size:  # valid on the wire, but not for this model
            self.reader.dead_letter(entry.id, f"token id {top} >= vocab size {self.vocab_size}")
            return "dropped:dead"
        if batching.stale(entry.group, self.version, self._bound_for(entry.group)) and self.cfg.off_policy.stale == "drop":
            return "dropped:stale"
        if self.cfg.learner.drop_no_signal and batching.no_signal(entry.group):
            return "dropped:no_signal"
        return None

    def step(self) -> dict:
        """One policy version, as the algorithm reads. Rank 0 pulls and plans; every rank trains its shard."""
        work = Work(self.cfg.learner.minibatches)
        if self.rank == 0:
            groups = self.pull(work)  # 1. groups from the stream; 2. the staleness policy, dynamic sampling
            minibatches = self.advantages(groups, work)  # 3. advantages, per minibatch of whole groups
            self.partition(minibatches, work)  # 4. packed micro-batches, balanced over the ranks
        shards = [batching.unpack(_send(payload, self.policy.device)) for payload in work.payloads]
        t0 = time.perf_counter()
        ptx = self.ptx.for_step(self.version, self.rank, self.world, self.cfg.learner.ptx_per_rank) if self.ptx else None
        end_push = (lambda: self._end_push(work.info)) if self.rank == 0 else None
        # 5. proximal, reference and critic forwards; 6. an optimizer step per minibatch, for each epoch
        stats, landed = train(self.policy, shards, self.cfg.learner.epochs, self.critic, ptx, end_push)
        return self.finish(stats, landed, work, time.perf_counter() - t0)  # 7. push, checkpoint, export

    def finish(self, stats: dict, landed: int, work: Work, train_s: float) -> dict:
        """After the updates: the new version (if any update landed), the ledger, the push, checkpoint and
        export on their cadences, the metrics line."""
        self._warn(stats, landed, len(work.payloads))
        if self.rank == 0:  # groups of a minibatch whose update was skipped reached no weights
            work.outcomes |= {g: "trained" if i < landed else "dropped:skipped"
                              for i, ids in enumerate(work.members) for g in ids}
        if not landed:  # nothing reached the weights: the version stays, the batch is reported
            if self.rank == 0:
                self.ledger.record(self.version + 1, self.reader.cursor, work.outcomes)
                self._write({"step": self.version, "time": time.time(), **work.info, **stats,
                             "cursor": self.reader.cursor})
            return stats
        self.version += 1  # one policy version per step of the loop, however many updates it ran
        if self.rank == 0:
            self.ledger.record(self.version, self.reader.cursor, work.outcomes)
        pushing = self.version % self.cfg.weight_sync.sync_every == 0
        if pushing:
            stats.update(self.push() or {})
            if self.cfg.mode == "sync" and self.rank == 0:  # no group may start before the servers have the weights
                self._end_push(stats)
        if self.version % self.cfg.learner.checkpoint_every == 0:
            self.checkpoint()
        if self.version % self.cfg.learner.export_every == 0:
            self.export()
        if self.rank != 0:
            return stats
        if not (pushing and self.pusher.pending):  # a push in flight publishes its version when it lands
            self._publish(self.version)
        record = {"step": self.version, "time": time.time(), "train_s": train_s, **work.info, **stats,
                  "cursor": self.reader.cursor}
        record["tokens_per_s"] = record["tokens_global"] / max(train_s, 1e-9)
        if self.auto:  # max_staleness: auto judges the step, and may move the bound for the next
            record.update(self.auto.after_step(self.version, record))
        self._write(record)
        return record

    def _warn(self, stats: dict, landed: int, minibatches: int) -> None:
        learner = self.cfg.learner
        if self.rank == 0 and stats.get("fresh_tokens") and stats["fresh_mismatch_kl"] > learner.mismatch_warn_kl:
            log.warning("train/inference mismatch: KL(behaviour || learner) %.2e on %d tokens generated by these very "
                        "weights (learner.mismatch_warn_kl %.0e): check dtypes, the chat template and the engine's "
                        "logprobs", stats["fresh_mismatch_kl"], stats["fresh_tokens"], learner.mismatch_warn_kl)
        if stats["skipped"]:
            log.warning("update skipped: non-finite loss or gradient (%d of %d minibatches trained)", landed,
                        minibatches)

    def _end_push(self, info: dict) -> None:
        """Wait for the push in flight, if any, recording how long the learner stalled on it (``push_wait_s``).

        Async: the previous version's push, which read the weights while this step's data came in and its
        forwards and backwards ran (none of them writes the weights); the optimizer may then move them.
        Sync: this version's, whole, before the servers may generate again."""
        t0 = time.perf_counter()
        info.update(self.pusher.wait())
        info["push_wait_s"] = time.perf_counter() - t0

    def advantages(self, groups: list, work: Work) -> list[tuple[list, list[batching.TrainSequence]]]:
        """Rank 0: the groups as ``learner.minibatches`` minibatches of whole groups, each with its sequences
        carrying their advantages (the reference's KL subtracted from the rewards first, with kl_in_reward)."""
        learner, info = self.cfg.learner, work.info
        penalties = None
        if self.reference is not None:
            penalties = self.reference.kl_penalties(groups, learner.kl_coef, learner.kl_estimator,
                                                    learner.micro_batch_tokens)
            info["kl_penalty_mean"] = float(np.mean(np.concatenate(penalties)))
        turns = batching.TurnCredit(learner.turn_gamma, learner.turn_lam) if learner.credit == "turn" else None
        out = []
        for part in np.array_split(np.arange(len(groups)), learner.minibatches):
            mine = [groups[i] for i in part]
            out.append((mine, batching.sequences(mine, self.version, learner.algorithm,
                                                 None if penalties is None else [penalties[i] for i in part], turns)))
        if turns is not None:  # samples whose turns could not be told apart were scored as one turn
            info["turn_credit_fallbacks"] = sum(batching.turn_spans(s) is None for g in groups for s in g.samples)
        rewards = [s.reward for g in groups for s in g.samples]
        staleness = np.array([s.staleness for _, seqs in out for s in seqs])
        info.update(reward_mean=float(np.mean(rewards)), reward_std=float(np.std(rewards)), groups=len(groups),
                    staleness_hist={str(k): int(v) for k, v in zip(*np.unique(staleness, return_counts=True))},
                    group_ids=[g.group_id for g in groups], staleness_max=int(staleness.max()))
        return out

    def partition(self, minibatches: list[tuple[list, list[batching.TrainSequence]]], work: Work) -> None:
        """Rank 0: each minibatch's sequences packed into micro-batches, the same number on every rank and
        balanced over them (``partition``), as one msgpack payload per rank. Sequences without a gradient are
        left out (``learner.skip_zero_advantage``); a rank left with nothing steps on a zero loss."""
        learner = self.cfg.learner
        imbalance, per_rank, tokens_global, skipped = 0.0, 0, 0, 0
        work.payloads = []
        for groups, seqs in minibatches:
            tokens, count = int(sum(s.mask.sum() for s in seqs)), len(seqs)  # the loss's mean counts all of them
            if learner.skip_zero_advantage and self.zero_advantage_is_inert:
                seqs = [s for s in seqs if batching.has_gradient(s)]
                skipped += count - len(seqs)
            lengths = [len(s) for s in seqs]
            costs = [attention_cost(n, self.hidden) for n in lengths] if learner.balance == "flops" else None
            plan = plan_micro_batches(lengths, self.world, learner.micro_batch_tokens, costs)
            work.payloads.append([batching.pack([[seqs[i] for i in mb] for mb in rank], tokens, count)
                                  for rank in plan.ranks])
            work.members.append([g.group_id for g in groups])
            loads = [sum(lengths[i] for i in mb) for rank in plan.ranks for mb in rank]
            imbalance = max(imbalance, max(loads) / max(sum(loads) / len(loads), 1e-9))
            per_rank += plan.per_rank
            tokens_global += tokens
        work.info.update(micro_batch_imbalance=imbalance, micro_batches_per_rank=per_rank, tokens_global=tokens_global,
                         zero_advantage_skipped=skipped)

    def _catch_up(self) -> None:
        """While data is late, bring servers that lack the current weights up to date (plain DP only:
        under ZeRO-3 gathering the weights is a collective the other ranks are not in)."""
        if self.version == 0 or self.cfg.learner.zero_stage == 3:
            return
        stats = self.pusher.catch_up([(name, p.detach()) for name, p in self.policy.pushed()], self.version)
        if stats:
            log.info("caught up %d server(s) to version %d in %.2fs", stats["push_targets"], self.version,
                     stats["push_s"])

    def push(self) -> dict | None:
        """Send the weights to every live rollout server.

        Plain DP: rank 0 pushes in the background (figures land in the next step's record).
        ZeRO-3: the shards are gathered, a collective, so the push runs to the end here.
        """
        params = self.policy.pushed()
        if self.cfg.learner.zero_stage != 3:
            if self.rank == 0:  # admission counts this version once the servers serve it (``_publish``)
                version = self.version
                self.pusher.start([(name, p.detach()) for name, p in params], version,
                                  landed=lambda: self._publish(version))
            return None
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            if self.rank == 0:
                stats = self.pusher.push([(name, p.detach()) for name, p in params], self.version)
                return {**stats, "push_wait_s": stats["push_s"]}  # the learner waited for all of it
        return None

    def _publish(self, version: int) -> None:
        """The policy version admission counts: the newest the servers serve, or between pushes the learner's.

        A push runs in flight for a second or so on CPU. Were slots of a version handed out before its push
        landed, the groups they start would begin on the weights before it and could reach the learner one
        version past the staleness bound, to be dropped: 17% of the groups on SmolLM2. Called from the push's
        thread as well: never moves the version back."""
        with self.publish_lock:
            if version > self.published:
                self.versions.set(version)
                self.published = version

    def export(self) -> None:
        checkpoint.export_hf(self.policy.model, self.cfg.model.tokenizer or self.cfg.model.path,
                             Path(self.cfg.run.path) / "export", version=self.version, rank=self.rank,
                             zero_stage=self.cfg.learner.zero_stage, lora=self.cfg.learner.lora,
                             base_model=self.cfg.model.path)

    def _write(self, record: dict) -> None:
        self.metrics.write(record)

    def checkpoint(self) -> None:
        """Save on every rank (the cursor is rank 0's); then trim what the checkpoint covers."""
        cursor = self.reader.cursor if self.rank == 0 else ""
        checkpoint.save(self.policy.model, self.checkpoints, version=self.version, cursor=cursor,
                        critic=self.critic.model if self.critic else None, adapter_only=self.cfg.learner.lora is not None)
        dist.barrier()
        if self.rank == 0:
            self.ledger.settle(self.version)
            if cursor != "0-0":
                self.stream.trim(cursor)


def launch(cfg: Config, steps: int | None = None, solo: bool = False) -> None:
    """Process entry of ``streamrl launch-learner`` (under torchrun)."""
    if not cfg.redis.url:
        raise ValueError("redis.url is not set: the learner reads the replay stream from a shared Redis")
    if not cfg.model.path:
        raise ValueError("model.path is not set: give a local Hugging Face model directory")
    if solo:  # a world of one rendezvouses through a file: no port to race for
        import tempfile

        rendezvous = Path(tempfile.mkdtemp(prefix="streamrl-rdzv-")) / "init"
        init_distributed(init_method=f"file://{rendezvous}", rank=0, world_size=1, auto_mpi_discovery=False)
    else:
        init_distributed()
    learner = Learner(cfg, cfg.redis.url)
    target = steps if steps is not None else cfg.learner.max_steps
    while learner.version < target:
        record = learner.step()
        if learner.rank == 0:
            log.info("step %(step)s  reward %(reward_mean).3f  loss %(loss).4f  tokens %(tokens_global)d", record)
    if learner.version % cfg.weight_sync.sync_every:  # the servers get the final weights too
        learner.push()
    if learner.version % cfg.learner.export_every:  # the final weights, for serving and evaluation
        learner.export()
    if learner.rank == 0:
        last_push = learner.pusher.wait()
        if last_push.get("push_targets"):  # the last push ends after the last step's line: a line of its own
            learner.metrics.write({"step": learner.version, "time": time.time(), **last_push})
        learner.metrics.close()
    dist.barrier()
    # An exit with the group still up can abort in a backend thread's teardown ("terminate called without
    # an active exception", exit status 250, seen once under the DeepSpeed launcher in CI); PyTorch asks
    # for an explicit destroy.
    dist.destroy_process_group()
