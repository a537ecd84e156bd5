"""Supervised (SFT / pretraining) data mixed into RL steps: the ``ptx`` term.

Rows are ``{"prompt", "completion"}`` (the prompt chat-templated, loss on the completion
and its end-of-turn token) or ``{"text"}`` (loss on every token). Which rows a step
uses follows from the step number, so a resumed learner continues the same sequence
without saving any loader state.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from streamrl.dataset import DatasetError, load_rows
from streamrl.learner.batching import TrainSequence


class PtxData:
    def __init__(self, path: str, tokenizer: Any, max_len: int = 1024):
        self.rows = load_rows(path)
        if not self.rows:
            raise DatasetError(f"ptx dataset {path} has no rows")
        self.tokenizer, self.max_len = tokenizer, max_len
        self._cache: dict[int, TrainSequence] = {}

    def sequence(self, index: int) -> TrainSequence:
        i = index % len(self.rows)
        if i not in self._cache:
            self._cache[i] = self._encode(self.rows[i], i)
        return self._cache[i]

    def for_step(self, step: int, rank: int, world: int, per_rank: int) -> list[TrainSequence]:
        start = (step * world + rank) * per_rank
        return [self.sequence(start + j) for j in range(per_rank)]

    def _encode(self, row: dict[str, Any], i: int) -> TrainSequence:
        tok = self.tokenizer
        if "text" in row:
            ids = tok(str(row["text"]), add_special_tokens=False).input_ids
            prompt_len = 0
        elif "prompt" in row and "completion" in row:
            prompt = tok.apply_chat_template([{"role": "user", "content": str(row["prompt"])}], tokenize=False,
                                             add_generation_prompt=True) if tok.chat_template else str(row["prompt"])
            head = tok(prompt, add_special_tokens=False).input_ids
            tail = tok(str(row["completion"]), add_special_tokens=False).input_ids + [tok.eos_token_id]
            ids, prompt_len = head + tail, len(head)
        else:
            raise DatasetError(f"ptx row {i} needs 'text' or 'prompt' and 'completion'")
        cut = max(0, len(ids) - self.max_len)  # keep the end: that is where the completion is
        ids, prompt_len = ids[cut:], max(0, prompt_len - cut)
        mask = np.zeros(len(ids), np.uint8)
        mask[max(prompt_len, 1):] = 1  # the first token has no prediction
        return TrainSequence(tokens=np.array(ids, np.int32), mask=mask, logprobs=np.zeros(len(ids), np.float32),
                             advantages=np.zeros(len(ids), np.float32), staleness=0)
