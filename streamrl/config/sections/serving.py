"""The serving side's sections: the router, the rollout servers and the reward-model server.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from streamrl.config.sections.base import Section


class RouterConfig(Section):
    """The sglang-router in front of the rollout servers."""

    host: str | None = Field(None, description="address the router binds, and rollout workers reach it at; empty: "
                             "its node's address on a Ray cluster (ray.address), else 127.0.0.1; announced in Redis")
    port: int = Field(30000, ge=1, le=65535, description="router port")
    policy: Literal["round_robin", "random", "cache_aware", "power_of_two"] = Field(
        "cache_aware", description="how the router picks a server for a request (cache_aware: the one holding the "
                                   "longest shared prefix)")
    request_timeout_s: float = Field(600.0, ge=1, description="longest the router waits on a server for one request "
                                     "(workers wait on the router as long, and 10 s more)")
    prometheus_port: int | None = Field(None, ge=1, le=65535, description="router metrics; default port + 1")
    health_check_interval_s: float = Field(2.0, ge=1, description="seconds between the router's health checks")
    sync_every_s: float = Field(1.0, gt=0, description="how often the worker set follows the registry")


class ServerConfig(Section):
    """Rollout servers (``streamrl serve``): an inference engine behind SGLang's HTTP API."""

    engine: Literal["hf", "vllm", "sglang"] = Field("hf", description="hf (transformers, continuous batching), "
                                                    "vllm (vLLM's engine) or sglang (a stock SGLang server)")
    count: int = Field(1, ge=0, description="rollout servers started by `streamrl up`")
    host: str | None = Field(None, description="address servers bind and register (others reach them at it); empty: "
                             "its node's address on a Ray cluster (ray.address), else 127.0.0.1")
    base_port: int = Field(31000, ge=1, le=65535, description="port of server 0; server i listens on base_port + i")
    max_batch_size: int = Field(64, ge=1, description="sequences a server decodes at once")
    kv_cache_gb: float | None = Field(None, gt=0, description="vllm engine: KV cache size in GiB (default: 2 on a "
                                      "CPU, vLLM's gpu_memory_utilization on a GPU)")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="vllm engine on a GPU: the share of "
                                                 "the GPU's memory a server may take (vLLM's own default: 0.9); "
                                                 "lower it where servers share a GPU with the learner")
    token: str | None = Field(None, description="bearer token required by control endpoints")
    max_lora_rank: int | None = Field(None, ge=1, description="with learner.lora: the largest adapter rank a "
                                      "server takes (default: learner.lora.rank)")
    max_loras: int | None = Field(None, ge=1, description="with learner.lora on vllm: adapter versions a server "
                                  "holds at once (default: off_policy.max_staleness + 2: every version a "
                                  "request may still run under, and the one arriving)")
    heartbeat_s: float = Field(2.0, gt=0, description="how often a server renews its entry in the registry")
    registry_ttl_s: float = Field(10.0, gt=0, description="a server whose heartbeat is older than this is taken "
                                  "for dead (the router, pushes and workers stop using it)")


class RewardConfig(Section):
    """The reward-model server `streamrl serve-reward` starts (the `reward_model` env takes its URL from
    `rollout.env_args.url`)."""

    model_path: str | None = Field(None, description="local HF sequence-classification model")
    host: str = Field("127.0.0.1", description="address the reward server binds")
    port: int = Field(32000, ge=1, le=65535, description="reward server port")
    max_batch_size: int = Field(32, ge=1, description="(prompt, response) pairs scored in one forward")
    max_wait_ms: float = Field(5.0, ge=0, description="how long a batch waits to fill")
    max_length: int = Field(2048, ge=8, description="longest (prompt, response) in tokens; longer is cut from the left")
