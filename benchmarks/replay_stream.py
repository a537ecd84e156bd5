"""Replay-stream throughput: streamrl's put/read against a raw redis-py XADD/XREAD loop.

Both sides move the same encoded payloads through the same embedded redis-server
in the same run. streamrl's put adds encoding, validation and the atomic Lua put
(dedupe + counters); its read adds decoding, validation and the header check.

    python -m benchmarks.replay_stream [--quick]      (or: streamrl bench queue)
"""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from benchmarks.common import cli, console, median, new_figure, print_table, save_figure, write_json
from streamrl.buffer import EmbeddedRedis, Namespace, ReplayStream, StreamReader
from streamrl.protocol import encode_group
from streamrl.testing import synthetic_group

# (label, samples per group, tokens per sample)
SHAPES = [("8x1k", 8, 1024), ("16x4k", 16, 4096), ("64x256", 64, 256)]
READ_BATCH = 32


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _ours(ns: Namespace, groups) -> tuple[float, float]:
    stream = ReplayStream(ns)
    put_s = _timed(lambda: [stream.put(g) for g in groups])
    reader = StreamReader(ns)

    def drain():
        n = 0
        while n < len(groups):
            n += len(reader.read(READ_BATCH))

    return put_s, _timed(drain)


def _raw(ns: Namespace, payloads) -> tuple[float, float]:
    conn, key = ns.conn, ns.key("groups")
    put_s = _timed(lambda: [conn.xadd(key, {"d": p}) for p in payloads])

    def drain():
        cursor, n = "0-0", 0
        while n < len(payloads):
            reply = conn.xread({key: cursor}, count=READ_BATCH)
            entries = reply[0][1]
            cursor, n = entries[-1][0], n + len(entries)

    return put_s, _timed(drain)


def run(quick: bool) -> dict:
    repeats = 3 if quick else 5
    budget_mb = 20 if quick else 120  # payload per shape and side, per repeat
    rng = np.random.default_rng(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp)) as server:
        for label, n_samples, n_tokens in SHAPES:
            probe = len(encode_group(synthetic_group(n_samples, n_tokens, rng=rng)))
            count = max(20, int(budget_mb * 2**20 / probe))
            groups = [synthetic_group(n_samples, n_tokens, rng=rng, prompt_id=str(i)) for i in range(count)]
            payloads = [encode_group(g) for g in groups]
            mb = sum(map(len, payloads)) / 2**20
            samples = {"ours_put": [], "ours_read": [], "raw_put": [], "raw_read": []}
            for _ in range(repeats):
                # Alternate sides within each repeat so drift on the machine hits both alike.
                for side in ("raw", "ours"):
                    ns = Namespace.open(server.url, f"bench-{uuid.uuid4().hex[:8]}")
                    put_s, read_s = _raw(ns, payloads) if side == "raw" else _ours(ns, groups)
                    samples[f"{side}_put"].append(put_s)
                    samples[f"{side}_read"].append(read_s)
                    ns.conn.flushdb()
                    for g in groups:  # fresh ids, so the dedupe never short-cuts a put
                        g.group_id = uuid.uuid4().hex
            med = {k: median(v) for k, v in samples.items()}
            results.append({
                "shape": label, "samples_per_group": n_samples, "tokens_per_sample": n_tokens,
                "groups": count, "payload_mb": mb, "bytes_per_group": probe, "seconds": samples,
                "groups_per_s": {k: count / v for k, v in med.items()},
                "mb_per_s": {k: mb / v for k, v in med.items()},
                "ratio_put": med["raw_put"] / med["ours_put"],
                "ratio_read": med["raw_read"] / med["ours_read"],
            })
            console.log(f"{label}: {count} groups of {probe / 1024:.0f} KiB, {repeats} repeats")
    return {"study": "queue", "repeats": repeats, "read_batch": READ_BATCH, "results": results}


def report(data: dict, out: Path) -> None:
    rows = []
    for r in data["results"]:
        for op in ("put", "read"):
            rows.append([r["shape"], op, r["groups_per_s"][f"ours_{op}"], r["mb_per_s"][f"ours_{op}"],
                         r["mb_per_s"][f"raw_{op}"], r[f"ratio_{op}"]])
    print_table(
        f"Replay stream throughput, medians of {data['repeats']} runs",
        ["group", "op", "streamrl groups/s", "streamrl MB/s", "raw redis-py MB/s", "streamrl/raw"],
        rows,
    )
    json_path = write_json(out, "queue", data)

    fig, axes = new_figure(2, "Replay stream: streamrl vs raw redis-py (same server, same payloads)")
    labels = [r["shape"] for r in data["results"]]
    x = np.arange(len(labels))
    for ax, op in zip(axes, ("put", "read")):
        ax.bar(x - 0.2, [r["mb_per_s"][f"raw_{op}"] for r in data["results"]], 0.4, label="raw redis-py")
        ax.bar(x + 0.2, [r["mb_per_s"][f"ours_{op}"] for r in data["results"]], 0.4, label="streamrl")
        ax.set_xticks(x, labels)
        ax.set_xlabel("samples x tokens per group")
        ax.set_ylabel("MB/s")
        ax.set_title(op)
        ax.legend()
    save_figure(fig, out, "queue", json_path)


def main(quick: bool = False, out: Path = Path("benchmarks/results")) -> dict:
    data = run(quick)
    report(data, out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
