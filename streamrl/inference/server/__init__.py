"""A rollout server: one engine behind SGLang's native HTTP API (ARCHITECTURE §2.1).

The same client, sglang-router and learner work against this server, our vLLM
server and a stock SGLang server. Bad requests get a 400 with the reason; an
engine fault gets a 500 (sglang-router retries those on another server). Control
endpoints require ``Authorization: Bearer <token>`` when a token is configured.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from streamrl import __version__
from streamrl.inference.engines.base import Engine
from streamrl.inference.server import control, generation, weights


def create_app(engine: Engine, *, model_path: str, tokenizer: Any = None, token: str | None = None,
               engine_name: str = "hf", withdrawn: str | None = None) -> FastAPI:
    """``withdrawn``: why the server starts withdrawn from generation (weights that failed their probe)."""
    app = FastAPI(title="streamrl rollout server", version=__version__)
    standing = app.state.standing = generation.Standing(withdrawn)  # set by the weight routes, honoured here
    metrics = generation.Metrics(engine, standing)

    def authorized(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "this endpoint needs 'Authorization: Bearer <token>'")

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        reasons = "; ".join(f"{'.'.join(map(str, e['loc'][1:])) or 'body'}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"error": {"message": reasons, "code": 400}}, status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": {"message": exc.detail, "code": exc.status_code}}, status_code=exc.status_code)

    control_only = [Depends(authorized)]
    app.include_router(generation.routes(engine, tokenizer, metrics, standing))
    app.include_router(control.routes(engine, metrics, standing, model_path=model_path, engine_name=engine_name,
                                      control=control_only))
    app.include_router(weights.routes(engine, engine.weight_receiver(), standing, control_only))
    return app
