"""``streamrl launch-learner``: the training loop, one process per data-parallel rank (torchrun).

Each policy version runs the same four moves on every rank: rank 0's coordinator plans it (groups from the
replay stream, their advantages, micro-batches for every rank), the plan is scattered (msgpack bytes over the
DP group — no pickle), every rank trains its shard, and the version is committed: its push, checkpoint and
export on every rank, and rank 0's ledger, published version and metrics line.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from streamrl.config import Config
from streamrl.learner import batching, checkpoint, probe
from streamrl.learner.coordinator import Bystander, Coordinator, Plan
from streamrl.learner.policy import Policy, init_distributed
from streamrl.learner.updates import train
from streamrl.models import load_tokenizer
from streamrl.weightsync import Probe

log = logging.getLogger("streamrl.learner")


def _scatter(payloads: list[bytes] | None, device: torch.device) -> bytes:
    """Payload r to rank r from rank 0, the one rank that holds them (None elsewhere): sizes first, then one
    padded byte tensor per rank, through tensors on ``device`` (NCCL carries only CUDA tensors)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = torch.zeros(world, dtype=torch.long, device=device)
    if payloads is not None:
        sizes = torch.tensor([len(p) for p in payloads], dtype=torch.long, device=device)
    dist.broadcast(sizes, 0)
    buf = torch.zeros(int(sizes.max()), dtype=torch.uint8, device=device)
    mine = None
    for r in range(world):  # one broadcast per rank keeps it simple and backend-agnostic
        if payloads is not None:
            buf[: sizes[r]] = torch.frombuffer(bytearray(payloads[r]), dtype=torch.uint8).to(device)
        dist.broadcast(buf, 0)
        if r == rank:
            mine = bytes(buf[: sizes[r]].cpu().numpy())
    return mine


class Learner:
    """One data-parallel rank: its policy (and PPO's critic, and SFT rows), trained every policy version; rank 0
    holds the ``Coordinator``, every other rank a ``Bystander`` in its place."""

    def __init__(self, cfg: Config, coordinate: Callable[[Policy, dict | None], Coordinator],
                 start: checkpoint.Start | None = None, pushes: bool = True):
        """``coordinate(policy, resumed)``: rank 0's coordinator. ``start``: the checkpoint to begin from (default:
        with ``learner.resume: auto``, the run's newest). ``pushes``: whether there are servers to push to."""
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if cfg.record.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what cuBLAS needs to be deterministic
            torch.use_deterministic_algorithms(True)
        self.policy = Policy(cfg, cfg.model.path)
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
        if start is None and cfg.learner.resume == "auto":
            start = checkpoint.Start(self.checkpoints)
        critic = self.critic.model if self.critic else None
        resumed = (checkpoint.load(self.policy.model, start.root, critic, cfg.learner.lora is not None, start.version)
                   if start else None)
        self.version = resumed["version"] if resumed else 0
        self.checked: tuple[int, Probe | None] = (-1, None)  # the last version scored, and its probe
        self.coordinator = coordinate(self.policy, resumed) if self.rank == 0 else Bystander(cfg.learner.minibatches, pushes)
        # every step's weights are hashed into the run's record: rank 0's, or under ZeRO-3 each rank its shard
        self.recording = cfg.record.enabled and (self.rank == 0 or cfg.learner.zero_stage == 3)

    def step(self) -> dict:
        """One policy version, as the algorithm reads: plan, scatter, train, commit."""
        plan = self.coordinator.plan(self.version)  # 1.-4. groups, verdicts, advantages, micro-batches
        shards = [batching.decode_shard(_scatter(payload, self.policy.device)) for payload in plan.payloads]
        t0 = time.perf_counter()
        ptx = self.ptx.for_step(self.version, self.rank, self.world, self.cfg.learner.ptx_per_rank) if self.ptx else None
        # 5. proximal, reference and critic forwards; 6. an optimizer step per minibatch, for each epoch
        stats, landed = train(self.policy, shards, self.cfg.learner.epochs, self.critic, ptx,
                              lambda: self.coordinator.end_push(plan.info))
        if (wide_from := self.policy.cores.end()) is not None:  # the phase it took every core from
            stats["wide_from"] = wide_from
        return self.commit(plan, stats, landed, time.perf_counter() - t0)  # 7. push, checkpoint, export

    def commit(self, plan: Plan, stats: dict, landed: int, train_s: float) -> dict:
        """After the updates: the ledger, the new version (if any update landed), the push, checkpoint and export
        on their cadences (collectives every rank enters), the metrics line."""
        weights = self.policy.fingerprint() if self.recording else ""  # collective under ZeRO-3
        self.coordinator.record(self.version + 1, plan, stats, landed, weights)
        if stats["skipped"]:
            log.warning("update skipped: non-finite loss or gradient (%d of %d minibatches trained)", landed,
                        len(plan.payloads))
        if not landed:  # nothing reached the weights: the version stays, the batch is reported
            return self.coordinator.report(self.version, plan, stats)
        self.version += 1  # one policy version per step of the loop, however many updates it ran
        pushing = self.coordinator.pushes and self.version % self.cfg.weight_sync.sync_every == 0
        if pushing:
            stats.update(self.push())
            if self.cfg.mode == "sync":  # no group may start before the servers have the weights
                self.coordinator.end_push(stats)
        if self.version % self.cfg.learner.checkpoint_every == 0:
            self.checkpoint()
        if self.version % self.cfg.learner.export_every == 0:
            self.export()
        return self.coordinator.commit(self.version, plan, stats, train_s, pushing)

    def push(self) -> dict:
        """Send the weights to every live rollout server.

        Plain DP: rank 0 pushes in the background (figures land in the next step's record).
        ZeRO-3: the shards are gathered, a collective every rank enters, so the push runs to the end here.
        """
        params, check = self.policy.pushed(), self.probe()
        if self.cfg.learner.zero_stage != 3:
            return self.coordinator.push(params, self.version, whole=False, check=check)
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return self.coordinator.push(params, self.version, whole=True, check=check)

    def probe(self) -> Probe | None:
        """The check each server must pass before it serves this version: rank 0's probe, scored on every rank
        under the weights of this version (once per version), None with ``weight_sync.verify`` off."""
        sync = self.cfg.weight_sync
        if not sync.verify:
            return None
        if self.checked[0] != self.version:
            ids = probe.share(self.coordinator.probe_ids, self.policy.device)
            check = (probe.reference(self.policy.model, ids, self.policy.device, sync.tolerance(self.cfg.model.dtype))
                     if ids else None)
            self.checked = (self.version, check)
        return self.checked[1]

    def export(self) -> None:
        """The weights as a plain HF directory, with their probe: a server that starts from it verifies them."""
        check = self.probe()
        checkpoint.export_hf(self.policy.model, self.cfg.model.tokenizer or self.cfg.model.path,
                             Path(self.cfg.run.path) / "export", version=self.version, rank=self.rank,
                             zero_stage=self.cfg.learner.zero_stage, lora=self.cfg.learner.lora,
                             base_model=self.cfg.model.path, check=check)

    def checkpoint(self) -> None:
        """Save on every rank (the cursor is rank 0's); then trim what the checkpoint covers."""
        cursor = self.coordinator.cursor
        checkpoint.save(self.policy.model, self.checkpoints, version=self.version, cursor=cursor,
                        critic=self.critic.model if self.critic else None, adapter_only=self.cfg.learner.lora is not None)
        dist.barrier()
        self.coordinator.checkpointed(self.version, cursor)

    def finish(self) -> None:
        """After the last step: the final weights pushed (if the cadence left them out) and exported."""
        if self.coordinator.pushes and self.version % self.cfg.weight_sync.sync_every:
            self.push()
        if self.version % self.cfg.learner.export_every:  # the final weights, for serving and evaluation
            self.export()
        self.coordinator.close(self.version)
        dist.barrier()


def init_rank(solo: bool) -> None:
    """Join the data-parallel group: torchrun's variables, or ``solo`` a world of one that rendezvouses through a
    file (no port to race for)."""
    if not solo:
        init_distributed()
        return
    import tempfile

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # what DeepSpeed reads of a launcher's
    rendezvous = Path(tempfile.mkdtemp(prefix="streamrl-rdzv-")) / "init"
    init_distributed(init_method=f"file://{rendezvous}", rank=0, world_size=1, auto_mpi_discovery=False)


def launch(cfg: Config, steps: int | None = None, solo: bool = False) -> None:
    """Process entry of ``streamrl launch-learner`` (under torchrun)."""
    if not cfg.redis.url:
        raise ValueError("redis.url is not set: the learner reads the replay stream from a shared Redis")
    if not cfg.model.path:
        raise ValueError("model.path is not set: give a local Hugging Face model directory")
    init_rank(solo)
    learner = Learner(cfg, lambda policy, resumed: Coordinator(cfg, cfg.redis.url, policy, resumed))
    target = steps if steps is not None else cfg.learner.max_steps
    while learner.version < target:
        learner.coordinator.announce(learner.step())
    learner.finish()
    # An exit with the group still up can abort in a backend thread's teardown ("terminate called without
    # an active exception", exit status 250, seen once under the DeepSpeed launcher in CI); PyTorch asks
    # for an explicit destroy.
    dist.destroy_process_group()
