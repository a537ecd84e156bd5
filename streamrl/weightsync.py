"""Moving weights from the learner to rollout servers (ARCHITECTURE §5): shared by sender and receiver.

One process group per push target, built directly from a ``TCPStore`` (+ ``PrefixStore``) and
``ProcessGroupGloo`` on CPU or ``ProcessGroupNCCL`` on GPU — the same code path — beside the
learner's own data-parallel group. Tensors travel in buckets: each bucket is one flat byte
buffer broadcast from rank 0, laid out by ``buckets`` identically on both ends, its ``digest`` sent beside it
and checked by the receiver before the bucket is kept. A whole push is then proven by its ``Probe``: the
logprobs of a fixed token sequence, computed by the learner and again by the server on the weights it applied.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import xxhash


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str   # e.g. "float32"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def metas(named_tensors: list[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    return [TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named_tensors]


def buckets(items: list[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Consecutive tensors grouped up to ``bucket_bytes`` (a bigger tensor gets a bucket of its own)."""
    out: list[list[TensorMeta]] = []
    size = 0
    for m in items:
        if not out or (size + m.nbytes > bucket_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].append(m)
        size += m.nbytes
    return out


def flatten(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """One flat uint8 buffer holding the tensors' bytes back to back (written into ``out`` when given)."""
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    if out is None:
        return torch.cat(flat)
    return torch.cat(flat, out=out[: sum(f.numel() for f in flat)])


def unflatten(buffer: torch.Tensor, bucket: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """``flatten`` undone: views into ``buffer`` (no copy); consume them before the buffer is reused."""
    out, offset = [], 0
    for m in bucket:
        chunk = buffer[offset: offset + m.nbytes]
        out.append((m.name, chunk.view(getattr(torch, m.dtype)).reshape(m.shape)))
        offset += m.nbytes
    return out


def digest(buffer: torch.Tensor) -> str:
    """A bucket's checksum: xxh3-128 of its bytes (about 9 GB/s on one CPU core). A GPU buffer is hashed on the
    host, after a copy."""
    host = buffer.detach().reshape(-1)
    host = host.cpu() if host.device.type != "cpu" else host
    return xxhash.xxh3_128_hexdigest(memoryview(host.numpy()))


class CorruptBucket(ValueError):
    """A bucket's bytes differ from those the learner sent."""


def check_digest(buffer: torch.Tensor, expected: str | None, names: list[str], version: int | None = None) -> None:
    """Raise ``CorruptBucket`` unless ``buffer`` hashes to ``expected`` (None: the sender sent no digest)."""
    if expected is not None and (got := digest(buffer)) != expected:
        held = f"{names[0]!r} and {len(names) - 1} more" if len(names) > 1 else repr(names[0]) if names else "nothing"
        of = "" if version is None else f" of version {version}"
        raise CorruptBucket(f"a bucket{of} ({held}) arrived corrupted: its bytes hash to {got}, the learner's to "
                            f"{expected}")


@dataclass(frozen=True)
class Probe:
    """A version's end-to-end check: the learner's logprobs of ``input_ids[1:]`` (teacher-forced, temperature 1,
    fp32 log-softmax) under the weights it pushed, which the server must reproduce within ``tolerance``.

    Token i passes when ``|served - learner| <= tolerance * max(1, |learner|)``: absolute for likely tokens,
    relative for unlikely ones, whose large logprobs carry proportionally larger rounding (numpy's ``isclose``
    with atol = rtol = tolerance, both sides fp32)."""

    input_ids: list[int]
    logprobs: list[float]
    tolerance: float

    def check(self, served: list[float], version: int) -> float:
        """The largest gap, as a share of what token i allows (``tolerance * max(1, |learner's|)``) times the
        tolerance: comparable to ``tolerance``; ``ProbeMismatch`` past it."""
        if len(served) != len(self.logprobs):
            raise ProbeMismatch(f"version {version} failed its probe: the server scored {len(served)} tokens, the "
                                f"learner {len(self.logprobs)}")
        gaps = [abs(a - b) / max(1.0, abs(b)) if math.isfinite(a) else math.inf
                for a, b in zip(served, self.logprobs)]
        worst = max(range(len(gaps)), key=gaps.__getitem__, default=0)
        gap = gaps[worst] if gaps else 0.0
        if not gap <= self.tolerance:
            want = self.logprobs[worst]
            raise ProbeMismatch(f"version {version} failed its probe: the served weights' logprob of probe token "
                                f"{worst + 1} is {served[worst]:.6f}, the learner's {want:.6f} (off by "
                                f"{abs(served[worst] - want):.2e}; allowed {self.tolerance * max(1.0, abs(want)):.2e})")
        return gap


class ProbeMismatch(ValueError):
    """A server's weights do not compute the learner's function: the push was not applied as sent."""


class Staging:
    """Reusable byte buffers (no allocation and page faults per bucket), ``depth`` per key, used in turn.

    A receiving engine may adopt the received tensors as its weights without copying them; with
    ``depth=2`` per bucket layout, the buffer it adopted is only written again after the next push
    has moved the weights onto the other one.
    """

    def __init__(self, device: str = "cpu", depth: int = 1):
        self.device, self.depth = device, depth
        self.buffers: dict[Hashable, list[torch.Tensor]] = {}

    def take(self, key: Hashable, nbytes: int) -> torch.Tensor:
        ring = self.buffers.get(key)
        if ring is None or ring[0].numel() < nbytes:
            ring = self.buffers[key] = [torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                                        for _ in range(self.depth)]
        ring.append(ring.pop(0))
        return ring[-1][:nbytes]

    def untake(self, key: Hashable) -> None:
        """Undo the last ``take(key)``: its buffer was not adopted (a push dropped half way), so the next
        ``take(key)`` returns it again, not the buffer an engine may still be serving from."""
        ring = self.buffers[key]
        ring.insert(0, ring.pop())


def make_group(master_address: str, master_port: int, rank: int, world_size: int, *, backend: str = "gloo",
               group_name: str = "weight_update_group", timeout_s: float = 60.0) -> dist.ProcessGroup:
    """A process group of its own, not registered with torch.distributed's default world.

    Rank 0 (the learner) hosts the store; every other member connects to it. Blocks until all joined.
    """
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore(group_name, store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def broadcast(group: dist.ProcessGroup, buffer: torch.Tensor) -> None:
    """Rank 0's ``buffer`` into everyone's (a raw group: ``dist.broadcast(..., group=)`` refuses it)."""
    group.broadcast(buffer, 0).wait()
