"""``/generate``: SGLang's native generation request, token ids or text in, sampled ids with behaviour logprobs and
their weight versions out; ``max_new_tokens: 0`` scores the prompt instead."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field

from streamrl.generation import Completion, PromptScores, SamplingParams
from streamrl.inference.engines.base import Engine

log = logging.getLogger("streamrl.server")


class SamplingIn(BaseModel):
    """SGLang's ``sampling_params``; fields we do not implement are ignored, as SGLang ignores unknown ones."""

    model_config = ConfigDict(extra="ignore")
    max_new_tokens: int = Field(128, ge=0, description="0: score the prompt, generate nothing")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1024)
    ignore_eos: bool = False
    sampling_seed: int | None = None
    # how ``text`` is made from the output ids (they are returned untouched)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = Field(True, description="passed to the tokenizer's decode; "
                                                "transformers 5's tokenizers ignore it, as with SGLang")
    no_stop_trim: bool = Field(False, description="keep the matched stop token or string in text")

    def to_params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, stop_token_ids=tuple(self.stop_token_ids or ()), stop=tuple(stop),
            ignore_eos=self.ignore_eos, seed=self.sampling_seed,
        )


class GenerateIn(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the router adds fields of its own
    text: str | list[str] | None = Field(None, description="a prompt, or a batch of them")
    input_ids: list[int] | list[list[int]] | None = Field(None, description="a prompt, or a batch of them")
    sampling_params: SamplingIn = Field(default_factory=SamplingIn)
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1, description="with return_logprob: input_token_logprobs from this "
                                   "prompt position on (-1: none)")
    top_logprobs_num: int = Field(0, ge=0, description="with return_logprob: the k likeliest tokens at each "
                                  "position (input_top_logprobs); needs max_new_tokens 0")
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    stream: bool = False
    priority: int = Field(0, description="larger joins the batch sooner while requests wait (SGLang's order)")
    lora_path: str | None = Field(None, description="a LoRA server: the adapter version to generate with, by its "
                                  "served name NAME-vN (default: the newest)")


@dataclass
class Standing:
    """Whether the server may generate: ``withdrawn`` says which version failed its probe (set by the weight
    routes); until a later version passes, generation is refused with a 503 that sglang-router retries elsewhere."""

    withdrawn: str | None = None
    failures: int = 0  # probes failed since the server started


class Metrics:
    def __init__(self, engine: Engine, standing: Standing):
        self.registry = CollectorRegistry()
        self.requests = Counter("streamrl_requests", "generate requests by outcome", ["status"], registry=self.registry)
        self.prompt_tokens = Counter("streamrl_prompt_tokens", "prompt tokens", registry=self.registry)
        self.generated_tokens = Counter("streamrl_generated_tokens", "generated tokens", registry=self.registry)
        self.latency = Histogram("streamrl_request_latency_seconds", "end-to-end latency", registry=self.registry,
                                 buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300))
        for key, help_text in [("num_reqs", "running requests (batch size)"), ("num_waiting_reqs", "queued requests"),
                               ("num_tokens", "tokens held in the KV cache")]:
            Gauge(f"streamrl_{key}", help_text, registry=self.registry).set_function(
                lambda key=key: engine.load()[key])
        Gauge("streamrl_weight_version", "weight version served", registry=self.registry).set_function(
            lambda: engine.version)
        Gauge("streamrl_probe_failures", "pushed versions that failed their probe and were rolled back",
              registry=self.registry).set_function(lambda: standing.failures)
        Gauge("streamrl_withdrawn", "1 while a failed probe keeps the server from generating",
              registry=self.registry).set_function(lambda: standing.withdrawn is not None)
        if hasattr(engine, "busy_s"):  # the hf engine: seconds it spent generating, for tokens/s while it has work
            Gauge("streamrl_busy_seconds", "seconds spent prefilling and decoding", registry=self.registry
                  ).set_function(lambda: engine.busy_s)

    def served(self, served: list[tuple[list[int], Any, list[tuple[str, Completion]]]], latency: float) -> None:
        """Count one answered /generate: per prompt, its ids, scores and samples."""
        self.requests.labels("ok").inc(sum(len(samples) for _, _, samples in served))
        self.prompt_tokens.inc(sum(len(ids) * len(samples) for ids, _, samples in served))
        self.generated_tokens.inc(sum(len(out.output_ids) for _, _, samples in served for _, out in samples))
        self.latency.observe(latency)


def routes(engine: Engine, tokenizer: Any, metrics: Metrics, standing: Standing) -> APIRouter:
    router = APIRouter()

    @router.post("/generate")
    async def generate(req: GenerateIn, request: Request):
        if standing.withdrawn:
            metrics.requests.labels("withdrawn").inc()
            raise HTTPException(503, f"this server is withdrawn from generation: {standing.withdrawn}")
        prompts, batch = _prompts(req, tokenizer)
        rids = _rids(req.rid, len(prompts), batch)
        _check_logprob_fields(req, prompts, tokenizer)
        sampling = req.sampling_params
        try:  # checked as for a generation even when max_new_tokens 0 scores the prompt, as SGLang does
            params = sampling.model_copy(update={"max_new_tokens": max(sampling.max_new_tokens, 1)}).to_params()
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        if sampling.max_new_tokens == 0:
            params = None
        start = time.perf_counter()
        try:
            served = await _unless_hung_up(request, asyncio.gather(
                *(_serve(engine, req, r, ids, params) for r, ids in zip(rids, prompts))))
        except ValueError as e:
            metrics.requests.labels("bad_request").inc()
            raise HTTPException(400, str(e)) from None
        except HungUp:
            metrics.requests.labels("hung_up").inc()
            raise HTTPException(499, "the client closed the request; its generation was aborted") from None
        except Exception as e:  # an engine fault: 5xx, so the router retries elsewhere
            metrics.requests.labels("error").inc()
            if not engine.healthy():  # the engine died (said once, by serve's watch): no trace per request
                raise HTTPException(503, f"the engine is dead: {e}") from None
            log.exception("generate %s failed in the engine", rids[0])
            raise HTTPException(500, f"engine error: {e}") from None
        latency = time.perf_counter() - start
        metrics.served(served, latency)
        bodies = [_response(r, o, ids, scores, latency, req, tokenizer)
                  for ids, scores, samples in served for r, o in samples]
        # plain JSON already: a JSONResponse skips FastAPI's per-element encoder (a tenth of the front end's CPU)
        return JSONResponse(bodies if batch or len(bodies) > 1 else bodies[0])

    return router


class HungUp(Exception):
    """The caller closed its request before the answer was ready."""


async def _unless_hung_up(request: Request, work: Awaitable, every_s: float = 0.5) -> Any:
    """The work's result; cancelled, and with it its requests in the engine, if the caller hangs up first (a
    worker whose agent went away, or sglang-router passing on its client's): a generation nobody waits for would
    hold a batch slot to its last token."""
    work = asyncio.ensure_future(work)
    try:
        while not (await asyncio.wait({work}, timeout=every_s))[0]:
            if await request.is_disconnected():
                raise HungUp()
        return work.result()
    finally:
        work.cancel()


def _prompts(req: GenerateIn, tokenizer: Any) -> tuple[list[list[int]], bool]:
    """The request's prompts as token ids, and whether it sent a batch (answered with a list)."""
    if req.stream:
        raise HTTPException(400, "stream=true is not supported; send stream=false")
    if (req.input_ids is None) == (req.text is None):
        raise HTTPException(400, "give exactly one of input_ids or text")
    if req.input_ids is not None:
        batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        prompts = req.input_ids if batch else [req.input_ids]
        if not all(prompts):
            raise HTTPException(400, "input_ids is empty")
        return prompts, batch
    if tokenizer is None:
        raise HTTPException(400, "this server has no tokenizer: send input_ids")
    batch = isinstance(req.text, list)
    texts = req.text if batch else [req.text]
    if not texts:
        raise HTTPException(400, "text is an empty batch")
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts], batch


def _rids(rid: str | list[str] | None, count: int, batch: bool) -> list[str]:
    """One id per prompt; a batch given one rid numbers it as SGLang does (``rid_0``, ``rid_1``, ...)."""
    if isinstance(rid, list):
        if not batch or len(rid) != count:
            raise HTTPException(400, f"rid: a list of rids needs a batch of as many prompts ({count} here)")
        return rid
    if not batch:
        return [rid or uuid.uuid4().hex]
    return [f"{rid}_{i}" for i in range(count)] if rid else [uuid.uuid4().hex for _ in range(count)]


def _check_logprob_fields(req: GenerateIn, prompts: list[list[int]], tokenizer: Any) -> None:
    if not req.return_logprob:
        return  # SGLang ignores the logprob fields then
    shortest = min(map(len, prompts))
    if req.logprob_start_len > shortest:
        raise HTTPException(400, f"logprob_start_len {req.logprob_start_len} is past the end of a "
                                 f"{shortest}-token prompt")
    if req.top_logprobs_num and req.sampling_params.max_new_tokens:
        raise HTTPException(400, "top_logprobs_num needs max_new_tokens 0 (prompt scoring): the engines report "
                                 "the sampled token's logprob only")
    if req.return_text_in_logprobs and tokenizer is None:
        raise HTTPException(400, "return_text_in_logprobs: this server has no tokenizer")


async def _serve(engine: Engine, req: GenerateIn, rid: str, ids: list[int],
                 params: SamplingParams | None) -> tuple[list[int], PromptScores | None, list[tuple[str, Completion]]]:
    """One prompt: its ``n`` samples, and its scores when the request wants input logprobs.

    ``max_new_tokens: 0`` scores the prompt and generates nothing (SGLang's prefill-only request); its
    forward also checks the prompt, as SGLang's prefill does, when no logprob was asked for.
    """
    n = req.sampling_params.n
    rids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
    wants_input = req.return_logprob and req.logprob_start_len >= 0
    adapter = req.lora_path
    if params is None:
        scores = await engine.score_prompt(f"{rid}-prompt", ids, req.top_logprobs_num if req.return_logprob else 0,
                                           adapter)
        return ids, scores, [(r, Completion(finish_reason={"type": "length", "length": 0})) for r in rids]
    samples = asyncio.gather(*(engine.generate(r, ids, _nth(params, i), req.priority, adapter)
                               for i, r in enumerate(rids)))
    if not wants_input:
        return ids, None, list(zip(rids, await samples))
    outs, scores = await asyncio.gather(samples, engine.score_prompt(f"{rid}-prompt", ids, 0, adapter))
    return ids, scores, list(zip(rids, outs))


def _nth(params: SamplingParams, i: int) -> SamplingParams:
    """The i-th of n samples: a distinct seed when the request fixed one."""
    if params.seed is None or i == 0:
        return params
    return replace(params, seed=params.seed + i)


def _text(out: Completion, sampling: SamplingIn, tokenizer: Any) -> str:
    """SGLang's text: the matched stop token or string trimmed (unless ``no_stop_trim``), special tokens
    skipped (unless ``skip_special_tokens`` is false)."""
    if tokenizer is None:
        return ""
    ids, matched = out.output_ids, out.finish_reason.get("matched")
    trim = not sampling.no_stop_trim
    if trim and isinstance(matched, int) and ids:  # the matched stop token is the last one
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=sampling.skip_special_tokens,
                            spaces_between_special_tokens=sampling.spaces_between_special_tokens)
    if trim and isinstance(matched, str) and matched in text:
        text = text[: text.index(matched)]
    return text


def _token_texts(ids: list[int], req: GenerateIn, tokenizer: Any) -> list[str | None]:
    """Each token's own text when ``return_text_in_logprobs``, else None (SGLang's third field)."""
    if not req.return_text_in_logprobs or not ids:
        return [None] * len(ids)
    return tokenizer.batch_decode([[t] for t in ids])


def _input_logprobs(ids: list[int], scores: PromptScores, req: GenerateIn, tokenizer: Any) -> dict:
    """SGLang's input logprobs from ``logprob_start_len`` on: the first entry's logprob is null whatever
    the start (SGLang computes none for it), each later one is the token's logprob given all before it."""
    start = req.logprob_start_len
    if start < 0 or start == len(ids):
        return {"input_token_logprobs": [], **({"input_top_logprobs": []} if req.top_logprobs_num else {})}
    tail = ids[start:]
    values = [None, *scores.logprobs[start:]]
    meta = {"input_token_logprobs": [[v, t, x] for v, t, x in zip(values, tail, _token_texts(tail, req, tokenizer))]}
    if req.top_logprobs_num:
        meta["input_top_logprobs"] = [None] + [
            [[v, t, x] for (v, t), x in zip(top, _token_texts([t for _, t in top], req, tokenizer))]
            for top in scores.top[start:]]
    return meta


def _response(rid: str, out: Completion, ids: list[int], scores: PromptScores | None, latency: float,
              req: GenerateIn, tokenizer: Any) -> dict:
    version = out.versions[-1] if out.versions else (scores.version if scores else None)  # scoring: no tokens
    meta = {
        "id": rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": len(ids),
        "completion_tokens": len(out.output_ids),
        "cached_tokens": 0,
        "weight_version": version,
        "weight_versions": out.version_spans(),
        "e2e_latency": latency,
    }
    if req.return_logprob:
        meta.update(_input_logprobs(ids, scores, req, tokenizer) if scores else {"input_token_logprobs": []})
        texts = _token_texts(out.output_ids, req, tokenizer)
        meta["output_token_logprobs"] = [[lp, t, x] for lp, t, x in zip(out.logprobs, out.output_ids, texts)]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = []  # only prompt scoring (no output token) takes top_logprobs_num
    return {"text": _text(out, req.sampling_params, tokenizer), "output_ids": out.output_ids, "meta_info": meta}
