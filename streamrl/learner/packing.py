"""Packed micro-batches: a micro-batch's sequences concatenated into one row, with no padding.

Position ids restart at each sequence, and every token attends within its own sequence only, so a
packed forward computes exactly what one forward per sequence would. The attention reads the
boundaries off the position ids (``attention()`` names the implementation the learner's models load
with): flash-attention's varlen kernels where they are installed on a GPU (transformers passes them
``cu_seqlens``), elsewhere ``varlen``. On a CPU ``varlen`` runs PyTorch's causal SDPA on the sequences of
each length as one batch: a dense block-diagonal mask over the whole row costs (sum of lengths)² instead of
the sum of squares, 10x the padded forward on the quickstart's batch. On a GPU it is the other way round: a
call per length is many small kernels and a host sync each (on an H200, a fifth of the padded forward's
tokens/s on the SmolLM2 recipe's batch), so rows up to ``DENSE_MAX_TOKENS`` attend through one SDPA call
under that mask.

Only the scored tokens (the generated ones: ``mask``) get logits: the model's head runs on the positions
that predict them and nowhere else, so a prompt costs its share of the body but nothing of the head or of
the softmax over the vocabulary. Per-token quantities (logprob of the token taken, entropy of the
distribution it came from) are gathered from those logits a chunk at a time: no ``[T, V]`` fp32 copy of
the logits is ever made, and under autograd each chunk is recomputed in the backward instead of kept.

This is the one place a packed micro-batch becomes logits, per-token logprobs or values: the policy's forwards,
the reference's and the critic's all run here (``forward``, ``logprobs``, ``values``), and so does the forward
of a micro-batch whose shared prompts ``prefix`` laid out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from streamrl.learner.batching import TrainSequence

VARLEN = "streamrl_varlen"  # the attention implementation name registered with transformers
CHUNK_ELEMENTS = 1 << 24  # logits elements per chunk (64 MB in fp32)
FIELDS = {"mask": torch.float32, "logprobs": torch.float32, "advantages": torch.float32}
DENSE_MAX_TOKENS = 16384  # longest row that attends through one masked call on a GPU (its bool mask: 256 MB)


def collate(mb: Sequence[TrainSequence], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """One micro-batch as one row ``[1, N]`` on ``device``, N its real token count.

    ``bounds`` (on the CPU) holds the sequences' start offsets and N (``cu_seqlens``); ``sequence``
    the index of the sequence each token belongs to; ``fresh`` marks the generated tokens of sequences
    generated wholly at the learner's version (by the very weights it holds).
    """
    lengths = [len(s) for s in mb]
    bounds = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.long)
    row = {
        "input_ids": torch.as_tensor(np.concatenate([s.tokens for s in mb]).astype(np.int64)),
        "position_ids": torch.as_tensor(np.concatenate([np.arange(n) for n in lengths]), dtype=torch.long),
        "sequence": torch.repeat_interleave(torch.arange(len(mb)), torch.as_tensor(lengths)),
        "fresh": torch.as_tensor(np.concatenate([s.mask.astype(bool) & (s.staleness == 0) for s in mb])),
        **{name: torch.as_tensor(np.concatenate([getattr(s, name) for s in mb]).astype(np.float32))
           for name in FIELDS},
    }
    out = {k: v[None].to(device) for k, v in row.items()}
    out["bounds"] = bounds
    return out


def attention() -> str:
    """The attention implementation for packed rows: flash-attention's varlen kernels on a GPU that has
    them, else ``varlen`` (registered with transformers on first use)."""
    import importlib.util

    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen)
    AttentionMaskInterface.register(VARLEN, _varlen_mask)
    return VARLEN


def _varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """No mask for rows without padding or cache (``varlen`` keeps packed sequences apart); SDPA's mask for
    the padded, cached forwards of shared prompts (``prefix``)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if q_length == kv_length and q_offset == 0 and (attention_mask is None or bool(attention_mask.all())):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function or causal_mask_function,
                     attention_mask, **kwargs)


def varlen(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None, **kwargs
           ) -> tuple[torch.Tensor, None]:
    """Causal attention within each sequence of a packed row ``[1, H, N, D]``: transformers' SDPA once per
    sequence length, the sequences of one length as a batch, found where ``position_ids`` restart at 0."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None or position_ids is None or query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # not a packed row
    if one_call(query):
        if bool(position_ids[0, 0] != 0):
            raise ValueError("a packed row's position ids must start at 0")
        return sdpa_attention_forward(module, query, key, value, block_causal_mask(position_ids), **kwargs)
    starts = (position_ids[0] == 0).nonzero()[:, 0].tolist()
    if not starts or starts[0] != 0:
        raise ValueError("a packed row's position ids must start at 0")
    by_length: dict[int, list[int]] = {}
    for a, b in zip(starts, [*starts[1:], query.shape[2]]):
        by_length.setdefault(b - a, []).append(a)
    pieces: dict[int, torch.Tensor] = {}  # start -> the sequence's output [length, H, D]
    for length, firsts in by_length.items():
        if len(firsts) == 1:  # a length of its own: a view, no gather
            a = firsts[0]
            pieces[a] = sdpa_attention_forward(module, query[:, :, a:a + length], key[:, :, a:a + length],
                                               value[:, :, a:a + length], None, **kwargs)[0][0]
            continue
        index = (torch.tensor(firsts, device=query.device)[:, None] + torch.arange(length, device=query.device)).view(-1)

        def take(x: torch.Tensor) -> torch.Tensor:  # [1, H, N, D] -> [sequences, H, length, D]
            return x[0, :, index].unflatten(1, (len(firsts), length)).transpose(0, 1)

        attended = sdpa_attention_forward(module, take(query), take(key), take(value), None, **kwargs)[0]
        pieces.update(zip(firsts, attended.unbind(0)))
    return torch.cat([pieces[a] for a in starts])[None], None


def one_call(query: torch.Tensor) -> bool:
    """Whether a packed row attends through one SDPA call under ``block_causal_mask`` (see the module's doc)."""
    return query.is_cuda and query.shape[2] <= DENSE_MAX_TOKENS


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """``[1, 1, N, N]``, True where token i may attend to token j: j <= i, in i's sequence (each sequence starts
    where its position id is 0)."""
    sequence = (position_ids[0] == 0).cumsum(0)
    index = torch.arange(sequence.numel(), device=position_ids.device)
    return ((sequence[:, None] == sequence[None, :]) & (index[:, None] >= index[None, :]))[None, None]


def scored(row: dict[str, torch.Tensor]) -> torch.Tensor:
    """Offsets ``[M]`` in the row of the tokens that are scored: generated (``mask``), not a sequence's first."""
    return ((row["mask"][0] > 0) & (row["position_ids"][0] > 0)).nonzero()[:, 0]


def forward(model: torch.nn.Module, row: dict[str, torch.Tensor], bf16: bool = False) -> torch.Tensor:
    """``model``'s logits ``[M, V]`` at the positions that predict the scored tokens, in the row's order.
    One packed row (no attention mask, no cache: the restarting position ids keep the sequences apart), or each
    shared prompt forwarded once where ``prefix`` laid it out.

    ``bf16`` (mixed precision): the forward's matmuls (and so the backward's) run in bfloat16, the gradients land
    on the fp32 weights. DeepSpeed's own autocast does it inside its forward; this one around it keeps the bf16
    copies of the weights for both forwards of a shared prompt (5% of a step on a CPU)."""
    with torch.autocast(row["input_ids"].device.type, dtype=torch.bfloat16, enabled=bf16):
        if "prompt_ids" in row:
            return _shared_prompt_logits(model, row, scored(row))
        return model(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False,
                     logits_to_keep=scored(row) - 1).logits[0]


def _shared_prompt_logits(model: torch.nn.Module, row: dict[str, torch.Tensor], where: torch.Tensor) -> torch.Tensor:
    """``[M, V]`` logits predicting the row's tokens at offsets ``where`` (each after its sequence's prompt), from
    one forward of the prompts and one of the continuations over their keys and values (``prefix.layout``)."""
    prompt_mask, prompt_rows, starts = row["prompt_mask"], row["prompt_row"], row["prompt_len"]
    positions = (prompt_mask.cumsum(1) - 1).clamp(min=0)
    head = model(input_ids=row["prompt_ids"], attention_mask=prompt_mask, position_ids=positions, use_cache=True,
                 logits_to_keep=1)  # only the last position predicts: skip the head's other logits
    cache = head.past_key_values
    cache.batch_select_indices(prompt_rows)  # each sequence's copy of its prompt's keys and values
    rest_mask = row["rest_mask"]
    # padding slots get position 0: a position past the sequence's end could exceed the model's range
    rest_positions = (starts[:, None] + torch.arange(rest_mask.shape[1], device=starts.device)) * rest_mask
    tail = model(input_ids=row["rest_ids"], attention_mask=torch.cat([prompt_mask[prompt_rows], rest_mask], 1),
                 position_ids=rest_positions, past_key_values=cache, use_cache=True).logits
    seq = row["sequence"][0, where]
    k = where - row["bounds"][:-1].to(where.device)[seq] - starts[seq]  # the token's place after its prompt
    first, later = (k == 0).nonzero()[:, 0], (k > 0).nonzero()[:, 0]
    out = tail.new_empty(len(where), tail.shape[-1])
    # the prompt's last position predicts each sequence's first generated token; rest slot j the token after it
    out = out.index_put((first,), head.logits[prompt_rows[seq[first]], -1])
    return out.index_put((later,), tail[seq[later], k[later] - 1])


def logprobs(model: torch.nn.Module, row: dict[str, torch.Tensor], temperature: float, entropy: bool = False,
             bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_logprobs`` of ``model``'s ``forward`` of the row."""
    return token_logprobs(forward(model, row, bf16), row, temperature, entropy)


def values(model: torch.nn.Module, row: dict[str, torch.Tensor]) -> torch.Tensor:
    """A value model's values ``[1, N]`` at every position of the row (PPO's critic)."""
    return model(input_ids=row["input_ids"], position_ids=row["position_ids"])


def token_logprobs(logits: torch.Tensor, row: dict[str, torch.Tensor], temperature: float,
                   entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logp[0, t]``: scored token t's logprob under the tempered distribution at position t-1, in fp32, and
    with ``entropy`` that distribution's entropy; both 0 at the tokens not scored. ``logits``: ``forward``'s.

    The same quantity the rollout engine reports: tempered, before any truncation.
    """
    scale = 1.0 / (temperature or 1.0)
    where = scored(row)
    targets = row["input_ids"][0, where]
    chunk = max(1, CHUNK_ELEMENTS // max(logits.shape[-1], 1))
    recompute = torch.is_grad_enabled() and logits.requires_grad and logits.shape[0] > chunk
    picked, spread = [], []
    for start in range(0, logits.shape[0], chunk):
        args = (logits[start: start + chunk], targets[start: start + chunk], scale, entropy)
        lp, h = checkpoint(_gather, *args, use_reentrant=False) if recompute else _gather(*args)
        picked.append(lp)
        spread.append(h)
    width = row["input_ids"].shape[1]
    logp = _place(torch.cat(picked) if picked else logits.new_zeros(0, dtype=torch.float32), where, width)
    return logp, (_place(torch.cat(spread), where, width) if entropy and spread else None)


def _gather(logits: torch.Tensor, targets: torch.Tensor, scale: float, entropy: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits.float() * scale, -1)
    picked = logp.gather(-1, targets[:, None])[:, 0]
    return picked, (-(logp.exp() * logp).sum(-1) if entropy else torch.zeros_like(picked))


def _place(values: torch.Tensor, where: torch.Tensor, width: int) -> torch.Tensor:
    """``values [M]`` at offsets ``where`` of a row ``[1, width]`` of zeros."""
    return values.new_zeros(width).index_put((where,), values)[None]


def per_sequence(per_token: torch.Tensor, row: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sums of ``per_token [1, N]`` over each sequence of the row: ``[S]``."""
    sums = per_token.new_zeros(sequence_count(row))
    return sums.index_add(0, row["sequence"][0], per_token[0])


def sequence_count(row: dict[str, torch.Tensor]) -> int:
    return len(row["bounds"]) - 1
