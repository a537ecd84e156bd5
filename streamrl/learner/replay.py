"""``streamrl replay RUN``: the learner alone, retraining a recorded run from exactly what it consumed.

Every rank starts from the run's checkpoint at or before ``--from`` (or the model, before any), and rank 0's
``Replayer`` stands in for the coordinator: each step's groups come from the run's record instead of the replay
stream, and are planned by the same code (``planning``) the run used; no server is pushed to, nothing is
published. After every step the weights' hash is set beside the one the run recorded.

Without overrides the replay reproduces the run bit for bit (same machine, same threads: the record keeps them).
With overrides it is a counterfactual: another loss, correction or learning rate trained on the identical data.
An override that would change what data is consumed is refused (``refused``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from streamrl.config import Config, config_from, dump_config, load_config
from streamrl.learner import probe, record
from streamrl.learner.checkpoint import Start, versions
from streamrl.learner.main import Learner, init_rank
from streamrl.learner.metrics import MetricsSink, line
from streamrl.learner.planning import Plan, Planner
from streamrl.learner.policy import Policy
from streamrl.protocol import decode_group
from streamrl.weightsync import Probe

log = logging.getLogger("streamrl.replay")

# What decides which data a run consumes, or what a learner alone does not do: a replay cannot change it.
FIXED = {
    "rollout": "the data were generated under it",
    "eval": "a replay evaluates nothing (evaluate its exports)",
    "off_policy.max_staleness": "it decided which groups were dropped as stale",
    "off_policy.auto": "it decided which groups were dropped as stale",
    "off_policy.stale": "it decided which groups were dropped as stale",
    "learner.groups_per_step": "it decided which groups made each step",
    "learner.drop_no_signal": "it decided which groups were left out",
    "learner.max_steps": "give --to",
    "learner.resume": "a replay starts from the checkpoint at or before --from",
    "model.tokenizer": "the recorded tokens are the tokenizer's",
    "mode": "it decided which groups made each step",
    "run": "give --out",
    "record": "a replay is not recorded",
    **{section: "a replay runs the learner alone" for section in
       ("redis", "router", "server", "reward", "weight_sync", "prepare", "supervise", "ray", "launcher")},
}


def refused(recorded: Config, replayed: Config) -> list[str]:
    """Each setting the replay's config changes that a replay cannot change, with the reason."""
    def flat(tree: dict, prefix: str = "") -> dict[str, object]:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict) and value:
                out |= flat(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = value
        return out

    before, after = flat(recorded.model_dump(mode="json")), flat(replayed.model_dump(mode="json"))
    problems = []
    for key in sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)):
        reason = next((why for fixed, why in FIXED.items() if key == fixed or key.startswith(fixed + ".")), None)
        if reason:
            problems.append(f"{key}: {reason}")
    return problems


@dataclass
class Source:
    """The recorded run a replay reads: its directory, the checkpoint it starts from, the steps it replays."""

    run: Path
    start: int         # the version of the checkpoint it starts from (0: the model, before any step)
    steps: int         # frames to replay
    reaches: int       # the version the run reached after them
    meta: dict         # the record's meta of the learner start that covers ``start``
    overrides: list[str] = field(default_factory=list)  # how the replay departs from the run (a counterfactual)

    @classmethod
    def find(cls, run: Path, first: int | None, last: int | None) -> Source:
        root = run / "record"
        meta = record.read_meta(root)
        steps = record.headers(root)  # read once; every frame is checked
        recorded = record.span(root, steps)  # (first version planned, last version reached)
        first = recorded[0] if first is None else first
        start = max((v for v in versions(run / "checkpoints") if v <= first), default=0)
        if start < recorded[0]:
            raise ValueError(f"no checkpoint of {run} at or before step {first} lies inside the record, which starts "
                             f"at step {recorded[0] + 1} (record.keep_steps deleted what came before)")
        steps, reaches = record.count(root, start, recorded[1] if last is None else last, steps)
        if steps == 0:
            raise ValueError(f"the record of {run} has no step after version {start} up to {last}")
        starts = [s for s in meta["starts"] if s["version"] <= start] or meta["starts"][:1]
        return cls(run, start, steps, reaches, starts[-1])


def prepare(run: Path, first: int | None, last: int | None, out: Path | None, overrides: list[str],
            verify: bool) -> tuple[Config, Source]:
    """The replay's config (the run's recorded one, with ``overrides``, writing to ``out``) and what it reads;
    both are written to ``out``, from which each rank reads them (``prepared``). Raises ValueError on an override
    a replay cannot honour."""
    source = Source.find(run, first, last)
    where = str(run / "record" / "meta.json")
    recorded, replayed = config_from(source.meta["config"], (), where), config_from(source.meta["config"], overrides, where)
    if verify and overrides:
        raise ValueError("--verify compares the replay with the run, bit for bit: it takes no overrides")
    if verify and source.meta.get("device") == "cuda" and not recorded.record.deterministic:
        raise ValueError("the run trained on CUDA without record.deterministic: its kernels' sums may fall in another "
                         "order each time, so its steps cannot be reproduced bit for bit (replay it without --verify, "
                         "or record runs with record.deterministic=true)")
    source.overrides = list(overrides)
    problems = refused(recorded, replayed)
    if problems:
        raise ValueError("a replay trains on the run's own data and cannot change:\n  " + "\n  ".join(problems))
    out = out or run / "replays" / time.strftime("%Y%m%d-%H%M%S")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty: give another --out")
    if replayed.learner.nproc == recorded.learner.nproc:  # the run's world (torchrun's, whatever nproc said)
        replayed.learner.nproc = int(source.meta["world"])
    replayed.run.dir, replayed.run.name = out.parent, out.name
    replayed.learner.resume = "never"  # it starts where the source says, and nowhere else
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(replayed))
    (out / "source.json").write_text(json.dumps(asdict(source) | {"run": str(source.run)}, indent=1))
    return replayed, source


def prepared(out: Path) -> tuple[Config, Source]:
    """What ``prepare`` wrote to ``out``: read by each rank of a replay of several."""
    raw = json.loads((out / "source.json").read_text())
    return load_config(out / "config.yaml"), Source(**raw | {"run": Path(raw["run"])})


def verdict(summary: dict) -> tuple[bool, str]:
    """Whether the replay did what it was asked, and the line that says so: a replay of the run matched it at
    every step; a counterfactual (overrides) trained on the run's data, whatever its weights became."""
    through, difference, overrides = summary["identical_through"], summary["difference"], summary["overrides"]
    if overrides:
        departs = (f"its weights part from the run's at step {difference['step']}" if difference else
                   f"its weights stayed identical to the run's through step {through}")
        return True, f"a counterfactual ({' '.join(overrides)}) on the run's data: {departs}"
    if difference is None:
        return True, f"identical through step {through}"
    return False, f"step {difference['step']} differs: {difference['problem']} (identical through step {through})"


class Replayer:
    """Rank 0's side of a replay, in the coordinator's place: each step's plan from the record, its weights
    compared with the run's, its metrics line; no push, no ledger, nothing published."""

    pushes = False

    def __init__(self, cfg: Config, policy: Policy, source: Source):
        self.cfg, self.source, self.policy = cfg, source, policy
        self.planner = Planner(cfg, policy, dist.get_world_size())
        self.frames = record.read(source.run / "record", since=source.start)
        self.frame: record.Step | None = None
        self.probe_ids = probe.load(source.run)  # exports carry the run's probe
        self.metrics = MetricsSink(Path(cfg.run.path), tensorboard=cfg.learner.tensorboard,
                                   wandb_project=cfg.learner.wandb_project, run_name=cfg.run.name,
                                   config=cfg.redacted())
        self.identical_through, self.difference = source.start, None
        self.same = True

    @property
    def cursor(self) -> str:
        return self.frame.cursor if self.frame else ""

    def plan(self, version: int) -> Plan:
        """The recorded step's groups and outcomes, planned as the run planned them (at the version the run was
        at: a counterfactual whose update was skipped falls behind, and trains on the same data)."""
        self.frame = frame = next(self.frames)
        self.policy.cores.follow(frame.wide_from)  # each phase on the threads the run trained it on
        plan = Plan(payloads=[], groups=[decode_group(g) for g in frame.trained], outcomes=dict(frame.outcomes))
        plan.info.update(frame.info, staleness_bound=frame.bound)
        parts = self.planner.advantages(plan.groups, frame.version, plan)
        self.planner.partition(parts, plan)
        return plan

    def end_push(self, info: dict) -> None:
        pass

    def record(self, version: int, plan: Plan, stats: dict, landed: int, weights: str) -> None:
        frame = self.frame
        problem = (f"its partition differs from the run's ({_sizes(plan.partition)} vs {_sizes(frame.partition)} "
                   "sequences per micro-batch)" if plan.partition != frame.partition else
                   f"{landed} of its updates landed, the run's {frame.landed}" if landed != frame.landed else
                   f"its weights hash to {weights[:12]}, the run's to {frame.weights[:12]}"
                   if weights != frame.weights else None)
        self.same = problem is None
        if self.same and self.difference is None:
            self.identical_through = frame.version + (frame.landed > 0)
        elif self.difference is None:
            self.difference = {"step": frame.version + 1, "problem": problem}
        stats.update(weights=weights, recorded_weights=frame.weights, identical=self.same)

    def report(self, version: int, plan: Plan, stats: dict) -> dict:
        self.metrics.write(out := line(version, plan, stats, self.cursor))
        return out

    def push(self, params: list, version: int, whole: bool, check: Probe | None = None) -> dict:
        return {}

    def checkpointed(self, version: int, cursor: str) -> None:
        pass

    def commit(self, version: int, plan: Plan, stats: dict, train_s: float, pushing: bool) -> dict:
        self.metrics.write(out := line(version, plan, stats, self.cursor, train_s))
        return out

    def announce(self, out: dict) -> None:
        mark = "identical" if out["identical"] else "DIFFERS"
        log.info("step %d  loss %.4f  weights %s  run's %s  %s", self.frame.version + 1, out.get("loss", float("nan")),
                 out["weights"][:12], out["recorded_weights"][:12], mark)

    def close(self, version: int) -> None:
        self.metrics.close()
        summary = {"source": str(self.source.run.resolve()), "start": self.source.start, "steps": self.source.steps,
                   "reaches": self.source.reaches, "overrides": self.source.overrides, "version": version, "identical_through": self.identical_through,
                   "difference": self.difference, "time": time.time()}
        (Path(self.cfg.run.path) / "replay.json").write_text(json.dumps(summary, indent=1))


def _sizes(partition: list) -> list:
    return [[len(mb) for mb in rank] for minibatch in partition for rank in minibatch]


def _rank0_says(flag: bool, device: torch.device) -> bool:
    """Rank 0's ``flag`` on every rank."""
    t = torch.tensor([int(flag)], device=device)
    dist.broadcast(t, 0)
    return bool(t.item())


def run(cfg: Config, source: Source, verify: bool, solo: bool) -> dict:
    """One rank of a replay (under torchrun, or ``solo``): train the recorded steps, then the summary (rank 0's;
    {} elsewhere). With ``verify`` it stops at the first step that differs from the run."""
    torch.set_num_threads(int(source.meta["threads"]))
    init_rank(solo)
    if "init_rng" in source.meta:  # the state the run's model drew its random init from (a LoRA adapter's)
        torch.set_rng_state(record.unpack(source.meta["init_rng"]))
    start = Start(source.run / "checkpoints", source.start) if source.start else None
    learner = Learner(cfg, lambda policy, resumed: Replayer(cfg, policy, source), start=start, pushes=False)
    learner.policy.cores.every = int(source.meta.get("cores", source.meta["threads"]))  # the run's, not this machine's
    for _ in range(source.steps):
        learner.coordinator.announce(learner.step())
        if verify and not _rank0_says(getattr(learner.coordinator, "same", True), learner.policy.device):
            break
    learner.finish()
    summary = json.loads((Path(cfg.run.path) / "replay.json").read_text()) if dist.get_rank() == 0 else {}
    dist.destroy_process_group()
    return summary
