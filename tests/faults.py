"""Weights a server could end up serving when its loader goes wrong, for the fault-injection tests of the weight
push: each fault turns the learner's new tensors (and the old ones the server held) into what the server would
hold after it. The bytes still travel intact (their digests match): only the probe can tell."""

from __future__ import annotations

import torch

Named = list[tuple[str, torch.Tensor]]


def _two_alike(new: Named) -> tuple[int, int]:
    """Two q_proj tensors of one shape (one layer's q_proj and the next one's; for an adapter, its lora_A)."""
    first: dict[tuple[int, ...], int] = {}
    for i, (name, t) in enumerate(new):
        if "q_proj" in name:
            if tuple(t.shape) in first:
                return first[tuple(t.shape)], i
            first[tuple(t.shape)] = i
    raise ValueError("no two q_proj tensors of one shape")


def swapped(new: Named, old: Named) -> Named:
    i, j = _two_alike(new)
    out = list(new)
    out[i], out[j] = (new[i][0], new[j][1]), (new[j][0], new[i][1])
    return out


def transposed(new: Named, old: Named) -> Named:
    i, _ = _two_alike(new)  # a model's q_proj is square: hidden x hidden
    out = list(new)
    out[i] = (new[i][0], new[i][1].t().contiguous())
    return out


def rounded_to_bf16(new: Named, old: Named) -> Named:
    return [(name, t.to(torch.bfloat16).to(t.dtype)) for name, t in new]


def kept_old_weights(new: Named, old: Named) -> Named:
    """The server acknowledged the push and kept what it had."""
    return [(name, t.clone()) for name, t in old]


def half_applied(new: Named, old: Named) -> Named:
    """The first half of the tensors landed; the rest stayed as they were."""
    half = len(new) // 2
    return [(name, t.clone()) for name, t in new[:half]] + [(name, t.clone()) for name, t in old[half:]]


FAULTS = {f.__name__: f for f in (swapped, transposed, rounded_to_bf16, kept_old_weights, half_applied)}
