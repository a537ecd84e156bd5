"""The rollout worker: claims prompts, plays ``n`` episodes of each through the router, and
pushes each finished group into the replay stream.

Admission control keeps the data fresh (a group starts only while the learner's
version allows it); prompt claims keep the data whole (a prompt is finished by the
put of its group, or taken over after a crash); the atomic put keeps it single
(a group lands once or not at all). A failing env fails its sample, not the worker.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import signal
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server
from prometheus_client import Counter as PromCounter

from streamrl.buffer import Admission, BufferUnavailable, Namespace, PolicyVersion, PromptClaims, ReplayStream
from streamrl.buffer.admission import RETRY_S
from streamrl.buffer.admission import group_id as admitted_group_id
from streamrl.config import Config, RolloutConfig
from streamrl.dataset import Prompts, load_rows
from streamrl.envs import Env, Observation, StepResult, env_factory
from streamrl.envs.registry import env_plugin, is_agent
from streamrl.generation import Completion, SamplingParams
from streamrl.models import load_tokenizer, stop_token_ids
from streamrl.protocol import Group, Sample, WireError
from streamrl.rollout.agent import AgentRunner
from streamrl.rollout.client import GenerateClient, GenerateError, RouterLocator, run_event_loop
from streamrl.rollout.coalesce import Coalescer
from streamrl.rollout.episode import ChatRenderer, EnvFault, EpisodeAborted, run_episode
from streamrl.rollout.tool_calls import load_parser

log = logging.getLogger("streamrl.worker")


async def _within(coro, seconds: float):
    """``coro``'s result, or TimeoutError after ``seconds``. An env is called three times an episode:
    ``asyncio.timeout`` (3.11+) bounds a call without the task ``wait_for`` creates for each."""
    if not hasattr(asyncio, "timeout"):
        return await asyncio.wait_for(coro, seconds)
    async with asyncio.timeout(seconds):
        return await coro


class GuardedEnv(Env):
    """Wraps a user's env: bounded concurrency, a time limit, and type checks on what it returns."""

    def __init__(self, env: Env, gate: asyncio.Semaphore, timeout_s: float):
        self.env, self.gate, self.timeout_s = env, gate, timeout_s
        self.max_turns = env.max_turns

    async def _call(self, what: str, coro, kind: type):
        async with self.gate:
            try:
                result = await _within(coro, self.timeout_s)
            except asyncio.TimeoutError:
                raise EnvFault(f"{what} timed out after {self.timeout_s:.0f}s") from None
            except Exception as e:
                raise EnvFault(f"{what} raised {type(e).__name__}: {e}") from e
        if not isinstance(result, kind):
            raise EnvFault(f"{what} returned {type(result).__name__}, expected {kind.__name__}")
        if isinstance(result, StepResult) and not math.isfinite(result.reward):
            raise EnvFault(f"{what} returned a non-finite reward {result.reward}")
        return result

    async def reset(self, item: dict[str, Any]) -> Observation:
        return await self._call("env.reset", self.env.reset(item), Observation)

    async def step(self, action) -> StepResult:
        return await self._call("env.step", self.env.step(action), StepResult)

    async def close(self) -> None:
        try:
            await _within(self.env.close(), self.timeout_s)
        except Exception as e:  # closing must not lose the episode
            log.warning("env.close failed: %s", e)


class RolloutWorker:
    def __init__(self, cfg: Config, name: str, *, redis_url: str):
        if not name or "/" in name:
            raise ValueError(f"worker name {name!r}: give a non-empty name without '/' (it begins its group ids)")
        self.cfg, self.name = cfg, name
        rollout = cfg.rollout
        if not cfg.model.path and not cfg.model.tokenizer:
            raise ValueError("model.path (or model.tokenizer) is not set: the worker needs the tokenizer")
        ns = Namespace.open(redis_url, cfg.run.name, **cfg.redis.retry())
        self.stream = ReplayStream(ns, dedupe_ttl_s=cfg.redis.dedupe_ttl_s)
        self.policy_version = PolicyVersion(ns)
        self.version_watch = self.policy_version.watch()
        self.admission = Admission(ns, max_staleness=cfg.admission_bound, groups_per_step=cfg.learner.groups_per_step,
                                   lease_s=rollout.group_lease_s)
        self.life = uuid.uuid4().hex  # this run of the worker, told from earlier ones under the same name
        self.claims = PromptClaims(ns, name, lease_s=rollout.prompt_lease_s, life=self.life)
        self.renderer = ChatRenderer(load_tokenizer(cfg.model.tokenizer or cfg.model.path),
                                     stop_token_ids(cfg.model.path, cfg.model.tokenizer))
        self.make_env, self.agent = episode_player(cfg, self.renderer)
        if self.agent is not None and not rollout.dataset:
            raise ValueError(f"agent {rollout.env!r} has no dataset of its own: set rollout.dataset "
                             "(or a prepare.fn that writes one)")
        self.prompts = (Prompts(rows=load_rows(rollout.dataset), seed=cfg.run.seed if rollout.shuffle else None)
                        if rollout.dataset
                        else Prompts(generator=lambda: self.make_env().items(cfg.run.seed)))
        s = rollout.sampling
        self.params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                     top_k=s.top_k)
        self.router = RouterLocator(cfg, ns)
        self.metrics = WorkerMetrics(cfg.run.path / "metrics" / f"rollout-{name}.jsonl", rollout.prometheus_port)
        self.stopping = asyncio.Event()

    # ------------------------------------------------------------------ main loop

    async def run(self, max_groups: int | None = None) -> None:
        rollout = self.cfg.rollout
        self.generation_gate = asyncio.Semaphore(rollout.concurrency)
        self.env_gate = asyncio.Semaphore(rollout.env_concurrency)
        groups_in_flight = asyncio.Semaphore(max_groups_in_flight(rollout))
        tasks: set[asyncio.Task] = set()
        reporter = asyncio.create_task(self._report_every(rollout.metrics_every_s))
        self.running: dict[str, int] = {}  # group id -> its prompt index, while the group runs
        keeper = asyncio.create_task(self._keep_leases(min(rollout.group_lease_s, rollout.prompt_lease_s) / 3))
        if reclaimed := await self._redis(self.admission.reclaim, self.name, self.life):
            log.info("%s: gave back %d admission slots of its earlier life (its groups died with it)", self.name,
                     reclaimed)
        # a request may take the router its whole timeout, then the client hears why
        router_url = await self.router.url()
        async with GenerateClient(router_url, timeout_s=self.cfg.router.request_timeout_s + 10) as client:
            follower = asyncio.create_task(self.router.follow(client))
            self.coalescer = Coalescer(client.generate_n, rollout.coalesce_ms / 1000)
            log.info("%s: generating through %s", self.name, router_url)
            await self._report()  # an opening report: when generation began (start-up done); rates count from here
            started = 0
            while not self.stopping.is_set() and (max_groups is None or started < max_groups):
                await groups_in_flight.acquire()
                group_id = admitted_group_id(self.name, self.life)
                if not await self._admit(group_id):
                    groups_in_flight.release()
                    break
                index = await self._redis(self.claims.claim)
                self.running[group_id] = index
                task = asyncio.create_task(self._group(group_id, index))
                task.add_done_callback(lambda t, g=group_id: self.running.pop(g))
                task.add_done_callback(lambda t: groups_in_flight.release())
                task.add_done_callback(_log_crash)
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                started += 1
            if tasks:  # finish what was started; a group is put whole or not at all
                await asyncio.wait(tasks)
            follower.cancel()
        if self.agent is not None:
            await self.agent.close()
        reporter.cancel()
        keeper.cancel()
        self.metrics.write(self.admission.counters())
        self.version_watch.close()

    async def _admit(self, group_id: str) -> bool:
        """Wait for a slot under the staleness bound; False if asked to stop meanwhile.

        Slots free when the learner publishes a new version, so a refused worker waits for that
        (a polling worker would lose up to its poll interval per step: the synchronous mode pays it
        on every step). The wait is bounded for slots freed otherwise (abandoned or dropped groups).
        """
        while not self.stopping.is_set():
            if await self._redis(self.admission.try_admit, group_id):
                return True
            self.metrics.count("admission_waits")
            await asyncio.to_thread(self.version_watch.wait, RETRY_S)
        return False

    async def _group(self, group_id: str, index: int) -> None:
        item, started = self.prompts[index], time.perf_counter()
        # a group that waits behind younger ones at a busy server may be too old to train when it is done
        priority = -(await self._redis(self.policy_version.get)) if self.cfg.rollout.oldest_first else 0
        results = await asyncio.gather(*(self._episode(item, priority) for _ in range(self.cfg.rollout.sampling.n)),
                                       return_exceptions=True)
        good = [r for r in results if isinstance(r, Sample)]
        for r in results:
            if not isinstance(r, Sample):
                self.metrics.failure(r)
        if len(good) < self.cfg.rollout.min_group:
            await self._redis(self.admission.abandon, group_id, "failed_samples")
            await self._redis(self.claims.release, index)
            self.metrics.count("groups_abandoned")
            return
        group = Group(prompt_id=str(index), env=self.cfg.rollout.env, samples=good, group_id=group_id,
                      meta={"prompt_index": index, "worker": self.name, "failed": len(results) - len(good),
                            "group_s": time.perf_counter() - started})  # the learner measures who it drops
        version = await self._redis(self.policy_version.get)
        try:
            await self._redis(self.stream.put, group, index)  # validates the group as it encodes it
        except WireError as e:  # an engine or env produced something the learner cannot use
            self.metrics.failure(e)
            await self._redis(self.admission.abandon, group_id, "malformed")
            await self._redis(self.claims.release, index)
            return
        self.metrics.pushed(staleness=version - group.version_range()[0],
                            seconds=time.perf_counter() - started)

    async def _redis(self, fn, *args):
        """A Redis call that outlasts an outage: a finished group waits in memory, never dropped."""
        delay = 1.0
        while True:
            try:
                return await asyncio.to_thread(fn, *args)
            except BufferUnavailable as e:
                self.metrics.count("redis_outages")
                log.warning("%s; retrying in %.0fs", e, delay)
                await asyncio.sleep(delay)
                delay = min(30.0, delay * 2)

    async def _episode(self, item: dict[str, Any], priority: int) -> Sample:
        generate = functools.partial(self._generate, priority=priority)
        if self.agent is not None:
            opening = functools.partial(generate, siblings=self.cfg.rollout.sampling.n)  # the group's n first calls
            sample = await self.agent.play(item, generate=generate, params=self.params, opening=opening)
        else:
            env = GuardedEnv(self.make_env(), self.env_gate, self.cfg.rollout.env_timeout_s)
            try:
                sample = await run_episode(env, item, generate=generate, renderer=self.renderer, params=self.params,
                                           max_context=self.cfg.rollout.max_context)
            finally:
                await env.close()
        self.metrics.episode(sample)
        return sample

    async def _generate(self, input_ids: list[int], params: SamplingParams, priority: int = 0,
                        siblings: int = 1) -> Completion:
        async with self.generation_gate:
            return await self.coalescer.generate(input_ids, params, priority, siblings)

    async def _keep_leases(self, every_s: float) -> None:
        """Renew the slot and the prompt claim of every running group: a group slower than its lease
        would otherwise lose both, and another would take its slot or redo its prompt."""
        while True:
            await asyncio.sleep(every_s)
            running = dict(self.running)
            try:
                await asyncio.to_thread(self.admission.renew, list(running))
                await asyncio.to_thread(self.claims.renew, list(running.values()))
            except BufferUnavailable as e:  # the leases may lapse; the put's ledger counts such a group late
                log.warning("could not renew leases: %s", e)

    async def _report_every(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            await self._report()

    async def _report(self) -> None:
        self.metrics.write(await self._redis(self.admission.counters))


def episode_player(cfg: Config, renderer: ChatRenderer) -> tuple[Callable[[], Env] | None, AgentRunner | None]:
    """``rollout.env`` as (a maker of fresh envs, None), or (None, the runner of its agent's episodes)."""
    rollout = cfg.rollout
    plugin = env_plugin(rollout.env)
    if not is_agent(plugin):
        agents_only = [f"rollout.{name}" for name in ("tool_parser", "agent_max_calls")
                       if getattr(rollout, name) != type(rollout).model_fields[name].default]
        if agents_only:  # the config cannot tell an env from an agent: the plugin can
            raise ValueError(f"{' and '.join(agents_only)} apply to agents; rollout.env {rollout.env!r} is an env")
        return env_factory(rollout.env, rollout.env_args), None
    return None, AgentRunner(plugin, rollout.env_args, renderer=renderer, parser=load_parser(rollout.tool_parser),
                             temperature=rollout.sampling.temperature, max_context=rollout.max_context,
                             max_calls=rollout.agent_max_calls, timeout_s=rollout.env_timeout_s)


def max_groups_in_flight(rollout: RolloutConfig) -> int:
    """Groups a worker runs at once: enough to keep ``concurrency`` episodes busy, and one starting."""
    return max(1, math.ceil(rollout.concurrency / rollout.sampling.n)) + 1


def _log_crash(task: asyncio.Task) -> None:
    """A group that died (Redis gone for good) is redone from its claim after a restart."""
    if not task.cancelled() and task.exception() is not None:
        log.error("group failed: %r", task.exception())


class WorkerMetrics:
    """Counters of one worker: appended as JSON lines (one per report), and on /metrics for Prometheus."""

    def __init__(self, path: Path, prometheus_port: int | None = None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.registry = CollectorRegistry()
        self.events = PromCounter("streamrl_rollout_events", "episodes, groups, failures", ["event"],
                                  registry=self.registry)
        self.generated = PromCounter("streamrl_rollout_generated_tokens", "policy tokens", registry=self.registry)
        self.env_latency = Histogram("streamrl_rollout_env_seconds", "env time per episode", registry=self.registry)
        self.push_staleness = Histogram("streamrl_rollout_staleness_at_push", "learner version minus oldest token's",
                                        buckets=(0, 1, 2, 3, 4, 8, 16), registry=self.registry)
        self.reward = Gauge("streamrl_rollout_reward_mean", "mean reward since the last report", registry=self.registry)
        if prometheus_port is not None:
            start_http_server(prometheus_port, addr="127.0.0.1", registry=self.registry)
        self.counts: Counter[str] = Counter()
        self.rewards: list[float] = []
        self.staleness: list[int] = []
        self.group_s: list[float] = []  # a group's first episode starting to its put: its rollout latency
        self.tokens = self.turns = self.version_span = 0  # sums over the episodes since the last report
        self.env_s = self.generate_s = 0.0
        self.since = time.time()

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n
        self.events.labels(name).inc(n)

    def failure(self, error: BaseException) -> None:
        kinds = {EnvFault: "env", GenerateError: "generate", WireError: "wire", EpisodeAborted: "aborted"}
        kind = kinds.get(type(error), "other")
        self.count(f"failed_{kind}")
        log.warning("sample failed (%s): %s", kind, error)

    def episode(self, sample: Sample) -> None:
        self.count("episodes")
        generated = int(sample.loss_mask.sum())
        self.tokens += generated
        self.generated.inc(generated)
        self.rewards.append(sample.reward)
        self.env_s += sample.timings.get("env_s", 0.0)
        self.generate_s += sample.timings.get("generate_s", 0.0)
        self.env_latency.observe(sample.timings.get("env_s", 0.0))
        self.turns += int(sample.env_info.get("turns", 1))
        versions = sample.versions[sample.versions >= 0]  # a weight update between turns spans versions
        self.version_span += int(versions.max() - versions.min()) if versions.size else 0

    def pushed(self, staleness: int, seconds: float) -> None:
        self.count("groups_pushed")
        self.staleness.append(staleness)
        self.group_s.append(seconds)
        self.push_staleness.observe(staleness)

    def write(self, ledger: dict[str, int]) -> None:
        now = time.time()
        span = max(now - self.since, 1e-9)
        episodes = self.counts["episodes"]
        record = {
            "time": now, **self.counts,
            "episodes_per_s": episodes / span, "tokens_per_s": self.tokens / span,
            "reward_mean": sum(self.rewards) / len(self.rewards) if self.rewards else None,
            "env_s_per_episode": self.env_s / episodes if episodes else None,
            "generate_s_per_episode": self.generate_s / episodes if episodes else None,
            "turns_mean": self.turns / episodes if episodes else None,
            "version_span_mean": self.version_span / episodes if episodes else None,
            "group_s_mean": statistics.fmean(self.group_s) if self.group_s else None,
            "group_s_std": statistics.pstdev(self.group_s) if self.group_s else None,
            "staleness_mean": sum(self.staleness) / len(self.staleness) if self.staleness else None,
            "staleness_max": max(self.staleness, default=None), "ledger": ledger,
        }
        if record["reward_mean"] is not None:
            self.reward.set(record["reward_mean"])
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.counts.clear()
        self.rewards.clear()
        self.staleness.clear()
        self.group_s.clear()
        self.tokens = self.turns = self.version_span = 0
        self.env_s, self.generate_s, self.since = 0.0, 0.0, now


def launch(cfg: Config, name: str, max_groups: int | None = None) -> None:
    """Process entry of ``streamrl launch-rollout``: run until SIGTERM/SIGINT (or ``max_groups``)."""
    if not cfg.redis.url:
        raise ValueError("redis.url is not set: a rollout worker pushes into a shared Redis")
    worker = RolloutWorker(cfg, name, redis_url=cfg.redis.url)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stopping.set)
        await worker.run(max_groups)

    run_event_loop(main())
