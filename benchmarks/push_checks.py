"""The weight push's checks and waves, measured: what verifying a push costs (``--study verification``) and how
much of the fleet a push pauses (``--study fleet``); ``benchmarks/weight_push.py`` runs them and says how."""

from __future__ import annotations

import importlib.util
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import console, median, new_figure, print_table, save_figure, serve_processes, write_json
from streamrl.buffer import EmbeddedRedis, Namespace, ServerRegistry
from streamrl.config import load_config
from streamrl.learner.push import WeightPusher
from streamrl.models import make_tiny_model

# weight_sync.verify off; on without a probe (the digests alone); on with a probe of 64 or of 256 tokens
ARMS = {"off": 0, "digest": 0, "digest+probe 64": 64, "digest+probe 256": 256}
PROBE_TEXT = ("The quick brown fox jumps over the lazy dog. What is 12 plus 7? Reverse the word abgiie. "
              "Write a short poem about the sea and the wind that blows over it at night. ")


def verification(model_dir: str, redis_url: str, run_dir: Path, engine: str, repeats: int) -> dict:
    """What checking a push costs, into one ``engine`` server, 64 MB buckets: the push without verification,
    with the buckets' digests, and with digests and a probe (64 or 256 tokens of text), interleaved within
    each repeat; and the learner's own probe forward, timed apart (it runs in the learner's step, not in the
    push)."""
    from transformers import AutoModelForCausalLM

    from streamrl.learner import probe
    from streamrl.models import load_tokenizer
    from streamrl.weightsync import Probe

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    named = [(name, p.detach()) for name, p in model.named_parameters()]
    text = load_tokenizer(model_dir)(PROBE_TEXT * 16, add_special_tokens=False).input_ids
    checks, learner_s = {}, {}
    for arm, n in ARMS.items():
        if n:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                checks[arm] = Probe(text[:n], probe.logprobs(model, text[:n], torch.device("cpu")), 1e-4)
                times.append(time.perf_counter() - t0)
            learner_s[arm] = median(times)
    run = f"verify-{time.monotonic_ns()}"
    common = [f"model.path={model_dir}", f"redis.url={redis_url}", f"run.name={run}", f"run.dir={run_dir}",
              "server.heartbeat_s=0.3", f"server.engine={engine}"]
    cfg = load_config(None, [*common, "weight_sync.timeout_s=300"])
    registry = ServerRegistry(Namespace.open(redis_url, run), ttl_s=cfg.server.registry_ttl_s)
    samples: dict[str, list[float]] = {arm: [] for arm in ARMS}
    gaps = []
    with serve_processes(common, 1, {"OMP_NUM_THREADS": "1"}, timeout_s=300):
        while not registry.alive():
            time.sleep(0.1)
        pusher = WeightPusher(cfg, registry)
        for version in range(1, 1 + len(ARMS) * (repeats + 1)):
            arm = list(ARMS)[version % len(ARMS)]
            pusher.sync.verify = arm != "off"
            stats = pusher.push(named, version, check=checks.get(arm))
            if stats["push_targets"] != 1:
                raise RuntimeError(f"the {arm} push of version {version} was not served: {stats}")
            if version > len(ARMS):  # the first round touches every staging buffer
                samples[arm].append(stats["push_s"])
                gaps += [stats["push_probe_gap"]] if "push_probe_gap" in stats else []
    medians = {arm: median(v) for arm, v in samples.items()}
    return {"engine": engine, "params": sum(t.numel() for _, t in named), "samples": samples, "median_s": medians,
            "learner_probe_s": learner_s, "probe_gap_max": max(gaps),
            "cost": {arm: medians[arm] / medians["off"] - 1 for arm in list(ARMS)[1:]}}


def fleet_pauses(model_dir: str, redis_url: str, run_dir: Path, engine: str, repeats: int, n_servers: int = 2) -> dict:
    """How much of the fleet stops generating while a push is applied: every server at once
    (``max_paused_share`` 1, as before waves) against waves of half of them, pushes interleaved. From each
    server's own record of its pauses (``/server_info``'s ``weight_pauses``)."""
    import httpx
    from transformers import AutoModelForCausalLM

    named = [(n, p.detach()) for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()]
    run = f"fleet-{time.monotonic_ns()}"
    common = [f"model.path={model_dir}", f"redis.url={redis_url}", f"run.name={run}", f"run.dir={run_dir}",
              "server.heartbeat_s=0.3", f"server.engine={engine}"]
    cfg = load_config(None, [*common, "weight_sync.timeout_s=300"])
    registry = ServerRegistry(Namespace.open(redis_url, run), ttl_s=cfg.server.registry_ttl_s)
    arms = {"all at once": 1.0, "waves of half": 0.5}
    samples: dict[str, list[dict]] = {arm: [] for arm in arms}
    with serve_processes(common, n_servers, {"OMP_NUM_THREADS": "1"}, timeout_s=300):
        while len(registry.alive()) < n_servers:
            time.sleep(0.1)
        urls = [s.url for s in registry.alive()]
        pusher = WeightPusher(cfg, registry)
        for version in range(1, 3 + 2 * repeats):
            arm = list(arms)[version % 2]
            pusher.sync.max_paused_share = arms[arm]
            start = time.time()
            stats = pusher.push(named, version)
            if stats["push_targets"] != n_servers:
                raise RuntimeError(f"push {version} reached {stats['push_targets']:.0f} of {n_servers} servers")
            spans = [[(a, b) for a, b in httpx.get(f"{url}/server_info", timeout=30).json()["weight_pauses"]
                      if a >= start] for url in urls]
            if version > 2:  # the first two touch every staging buffer
                samples[arm].append(_pause_figures(spans, stats["push_s"]))
    summary = {arm: {k: median([s[k] for s in rows]) for k in rows[0]} for arm, rows in samples.items()}
    return {"engine": engine, "servers": n_servers, "params": sum(t.numel() for _, t in named), "samples": samples,
            "median": summary}


def _pause_figures(spans: list[list[tuple[float, float]]], push_s: float) -> dict[str, float]:
    """One push's pauses, a list of spans per server: server-seconds paused, the seconds during which every server
    was paused at once, the largest share of the fleet paused at one moment, and the paused share of the fleet's
    server-time over the push."""
    paused = sum(b - a for server in spans for a, b in server)
    edges = sorted({t for server in spans for span in server for t in span})
    counts = [(hi - lo, sum(any(a <= lo and hi <= b for a, b in server) for server in spans))
              for lo, hi in zip(edges, edges[1:])]
    return {"push_s": push_s, "paused_server_s": paused,
            "all_paused_s": sum(d for d, n in counts if n == len(spans)),
            "peak_paused_share": max((n for d, n in counts if d > 0), default=0) / len(spans),
            "paused_share": paused / (len(spans) * push_s)}


def run_fleet(quick: bool) -> dict:
    """The fleet's pauses with two servers of SmolLM2-135M (a tiny model with --quick): vllm where installed."""
    from streamrl.models import convert_smollm2

    engine = "hf" if importlib.util.find_spec("vllm") is None else "vllm"
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as redis:
        model_dir = str(make_tiny_model(Path(tmp) / "tiny", hidden=256) if quick else convert_smollm2(Path(tmp) / "smollm2"))
        row = fleet_pauses(model_dir, redis.url, Path(tmp) / "runs", engine, repeats=3 if quick else 7)
    return {"study": "weight-push fleet", "model": "tiny" if quick else "SmolLM2-135M", "row": row}


def report_fleet(data: dict, out: Path) -> None:
    row = data["row"]
    print_table(f"The fleet's pauses per push, {row['servers']} {row['engine']} servers, {data['model']}, medians",
                ["servers take a push", "push s", "server-s paused", "s all paused at once", "most paused at once",
                 "paused share of server-time over the push"],
                [[arm, m["push_s"], m["paused_server_s"], m["all_paused_s"], f"{m['peak_paused_share']:.0%}",
                  f"{m['paused_share']:.0%}"] for arm, m in row["median"].items()])
    json_path = write_json(out, "weight_push_fleet", data)
    fig, (ax,) = new_figure(1, f"Paused share of the fleet's server-time per push ({row['servers']} {row['engine']})")
    for i, (arm, rows) in enumerate(row["samples"].items()):
        ax.plot([i] * len(rows), [r["paused_share"] for r in rows], "o", alpha=0.6)
    ax.set_xticks(range(len(row["samples"])), list(row["samples"]))
    ax.set_ylabel("paused server-time / (servers x push time)")
    save_figure(fig, out, "weight_push_fleet", json_path)


def run_verification(quick: bool) -> dict:
    """The cost of verification on SmolLM2-135M (a tiny model with --quick), into each engine installed."""
    from streamrl.models import convert_smollm2

    rows = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as redis:
        model_dir = str(make_tiny_model(Path(tmp) / "tiny", hidden=256) if quick else convert_smollm2(Path(tmp) / "smollm2"))
        for engine in ["hf"] + ([] if importlib.util.find_spec("vllm") is None else ["vllm"]):
            rows.append(verification(model_dir, redis.url, Path(tmp) / "runs", engine, repeats=3 if quick else 7))
            console.log(f"verification into {engine}: " + ", ".join(f"{k} {v:.3f}s" for k, v in
                                                                    rows[-1]["median_s"].items()))
    return {"study": "weight-push verification", "model": "tiny" if quick else "SmolLM2-135M", "rows": rows}


def report_verification(data: dict, out: Path) -> None:
    rows = data["rows"]
    print_table(f"What verifying a push costs, {data['model']} (one server, 64 MB buckets), medians; cost = vs "
                "the push without; learner: its forward of the probe, in its step",
                ["engine", "push s", *(f"+ {arm} s" for arm in list(ARMS)[1:]), *(f"{arm} cost" for arm in list(ARMS)[1:]),
                 *(f"learner probe {n} s" for n in ARMS.values() if n), "largest probe gap"],
                [[r["engine"], r["median_s"]["off"], *(r["median_s"][arm] for arm in list(ARMS)[1:]),
                  *(f"{r['cost'][arm]:+.0%}" for arm in list(ARMS)[1:]),
                  *(r["learner_probe_s"][arm] for arm, n in ARMS.items() if n), f"{r['probe_gap_max']:.1e}"]
                 for r in rows])
    json_path = write_json(out, "weight_push_verification", data)
    fig, (ax,) = new_figure(1, f"Push seconds with and without verification, {data['model']}")
    width = 0.8 / len(ARMS)
    for i, arm in enumerate(ARMS):
        ax.bar([j + i * width for j in range(len(rows))], [r["median_s"][arm] for r in rows], width, label=arm)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [r["engine"] for r in rows])
    ax.set_ylabel("seconds per push")
    ax.legend(fontsize=7)
    save_figure(fig, out, "weight_push_verification", json_path)
