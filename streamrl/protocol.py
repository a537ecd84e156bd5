"""Wire types: a group of samples as it travels from rollout workers to the learner.

A ``Sample`` is one trajectory. ``tokens`` is the prompt, every response and every
environment observation concatenated as token ids (never re-tokenised text).
``loss_mask`` is 1 exactly on tokens the policy generated; on those tokens
``logprobs`` holds the behaviour logprob and ``versions`` the policy version that
sampled it (0.0 / -1 elsewhere). A trajectory whose context stopped being a token
prefix of itself is split into several sequences: ``seq_lens`` gives their lengths
(one sequence covering everything when absent).

The codec is msgpack with arrays as little-endian typed bytes; no pickle. Decoding
validates everything, so a malformed entry raises ``WireError`` naming the fault.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

SCHEMA = 1

# Field name -> dtype on the wire. Arrays of a sample share one length, except seq_lens.
ARRAYS: dict[str, np.dtype] = {
    "tokens": np.dtype("<i4"),
    "loss_mask": np.dtype("u1"),
    "logprobs": np.dtype("<f4"),
    "versions": np.dtype("<i4"),
}
SEQ_LENS_DTYPE = np.dtype("<i4")
FINISH_REASONS = ("stop", "length", "abort", "error")


class WireError(ValueError):
    """A payload that does not decode to a valid group."""


@dataclass
class Sample:
    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reward: float
    finish_reason: str = "stop"
    seq_lens: np.ndarray | None = None
    turn_rewards: list[float] | None = None
    env_info: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, dtype in ARRAYS.items():
            setattr(self, name, np.ascontiguousarray(getattr(self, name), dtype=dtype))
        if self.seq_lens is not None:
            self.seq_lens = np.ascontiguousarray(self.seq_lens, dtype=SEQ_LENS_DTYPE)
        self.reward = float(self.reward)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def generated_versions(self) -> np.ndarray:
        return self.versions[self.loss_mask.astype(bool)]

    def sequences(self) -> list[slice]:
        """The token ranges of this trajectory's sequences."""
        lens = [self.num_tokens] if self.seq_lens is None else self.seq_lens.tolist()
        ends = np.cumsum(lens).tolist()
        return [slice(end - n, end) for n, end in zip(lens, ends)]


@dataclass
class Group:
    """All ``n`` samples of one prompt; the unit that is pushed, read and trained."""

    prompt_id: str
    env: str
    samples: list[Sample]
    meta: dict[str, Any] = field(default_factory=dict)
    group_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    def version_range(self) -> tuple[int, int]:
        """(oldest, newest) policy version over every generated token; (-1, -1) if none."""
        versions = [s.generated_versions for s in self.samples]
        versions = np.concatenate(versions) if versions else np.empty(0, np.int32)
        if versions.size == 0:
            return -1, -1
        return int(versions.min()), int(versions.max())


# --------------------------------------------------------------------------- encode
#
# On the wire a group stores each per-token array once, concatenated over its
# samples, with the samples' lengths beside it: encoding and validation are a few
# vectorised numpy operations however many samples a group has.


def encode_group(group: Group) -> bytes:
    arrays, lengths = _concatenated(group)
    _validate(group, arrays, lengths)
    samples = group.samples
    packed = {name: arr.tobytes() for name, arr in arrays.items()}
    packed.update(
        schema=SCHEMA,
        group_id=group.group_id,
        prompt_id=group.prompt_id,
        env=group.env,
        meta=group.meta,
        lengths=lengths.tobytes(),
        rewards=[s.reward for s in samples],
        finish_reasons=[s.finish_reason for s in samples],
        seq_lens=[None if s.seq_lens is None else s.seq_lens.tolist() for s in samples],
        turn_rewards=[s.turn_rewards for s in samples],
        env_info=[s.env_info for s in samples],
        timings=[s.timings for s in samples],
    )
    return msgpack.packb(packed, use_bin_type=True)


# --------------------------------------------------------------------------- decode

_PER_SAMPLE = {"rewards": (int, float), "finish_reasons": str, "seq_lens": (list, type(None)),
               "turn_rewards": (list, type(None)), "env_info": dict, "timings": dict}


def decode_group(payload: bytes) -> Group:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError(f"not a msgpack payload: {e}") from None
    if not isinstance(raw, dict):
        raise WireError(f"group must be a map, got {type(raw).__name__}")
    if raw.get("schema") != SCHEMA:
        raise WireError(f"unsupported schema {raw.get('schema')!r}; this build reads schema {SCHEMA}")
    lengths = _array(raw, "lengths", np.dtype("<i4"))
    if lengths.size == 0 or (lengths <= 0).any():
        raise WireError(f"group.lengths must be positive, got {lengths.tolist()}")
    arrays = {name: _array(raw, name, dtype) for name, dtype in ARRAYS.items()}
    total = int(lengths.sum())
    for name, arr in arrays.items():
        if arr.shape[0] != total:
            raise WireError(f"group.{name} has {arr.shape[0]} items; lengths add up to {total}")
    per_sample = {name: _list(raw, name, kind, lengths.size) for name, kind in _PER_SAMPLE.items()}
    bounds = [0, *np.cumsum(lengths).tolist()]
    try:
        samples = [
            Sample(
                **{name: arr[bounds[i] : bounds[i + 1]] for name, arr in arrays.items()},
                reward=per_sample["rewards"][i],
                finish_reason=per_sample["finish_reasons"][i],
                seq_lens=per_sample["seq_lens"][i],
                turn_rewards=per_sample["turn_rewards"][i],
                env_info=per_sample["env_info"][i],
                timings=per_sample["timings"][i],
            )
            for i in range(lengths.size)
        ]
    except (TypeError, ValueError, OverflowError) as e:  # e.g. seq_lens with non-integers
        raise WireError(f"group has a malformed per-sample field: {e}") from None
    group = Group(
        group_id=_field(raw, "group_id", str),
        prompt_id=_field(raw, "prompt_id", str),
        env=_field(raw, "env", str),
        meta=_field(raw, "meta", dict),
        samples=samples,
    )
    _validate(group, arrays, lengths)
    return group


def _field(raw: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in raw:
        raise WireError(f"group.{name} is missing")
    value = raw[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise WireError(f"group.{name} has type {type(value).__name__}")
    return value


def _list(raw: dict, name: str, kind: type | tuple[type, ...], n: int) -> list:
    values = _field(raw, name, list)
    if len(values) != n:
        raise WireError(f"group.{name} has {len(values)} entries for {n} samples")
    for i, v in enumerate(values):
        if not isinstance(v, kind) or isinstance(v, bool):
            raise WireError(f"group.{name}[{i}] has type {type(v).__name__}")
    return values


def _array(raw: dict, name: str, dtype: np.dtype) -> np.ndarray:
    buf = _field(raw, name, bytes)
    if len(buf) % dtype.itemsize:
        raise WireError(f"group.{name}: {len(buf)} bytes is not a whole number of {dtype} items")
    return np.frombuffer(buf, dtype=dtype)


# --------------------------------------------------------------------------- validate


def _concatenated(group: Group) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Each per-token array over all samples, and the samples' lengths (shapes checked)."""
    if not group.samples:
        raise WireError(f"group {group.group_id!r} has no samples")
    for i, s in enumerate(group.samples):
        for name in ARRAYS:
            arr = getattr(s, name)
            if arr.ndim != 1 or arr.shape[0] != s.num_tokens:
                raise WireError(f"group {group.group_id!r} samples[{i}]: {name} has shape {arr.shape}, "
                                f"expected ({s.num_tokens},) like tokens")
    lengths = np.array([s.num_tokens for s in group.samples], dtype="<i4")
    return {name: np.concatenate([getattr(s, name) for s in group.samples]) for name in ARRAYS}, lengths


def _validate(group: Group, arrays: dict[str, np.ndarray], lengths: np.ndarray) -> None:
    """Checks over the concatenated arrays; a failure names the first offending sample."""
    def fail(what: str, bad: np.ndarray | None = None) -> None:
        where = ""
        if bad is not None:
            first = int(np.flatnonzero(bad)[0]) if bad.dtype == bool else int(bad)
            where = f" samples[{int(np.searchsorted(np.cumsum(lengths), first, side='right'))}]"
        raise WireError(f"group {group.group_id!r}{where}: {what}")

    if not group.group_id:
        fail("group_id is empty")
    if (lengths == 0).any():
        fail("a sample has no tokens")
    tokens, mask = arrays["tokens"], arrays["loss_mask"]
    logprobs, versions = arrays["logprobs"], arrays["versions"]
    if (bad := tokens < 0).any():
        fail("negative token id", bad)
    if (bad := mask > 1).any():
        fail("loss_mask must be 0 or 1", bad)
    generated = mask.astype(bool)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    per_sample_generated = np.add.reduceat(mask.astype(np.int64), starts)
    if (per_sample_generated == 0).any():
        fail(f"samples {np.flatnonzero(per_sample_generated == 0).tolist()} have no generated token")
    if (bad := generated & (versions < 0)).any():
        fail("a generated token has a negative policy version", bad)
    if (bad := ~generated & (versions != -1)).any():
        fail("a token the policy did not generate must have version -1", bad)
    if (bad := generated & ~(np.isfinite(logprobs) & (logprobs <= 1e-4))).any():
        fail("behaviour logprobs must be finite and <= 0", bad)
    if (bad := ~generated & (logprobs != 0)).any():
        fail("logprobs of tokens the policy did not generate must be 0", bad)
    for i, s in enumerate(group.samples):
        _validate_scalars(s, f"group {group.group_id!r} samples[{i}]")


def _validate_scalars(s: Sample, where: str) -> None:
    if not math.isfinite(s.reward):
        raise WireError(f"{where}: reward {s.reward} is not finite")
    if s.finish_reason not in FINISH_REASONS:
        raise WireError(f"{where}: finish_reason {s.finish_reason!r} not one of {FINISH_REASONS}")
    if s.seq_lens is not None:
        if s.seq_lens.size == 0 or (s.seq_lens <= 0).any() or int(s.seq_lens.sum()) != s.num_tokens:
            raise WireError(f"{where}: seq_lens {s.seq_lens.tolist()} must be positive and sum to {s.num_tokens}")
    firsts = [0] if s.seq_lens is None else np.concatenate(([0], np.cumsum(s.seq_lens)[:-1]))
    if np.asarray(s.loss_mask)[firsts].any():  # a token is scored from the positions before it, in its sequence
        raise WireError(f"{where}: a sequence's first token is marked generated (loss_mask 1): no token precedes it "
                        "to score it from")
    if s.turn_rewards is not None and not all(
        isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) for r in s.turn_rewards
    ):
        raise WireError(f"{where}: turn_rewards must be finite numbers")
