"""The learner's LoRA adapter (``learner.lora``), through PEFT: the wrapped model, the tensors a push sends,
and the export (the adapter in PEFT's format, and the merged plain model)."""

from __future__ import annotations

from pathlib import Path

import torch

from streamrl import adapters
from streamrl.config.sections import LoraConfig


def wrap(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """``model`` with an adapter on the target modules; only the adapter's parameters require gradients."""
    import peft

    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                             target_modules=lora.target_modules, task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The adapter's tensors under their wire names (PEFT's saved names), as a push sends them."""
    return [(name.replace(".default.", "."), p) for name, p in model.named_parameters() if ".lora_" in name]


def spec(lora: LoraConfig, count: int) -> adapters.AdapterSpec:
    return adapters.AdapterSpec(lora.rank, lora.alpha, count, lora.name)


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict with every adapter folded into its layer: ``W + (alpha / r) * B @ A``."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    state = {name.replace(".base_layer.", "."): t.detach() for name, t in base.state_dict().items()
             if ".lora_" not in name}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            key = f"{name}.weight"
            state[key] = state[key] + module.get_delta_weight("default").to(state[key].dtype)
    return state


def export(model: torch.nn.Module, lora: LoraConfig, target: Path, base_model: str) -> None:
    """Write the merged model into ``target`` and the adapter into ``target/adapter``."""
    named = [(n, p.detach()) for n, p in tensors(model)]
    adapters.save(target / "adapter", named, spec(lora, len(named)), base_model)
    model.get_base_model().save_pretrained(target, state_dict=merged_state_dict(model), safe_serialization=True)
