"""Where a running ``streamrl up`` spends its CPU: py-spy on every Python part at once.

Samples each part's threads for ``--seconds`` (py-spy, ``--rate`` Hz, active threads only), writes each
part's collapsed stacks to ``RUN/profiles/PART.txt`` (speedscope and flamegraph.pl open them), and prints per part
its busy share (samples over rate × seconds, summed over threads: 1.0 is one core kept busy) and the
functions that held most of its samples, by self time and by total time. For each ``hf`` server it also
reads, over the same window, the tokens it generated per second it was busy (``streamrl_busy_seconds``)
and the share of the window it was busy.

    python -m benchmarks.profile_run runs/smollm2 [--seconds 60] [--rate 50]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.common import console, print_table
from streamrl.config import load_config

PYTHON_PARTS = ("learner", "server", "rollout", "evaluator")  # redis and the router are not Python


def record(run: Path, seconds: int, rate: int) -> dict[str, Path]:
    """py-spy on every Python part at once; the collapsed stacks of each."""
    spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if spy is None:
        raise SystemExit("py-spy is not installed: pip install 'streamrl[bench]'")
    parts = json.loads((run / "parts.json").read_text())
    out = run / "profiles"
    out.mkdir(exist_ok=True)
    procs, raw = [], {}
    for name, part in parts.items():
        if part["kind"] not in PYTHON_PARTS:
            continue
        raw[name] = out / f"{name}.txt"
        procs.append(subprocess.Popen([spy, "record", "--pid", str(part["pid"]), "--duration", str(seconds),
                                       "--rate", str(rate), "--format", "raw", "--output", str(raw[name]),
                                       "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for proc in procs:
        proc.wait()
    return raw


def server_counters(url: str) -> dict[str, float]:
    """A server's generated tokens and busy seconds so far, from its /metrics."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = float(value) if value and not name.startswith("#") else None
    return {"tokens": values.get("streamrl_generated_tokens_total") or 0.0,
            "busy_s": values.get("streamrl_busy_seconds") or 0.0, "time": time.monotonic()}


def generation(urls: list[str], before: list[dict], after: list[dict]) -> dict[str, dict]:
    out = {}
    for url, a, b in zip(urls, before, after):
        tokens, busy, wall = (b[k] - a[k] for k in ("tokens", "busy_s", "time"))
        out[url] = {"tokens_per_busy_s": tokens / busy if busy else None, "busy_share": busy / wall,
                    "tokens_per_s": tokens / wall}
    return out


def summarise(path: Path, seconds: int, rate: int, top: int = 6) -> dict:
    """Busy share and the functions holding most samples, from py-spy's collapsed stacks."""
    own, total, samples = Counter(), Counter(), 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f.split(" (")[0] for f in stack.split(";")[1:]]  # the first frame is the thread
        n = int(count)
        samples += n
        if frames:
            own[frames[-1]] += n
            for f in set(frames):
                total[f] += n
    share = {k: v / max(samples, 1) for k, v in own.most_common(top)}
    return {"busy_cores": samples / (rate * seconds), "self": share,
            "total": {k: v / max(samples, 1) for k, v in total.most_common(top + 4)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("run", type=Path, help="the run directory of a running `streamrl up`")
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--rate", type=int, default=50)
    args = parser.parse_args()
    console.log(f"profiling every part of {args.run} for {args.seconds} s")
    cfg = load_config(args.run / "config.yaml")
    urls = [f"http://{cfg.server.host or '127.0.0.1'}:{cfg.server.base_port + i}" for i in range(cfg.server.count)]
    before = [server_counters(u) for u in urls]
    raw = record(args.run, args.seconds, args.rate)
    servers = generation(urls, before, [server_counters(u) for u in urls])
    found = {name: summarise(path, args.seconds, args.rate) for name, path in raw.items()}
    (args.run / "profiles" / "summary.json").write_text(json.dumps({"parts": found, "servers": servers}, indent=1))
    for url, g in servers.items():
        console.print(f"{url}: {g['tokens_per_s']:.1f} tok/s over the window, busy {100 * g['busy_share']:.0f}% of it, "
                      f"{g['tokens_per_busy_s'] or 0:.1f} tok/s while busy")
    print_table(f"CPU by part over {args.seconds} s (busy: cores kept busy; self: share of the part's samples)",
                ["part", "busy cores", "functions by self time"],
                [[name, s["busy_cores"], "; ".join(f"{k} {100 * v:.0f}%" for k, v in s["self"].items())]
                 for name, s in found.items()])


if __name__ == "__main__":
    main()
