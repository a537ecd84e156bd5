"""What the server is and serves (health, model and server info, load, Prometheus metrics), and the control of
its generation (abort, pause, continue); the control endpoints take the server's token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict

from streamrl import __version__
from streamrl.inference.engines.base import Engine
from streamrl.inference.server.generation import Metrics, Standing


class AbortIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rid: str = ""
    abort_all: bool = False


def routes(engine: Engine, metrics: Metrics, standing: Standing, *, model_path: str, engine_name: str,
           control: Sequence[Any]) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.healthy() else 503)

    @router.get("/get_model_info")
    @router.get("/model_info")
    async def model_info() -> dict:
        return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True,
                "weight_version": engine.version}

    @router.get("/get_server_info")
    @router.get("/server_info")
    async def server_info() -> dict:
        return {"model_path": model_path, "engine": engine_name, "version": __version__,
                "weight_version": engine.version, "withdrawn": standing.withdrawn,
                "weight_pauses": list(engine.pauses), **engine.load()}

    @router.get("/get_load")
    async def get_load() -> list[dict]:
        return [{"dp_rank": 0, **engine.load()}]

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.post("/abort_request", dependencies=control)
    async def abort_request(req: AbortIn) -> dict:
        engine.abort(None if req.abort_all or not req.rid else req.rid)
        return {"success": True}

    @router.post("/pause_generation", dependencies=control)
    async def pause_generation() -> dict:
        engine.pause()
        return {"success": True}

    @router.post("/continue_generation", dependencies=control)
    async def continue_generation() -> dict:
        engine.resume()
        return {"success": True}

    @router.post("/flush_cache", dependencies=control)
    async def flush_cache() -> dict:
        return {"success": True, "message": "no prefix cache to flush"}

    return router
