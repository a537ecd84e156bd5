"""The learner's end of the weight push: rank 0 broadcasts bucketed weights to every live rollout server.

Each server gets its own process group (set up through its ``/init_weights_update_group``
the first time it is seen in the registry). A push: optionally pause generation, then per
bucket POST ``/update_weights_from_distributed`` (with the bucket's digest) while broadcasting the bucket, then
continue. A server whose bucket arrived corrupted refuses it, drops the push and keeps its weights.
The last bucket carries the version's probe: a server serves the version only once the weights it applied
reproduce the learner's logprobs of it; one that fails (a 409) rolls back and stays in the group, and the push
counts it as ``push_rejected``. A server that fails or times out otherwise is dropped (it rejoins when it
reappears); the others go on.
With ``learner.lora`` a push carries the adapter alone, and each bucket names it (``lora``: name, rank, alpha
and the adapter's tensor count), so that the server serves it as a new adapter version.
The servers take a push in waves of at most ``weight_sync.max_paused_share`` of them (one server at least):
each server of a wave gets each bucket at the same time (one broadcast per group, run side by side) and applies
the version, then the next wave starts; the servers not in the wave go on generating.
``start`` runs a push in the background so that it overlaps the learner's wait for data;
the learner calls ``wait`` before its optimizer touches the weights again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import httpx
import torch

from streamrl.buffer import ServerRegistry
from streamrl.buffer.redis_server import free_port
from streamrl.config import Config
from streamrl.node import node_address
from streamrl.weightsync import Probe, Staging, broadcast, buckets, digest, flatten, make_group, metas

log = logging.getLogger("streamrl.push")
GROUP = "streamrl-weights"  # the group's name in SGLang's API, and its store prefix on both ends


def transport(cfg: Config) -> str:
    """``weight_sync.backend`` resolved: ``auto`` is NCCL when the learner has CUDA and the servers run vLLM (the
    ``hf`` engine keeps its weights on the CPU) on their GPUs, else gloo (a LoRA adapter goes to the server's
    own process, which hands it to vLLM's LoRA API)."""
    if cfg.weight_sync.backend != "auto":
        return cfg.weight_sync.backend
    full_into_vllm = cfg.server.engine == "vllm" and cfg.learner.lora is None
    return "nccl" if torch.cuda.is_available() and full_into_vllm else "gloo"


@dataclass
class Verdicts:
    """What the servers said of one push: those whose probe failed (a reason each), the gaps of those that passed."""

    rejected: dict[str, str] = field(default_factory=dict)
    gaps: list[float] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)  # took the version without scoring the probe

    def scored(self, url: str, reply: httpx.Response, version: int) -> None:
        """A server's answer to the last bucket: the probe's gap, or none from a server that cannot verify (a
        stock SGLang server ignores the probe): it serves the version unproven, which is said, not hidden."""
        gap = reply.json().get("probe_gap")
        if gap is None:
            self.unverified.append(url)
            log.warning("%s took version %d without scoring its probe (not a streamrl server?): its tokens are "
                        "unverified", url, version)
        else:
            self.gaps.append(float(gap))

    def failed(self, url: str, error: BaseException, version: int) -> None:
        if isinstance(error, httpx.HTTPStatusError) and error.response.status_code == 409:
            self.rejected[url] = reason = _detail(error.response)
            log.error("%s refused version %d: %s", url, version, reason)
            return
        reason = _detail(error.response) if isinstance(error, httpx.HTTPStatusError) else error or type(error).__name__
        log.warning("dropping %s from the weight push: %s", url, reason)


def waves(targets: list[str], share: float) -> list[list[str]]:
    """``targets`` in turns of at most ``share`` of them (at least one server a turn)."""
    size = max(1, int(share * len(targets) + 1e-9))
    return [targets[i: i + size] for i in range(0, len(targets), size)]


def _detail(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text


class WeightPusher:
    def __init__(self, cfg: Config, registry: ServerRegistry):
        self.cfg, self.registry = cfg, registry
        self.sync = cfg.weight_sync
        self.groups: dict[str, object] = {}
        self.started: dict[str, float] = {}  # a server restarted on the same URL is a new server
        self.has: dict[str, int] = {}  # the version each server was last pushed successfully
        self.pool = ThreadPoolExecutor(32, thread_name_prefix="push")
        self.pending: Future | None = None
        self.staging: Staging | None = None
        self.refused: Callable[[int, str, str], None] = lambda version, url, reason: None  # the ledger's record
        headers = {"Authorization": f"Bearer {cfg.server.token}"} if cfg.server.token else {}
        self.http = httpx.Client(timeout=self.sync.timeout_s, headers=headers)

    def _join(self, url: str, started: float) -> None:
        address, port = node_address(self.sync.master_address), free_port()
        backend = transport(self.cfg)
        mine = self.pool.submit(make_group, address, port, 0, 2, backend=backend,
                                group_name=GROUP, timeout_s=self.sync.timeout_s)
        reply = self.http.post(f"{url}/init_weights_update_group", json={
            "master_address": address, "master_port": port, "rank_offset": 1, "world_size": 2,
            "backend": backend, "group_name": GROUP, "timeout_s": self.sync.timeout_s})
        reply.raise_for_status()
        self.groups[url] = mine.result(self.sync.timeout_s)
        self.started[url] = started

    def refresh(self) -> None:
        """Join servers that appeared; forget those whose heartbeats stopped."""
        alive = {s.url: s.started_at for s in self.registry.alive()}
        for url in list(self.groups):
            if alive.get(url) != self.started.get(url):  # gone, or back as a new process
                self.groups.pop(url, None)
                self.has.pop(url, None)
        for url in alive.keys() - self.groups.keys():
            try:
                self._join(url, alive[url])
            except Exception as e:
                log.warning("could not set up a weight group with %s: %s", url, e)

    def start(self, named_tensors: list[tuple[str, torch.Tensor]], version: int, check: Probe | None = None,
              landed: Callable[[dict], None] | None = None) -> None:
        """Push in the background; the tensors must not change until ``wait`` returns. ``landed`` is called
        (on the push's thread) with the push's figures once it is over, whether or not every server took it."""
        self.wait()

        def push() -> dict[str, float]:
            stats: dict[str, float] = {}
            try:
                stats = self.push(named_tensors, version, check=check)
                return stats
            finally:  # before ``wait`` returns
                if landed is not None:
                    landed(stats)

        self.pending = self.pool.submit(push)

    def wait(self) -> dict[str, float]:
        """Finish the background push, if any, and return its figures."""
        pending, self.pending = self.pending, None
        return pending.result() if pending else {}

    def catch_up(self, named_tensors: list[tuple[str, torch.Tensor]], version: int,
                 check: Probe | None = None) -> dict[str, float]:
        """Push ``version`` to servers that lack it (joined or restarted since the last push).

        Called while the learner waits for data: a server that came back with old weights would
        otherwise generate only stale data, and no step (hence no push) would ever come.
        """
        if self.pending is not None and not self.pending.done():
            return {}
        self.refresh()
        reported = {s.url: s.weight_version for s in self.registry.alive()}
        lagging = [url for url in self.groups if max(self.has.get(url, -1), reported.get(url, -1)) < version]
        if not lagging:
            return {}
        log.info("catching up %s to weight version %d", ", ".join(lagging), version)
        return self.push(named_tensors, version, lagging, check)

    def push(self, named_tensors: list[tuple[str, torch.Tensor]], version: int,
             only: list[str] | None = None, check: Probe | None = None) -> dict[str, float]:
        """Every bucket to every live server (or to ``only``), in waves of at most ``max_paused_share`` of them, so
        that the rest keep generating while a wave applies; ``check``: the probe each must pass to serve the
        version. Figures: ``push_targets`` servers serve it, ``push_rejected`` failed its probe and rolled back,
        ``push_probe_gap`` the largest gap among those that passed."""
        t0 = time.perf_counter()
        if only is None:
            self.refresh()
        targets = list(self.groups) if only is None else [url for url in only if url in self.groups]
        served, verdicts = [], Verdicts()
        for wave in waves(targets, self.sync.max_paused_share):
            paused = wave[:] if self.sync.mode == "pause" else []
            self._each(paused, "/pause_generation")
            try:
                self._send(named_tensors, version, wave, check, verdicts)
                self.has.update(dict.fromkeys(wave, version))
                served += wave
            finally:  # every server that was paused continues, even one dropped from this push
                self._each(paused, "/continue_generation")
        for url, reason in verdicts.rejected.items():
            self.refused(version, url, reason)
        stats = {"push_s": time.perf_counter() - t0, "push_targets": float(len(served)), "push_version": version,
                 "push_rejected": float(len(verdicts.rejected))}
        if verdicts.gaps:
            stats["push_probe_gap"] = max(verdicts.gaps)
        if verdicts.unverified:
            stats["push_unverified"] = float(len(verdicts.unverified))
        if verdicts.rejected:  # a line of news on the live display
            stats["push_refusal"] = "; ".join(f"{url} refused version {version}: {reason}"
                                              for url, reason in verdicts.rejected.items())
        return stats

    def _send(self, named_tensors: list[tuple[str, torch.Tensor]], version: int, targets: list[str],
              check: Probe | None, verdicts: Verdicts) -> None:
        """Every bucket to every target, the last with ``check``; a target that fails is dropped from ``targets``
        (one whose probe failed stays in the group: it took every bucket)."""
        tensors, layout = dict(named_tensors), buckets(metas(named_tensors), int(self.sync.bucket_mb * 2**20))
        lora = self.cfg.learner.lora
        adapter = {} if lora is None else {"lora": {"name": lora.name, "rank": lora.rank, "alpha": lora.alpha,
                                                    "tensors": len(named_tensors)}}
        if self.staging is None:
            self.staging = Staging(str(named_tensors[0][1].device))

        def flattened(i: int) -> tuple[torch.Tensor, str | None]:  # two buffers in turn: bucket i+1 is flattened (and
            bucket = layout[i]                                  # hashed) while bucket i is sent
            buffer = flatten([tensors[m.name] for m in bucket], out=self.staging.take(i % 2, sum(m.nbytes for m in bucket)))
            return buffer, digest(buffer) if self.sync.verify else None

        next_buffer = self.pool.submit(flattened, 0)
        for i, bucket in enumerate(layout):
            buffer, checksum = next_buffer.result()
            last = i + 1 == len(layout)
            if not last:
                next_buffer = self.pool.submit(flattened, i + 1)
            body = {"names": [m.name for m in bucket], "dtypes": [m.dtype for m in bucket],
                    "shapes": [list(m.shape) for m in bucket], "weight_version": version, "digest": checksum,
                    "group_name": GROUP, "flush_cache": True, **adapter}  # SGLang drops its prefix cache
            if last and check is not None:
                body["probe"] = {"input_ids": check.input_ids, "logprobs": check.logprobs,
                                 "tolerance": check.tolerance}
            sends = {url: self.pool.submit(self.http.post, f"{url}/update_weights_from_distributed", json=body)
                     for url in targets}
            casts = {url: self.pool.submit(broadcast, self.groups[url], buffer) for url in targets}
            wait([*sends.values(), *casts.values()], timeout=self.sync.timeout_s)
            for url in list(targets):
                try:
                    casts[url].result(0)
                    reply = sends[url].result(0).raise_for_status()
                except Exception as e:  # a dead or failing server must not stop the others
                    targets.remove(url)
                    self.has.pop(url, None)
                    verdicts.failed(url, e, version)
                    if url not in verdicts.rejected:  # out of step with the learner: it joins again
                        self.groups.pop(url, None)
                    continue
                if last and check is not None:
                    verdicts.scored(url, reply, version)

    def _each(self, urls: list[str], path: str) -> None:
        for url in urls:
            try:
                self.http.post(url + path)
            except httpx.HTTPError as e:
                log.warning("%s%s failed: %s", url, path, e)
