"""LoRA adapters between the learner and the servers: what one is on the wire, the checks a server runs on it
before serving it, and PEFT's directory format (exports, late joiners, vLLM's LoRA API).

A tensor's wire name is PEFT's saved name, ``base_model.model.<module>.lora_A.weight`` (``[rank, in]``) or
``...lora_B.weight`` (``[out, rank]``); ``<module>`` is the linear layer's name in the plain model. The served
update of that layer is ``(alpha / rank) * B @ A``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

PREFIX = "base_model.model."
SIDES = {".lora_A.weight": "A", ".lora_B.weight": "B"}
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterSpec:
    """What a server must know of an adapter besides its tensors."""

    rank: int
    alpha: float
    tensors: int  # the whole adapter's tensor count: a push is complete when all of them came
    name: str = "policy"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def served_name(self, version: int) -> str:
        """The name version ``version`` is served under (vLLM's ``lora_name``, SGLang's ``lora_path``)."""
        return f"{self.name}-v{version}"


@dataclass(frozen=True)
class LoraServing:
    """A LoRA server's settings: the adapter name it serves, the largest rank it takes, and how many versions it
    holds at once (vllm; the hf engine merges each into its weights and holds one)."""

    name: str
    max_rank: int
    slots: int

    @classmethod
    def of(cls, cfg) -> LoraServing | None:
        """From a run's config (``learner.lora``, ``server.max_lora_rank``, its slots); None without LoRA."""
        lora = cfg.learner.lora
        if lora is None:
            return None
        return cls(lora.name, cfg.server.max_lora_rank or lora.rank, cfg.adapter_slots)


def target_of(name: str) -> tuple[str, str]:
    """``(module, side)`` of a wire name: the linear layer it adapts, and ``A`` or ``B``."""
    for suffix, side in SIDES.items():
        if name.startswith(PREFIX) and name.endswith(suffix):
            return name[len(PREFIX): -len(suffix)], side
    raise ValueError(f"{name!r} is no LoRA tensor name (expected {PREFIX}<module>.lora_A.weight or .lora_B.weight)")


def linear_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """``module -> (out_features, in_features)`` of every linear layer of a plain (unwrapped) model."""
    return {name: (m.out_features, m.in_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)}


def check(names: list[str], shapes: list[list[int]], spec: AdapterSpec, linears: dict[str, tuple[int, int]],
          max_rank: int) -> None:
    """Refuse an adapter bucket the served model cannot take: a rank above ``max_rank``, a tensor for a layer
    the model lacks, or one whose shape does not fit that layer at the adapter's rank."""
    if spec.rank > max_rank:
        raise ValueError(f"adapter rank {spec.rank} exceeds this server's largest, {max_rank} (server.max_lora_rank)")
    for name, shape in zip(names, shapes, strict=True):
        module, side = target_of(name)
        if module not in linears:
            raise ValueError(f"the served model has no linear layer {module!r} (for {name!r}): the adapter was "
                             "made for another model or targets other modules")
        out, inp = linears[module]
        want = (spec.rank, inp) if side == "A" else (out, spec.rank)
        if tuple(shape) != want:
            raise ValueError(f"{name!r} has shape {list(shape)}; layer {module!r} at rank {spec.rank} needs "
                             f"{list(want)}")


def pairs(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``module -> (A, B)`` for every adapted layer (each needs both of its tensors)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, side = target_of(name)
        halves.setdefault(module, {})[side] = tensor
    for module, half in halves.items():
        if len(half) != 2:
            raise ValueError(f"layer {module!r} got lora_{next(iter(half))} without its other half")
    return {module: (half["A"], half["B"]) for module, half in halves.items()}


def merged(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``base + scale * B @ A`` in one pass, computed in fp32, into ``out`` (else a new tensor); ``base`` is left
    as it is."""
    if base.dtype == torch.float32:
        return torch.addmm(base, b.float(), a.float(), alpha=scale, out=out)
    weight = torch.addmm(base.float(), b.float(), a.float(), alpha=scale).to(base.dtype)
    return weight if out is None else out.copy_(weight)


def save(path: Path, tensors: list[tuple[str, torch.Tensor]], spec: AdapterSpec, base_model: str) -> None:
    """Write an adapter in PEFT's format (what ``PeftModel.from_pretrained`` and vLLM's LoRA API load)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    targets = sorted({target_of(name)[0].rsplit(".", 1)[-1] for name, _ in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
              "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "base_model_name_or_path": base_model}
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors}, str(path / WEIGHTS_FILE))
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))


def load(path: str | Path, name: str = "policy") -> tuple[list[tuple[str, torch.Tensor]], AdapterSpec]:
    """An adapter directory in PEFT's format: its tensors under their wire names, and its spec."""
    from safetensors.torch import load_file

    path = Path(path)
    if not is_adapter(path):
        raise ValueError(f"{path} holds no LoRA adapter ({CONFIG_FILE} is missing)")
    config = json.loads((path / CONFIG_FILE).read_text())
    if config.get("peft_type") != "LORA" or config.get("use_rslora") or config.get("fan_in_fan_out"):
        raise ValueError(f"{path}: only plain LoRA adapters are served (peft_type LORA, no rslora, no fan_in_fan_out)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors file")
    tensors = [(n.replace(".default.", "."), t) for f in files for n, t in load_file(f).items()]
    return tensors, AdapterSpec(int(config["r"]), float(config["lora_alpha"]), len(tensors), name)


def is_adapter(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()
