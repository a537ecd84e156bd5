"""What every study shares: machine facts, a results file, a table, a plot."""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console()
_printed: list[dict[str, Any]] = []  # tables shown since the last write_json; saved with the results
settings: dict[str, Any] = {"quick": False}  # how the study was run, saved with the results
ACROSS = " (across invocations)"  # a ratio's mark: its arms ran at different times, maybe on different machines


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def this_invocation() -> str:
    """This invocation's name in its runs: when and on what it ran (a ratio across two compares machines too)."""
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} ({cpu_model()})"  # the time as machine_info() gives it


def cpu_model() -> str:
    """The CPU's model name: a bf16 matmul runs 8x an fp32 one with AMX, 2x with AVX512-BF16 alone."""
    info = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (info.read_text().splitlines() if info.is_file() else [])
             if line.startswith("model name")]
    return names[0] if names else platform.processor() or "unknown"


def matmul_flops(size: int = 2048, seconds: float = 3.0, dtype=None, windows: int = 5) -> float:
    """This machine's matmul rate (FLOP/s) in ``dtype`` (fp32 by default) on every core: the compute bound of a
    model's work. The best of ``windows`` windows: another process's burst only lowers a reading, so the highest
    is the nearest the ceiling. The caller's torch threads are left as they were."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b  # warm-up
        best = 0.0
        for _ in range(windows):
            done, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / windows:
                a @ b
                done += 1
            best = max(best, done * 2 * size**3 / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(threads)


def chat_prompt_ids(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    """Each conversation's prompt tokens, generation prompt included (transformers 5 returns a dict unless told
    not to: its length would be 2)."""
    return [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
            for c in conversations]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# two-sided 95% quantiles of Student's t by degrees of freedom (beyond 30: the normal's 1.96)
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def paired_difference(a: list[float], b: list[float]) -> dict[str, float | int]:
    """Mean of ``a[i] - b[i]`` over runs paired by seed, with the half-width of its 95% t interval
    (``nan`` with fewer than two pairs): is a difference in final reward more than seed noise?"""
    if len(a) != len(b):
        raise ValueError(f"paired runs: {len(a)} against {len(b)}")
    d = [x - y for x, y in zip(a, b)]
    if len(d) < 2:
        return {"mean": d[0] if d else float("nan"), "ci95": float("nan"), "pairs": len(d)}
    t = _T95[len(d) - 2] if len(d) - 1 <= len(_T95) else 1.96
    return {"mean": statistics.fmean(d), "ci95": t * statistics.stdev(d) / len(d) ** 0.5, "pairs": len(d)}


def paired_ratio(a: list[float], b: list[float]) -> dict[str, float | int]:
    """``a[i] / b[i]`` over runs paired by seed: their geometric mean, with its 95% t interval (``low``, ``high``:
    ``nan`` with fewer than two pairs), from ``paired_difference`` of the logs. Pairing takes out what a seed does
    to both arms (its draws, the machine's hour), which a ratio of medians keeps."""
    logs = paired_difference([math.log(x) for x in a], [math.log(y) for y in b])
    mean, half = logs["mean"], logs["ci95"]
    return {"ratio": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half),
            "pairs": logs["pairs"], "per_seed": [x / y for x, y in zip(a, b)]}


def join_seeds(earlier: dict[str, list[dict]], new: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Each arm's runs in ``new``, with ``earlier``'s of the seeds ``new`` did not run, sorted by seed: a study's
    seeds can be run one session at a time (a seed run again replaces its earlier runs)."""
    fresh = {r["seed"] for rs in new.values() for r in rs}
    return {arm: sorted([*(r for r in earlier.get(arm, []) if r["seed"] not in fresh), *rs], key=lambda r: r["seed"])
            for arm, rs in new.items()}


def one_invocation(rows: list[dict], base: list[dict]) -> bool:
    """Whether each seed that two arms both ran, ran in one invocation for both: side by side, on one machine
    (seeds added by a later invocation pair among themselves). Runs from before runs were stamped count as one
    unknown invocation."""
    of = {x["seed"]: x.get("invocation") for x in base}
    return all(of.get(x["seed"], x.get("invocation")) == x.get("invocation") for x in rows)


def by_seed(rows: list[dict], base: list[dict], key: str) -> dict:
    """``paired_difference`` of ``key`` over the seeds both arms ran (an arm may have run fewer seeds)."""
    base_of = {x["seed"]: x[key] for x in base}
    pairs = [(x[key], base_of[x["seed"]]) for x in rows if x["seed"] in base_of]
    return paired_difference([a for a, _ in pairs], [b for _, b in pairs])


def points(diff: dict) -> str:
    """A paired difference in accuracy as percentage points: ``-1.2 ± 2.3 pts (3 pairs)``."""
    ci = "" if diff["ci95"] != diff["ci95"] else f" ± {100 * diff['ci95']:.1f}"  # nan: one pair, no interval
    return f"{100 * diff['mean']:+.1f}{ci} pts ({diff['pairs']} pair{'s' if diff['pairs'] != 1 else ''})"


def percent(fraction: float | None) -> str:
    """``14%``; empty for a figure not recorded (None, or the NaN median of none)."""
    return "" if fraction is None or fraction != fraction else f"{100 * fraction:.0f}%"


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    cells = [[f"{v:,.2f}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right" if col != columns[0] else "left")
    for row in cells:
        table.add_row(*row)
    console.print(table)
    _printed.append({"title": title, "columns": columns, "rows": cells})


RESULTS = Path("benchmarks/results")  # where studies write (git-ignored)
PUBLISHED = Path("docs/benchmarks")  # where ``bench report`` copies each study's results beside its plots


def earlier_results(out: Path, name: str) -> dict | None:
    """A study's earlier results, for its new runs to join: ``out``'s, else (writing to the default folder) the
    published copy, so a checkout without the runs of earlier sessions still adds seeds to them."""
    path = out / f"{name}.json"
    if not path.is_file() and out.resolve() == RESULTS.resolve():
        path = PUBLISHED / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def write_json(out: Path, name: str, data: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_info(), **settings, **data, "tables": list(_printed)}, indent=2))
    _printed.clear()
    return path


def new_figure(ncols: int, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4), squeeze=False)
    fig.suptitle(title)
    return fig, axes[0]


def save_figure(fig, out: Path, name: str, json_path: Path | None = None) -> Path:
    """Write the plot (and say where it and the study's JSON went)."""
    import matplotlib.pyplot as plt

    path = out / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    console.print(f"wrote {json_path} and {path}" if json_path else f"wrote {path}")
    return path


@contextmanager
def serve_processes(config_args: list[str], count: int, env: dict | None = None, timeout_s: float = 120.0):
    """``count`` real ``streamrl serve`` processes on free loopback ports; yields their URLs."""
    from streamrl.buffer.redis_server import free_port
    from streamrl.rollout.client import wait_healthy

    procs, urls = [], []
    try:
        for _ in range(count):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "streamrl", "serve", *config_args, "--port", str(port)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          env={**os.environ, **(env or {})}))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs):
            wait_healthy(url, proc, timeout_s=timeout_s)
        yield urls
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(60)


def _at_least(least: int):
    """An integer option's type that refuses values under ``least``."""

    def number(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is less than {least}")
        return value

    number.__name__ = "integer"  # argparse names the type in its error: "invalid integer value"
    return number


# every option a study's main may take, as argparse adds it: a study's parser has those its main takes
OPTIONS: dict[str, dict[str, Any]] = {
    "model": {"metavar": "DIR", "help": "HF model directory"},
    "repeats": {"type": _at_least(1), "metavar": "N", "help": "runs of each arm (default: the study's own)"},
    "steps": {"type": _at_least(1), "metavar": "N", "help": "learner steps of each run (default: the study's own)"},
    "trl_generation": {"choices": ["hf", "paged", "vllm"], "default": "hf", "help": "TRL's generation backend: hf "
                       "(model.generate), paged (continuous batching) or vllm (colocated)"},
    "precision": {"default": "fp32", "metavar": "P", "help": "fp32, or bf16 mixed precision (fp32 weights, bf16 "
                  "autocast) for both sides"},
    "trl_precision": {"metavar": "P", "help": "TRL's precision where it differs from --precision"},
    "streamrl_set": {"action": "append", "metavar": "KEY=VALUE", "help": "a config override for streamrl's side "
                     "(repeatable; stress: every arm's), e.g. mode=sync"},
    "trl_trainer": {"choices": ["sync", "async"], "default": "sync",
                    "help": "TRL's GRPOTrainer, or its AsyncGRPOTrainer on a vLLM server"},
    "lora": {"action": "store_true", "help": "both sides train the LoRA recipe's adapter (configs/smollm2-lora.yaml)"},
    "study": {"metavar": "NAME", "help": "one of the module's studies (default: all)"},
    "first_seed": {"type": _at_least(0), "default": 0, "metavar": "S", "help": "the first seed, to add seeds to an "
                   "earlier run's results: --out's, else the published docs/benchmarks/NAME.json"},
    "trl_set": {"action": "append", "metavar": "KEY=VALUE", "help": "a setting of TRL's async trainer (repeatable), "
                "e.g. server_threads=2"},
    "real_model": {"action": "store_true", "help": "SmolLM2-135M's workloads, not the toy's"},
    "staleness": {"action": "append", "metavar": "B", "help": "an async arm's max staleness, run beside sync "
                  "(repeatable: 4, 2, 1 or auto; default: all four)"},
    "sync_only": {"action": "store_true", "help": "the sync arm alone (replacing its seeds' runs)"},
    "async_only": {"action": "store_true", "help": "the async arms alone (paired with earlier sync)"},
    "workload": {"action": "append", "metavar": "W", "help": "one of the study's workloads (repeatable; "
                 "default: all)"},
}


def parser(main, doc: str, prog: str | None = None) -> argparse.ArgumentParser:
    """A study's own command line: --quick, --out, and the options of ``OPTIONS`` its ``main`` takes."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.strip().splitlines()[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help="a short run that still measures both sides")
    parser.add_argument("--out", type=Path, default=RESULTS, metavar="DIR", help="where JSON and PNG results go")
    for name in [n for n in inspect.signature(main).parameters if n in OPTIONS]:
        parser.add_argument(f"--{name.replace('_', '-')}", **OPTIONS[name])
    return parser


def cli(main, doc: str, argv: list[str] | None = None, prog: str | None = None, study: str | None = None) -> Any:
    """``python -m benchmarks.NAME [--quick] [--out DIR] ...`` (or ``streamrl bench STUDY ...``, ``argv`` the
    arguments after STUDY): read the study's options, then run it."""
    command = parser(main, doc, prog)
    args, unknown = command.parse_known_args(argv)
    if unknown:
        flag = unknown[0].split("=", 1)[0]
        command.error(f"{flag} does not apply to {study or command.prog}" if flag.startswith("-") else
                      f"unrecognized arguments: {' '.join(unknown)}")
    options = {k: tuple(v or ()) if OPTIONS.get(k, {}).get("action") == "append" else v for k, v in vars(args).items()}
    settings["quick"] = options["quick"]
    return main(**options)
