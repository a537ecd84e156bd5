"""What one asks of a model and what it answers: the generation contract the rollout side and the serving side
share (an engine takes ``SamplingParams`` and returns a ``Completion``; the HTTP API carries both)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; needs an engine with a tokenizer
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or >= 1, got {self.top_k}")


@dataclass
class Completion:
    """A finished request. ``versions[i]`` is the weight version that produced ``output_ids[i]``."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: dict = field(default_factory=dict)  # SGLang's shape: {"type": "stop"|"length"|"abort", ...}

    @property
    def finish_type(self) -> str:
        """``stop`` | ``length`` | ``abort``, as ``Sample.finish_reason`` takes it."""
        return self.finish_reason.get("type", "abort")

    def version_spans(self) -> list[dict]:
        """Runs of equal version as ``[{"version", "start", "end"}]`` (end exclusive)."""
        spans: list[dict] = []
        for i, v in enumerate(self.versions):
            if spans and spans[-1]["version"] == v:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": v, "start": i, "end": i + 1})
        return spans


@dataclass
class PromptScores:
    """A prompt scored by teacher forcing: the model's own next-token distribution at each position
    (temperature 1, no truncation, log-softmax in fp32), under the weights of ``version``."""

    logprobs: list[float]  # logprobs[i] = log p(input_ids[i + 1] | input_ids[: i + 1]); one fewer than the prompt
    top: list[list[tuple[float, int]]]  # top[i]: the k likeliest (logprob, token id) at that position, likeliest first
    version: int = 0


class Withdrawn(RuntimeError):
    """A completion made (in part) by weights that failed their probe and were rolled back: it is never
    returned; the caller retries (a server answers it with a 503)."""
