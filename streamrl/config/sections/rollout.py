"""The rollout side's sections: workers and their sampling, and held-out evaluation.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from streamrl.config.sections.base import Section


class SamplingConfig(Section):
    """How training episodes sample (evaluation is greedy)."""

    n: int = Field(8, ge=1, description="samples per prompt (the group size)")
    max_new_tokens: int = Field(256, ge=1, description="tokens one model call may generate")
    temperature: float = Field(1.0, ge=0, description="sampling temperature; the learner scores tokens at the same "
                               "temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling (1: off)")
    top_k: int = Field(-1, ge=-1, description="sample among the k likeliest tokens (-1: off)")


class RolloutConfig(Section):
    """Rollout workers (``streamrl launch-rollout``): they play episodes through the router into the replay stream."""

    env: str = Field("arithmetic", description="env name (entry point), module:Class or file.py:Class; or an agent: "
                     "an async function (client, item) -> reward, named the same ways (docs/agents.md)")
    env_args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the env (or agent)")
    dataset: str | None = Field(None, description="JSONL/Parquet file; empty uses the env's generator")
    shuffle: bool = Field(True, description="read the dataset in a new order each epoch, drawn from run.seed (off: "
                          "in file order)")
    workers: int = Field(1, ge=0, description="rollout workers started by `streamrl up`")
    concurrency: int = Field(32, ge=1, description="episodes in flight per worker")
    coalesce_ms: float = Field(2.0, ge=0, description="how long a generation waits for sibling episodes with the "
                               "same context, to go out together as one /generate with n (0: never)")
    env_concurrency: int = Field(64, ge=1, description="env steps in flight per worker")
    oldest_first: bool = Field(False, description="a busy server serves the requests of groups admitted at older "
                               "policy versions first, as their data goes stale first (off: first come first served)")
    env_timeout_s: float = Field(60.0, gt=0, description="longest an env reset or step may take; an agent's longest "
                                 "stretch of its own code between model calls")
    tool_parser: str = Field("hermes", description="agents: how tool calls are read from the generated text: hermes "
                             "(<tool_call>{json}</tool_call>), json (the reply is the call), or module:function")
    agent_max_calls: int = Field(32, ge=1, description="agents: model calls an episode may make")
    max_context: int = Field(2048, ge=8, description="longest trajectory context in tokens")
    min_group: int = Field(2, ge=1, description="fewest good samples a group needs to be pushed")
    prompt_lease_s: float = Field(600.0, gt=0, description="how long a dead worker's claimed prompt is held before another takes it (renewed while it runs)")
    group_lease_s: float = Field(600.0, gt=0, description="how long a dead worker's group holds its admission slot (renewed while it runs)")
    router_url: str | None = Field(None, description="where to send /generate; default: the router section")
    metrics_every_s: float = Field(10.0, gt=0, description="seconds between a worker's metrics records")
    prometheus_port: int | None = Field(None, ge=1, le=65535, description="worker /metrics on 127.0.0.1")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)


class EvalConfig(Section):
    """Held-out evaluation (``streamrl evaluate``) as the learner's version moves."""

    dataset: str | None = Field(None, description="held-out rows for rollout.env; empty: no evaluation")
    every: int = Field(10, ge=1, description="learner steps between evaluations (and one at the start and end)")
    size: int = Field(64, ge=1, description="prompts per evaluation (greedy decoding)")
    log_samples: int = Field(4, ge=0, description="trajectories written to rollouts/step_N.jsonl per evaluation")
