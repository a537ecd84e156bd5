"""The learner's half of a push's end-to-end check (ARCHITECTURE §5): a fixed probe, the first tokens the run
trains on, and their logprobs under the weights being pushed. A server serves a version only once its own
logprobs of the probe, on the weights it applied, agree within the tolerance (``weightsync.Probe``).

The probe is chosen once, on rank 0, from the first step's sequences; every rank scores it (under ZeRO-3 the
forward is a collective), at the point of the step where the pushed weights are the model's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from streamrl.learner.batching import TrainSequence


def choose(sequences: list[TrainSequence], n_tokens: int) -> list[int]:
    """The first ``n_tokens`` tokens of the step's sequences, concatenated in order (rank 0)."""
    ids: list[int] = []
    for seq in sequences:
        ids += seq.tokens[: n_tokens - len(ids)].tolist()
        if len(ids) == n_tokens:
            break
    return ids


def share(ids: list[int] | None, device: torch.device) -> list[int]:
    """Rank 0's probe on every rank (a collective; an empty list while rank 0 has none)."""
    if dist.get_world_size() == 1:
        return ids or []
    size = torch.tensor([len(ids or [])], dtype=torch.long, device=device)
    dist.broadcast(size, 0)
    buf = torch.tensor(ids, dtype=torch.long, device=device) if ids else torch.zeros(int(size), dtype=torch.long,
                                                                                      device=device)
    dist.broadcast(buf, 0)
    return buf.tolist()


@torch.no_grad()
def logprobs(model: torch.nn.Module, ids: list[int], device: torch.device) -> list[float]:
    """Teacher-forced logprobs of ``ids[1:]``: temperature 1, log-softmax in fp32, dropout off (as a server
    scores a prompt)."""
    training = model.training
    model.eval()
    try:
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].float()
    finally:
        model.train(training)
    chosen = torch.tensor(ids[1:], device=device).unsqueeze(1)
    return torch.log_softmax(logits, -1).gather(1, chosen).squeeze(1).tolist()
