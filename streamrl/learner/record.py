"""The run's record: every learner step's input, kept in the run directory so that ``streamrl replay`` can retrain
the run from exactly what it consumed.

A step's frame holds the groups it trained, in order, as the replay stream carried them (``encode_group``), what
became of every group it read and did not train, the staleness bound it judged under, the partition of its
sequences over ranks and micro-batches, and a hash of the weights the step ended with. Frames are msgpack,
compressed with zstd, appended to chunk files ``record/NNNNNNNN.rec`` (NNNNNNNN: the index of the chunk's first
frame) by a thread of their own, off the learner's critical path. Each frame carries a checksum, so that a
truncated or damaged record is named, step by step, never half read.

The record follows the learner's checkpoints as the ledger does: a learner that resumes from version V drops
the frames of steps planned at V or later (it replays them from the stream's cursor) and records them anew;
each checkpoint waits until the frames it covers are on disk.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import msgpack
import zstandard

from streamrl.protocol import encode_group

MAGIC = b"SRLR"
# magic, the version the step was planned at and the one it reached, compressed length, crc32 of the compressed bytes
HEADER = struct.Struct("<4sqqII")
FORMAT = 1
# the plan's figures a frame keeps, so that a replay's metrics lines read as the run's did
PLAN_INFO = ("wait_s", "admission_refused", "dropped_stale", "dropped_no_signal", "groups_no_signal")

log = logging.getLogger("streamrl.learner")


class RecordError(ValueError):
    """The record cannot be read as written: truncated, damaged, or not a record. ``offset``: where in the chunk
    file the readable frames end."""

    def __init__(self, message: str, offset: int | None = None):
        super().__init__(message)
        self.offset = offset


@dataclass
class Step:
    """One learner step's input and outcome."""

    version: int                 # the learner's version when it planned the step (it makes version + 1)
    trained: list                # the groups trained, in order, as the stream carries them (Group or bytes)
    outcomes: dict[str, str]     # group id -> why a group read was not trained ("dropped:stale", ...)
    bound: int                   # the staleness bound the groups were judged under
    partition: list[list[list[list[int]]]]  # per minibatch, per rank, per micro-batch: sequence indices
    cursor: str                  # the stream's cursor after the step's reads
    landed: int = 0              # minibatches whose update reached the weights
    weights: str = ""            # hash of the weights the step ended with (``Policy.fingerprint``)
    info: dict[str, Any] = field(default_factory=dict)  # the plan's counts (dropped, refused, waited)
    wide_from: int | None = None  # the phase from which the step trained on every core (``cores``); None: none


def encode(step: Step) -> bytes:
    """A frame: header and compressed payload (the groups encoded here, in the writer's thread)."""
    raw = {f.name: getattr(step, f.name) for f in fields(step)}  # shallow: the groups are encoded as the stream's
    raw["trained"] = [g if isinstance(g, bytes) else encode_group(g) for g in step.trained]
    payload = zstandard.ZstdCompressor(level=3).compress(msgpack.packb(raw, use_bin_type=True))
    reached = step.version + (step.landed > 0)
    return HEADER.pack(MAGIC, step.version, reached, len(payload), zlib.crc32(payload)) + payload


def _frames(path: Path) -> Iterator[tuple[int, int, int, bytes]]:
    """(offset, version planned, version reached, compressed payload) of each frame of one chunk file; a damaged or
    cut frame raises."""
    data, offset = path.read_bytes(), 0
    while offset < len(data):
        if len(data) - offset < HEADER.size:
            raise RecordError(f"{path}: cut off after byte {offset}, inside a frame's header: the record is "
                              "truncated", offset)
        magic, version, reached, length, crc = HEADER.unpack_from(data, offset)
        if magic != MAGIC:
            raise RecordError(f"{path}: no frame at byte {offset}: the record is damaged there", offset)
        payload = data[offset + HEADER.size: offset + HEADER.size + length]
        if len(payload) < length:
            raise RecordError(f"{path}: the frame of step {version + 1} is cut off ({len(payload)} of {length} "
                              "bytes): the record is truncated", offset)
        if zlib.crc32(payload) != crc:
            raise RecordError(f"{path}: the frame of step {version + 1} fails its checksum: the record is damaged",
                              offset)
        yield offset, version, reached, payload
        offset += HEADER.size + length


def decode(payload: bytes, where: str) -> Step:
    try:
        raw = msgpack.unpackb(zstandard.ZstdDecompressor().decompress(payload), raw=False, strict_map_key=False)
        return Step(**raw)
    except Exception as e:  # zstd, msgpack and a wrong field set raise unrelated types
        raise RecordError(f"{where}: cannot be decoded ({e})") from None


def chunks(root: Path) -> list[Path]:
    return sorted(root.glob("*.rec"))


def _sequence(root: Path) -> Iterator[tuple[Path, int, int, bytes]]:
    """(chunk, version planned, version reached, payload) of every frame, in order; a frame that is not where the
    previous one left the learner (a step missing) raises, naming it."""
    files = chunks(root)
    if not files:
        raise RecordError(f"{root} holds no record chunk (*.rec)")
    expected = None
    for path in files:
        for _, planned, reached, payload in _frames(path):
            if expected is not None and planned != expected:
                raise RecordError(f"{path}: the record has no step {expected + 1}: after version {expected} the next "
                                  f"frame was planned at version {planned}")
            expected = reached
            yield path, planned, reached, payload


def headers(root: Path) -> list[tuple[int, int]]:
    """(version planned, version reached) of every step, in order; every frame is checked (checksum, order)."""
    return [(planned, reached) for _, planned, reached, _ in _sequence(root)]


def span(root: Path, steps: list[tuple[int, int]] | None = None) -> tuple[int, int]:
    """The version the record's first step was planned at, and the version its last step reached (of ``steps``,
    the record's ``headers``, read here when not given)."""
    steps = headers(root) if steps is None else steps
    if not steps:
        raise RecordError(f"{root} holds no recorded step")
    return steps[0][0], steps[-1][1]


def count(root: Path, start: int, last: int, steps: list[tuple[int, int]] | None = None) -> tuple[int, int]:
    """How many steps a replay from version ``start`` up to version ``last`` trains, and the version they reach."""
    chosen = [reached for planned, reached in (headers(root) if steps is None else steps) if start <= planned < last]
    return len(chosen), chosen[-1] if chosen else start


def read(root: Path, since: int = 0) -> Iterator[Step]:
    """The steps of the record planned at version ``since`` or later, in order."""
    for path, planned, _, payload in _sequence(root):
        if planned >= since:
            yield decode(payload, f"{path}: step {planned + 1}")


class Recorder:
    """Rank 0's writer of the record: ``append`` hands a step to the writing thread and returns; ``sync`` waits
    until every step handed over is on disk (a checkpoint calls it). A failed write is raised at the next call."""

    def __init__(self, root: Path, resumed_version: int, chunk_steps: int = 50, keep_steps: int | None = None):
        self.root, self.chunk_steps, self.keep_steps = root, chunk_steps, keep_steps
        root.mkdir(parents=True, exist_ok=True)
        self.frames, self.in_chunk = self._truncate(resumed_version), 0
        self.file = None
        self.queue: queue.Queue[Step | None] = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._write_all, name="record-writer", daemon=True)
        self.thread.start()

    def _truncate(self, version: int) -> int:
        """Drop the frames of steps planned at ``version`` or later (a resumed learner makes them again), and a
        damaged tail (the learner died mid-write) with them; return the index the next frame gets."""
        following, cutting = 0, False
        for path in chunks(self.root):
            if cutting:
                path.unlink()
                continue
            cut, count = None, 0
            try:
                for offset, planned, _, _ in _frames(path):
                    if planned >= version:
                        cut = offset
                        break
                    count += 1
            except RecordError as e:
                log.warning("%s; the record is cut there and goes on from version %d", e, version)
                cut = e.offset
            following = int(path.stem) + count
            if cut is not None:
                cutting = True
                with path.open("r+b") as f:
                    f.truncate(cut)
                if cut == 0:
                    path.unlink()
        return following

    def append(self, step: Step) -> None:
        self._raise()
        self.queue.put(step)

    def sync(self) -> None:
        """Block until every appended step is written and on disk."""
        self.queue.join()
        self._raise()
        if self.file:
            os.fsync(self.file.fileno())

    def close(self) -> None:
        self.sync()
        self.queue.put(None)
        self.thread.join()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the run's record could not be written under {self.root}: {self.error}") from self.error

    def _write_all(self) -> None:
        while (step := self.queue.get()) is not None:
            try:
                if self.error is None:
                    self._write(step)
            except Exception as e:  # raised to the learner at its next append or sync
                self.error = e
            finally:
                self.queue.task_done()
        self.queue.task_done()
        if self.file:
            self.file.close()

    def _write(self, step: Step) -> None:
        if self.file is None or self.in_chunk >= self.chunk_steps:
            if self.file:
                self.file.close()
            self.file, self.in_chunk = (self.root / f"{self.frames:08d}.rec").open("ab"), 0
            self._retain(step.version)
        self.file.write(encode(step))
        self.file.flush()
        self.frames, self.in_chunk = self.frames + 1, self.in_chunk + 1

    def _retain(self, version: int) -> None:
        """With ``keep_steps``, delete whole chunks whose every step is older than the newest ``keep_steps``."""
        if self.keep_steps is None:
            return
        for path in chunks(self.root)[:-1]:
            newest = max((v for _, v, _, _ in _frames(path)), default=-1)
            if newest < version - self.keep_steps:
                path.unlink()


def write_meta(root: Path, meta: dict[str, Any], version: int) -> None:
    """``record/meta.json``: what a replay needs beside the frames (the learner's config, its world and thread
    settings), with one entry per learner start (a restart may differ)."""
    path = root / "meta.json"
    old = json.loads(path.read_text()) if path.is_file() else {"format": FORMAT, "starts": []}
    starts = [s for s in old["starts"] if s["version"] < version]
    start = {"version": version, "time": time.time(), **meta}
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / ".meta.json.tmp"
    tmp.write_text(json.dumps({"format": FORMAT, "starts": [*starts, start]}, indent=1))
    os.replace(tmp, path)


def pack(state) -> str:
    """A torch RNG state (a uint8 tensor) as text for ``meta.json``; ``unpack`` gives it back."""
    return base64.b64encode(state.numpy().tobytes()).decode()


def unpack(text: str):
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def read_meta(root: Path) -> dict[str, Any]:
    path = root / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: the run was not recorded (record.enabled: false, or a "
                                "streamrl older than the record)")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise RecordError(f"{path}: record format {meta.get('format')!r}, this streamrl reads format {FORMAT}")
    return meta
