"""A rollout server: one engine behind SGLang's native HTTP API (ARCHITECTURE §2.1).

The same client, sglang-router and learner work against this server, our vLLM
server and a stock SGLang server. Bad requests get a 400 with the reason; an
engine fault gets a 500 (sglang-router retries those on another server). Control
endpoints require ``Authorization: Bearer <token>`` when a token is configured.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from dataclasses import replace
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from streamrl import __version__
from streamrl.rollout.engines.base import Completion, Engine, SamplingParams

log = logging.getLogger("streamrl.server")


class SamplingIn(BaseModel):
    """SGLang's ``sampling_params``; fields we do not implement are ignored, as SGLang ignores unknown ones."""

    model_config = ConfigDict(extra="ignore")
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1024)
    ignore_eos: bool = False
    sampling_seed: int | None = None

    def to_params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, stop_token_ids=tuple(self.stop_token_ids or ()), stop=tuple(stop),
            ignore_eos=self.ignore_eos, seed=self.sampling_seed,
        )


class GenerateIn(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the router adds fields of its own
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingIn = Field(default_factory=SamplingIn)
    return_logprob: bool = False
    rid: str | None = None
    stream: bool = False
    priority: int = Field(0, description="larger joins the batch sooner while requests wait (SGLang's order)")


class AbortIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rid: str = ""
    abort_all: bool = False


class WeightsFromDiskIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model_path: str
    weight_version: int | None = None


class InitWeightsGroupIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)  # rank 0 is the learner
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = Field("gloo", pattern="^(gloo|nccl)$")
    timeout_s: float = Field(60.0, gt=0)


class WeightsFromDistributedIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: int | None = None


class _Metrics:
    def __init__(self, engine: Engine):
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


def create_app(engine: Engine, *, model_path: str, tokenizer: Any = None, token: str | None = None,
               engine_name: str = "hf") -> FastAPI:
    app = FastAPI(title="streamrl rollout server", version=__version__)
    metrics = _Metrics(engine)
    receiver = engine.weight_receiver()

    def authorized(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "this endpoint needs 'Authorization: Bearer <token>'")

    control = [Depends(authorized)]

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        reasons = "; ".join(f"{'.'.join(map(str, e['loc'][1:])) or 'body'}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"error": {"message": reasons, "code": 400}}, status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": {"message": exc.detail, "code": exc.status_code}}, status_code=exc.status_code)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.healthy() else 503)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict:
        return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True,
                "weight_version": engine.version}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict:
        return {"model_path": model_path, "engine": engine_name, "version": __version__,
                "weight_version": engine.version, **engine.load()}

    @app.get("/get_load")
    async def get_load() -> list[dict]:
        return [{"dp_rank": 0, **engine.load()}]

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/generate")
    async def generate(req: GenerateIn):
        input_ids = _input_ids(req, tokenizer)
        try:
            params = req.sampling_params.to_params()
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        rid = req.rid or uuid.uuid4().hex
        n = req.sampling_params.n
        rids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
        start = time.perf_counter()
        try:
            outs = await asyncio.gather(*(engine.generate(r, input_ids, _nth(params, i), req.priority)
                                         for i, r in enumerate(rids)))
        except ValueError as e:
            metrics.requests.labels("bad_request").inc()
            raise HTTPException(400, str(e)) from None
        except Exception as e:  # an engine fault: 5xx, so the router retries elsewhere
            metrics.requests.labels("error").inc()
            log.exception("generate %s failed in the engine", rid)
            raise HTTPException(500, f"engine error: {e}") from None
        latency = time.perf_counter() - start
        metrics.requests.labels("ok").inc(n)
        metrics.prompt_tokens.inc(len(input_ids) * n)
        metrics.generated_tokens.inc(sum(len(o.output_ids) for o in outs))
        metrics.latency.observe(latency)
        bodies = [_response(r, o, len(input_ids), latency, req.return_logprob, tokenizer)
                  for r, o in zip(rids, outs)]
        # plain JSON already: a JSONResponse skips FastAPI's per-element encoder (a tenth of the front end's CPU)
        return JSONResponse(bodies[0] if n == 1 else bodies)

    @app.post("/abort_request", dependencies=control)
    async def abort_request(req: AbortIn) -> dict:
        engine.abort(None if req.abort_all or not req.rid else req.rid)
        return {"success": True}

    @app.post("/pause_generation", dependencies=control)
    async def pause_generation() -> dict:
        engine.pause()
        return {"success": True}

    @app.post("/continue_generation", dependencies=control)
    async def continue_generation() -> dict:
        engine.resume()
        return {"success": True}

    @app.post("/flush_cache", dependencies=control)
    async def flush_cache() -> dict:
        return {"success": True, "message": "no prefix cache to flush"}

    @app.post("/update_weights_from_disk", dependencies=control)
    async def update_weights_from_disk(req: WeightsFromDiskIn) -> dict:
        version = req.weight_version if req.weight_version is not None else engine.version + 1
        try:
            count = await receiver.load_from_disk(req.model_path, version)
        except (KeyError, RuntimeError, ValueError) as e:
            raise HTTPException(400, f"weights do not fit this model: {e}") from None
        return {"success": True, "message": f"loaded {count} tensors", "weight_version": version}

    @app.post("/init_weights_update_group", dependencies=control)
    async def init_weights_update_group(req: InitWeightsGroupIn) -> dict:
        try:
            await receiver.init(req.master_address, req.master_port, req.rank_offset, req.world_size, req.backend,
                                req.group_name, req.timeout_s)
        except Exception as e:  # the learner never came, or the backend refused
            raise HTTPException(500, f"could not join weight update group: {e}") from None
        return {"success": True, "message": f"joined {req.group_name} as rank {req.rank_offset}"}

    @app.post("/update_weights_from_distributed", dependencies=control)
    async def update_weights_from_distributed(req: WeightsFromDistributedIn) -> dict:
        if not len(req.names) == len(req.dtypes) == len(req.shapes):
            raise HTTPException(400, "names, dtypes and shapes must have the same length")
        version = req.weight_version if req.weight_version is not None else engine.version + 1
        try:
            count = await receiver.receive(req.names, req.dtypes, req.shapes, version)
        except (KeyError, RuntimeError, ValueError) as e:
            raise HTTPException(400, f"weight update failed: {e}") from None
        return {"success": True, "message": f"updated {count} tensors", "weight_version": version}

    @app.post("/destroy_weights_update_group", dependencies=control)
    async def destroy_weights_update_group() -> dict:
        receiver.destroy()
        return {"success": True}

    return app


def _input_ids(req: GenerateIn, tokenizer: Any) -> list[int]:
    if req.stream:
        raise HTTPException(400, "stream=true is not supported; send stream=false")
    if (req.input_ids is None) == (req.text is None):
        raise HTTPException(400, "give exactly one of input_ids or text")
    if req.input_ids is not None:
        if not req.input_ids:
            raise HTTPException(400, "input_ids is empty")
        return req.input_ids
    if tokenizer is None:
        raise HTTPException(400, "this server has no tokenizer: send input_ids")
    return tokenizer(req.text, add_special_tokens=False).input_ids


def _nth(params: SamplingParams, i: int) -> SamplingParams:
    """The i-th of n samples: a distinct seed when the request fixed one."""
    if params.seed is None or i == 0:
        return params
    return replace(params, seed=params.seed + i)


def _response(rid: str, out: Completion, prompt_tokens: int, latency: float, return_logprob: bool,
              tokenizer: Any) -> dict:
    text = tokenizer.decode(out.output_ids) if tokenizer is not None else ""
    matched = out.finish_reason.get("matched")
    if isinstance(matched, str) and matched in text:  # SGLang trims a matched stop string from the text
        text = text[: text.index(matched)]
    meta = {
        "id": rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": 0,
        "weight_version": out.versions[-1] if out.versions else None,
        "weight_versions": out.version_spans(),
        "e2e_latency": latency,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out.logprobs, out.output_ids)]
    return {"text": text, "output_ids": out.output_ids, "meta_info": meta}
