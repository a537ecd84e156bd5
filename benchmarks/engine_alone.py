"""Generation in a running system against the engine alone, on the same requests.

Takes a finished (or running) ``streamrl up`` run of the ``hf`` engine and one of its exports, starts a
``streamrl serve`` of that export alone on the threads the run gave its server, and keeps it as busy as the
run's rollout worker kept its server: ``rollout.concurrency`` episodes in flight, groups of ``n`` samples of
the run's training prompts (the env's first observation, the chat template), the run's sampling. Reports the
engine's generated tokens per busy second (``streamrl_busy_seconds``), to set beside the same figure of the
server in the run (``benchmarks.profile_run`` reads it over its window).

    python -m benchmarks.engine_alone runs/smollm2 --version 20 [--seconds 90]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from pathlib import Path

from benchmarks.common import chat_prompt_ids, console, serve_processes
from benchmarks.profile_run import server_counters
from streamrl.config import load_config
from streamrl.envs.registry import env_factory
from streamrl.generation import SamplingParams
from streamrl.launch.local import _threads
from streamrl.rollout.client import GenerateClient


def prompts(cfg, limit: int = 512) -> list[list[int]]:
    """The run's training prompts as its workers render them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    make = env_factory(cfg.rollout.env, cfg.rollout.env_args)
    rows = [json.loads(line) for line in Path(cfg.rollout.dataset).read_text().splitlines()[:limit]]

    async def first(row):
        return (await make().reset(row)).messages

    async def every():
        return await asyncio.gather(*(first(r) for r in rows))

    return chat_prompt_ids(tokenizer, asyncio.run(every()))


async def load(url: str, cfg, ids: list[list[int]], seconds: float) -> None:
    """Groups of ``n`` samples, ``concurrency`` samples in flight, for ``seconds``."""
    s = cfg.rollout.sampling
    params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature)
    client, queue, deadline = GenerateClient(url), itertools.cycle(ids), time.monotonic() + seconds

    async def worker() -> None:
        while time.monotonic() < deadline:
            await client.generate_n(next(queue), params, s.n)

    await asyncio.gather(*(worker() for _ in range(max(1, cfg.rollout.concurrency // s.n))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--version", type=int, required=True, help="the export to serve (RUN/export/version-N)")
    parser.add_argument("--seconds", type=float, default=90.0)
    args = parser.parse_args()
    cfg = load_config(args.run / "config.yaml")
    model = args.run / "export" / f"version-{args.version}"
    env = _threads(cfg)
    with serve_processes([f"model.path={model}", f"server.max_batch_size={cfg.server.max_batch_size}"], 1, env,
                         timeout_s=300) as [url]:
        asyncio.run(load(url, cfg, prompts(cfg)[:8], 10.0))  # warm-up
        before = server_counters(url)
        asyncio.run(load(url, cfg, prompts(cfg), args.seconds))
        after = server_counters(url)
    tokens, busy = (after[k] - before[k] for k in ("tokens", "busy_s"))
    console.print(f"engine alone ({env['OMP_NUM_THREADS']} thread(s), version {args.version}): {tokens:.0f} tokens in "
                  f"{busy:.1f} busy s = {tokens / busy:.1f} tok/s while busy")


if __name__ == "__main__":
    main()
