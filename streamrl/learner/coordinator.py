"""Rank 0's coordination of a policy version: the plan that feeds every rank, and the commit that follows it.

The plan: pull groups from the replay stream, judge each (the staleness guard, dynamic sampling), compute the
advantages, partition the sequences and encode each rank's micro-batches. The commit: the ledger, the weight
push and the version published to admission, the staleness controller (``AutoBound``), the stream trimmed
behind a checkpoint, the metrics line. Every other rank holds a ``Bystander`` in the coordinator's place, so
that the same loop runs on every rank.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import torch

from streamrl.buffer import Admission, Ledger, Namespace, PolicyVersion, ReplayStream, ServerRegistry, StreamReader
from streamrl.config import Config
from streamrl.learner import batching, coverage, probe, record
from streamrl.learner.auto_bound import AutoBound, env_share
from streamrl.learner.metrics import MetricsSink, line
from streamrl.learner.planning import Plan, Planner
from streamrl.learner.policy import Policy
from streamrl.learner.push import WeightPusher
from streamrl.weightsync import Probe

log = logging.getLogger("streamrl.learner")


class Coordinator:
    """Rank 0's side of the loop: the stream reader, the ledger, the weight pusher, admission and its bound, the
    metrics sink, and with ``learner.kl_in_reward`` the reference whose KL goes into the rewards."""

    pushes = True  # there are servers to push to (a replay has none)

    def __init__(self, cfg: Config, redis_url: str, policy: Policy, resumed: dict | None):
        self.cfg, self.policy, self.world = cfg, policy, torch.distributed.get_world_size()
        self.vocab_size = policy.module.config.vocab_size
        self.planner = Planner(cfg, policy, self.world)
        version = resumed["version"] if resumed else 0
        learner = cfg.learner
        ns = Namespace.open(redis_url, cfg.run.name, **cfg.redis.retry())
        self.stream = ReplayStream(ns)
        self.pusher = WeightPusher(cfg, ServerRegistry(ns, ttl_s=cfg.server.registry_ttl_s))
        self.reader = StreamReader(ns, cursor=resumed["cursor"] if resumed else "0-0")
        self.version_key = PolicyVersion(ns)  # the version admission counts (``_publish``)
        if resumed:
            log.info("resumed from %s: version %d, cursor %s", resumed["path"], version, self.reader.cursor)
        self.admission = Admission(ns, max_staleness=cfg.admission_bound, groups_per_step=learner.groups_per_step)
        self.auto = AutoBound(cfg.off_policy.auto, self.admission) if cfg.off_policy.adaptive else None
        policy.cores.held = self.generation_held  # `learner_threads: auto` widens once it is
        self.planned = version  # the version the step in progress trains from
        self.version_key.set(version)
        self.published, self.publish_lock = version, threading.Lock()
        self.probe_ids = probe.load(Path(cfg.run.path))  # the push's probe: the first tokens trained on
        self.last_probe: tuple[int, Probe] | None = None  # the last version pushed, and its probe (catch-ups)
        self.ledger = Ledger(ns)
        self.pusher.refused = self.ledger.refuse
        forgotten = self.ledger.rollback(version, self.reader.cursor)  # gone with the lost weights
        if forgotten:
            log.info("ledger: %d outcomes of steps after version %d forgotten; they are replayed", forgotten, version)
        self.metrics = MetricsSink(Path(cfg.run.path), tensorboard=learner.tensorboard,
                                   wandb_project=learner.wandb_project, run_name=cfg.run.name, config=cfg.redacted())
        # who was trained, by quartile of generation time and of reward, since the run began (``coverage``)
        self.coverage = coverage.from_file(Path(cfg.run.path) / "metrics" / "learner.jsonl", version)
        self.recorder = None
        if cfg.record.enabled:  # every step's input, for ``streamrl replay``
            root = Path(cfg.run.path) / "record"
            record.write_meta(root, {"world": self.world, "threads": policy.cores.share, "cores": policy.cores.every,
                                     "device": policy.device.type, "init_rng": record.pack(policy.init_rng),
                                     "config": cfg.redacted()}, version)
            self.recorder = record.Recorder(root, version, cfg.record.chunk_steps, cfg.record.keep_steps)

    @property
    def cursor(self) -> str:
        """The replay stream's cursor: what the learner has read, saved with a checkpoint."""
        return self.reader.cursor

    # ------------------------------------------------------------------ the plan

    def plan(self, version: int) -> Plan:
        """The work of the step to ``version + 1``: 1. groups from the stream; 2. the staleness policy, dynamic
        sampling; 3. advantages, per minibatch of whole groups; 4. packed micro-batches, balanced over the ranks."""
        plan, self.planned = Plan(payloads=[]), version
        plan.groups = self.pull(version, plan)
        parts = self.planner.advantages(plan.groups, version, plan)
        if self.probe_ids is None and self.cfg.weight_sync.verify:
            context = getattr(self.policy.module.config, "max_position_embeddings", None) or 2**31
            self.probe_ids = probe.choose([s for _, seqs in parts for s in seqs],
                                          min(self.cfg.weight_sync.probe_tokens, context - 1))
            probe.save(Path(self.cfg.run.path), self.probe_ids)
        self.planner.partition(parts, plan)
        return plan

    def pull(self, version: int, plan: Plan) -> list:
        """``groups_per_step`` fresh groups from the stream; stale ones dropped (and counted) or kept, and with
        ``learner.drop_no_signal`` groups whose rewards are all equal left out (and counted). The ledger outcome
        of every group read and not trained goes into ``plan.outcomes``."""
        want, groups, dropped, silent_dropped, late, outcomes = self.cfg.learner.groups_per_step, [], 0, 0, 0, {}
        read = []
        refused = self.admission.refusals()  # the bound starves the learner if it turns workers away meanwhile
        t0 = last_catch_up = time.perf_counter()
        while len(groups) < want:
            entries = self.reader.read(want - len(groups), block_ms=1000)
            fresh_drops = silent = 0
            for entry in entries:
                plan.read[entry.group.group_id] = coverage.facts(entry.group)
                read.append(entry.group)
                past = self._late(entry.group, version)
                verdict = self._verdict(entry, version, past)
                if verdict is None:
                    groups.append(entry.group)
                    late += past  # kept past its bound (stale: keep, or late: keep)
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
                self._catch_up(version)
                last_catch_up = time.perf_counter()
        silent_kept = sum(batching.no_signal(g) for g in groups)  # trained, for no gradient under rloo and grpo
        bound = max(map(self._bound_for, groups))  # the loosest the step's groups were judged under
        plan.outcomes = outcomes
        plan.info.update(wait_s=time.perf_counter() - t0, admission_refused=self.admission.refusals() - refused,
                         dropped_stale=dropped, dropped_no_signal=silent_dropped,
                         groups_no_signal=silent_kept + silent_dropped, late_kept=late, staleness_bound=bound)
        if (share := env_share(read)) is not None:  # how much of a group's time more groups in flight cover
            plan.info["env_share"] = round(share, 4)
        return groups

    def _bound_for(self, group) -> int:
        """The staleness bound ``group`` is judged under: the one given, or with ``auto`` the learner's, which
        keeps the bound before an easing or a revert for the groups that may have been admitted under it."""
        return self.auto.bound_for(group.version_range()[0]) if self.auto else self.cfg.staleness_bound

    def _late(self, group, version: int) -> bool:
        """Whether ``group`` is past the staleness bound it is judged under."""
        return batching.stale(group, version, self._bound_for(group))

    def _verdict(self, entry, version: int, late: bool) -> str | None:
        """None to train on the entry's group (``late``: past the bound it is judged under), else the ledger
        outcome it gets instead."""
        top = max(int(s.tokens.max()) for s in entry.group.samples)
        if top >= self.vocab_size:  # valid on the wire, but not for this model
            self.reader.dead_letter(entry.id, f"token id {top} >= vocab size {self.vocab_size}")
            return "dropped:dead"
        longest = max(part.stop - part.start for s in entry.group.samples for part in s.sequences())
        if longest > (budget := self.cfg.learner.micro_batch_tokens):  # no plan could hold it, after any restart
            self.reader.dead_letter(entry.id, f"a sequence of {longest} tokens exceeds learner.micro_batch_tokens "
                                              f"= {budget}")
            return "dropped:dead"
        if late and self.cfg.off_policy.stale == "drop" and not (
                self.auto and self.auto.keeps_late(entry.group.version_range()[0], version)):
            return "dropped:stale"
        if self.cfg.learner.drop_no_signal and batching.no_signal(entry.group):
            return "dropped:no_signal"
        return None

    def _catch_up(self, version: int) -> None:
        """While data is late, bring servers that lack the current weights up to date (plain DP only:
        under ZeRO-3 gathering the weights is a collective the other ranks are not in)."""
        if version == 0 or self.cfg.learner.zero_stage == 3:
            return
        stats = self.pusher.catch_up([(name, p.detach()) for name, p in self.policy.pushed()], version,
                                     self._check(version))
        if stats:
            log.info("caught up %d server(s) to version %d in %.2fs", stats["push_targets"], version, stats["push_s"])
            self._publish(version, stats)  # a version every server had refused is served now

    def _check(self, version: int) -> Probe | None:
        """The probe of the weights the learner holds (``version``): the last push's, or after a restart scored
        here, on rank 0's whole module (below ZeRO-3)."""
        if self.last_probe and self.last_probe[0] == version:
            return self.last_probe[1]
        if not (self.cfg.weight_sync.verify and self.probe_ids):
            return None
        check = probe.reference(self.policy.module, self.probe_ids, self.policy.device,
                                self.cfg.weight_sync.tolerance(self.cfg.model.dtype))
        self.last_probe = (version, check)
        return check

    # ------------------------------------------------------------------ the commit

    def end_push(self, info: dict) -> None:
        """Wait for the push in flight, if any, recording how long the learner stalled on it (``push_wait_s``).

        Async: the previous version's push, which read the weights while this step's data came in and its
        forwards and backwards ran (none of them writes the weights); the optimizer may then move them.
        Sync: this version's, whole, before the servers may generate again."""
        t0 = time.perf_counter()
        info.update(self.pusher.wait())
        info["push_wait_s"] = time.perf_counter() - t0

    def record(self, version: int, plan: Plan, stats: dict, landed: int, weights: str) -> None:
        """The ledger's account of the step to ``version``: what became of every group it read (those of a
        minibatch whose update was skipped reached no weights), and the run's record of it (with ``weights``, the
        hash of the weights it ended with); a warning where the learner disagrees with the engine on tokens its
        very weights generated."""
        learner = self.cfg.learner
        if stats.get("fresh_tokens") and stats["fresh_mismatch_kl"] > learner.mismatch_warn_kl:
            log.warning("train/inference mismatch: KL(behaviour || learner) %.2e on %d tokens generated by these very "
                        "weights (learner.mismatch_warn_kl %.0e): check dtypes, the chat template and the engine's "
                        "logprobs", stats["fresh_mismatch_kl"], stats["fresh_tokens"], learner.mismatch_warn_kl)
        plan.outcomes |= {g: "trained" if i < landed else "dropped:skipped"
                          for i, ids in enumerate(plan.members) for g in ids}
        self.ledger.record(version, self.reader.cursor, plan.outcomes)
        rows = [(s, r, int(plan.outcomes[g] == "trained")) for g, (s, r) in plan.read.items()]
        self.coverage += rows
        plan.info.update(groups_read=rows, **coverage.metrics(self.coverage))
        if self.recorder:
            self.recorder.append(record.Step(
                version=version - 1, trained=plan.groups, outcomes={g: o for g, o in plan.outcomes.items()
                                                                     if o != "trained"},
                bound=plan.info["staleness_bound"], partition=plan.partition, cursor=self.reader.cursor,
                landed=landed, weights=weights, info={k: plan.info[k] for k in record.PLAN_INFO},
                wide_from=stats.get("wide_from")))
            if landed and version % self.cfg.learner.checkpoint_every == 0:
                self.recorder.sync()  # a checkpoint of this version follows: the frames it covers are on disk

    def report(self, version: int, plan: Plan, stats: dict) -> dict:
        """The metrics line of a step whose updates were all skipped: the version stays, the batch is reported."""
        out = line(version, plan, stats, self.reader.cursor)
        self.metrics.write(out)
        return out  # the step's line as any other's (the log line reads its figures: stats alone lack them)

    def push(self, params: list[tuple[str, torch.Tensor]], version: int, whole: bool,
             check: Probe | None = None) -> dict:
        """Start the push of ``version``'s weights in the background (its figures land in the next step's record),
        or with ``whole`` run it to its end here (the learner waited for all of it). ``check``: the probe each
        server must pass before it serves the version."""
        named = [(name, p.detach()) for name, p in params]
        self.last_probe = (version, check) if check else None
        if not whole:  # admission counts this version once a server serves it (``_publish``)
            self.pusher.start(named, version, check, landed=lambda stats: self._publish(version, stats))
            return {}
        stats = self.pusher.push(named, version, check=check)
        return {**stats, "push_wait_s": stats["push_s"]}

    def _publish(self, version: int, push: dict | None = None) -> None:
        """The policy version admission counts: the newest the servers serve, or between pushes the learner's.

        A push runs in flight for a second or so on CPU. Were slots of a version handed out before its push
        landed, the groups they start would begin on the weights before it and could reach the learner one
        version past the staleness bound, to be dropped: 17% of the groups on SmolLM2. A version every server
        refused (its probe failed) is served by none: it is not published. Called from the push's thread as
        well: never moves the version back."""
        if push and push.get("push_rejected") and not push.get("push_targets"):
            return
        with self.publish_lock:
            if version > self.published:
                self.version_key.set(version)
                self.published = version

    def generation_held(self) -> bool:
        """Whether no server generates again before this step ends: admission holds generation under the version the
        step trains from. Until that version's push lands, it is not published, and its landing reopens admission."""
        return self.published == self.planned and self.admission.held()

    def checkpointed(self, version: int, cursor: str) -> None:
        """What a checkpoint of ``version`` covers, read up to ``cursor``, is settled in the ledger and trimmed
        from the stream."""
        self.ledger.settle(version)
        if cursor != "0-0":
            self.stream.trim(cursor)

    def commit(self, version: int, plan: Plan, stats: dict, train_s: float, pushing: bool) -> dict:
        """The new version published (unless its push is in flight: it publishes when it lands), judged by the
        staleness controller, and its metrics line written; returns the line."""
        if not (pushing and self.pusher.pending):
            self._publish(version, stats)
        out = line(version, plan, stats, self.reader.cursor, train_s)
        if self.auto:  # max_staleness: auto judges the step, and may move the bound for the next
            out.update(self.auto.after_step(version, out))
        self.metrics.write(out)
        return out

    def announce(self, record: dict) -> None:
        log.info("step %(step)s  reward %(reward_mean).3f  loss %(loss).4f  tokens %(tokens_global)d", record)

    def close(self, version: int) -> None:
        """After the last step: the last push's figures, a line of their own (it ends after the last step's)."""
        last_push = self.pusher.wait()
        if last_push.get("push_targets"):
            self.metrics.write({"step": version, "time": time.time(), **last_push})
        self.metrics.close()
        if self.recorder:
            self.recorder.close()
        # the policy's cores ask this coordinator: a cycle that would keep both, and DeepSpeed's engine, alive past
        # the process group's destroy, to be torn down at interpreter exit
        self.policy.cores.held = None


class Bystander:
    """A rank other than 0, in the coordinator's place: its plan is an empty payload per minibatch (what it hands
    the scatter), and it commits nothing."""

    cursor = ""
    probe_ids = None  # rank 0's, shared when a push is verified

    def __init__(self, minibatches: int, pushes: bool = True):
        self.minibatches, self.pushes = minibatches, pushes

    def plan(self, version: int) -> Plan:
        return Plan(payloads=[None] * self.minibatches)

    def end_push(self, info: dict) -> None:
        pass

    def record(self, version: int, plan: Plan, stats: dict, landed: int, weights: str) -> None:
        pass

    def report(self, version: int, plan: Plan, stats: dict) -> dict:
        return stats

    def push(self, params: list[tuple[str, torch.Tensor]], version: int, whole: bool,
             check: Probe | None = None) -> dict:
        return {}

    def checkpointed(self, version: int, cursor: str) -> None:
        pass

    def commit(self, version: int, plan: Plan, stats: dict, train_s: float, pushing: bool) -> dict:
        return stats

    def announce(self, record: dict) -> None:
        pass

    def close(self, version: int) -> None:
        pass
