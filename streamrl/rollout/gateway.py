"""The agent gateway: OpenAI-compatible ``/v1/chat/completions`` and ``/v1/models`` for agent episodes.

One gateway per rollout worker, on loopback; each episode gets its own base URL
(``http://127.0.0.1:PORT/e/<episode>/v1``) and key, so a call lands in the episode that made it. The gateway
parses requests (``streamrl.rollout.chat_api``) and shapes answers and errors as OpenAI's API does; what a call
means for the trajectory is the episode's business (``streamrl.rollout.agent``).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from streamrl.rollout.chat_api import ChatRequest, RequestError, openapi, parse

log = logging.getLogger("streamrl.gateway")
MODEL = "policy"  # the one model an episode's URL serves: the policy being trained
MAX_BODY = 16 * 2**20  # bytes: a request past this gets a 413


Deliver = Callable[[list[dict[str, Any]], dict[str, int]], Awaitable[None]]


class Episode(Protocol):
    async def complete(self, request: ChatRequest, deliver: Deliver) -> None:
        """Answer the request: ``deliver`` its choices, each ``{"message": ..., "finish_reason": ...}``, and its
        token usage, then record the call (``deliver`` raises when the answer cannot reach the caller, and the
        call is then not recorded); raises ``RequestError``."""


class Gateway:
    """An aiohttp server on loopback that routes each call to its episode."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.port: int | None = None
        self._episodes: dict[str, tuple[str, Episode]] = {}
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/e/{episode}/v1/chat/completions", self._chat)
        app.router.add_get("/e/{episode}/v1/models", self._models)
        app.router.add_get("/openapi.json", self._openapi)
        # a caller that hangs up cancels its call: the engine stops, and the episode records nothing of it
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        log.info("agent gateway on http://%s:%d", self.host, self.port)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, episode: Episode) -> tuple[str, str, str]:
        """(id, base URL, key) of a new episode's endpoint."""
        eid, key = secrets.token_hex(12), secrets.token_urlsafe(24)
        self._episodes[eid] = (key, episode)
        return eid, f"http://{self.host}:{self.port}/e/{eid}/v1", key

    def forget(self, eid: str) -> None:
        self._episodes.pop(eid, None)

    def _episode(self, request: web.Request) -> Episode:
        found = self._episodes.get(request.match_info["episode"])
        if found is None:
            raise RequestError("no such episode: it ended, or this URL was never handed out", status=404)
        key, episode = found
        if not secrets.compare_digest(request.headers.get("Authorization", ""), f"Bearer {key}"):
            raise RequestError("missing or wrong API key (Authorization: Bearer <the episode's key>)", status=401)
        return episode

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._episode(request)
        except RequestError as e:
            return _error(e)
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "streamrl"}]})

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi())

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        sent: list[web.StreamResponse] = []

        async def deliver(choices: list[dict[str, Any]], usage: dict[str, int]) -> None:
            completion = {"id": f"chatcmpl-{secrets.token_hex(8)}", "created": int(time.time()), "model": body.model}
            sent.append(await (_stream if body.stream else _whole)(request, completion, choices, usage, body))

        try:
            episode = self._episode(request)
            body = parse(await _read(request))
            await episode.complete(body, deliver)
        except RequestError as e:
            return _error(e)
        except ConnectionError:  # the caller hung up while its answer was being written: nothing was recorded
            log.debug("an agent hung up before its answer was delivered")
        except Exception as e:  # the episode's fault, not the caller's: a 500 the agent sees, never a crash
            log.exception("agent call failed")
            return _error(RequestError(f"generation failed: {type(e).__name__}: {e}", status=500))
        return sent[0] if sent else web.Response(status=499)


async def _read(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(f"the body is larger than {MAX_BODY // 2**20} MiB", status=413) from None


async def _whole(request: web.Request, completion: dict, choices: list[dict], usage: dict,
                 body: ChatRequest) -> web.StreamResponse:
    out = web.json_response({**completion, "object": "chat.completion", "usage": usage,
                             "choices": [{"index": i, **c, "logprobs": None} for i, c in enumerate(choices)]})
    await out.prepare(request)
    await out.write_eof()
    return out


async def _stream(request: web.Request, completion: dict, choices: list[dict], usage: dict,
                  body: ChatRequest) -> web.StreamResponse:
    """The whole answer as server-sent events: each choice's role and content, its tool calls, its finish."""
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
    head = {**completion, "object": "chat.completion.chunk"}

    async def send(choices_delta: list[dict], **extra) -> None:
        await out.write(f"data: {json.dumps({**head, 'choices': choices_delta, **extra})}\n\n".encode())

    for i, choice in enumerate(choices):
        message = choice["message"]
        await send([{"index": i, "delta": {"role": "assistant", "content": message["content"]}, "finish_reason": None}])
        if message.get("tool_calls"):
            calls = [{"index": j, **call} for j, call in enumerate(message["tool_calls"])]
            await send([{"index": i, "delta": {"tool_calls": calls}, "finish_reason": None}])
        await send([{"index": i, "delta": {}, "finish_reason": choice["finish_reason"]}])
    if body.stream_options and body.stream_options.include_usage:
        await send([], usage=usage)
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


def _error(e: RequestError) -> web.Response:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error"}.get(e.status, "api_error")
    # the openai SDK retries 5xx unless told not to: a 503 (the episode is over) would only be refused again
    headers = {"x-should-retry": "false"} if e.status == 503 else None
    return web.json_response({"error": {"message": str(e), "type": kind, "param": e.param, "code": None}},
                             status=e.status, headers=headers)
