"""The ``hf`` engine's weights changing hands: a version swapped in whole (each received tensor adopted as a
parameter's data where it can be, not copied), proved by its probe before a decode step runs on it and put
back when the probe fails; and a LoRA adapter merged into the layers it touches."""

from __future__ import annotations

from collections.abc import Callable

import torch

from streamrl import adapters
from streamrl.weightsync import Probe


class Weights:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._base: dict[str, torch.Tensor] = {}  # a LoRA server's base weights of every layer an adapter touched
        self._merge_buffers: dict[str, list[torch.Tensor]] = {}

    def swap(self, named_tensors: list[tuple[str, torch.Tensor]], version: int, probe: Probe | None,
             score: Callable[[list[int]], list[float]]) -> float | None:
        """Make ``named_tensors`` the model's; with a ``probe``, ``score`` it on them (the served logprobs of its
        ids) and put the weights served before back when it fails (``ProbeMismatch``). Returns the probe's gap."""
        params = dict(self.model.named_parameters())
        missing = [name for name, _ in named_tensors if name not in params]
        if missing:
            raise KeyError(f"model has no parameter {missing[0]!r}")
        served = assign(params, named_tensors)
        if probe is None:
            return None
        try:
            return probe.check(score(probe.input_ids), version)
        except Exception:  # a mismatch, or a probe the model cannot score: the weights served stay
            assign(params, served)
            raise

    def merged(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> list:
        """The new weight of every layer the adapter touches, ``W = W_base + scale * B @ A``, and the base again
        where an earlier one did; each written into the layer's buffer not being served (two a layer, in turn: no
        allocation per push)."""
        layers = dict(self.model.named_modules())
        out = []
        for module in pairs.keys() | self._base.keys():
            served = layers[module].weight.detach()
            base = self._base.setdefault(module, served.clone())
            ring = self._merge_buffers.setdefault(module, [torch.empty_like(served), torch.empty_like(served)])
            spare = ring[0] if ring[0].data_ptr() != served.data_ptr() else ring[1]
            weight = adapters.merged(base, *pairs[module], scale, out=spare) if module in pairs else spare.copy_(base)
            out.append((f"{module}.weight", weight))
        return out


def assign(params: dict[str, torch.nn.Parameter],
           named_tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Make each tensor its parameter's data: adopted where dtype, device and shape agree (no copy), else copied
    in (converting the dtype; a wrong shape raises). Returns what was served before, to put back."""
    before = []
    with torch.no_grad():
        for name, tensor in named_tensors:
            param = params[name]
            if (tensor.dtype, tensor.device, tensor.shape) == (param.dtype, param.device, param.shape):
                before.append((name, param.data))
                param.data = tensor
            else:
                before.append((name, param.data.clone()))
                param.copy_(tensor)
    return before
