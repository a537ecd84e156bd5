"""The learner's half of a push's end-to-end check (ARCHITECTURE §5): a fixed probe, the first tokens the run
trains on, and their logprobs under the weights being pushed. A server serves a version only once its own
logprobs of the probe, on the weights it applied, agree within the tolerance (``weightsync.Probe``).

The probe is chosen once, on rank 0, from the first step's sequences, and kept in the run directory
(``probe.json``) for the run's life, restarts included; every rank scores it (under ZeRO-3 the forward is a
collective), at the point of the step where the pushed weights are the model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from streamrl.learner.batching import TrainSequence
from streamrl.weightsync import Probe


def choose(sequences: list[TrainSequence], n_tokens: int) -> list[int]:
    """The first ``n_tokens`` tokens of the step's sequences, concatenated in order (rank 0)."""
    ids: list[int] = []
    for seq in sequences:
        ids += seq.tokens[: n_tokens - len(ids)].tolist()
        if len(ids) == n_tokens:
            break
    return ids


def load(run_dir: Path) -> list[int] | None:
    """The run's probe, if one was chosen (by this learner or before a restart)."""
    path = run_dir / "probe.json"
    return json.loads(path.read_text())["input_ids"] if path.is_file() else None


def save(run_dir: Path, ids: list[int]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / ".probe.json.tmp"
    tmp.write_text(json.dumps({"input_ids": ids}))
    tmp.replace(run_dir / "probe.json")


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


def reference(model: torch.nn.Module, ids: list[int], device: torch.device, tolerance: float) -> Probe:
    """The check a server must pass: ``model``'s logprobs of ``ids``, the weights it holds now."""
    return Probe(ids, logprobs(model, ids, device), tolerance)
