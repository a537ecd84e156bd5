"""The quickstart's task: reverse a short word. Verifiable, and learnable on a laptop CPU in minutes.

The recipe makes everything itself: a character-level tokenizer with a chat template, a small Llama
from a config, train and held-out eval prompts, and a short supervised warm start. The warm start
imitates a careless teacher that reverses the word only ``reverse_rate`` of the time and otherwise
echoes it back: the model learns both behaviours and, decoding greedily, mostly echoes. Reversing is
in its distribution but not its habit; RL with an exact-match reward has to make it one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

LETTERS = "abcdefghij"


def word(rng: random.Random) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))


def task(w: str) -> dict[str, str]:
    return {"prompt": f"Reverse: {w}", "answer": w[::-1]}


def prepare(cfg, *, hidden: int = 128, layers: int = 2, sft_steps: int = 1000, sft_batch: int = 64,
            sft_lr: float = 1e-3, reverse_rate: float = 0.3, train_size: int = 4000, eval_size: int = 128) -> dict:
    """Make (once) the data, the model and its warm start under ``RUN/prepared``; return the overrides."""
    root = Path(cfg.run.path) / "prepared"
    overrides = {"model.path": str(root / "model"), "rollout.dataset": str(root / "train.jsonl"),
                 "eval.dataset": str(root / "eval.jsonl")}
    if (root / "done").is_file():
        return overrides
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the run's display is the progress report
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(cfg.run.seed)
    held_out = set()
    while len(held_out) < eval_size:
        held_out.add(word(rng))
    train = []
    while len(train) < train_size:
        w = word(rng)
        if w not in held_out:
            train.append(w)
    _write(root / "eval.jsonl", [task(w) for w in sorted(held_out)])
    _write(root / "train.jsonl", [task(w) for w in train])
    sft = [{"prompt": task(w)["prompt"], "completion": w[::-1] if rng.random() < reverse_rate else w} for w in train]
    _write(root / "sft.jsonl", sft)
    model_dir = make_model(root / "model", hidden=hidden, layers=layers, seed=cfg.run.seed)
    warm_start(model_dir, root / "sft.jsonl", steps=sft_steps, batch=sft_batch, lr=sft_lr, seed=cfg.run.seed)
    (root / "done").write_text("ok\n")
    return overrides


def make_model(path: Path, *, hidden: int, layers: int, seed: int) -> str:
    """A small Llama over a byte-level tokenizer without merges: one token per character."""
    from streamrl.models import make_tiny_model

    return make_tiny_model(path, vocab_size=259, hidden=hidden, layers=layers, seed=seed)  # 256 bytes + 3 specials


def warm_start(model_dir: str, rows_path: Path, *, steps: int, batch: int, lr: float, seed: int,
               say=print) -> None:
    """Supervised steps on prompt→completion rows (loss on the completion), tokenised as the learner's ptx term."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamrl.learner import packing
    from streamrl.learner.ptx import PtxData

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=packing.attention())
    data = PtxData(str(rows_path), tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    order = random.Random(seed)
    for step in range(steps):
        rows = packing.collate([data.sequence(order.randrange(len(data.rows))) for _ in range(batch)])
        logp, _ = packing.token_logprobs(packing.forward(model, rows), rows, 1.0)
        mask = rows["mask"]
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % 250 == 0 or step == steps - 1:
            say(f"warm start: step {step + 1}/{steps}, loss {loss.item():.3f}")
    model.save_pretrained(model_dir)


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
