"""vLLM's outputs in the shapes the server speaks (SGLang's): finish reasons, prompt scores, per-token weight
versions."""

from __future__ import annotations

from streamrl.generation import PromptScores


def finish_reason(reason: str | None, stop_reason: int | str | None, output_ids: list[int]) -> dict:
    """vLLM's finish/stop reasons in SGLang's shape."""
    if reason == "length":
        return {"type": "length", "length": len(output_ids)}
    if reason == "stop":  # stop_reason: the stop token id or string; None means EOS, the last token
        if stop_reason is None:
            stop_reason = output_ids[-1] if output_ids else None
        return {"type": "stop", "matched": stop_reason}
    return {"type": "abort", "message": "aborted" if reason == "abort" else f"vllm: {reason}"}


def prompt_scores(input_ids: list[int], prompt_logprobs: list, k: int, version: int) -> PromptScores:
    """vLLM's prompt logprobs (None, then one ``{token: Logprob}`` per later position: the prompt's token
    and the top ``k``, ranked from 1) as ``PromptScores``."""
    logprobs, top = [], []
    for token, position in zip(input_ids[1:], prompt_logprobs[1:], strict=True):
        logprobs.append(position[token].logprob)
        ranked = sorted((lp.rank, lp.logprob, t) for t, lp in position.items() if lp.rank <= k)
        top.append([(logprob, t) for _, logprob, t in ranked[:k]])
    return PromptScores(logprobs, top, version)


def token_versions(spans: list | None, n: int, current: int) -> list[int]:
    """Per-token versions from vLLM's ``weight_versions`` spans (labels are our version numbers)."""
    if not spans:  # no step reported a label (an abort before the first token)
        return [current] * n
    versions = [int(spans[0].version)] * n
    for span in spans:
        versions[span.start: span.end] = [int(span.version)] * (span.end - span.start)
    return versions
