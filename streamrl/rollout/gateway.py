"""The agent gateway: OpenAI-compatible ``/v1/chat/completions`` and ``/v1/models`` for agent episodes.

One gateway per rollout worker, on loopback; each episode gets its own base URL
(``http://127.0.0.1:PORT/e/<episode>/v1``) and key, so a call lands in the episode that made it. The gateway
parses requests (``streamrl.rollout.chat_api``) and shapes answers and errors as OpenAI's API does; what a call
means for the trajectory is the episode's business (``streamrl.rollout.agent``).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx2
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


@dataclass
class Answer:
    """An HTTP answer, whichever door it leaves by."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


Send = Callable[[Answer], Awaitable[None]]  # hands the answer to the caller; raises HungUp if it is gone


class HungUp(Exception):
    """The caller went away before its answer was delivered."""


class Gateway:
    """Routes each call to its episode, by two doors: an aiohttp server on loopback (any client, any process), and
    ``client()``, an in-process HTTP client for the openai client the worker hands each agent: the same answers
    without sockets or a server round trip (a model call's largest cost when generation is cheap)."""

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
        # a caller that hangs up cancels its call: the episode records nothing of it, and its generation is aborted
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

    def client(self) -> httpx2.AsyncClient:
        return Direct(InProcess(self))

    # ------------------------------------------------------------------ what both doors answer

    def models(self, eid: str, authorization: str) -> Answer:
        try:
            self._episode(eid, authorization)
        except RequestError as e:
            return _error(e)
        return _json(200, {"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "streamrl"}]})

    async def chat(self, eid: str, authorization: str, raw: bytes | RequestError, send: Send) -> None:
        """Answer one chat call through ``send``; the call joins its episode only if ``send`` succeeds."""
        async def deliver(choices: list[dict[str, Any]], usage: dict[str, int]) -> None:
            completion = {"id": f"chatcmpl-{secrets.token_hex(8)}", "created": int(time.time()), "model": body.model}
            await send(_events(completion, choices, usage, body) if body.stream else
                       _json(200, {**completion, "object": "chat.completion", "usage": usage, "choices": [
                           {"index": i, **c, "logprobs": None} for i, c in enumerate(choices)]}))

        try:
            episode = self._episode(eid, authorization)
            if isinstance(raw, RequestError):
                raise raw
            body = parse(raw)
            await episode.complete(body, deliver)
        except RequestError as e:
            await send(_error(e))
        except HungUp:  # the caller went away while its answer was being written: nothing was recorded
            log.debug("an agent hung up before its answer was delivered")
        except Exception as e:  # the episode's fault, not the caller's: a 500 the agent sees, never a crash
            log.exception("agent call failed")
            await send(_error(RequestError(f"generation failed: {type(e).__name__}: {e}", status=500)))

    def _episode(self, eid: str, authorization: str) -> Episode:
        found = self._episodes.get(eid)
        if found is None:
            raise RequestError("no such episode: it ended, or this URL was never handed out", status=404)
        key, episode = found
        if not secrets.compare_digest(authorization, f"Bearer {key}"):
            raise RequestError("missing or wrong API key (Authorization: Bearer <the episode's key>)", status=401)
        return episode

    # ------------------------------------------------------------------ the aiohttp door

    async def _models(self, request: web.Request) -> web.Response:
        answer = self.models(request.match_info["episode"], request.headers.get("Authorization", ""))
        return web.Response(status=answer.status, body=answer.body, content_type=answer.content_type)

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi())

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        sent: list[web.StreamResponse] = []

        async def send(answer: Answer) -> None:
            out = web.Response(status=answer.status, body=answer.body, headers=answer.headers,
                               content_type=answer.content_type)
            try:
                await out.prepare(request)
                await out.write_eof()
            except ConnectionError as e:
                raise HungUp() from e
            sent.append(out)

        try:
            raw: bytes | RequestError = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raw = RequestError(f"the body is larger than {MAX_BODY // 2**20} MiB", status=413)
        await self.chat(request.match_info["episode"], request.headers.get("Authorization", ""), raw, send)
        return sent[0] if sent else web.Response(status=499)


class InProcess(httpx2.AsyncBaseTransport):
    """The gateway as an httpx2 transport (the openai client's): each request answered by ``Gateway.chat`` or
    ``Gateway.models`` in the caller's own task. The client's read timeout is honoured: past it the call is
    cancelled, as a client hanging up is."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        parts = request.url.path.strip("/").split("/")  # the HTTP door's routes: e/<episode>/v1/...
        eid, route = (parts[1], (request.method, *parts[2:])) if parts[0] == "e" and len(parts) > 2 else ("", ())
        authorization = request.headers.get("Authorization", "")
        if route == ("GET", "v1", "models"):
            return _response(self.gateway.models(eid, authorization))
        if route != ("POST", "v1", "chat", "completions"):
            return _response(_error(RequestError(f"no route {request.method} {request.url.path}", status=404)))
        raw = await request.aread()
        if len(raw) > MAX_BODY:
            raw = RequestError(f"the body is larger than {MAX_BODY // 2**20} MiB", status=413)
        answers: list[Answer] = []

        async def send(answer: Answer) -> None:
            answers.append(answer)

        timeout = (request.extensions.get("timeout") or {}).get("read")
        try:
            await asyncio.wait_for(self.gateway.chat(eid, authorization, raw, send), timeout)
        except asyncio.TimeoutError:
            raise httpx2.ReadTimeout("the call took longer than the client's timeout", request=request) from None
        return _response(answers[0])  # in-process, send never fails: every call gets an answer


class Direct(httpx2.AsyncClient):
    """An httpx2 client whose every request goes straight to one transport: an in-process answer has no cookies,
    auth or redirects to handle, and skipping them is a tenth of what an openai client call costs."""

    def __init__(self, transport: httpx2.AsyncBaseTransport):
        super().__init__()
        self._direct = transport

    async def send(self, request: httpx2.Request, *, stream: bool = False, **_: Any) -> httpx2.Response:
        start = time.perf_counter()
        response = await self._direct.handle_async_request(request)  # its body is read already
        response.request, response.elapsed = request, datetime.timedelta(seconds=time.perf_counter() - start)
        return response

    async def aclose(self) -> None:
        await super().aclose()
        await self._direct.aclose()


def _response(answer: Answer) -> httpx2.Response:
    return httpx2.Response(answer.status, content=answer.body,
                           headers={"content-type": answer.content_type, **answer.headers})


def _json(status: int, value: Any, headers: dict[str, str] | None = None) -> Answer:
    return Answer(status, json.dumps(value).encode(), headers=headers or {})


def _events(completion: dict, choices: list[dict], usage: dict, body: ChatRequest) -> Answer:
    """The whole answer as server-sent events: each choice's role and content, its tool calls, its finish."""
    head = {**completion, "object": "chat.completion.chunk"}
    chunks = []
    for i, choice in enumerate(choices):
        message = choice["message"]
        chunks.append([{"index": i, "delta": {"role": "assistant", "content": message["content"]},
                        "finish_reason": None}])
        if message.get("tool_calls"):
            calls = [{"index": j, **call} for j, call in enumerate(message["tool_calls"])]
            chunks.append([{"index": i, "delta": {"tool_calls": calls}, "finish_reason": None}])
        chunks.append([{"index": i, "delta": {}, "finish_reason": choice["finish_reason"]}])
    events = [{**head, "choices": c} for c in chunks]
    if body.stream_options and body.stream_options.include_usage:
        events.append({**head, "choices": [], "usage": usage})
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return Answer(200, text.encode(), "text/event-stream", {"Cache-Control": "no-cache"})


def _error(e: RequestError) -> Answer:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error"}.get(e.status, "api_error")
    # the openai SDK retries 5xx unless told not to: a 503 (the episode is over) would only be refused again
    headers = {"x-should-retry": "false"} if e.status == 503 else None
    return _json(e.status, {"error": {"message": str(e), "type": kind, "param": e.param, "code": None}}, headers)
