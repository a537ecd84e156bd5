"""``streamrl evaluate``: held-out prompts, greedy, through the same router, as the policy moves.

Evaluates at version 0 (before any RL step), whenever the learner's version reaches the next
multiple of ``eval.every``, and at ``learner.max_steps``; then exits. Each evaluation appends
``eval/...`` figures to ``metrics/eval.jsonl`` and writes a few decoded trajectories with their
rewards and weight versions to ``rollouts/step_N.jsonl``, so a user can read what the model says.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from streamrl.buffer import Namespace, PolicyVersion, ServerRegistry
from streamrl.config import Config
from streamrl.dataset import load_rows
from streamrl.generation import SamplingParams
from streamrl.models import load_tokenizer, stop_token_ids
from streamrl.protocol import Sample
from streamrl.rollout.client import GenerateClient, GenerateError, RouterLocator, run_event_loop
from streamrl.rollout.episode import ChatRenderer, EpisodeAborted, run_episode
from streamrl.rollout.worker import episode_player

log = logging.getLogger("streamrl.evaluate")


class Evaluator:
    def __init__(self, cfg: Config, redis_url: str):
        if not cfg.eval.dataset:
            raise ValueError("eval.dataset is not set: give held-out rows for rollout.env")
        self.cfg = cfg
        self.rows = load_rows(cfg.eval.dataset)[: cfg.eval.size]
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
        self.renderer = ChatRenderer(self.tokenizer, stop_token_ids(cfg.model.path, cfg.model.tokenizer))
        self.make_env, self.agent = episode_player(cfg, self.renderer)
        self.params = SamplingParams(max_new_tokens=cfg.rollout.sampling.max_new_tokens, temperature=0.0)
        ns = Namespace.open(redis_url, cfg.run.name, **cfg.redis.retry())
        self.policy_version, self.registry = PolicyVersion(ns), ServerRegistry(ns, ttl_s=cfg.server.registry_ttl_s)
        self.router = RouterLocator(cfg, ns)
        self.metrics = cfg.run.path / "metrics" / "eval.jsonl"
        self.rollouts = cfg.run.path / "rollouts"
        self.metrics.parent.mkdir(parents=True, exist_ok=True)
        self.rollouts.mkdir(parents=True, exist_ok=True)

    def done_steps(self) -> set[int]:
        if not self.metrics.is_file():
            return set()
        return {json.loads(line)["step"] for line in self.metrics.read_text().splitlines() if line.strip()}

    async def run(self, stop: asyncio.Event) -> None:
        """Evaluate at 0, every ``eval.every`` steps and at the last step (a restart skips what is done)."""
        last, every = self.cfg.learner.max_steps, self.cfg.eval.every
        pending = sorted({0, last, *range(every, last, every)} - self.done_steps())
        timeout_s = self.cfg.router.request_timeout_s + 10  # the router's own timeout, then its answer
        async with GenerateClient(await self.router.url(), retries=5, timeout_s=timeout_s) as self.client:
            follower = asyncio.create_task(self.router.follow(self.client))
            while pending and not stop.is_set():
                step = await asyncio.to_thread(self.policy_version.get)
                due = [s for s in pending if s <= step]
                if not due:
                    await asyncio.sleep(0.5)
                    continue
                pending = [s for s in pending if s > step]
                target = due[-1] if step < last else last
                await self._servers_reach(target)
                self.write(await self._evaluate_patiently(target))
            follower.cancel()
        if self.agent is not None:
            await self.agent.close()

    async def _evaluate_patiently(self, version: int, patience_s: float = 300.0, pause_s: float = 5.0) -> dict:
        """``evaluate``, again while no server answers (one restarting, the router's circuit open) or one aborts
        an episode (scored, it would count as wrong): a run should not stop because its evaluator met a gap the
        rollout workers ride out."""
        deadline = time.monotonic() + patience_s
        while True:
            try:
                return await self.evaluate(version)
            except (GenerateError, EpisodeAborted) as e:
                if time.monotonic() + pause_s > deadline:
                    raise
                log.warning("evaluation at step %d failed, trying again in %.0f s: %s", version, pause_s, e)
                await asyncio.sleep(pause_s)

    async def _servers_reach(self, version: int, timeout_s: float = 60.0) -> None:
        """Wait (bounded) until every live server reports weights of ``version`` or newer.

        The learner bumps its version as a push starts; evaluating at once could score the previous
        weights under the new step. The versions that answered are recorded either way.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            serving = [s for s in await asyncio.to_thread(self.registry.alive) if s.weight_version >= 0]
            if serving and min(s.weight_version for s in serving) >= version:  # a withdrawn server serves nothing
                return
            await asyncio.sleep(0.2)
        log.warning("servers did not report weight version %d within %.0fs; evaluating anyway", version, timeout_s)

    async def evaluate(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        episodes = [asyncio.ensure_future(self._episode(row)) for row in self.rows]
        try:
            samples = await asyncio.gather(*episodes)
        except BaseException:  # one failed: the rest would run on unawaited
            for episode in episodes:
                episode.cancel()
            raise
        correct = [bool(s.env_info.get("correct", s.reward >= 1.0)) for s in samples]
        versions = [int(v) for s in samples for v in s.versions if v >= 0]
        record = {"step": step, "time": time.time(), "eval/accuracy": sum(correct) / len(correct),
                  "eval/reward_mean": sum(s.reward for s in samples) / len(samples), "eval/prompts": len(samples),
                  "eval/version_min": min(versions, default=-1), "eval/version_max": max(versions, default=-1),
                  "eval/seconds": time.perf_counter() - t0}
        self._log_samples(step, samples[: self.cfg.eval.log_samples])
        return record

    async def _episode(self, row: dict[str, Any]) -> Sample:
        if self.agent is not None:
            return await self.agent.play(row, generate=self.client.generate, params=self.params)
        env = self.make_env()
        try:
            return await run_episode(env, row, generate=self.client.generate, renderer=self.renderer,
                                     params=self.params, max_context=self.cfg.rollout.max_context)
        finally:
            await env.close()

    def write(self, record: dict[str, Any]) -> None:
        with self.metrics.open("a") as f:
            f.write(json.dumps(record) + "\n")
        log.info("step %d: eval accuracy %.3f (reward %.3f)", record["step"], record["eval/accuracy"],
                 record["eval/reward_mean"])

    def _log_samples(self, step: int, samples: list[Sample]) -> None:
        lines = []
        for s in samples:
            text = self.tokenizer.decode(s.tokens.tolist())
            generated = [int(v) for v in s.versions if v >= 0]
            lines.append(json.dumps({"step": step, "reward": s.reward, "text": text, "env_info": s.env_info,
                                     "versions": sorted(set(generated))}))
        (self.rollouts / f"step_{step}.jsonl").write_text("".join(line + "\n" for line in lines))


def launch(cfg: Config) -> None:
    """Process entry of ``streamrl evaluate``: run until the last evaluation or SIGTERM."""
    import signal

    if not cfg.redis.url:
        raise ValueError("redis.url is not set: the evaluator follows the learner's version in Redis")
    evaluator = Evaluator(cfg, cfg.redis.url)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await evaluator.run(stop)

    run_event_loop(main())


def read_records(path: Path) -> list[dict[str, Any]]:
    """Whole JSON lines of a metrics file (a line being written is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
