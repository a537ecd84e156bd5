"""One forward per shared prompt: the n samples of a group are trained without n copies of their prompt.

A group's samples continue the same context, so a micro-batch of padded sequences spends
most of its forward (and backward) on identical prompt tokens when prompts are long and
answers short. Here each distinct prompt runs once, its keys and values are gathered to
every sequence that continues it, and only the continuations run per sequence. This module lays a
micro-batch out so (``layout``); ``packing.forward`` runs it, and its logits come out as the packed forward's do
(one row per scored token), so the loss code sees no difference; the gather's backward sums the prompt's
gradient over its continuations, as the plain forward would. The prompt is what precedes a sequence's first
generated token.
"""

from __future__ import annotations

import torch

from streamrl.learner.batching import TrainSequence

KEYS = ("prompt_ids", "prompt_mask", "prompt_row", "prompt_len", "rest_ids", "rest_mask")  # what layout adds
MIN_SAVING = 0.25  # sharing runs two forwards instead of one: it must save this share of the padded tokens


def layout(mb: list[TrainSequence], device: torch.device | str = "cpu") -> dict[str, torch.Tensor] | None:
    """Tensors for ``packing.forward`` (on ``device``) when sharing prompts saves ``MIN_SAVING`` of the tokens of the
    micro-batch's packed row (shared prompts long beside their continuations), else None: the packed forward."""
    starts = [int(s.mask.argmax()) if s.mask.any() else 0 for s in mb]
    if min(starts) == 0:  # a sequence with nothing generated, or generated from its first token: no prompt
        return None
    prompts: dict[bytes, int] = {}  # prompt -> its row
    holders, rows = [], []  # the first sequence holding each prompt; each sequence's prompt row
    for i, (s, p) in enumerate(zip(mb, starts)):
        key = s.tokens[:p].tobytes()
        if key not in prompts:
            prompts[key] = len(holders)
            holders.append(i)
        rows.append(prompts[key])
    if len(holders) == len(mb):
        return None
    lengths = [starts[i] for i in holders]
    width, rest = max(lengths), max(len(s) - p for s, p in zip(mb, starts))
    if len(holders) * width + len(mb) * rest > (1 - MIN_SAVING) * sum(map(len, mb)):
        return None
    prompt_ids = torch.zeros(len(holders), width, dtype=torch.long)
    prompt_mask = torch.zeros(len(holders), width, dtype=torch.long)
    for r, (i, n) in enumerate(zip(holders, lengths)):  # left-padded: every prompt ends in the last column
        prompt_ids[r, width - n:] = torch.as_tensor(mb[i].tokens[:n].astype("int64"))
        prompt_mask[r, width - n:] = 1
    rest_ids = torch.zeros(len(mb), rest, dtype=torch.long)
    rest_mask = torch.zeros(len(mb), rest, dtype=torch.long)
    for i, (s, p) in enumerate(zip(mb, starts)):
        rest_ids[i, : len(s) - p] = torch.as_tensor(s.tokens[p:].astype("int64"))
        rest_mask[i, : len(s) - p] = 1
    tensors = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "prompt_row": torch.tensor(rows),
               "prompt_len": torch.tensor(starts), "rest_ids": rest_ids, "rest_mask": rest_mask}
    return {k: v.to(device) for k, v in tensors.items()}
