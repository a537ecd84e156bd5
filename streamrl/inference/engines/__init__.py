"""Inference engines. Each turns token ids into sampled token ids with behaviour logprobs."""

from __future__ import annotations

from typing import Any

from streamrl.adapters import LoraServing
from streamrl.inference.engines.base import Engine

__all__ = ["Engine", "load_engine"]


def load_engine(name: str, model_path: str, *, dtype: str = "float32", max_batch_size: int = 64,
                tokenizer: Any = None, kv_cache_gb: float | None = None,
                gpu_memory_utilization: float | None = None, lora: LoraServing | None = None) -> Engine:
    """Build the engine called ``name`` over a local Hugging Face model directory (with ``lora``: a LoRA server,
    which serves adapter versions over that model)."""
    if name == "hf":
        from streamrl.inference.engines.hf import HFEngine

        return HFEngine.from_pretrained(model_path, dtype=dtype, max_batch_size=max_batch_size, tokenizer=tokenizer,
                                        lora=lora)
    if name == "vllm":
        from streamrl.inference.engines.vllm import VLLMEngine

        # vLLM loads its own tokenizer (stop strings, detokenising): from model.tokenizer's directory too
        named = {"tokenizer": tokenizer.name_or_path} if getattr(tokenizer, "name_or_path", None) else {}
        return VLLMEngine(model_path, dtype=dtype, max_batch_size=max_batch_size, kv_cache_gb=kv_cache_gb,
                          gpu_memory_utilization=gpu_memory_utilization, lora=lora, **named)
    if name == "sglang":
        raise ValueError("engine 'sglang' is a stock SGLang server: start it with `python -m sglang.launch_server` "
                         "and register its URL; streamrl speaks its API as is")
    raise ValueError(f"unknown engine {name!r}; expected hf, vllm or sglang")
