"""The agent gateway: OpenAI-compatible ``/v1/chat/completions`` and ``/v1/models`` for agent episodes.

One gateway per rollout worker, on loopback; each episode gets its own base URL
(``http://127.0.0.1:PORT/e/<episode>/v1``) and key, so a call lands in the episode that made it. The gateway
validates requests and shapes answers and errors as OpenAI's API does; what a call means for the trajectory
is the episode's business (``streamrl.rollout.agent``).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal, Protocol

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

log = logging.getLogger("streamrl.gateway")
MODEL = "policy"  # the one model an episode's URL serves: the policy being trained
MAX_BODY = 16 * 2**20  # bytes: a request past this gets a 413
MAX_DEPTH = 64  # JSON nesting: a chat request nests about 8 deep, a tool's parameters schema a few more


class RequestError(ValueError):
    """A request the gateway refuses: 400, with the field at fault when there is one."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


# ---------------------------------------------------------------------------------------------- requests

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


Content = str | list[TextPart]


class _Message(_Strict):
    """A message of one role; ``Message`` is any of them, told apart by ``role``."""

    name: str | None = None

    @field_validator("content", mode="before", check_fields=False)
    @classmethod
    def _text_parts(cls, content: Any) -> Any:
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"part {i} is {kind!r}: only text parts are accepted (the policy reads text)")
        return content

    def plain(self) -> dict[str, Any]:
        """As the chat template takes it: text content (null as empty: templates concatenate it), tool-call
        arguments as objects, ``developer`` as ``system``."""
        content = self.content
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": "".join(p.text for p in content) if isinstance(content, list) else content or ""}
        if self.name:
            out["name"] = self.name
        return out


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str

    def plain(self) -> dict[str, Any]:
        return {**super().plain(), "tool_call_id": self.tool_call_id}


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    # what the openai client sends back when an agent appends a reply object as it came: empty here
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: list[Any] | None = Field(None, max_length=0)

    @model_validator(mode="after")
    def _says_something(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def plain(self) -> dict[str, Any]:
        out = super().plain()
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _object(c.function.arguments)}}
                                 for c in self.tool_calls]
        return out


ROLES = ("system", "developer", "user", "assistant", "tool")
Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _json_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is None:
            return schema
        import jsonschema

        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            raise ValueError(f"not a valid JSON schema: {e.message}") from None
        if schema.get("type", "object") != "object":
            raise ValueError("a function's parameters are a JSON schema of type object")
        return schema


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Strict):
    include_usage: bool = False


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


Stop = Annotated[str, Field(min_length=1)]


class ChatRequest(_Strict):
    """The chat-completions fields the gateway honours; any other field is refused by name."""

    model: str
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    # which calls are read from the reply: generation itself is never constrained (its tokens are the policy's)
    tool_choice: Literal["auto", "required", "none"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: Stop | Annotated[list[Stop], Field(max_length=4)] | None = None
    n: int = Field(1, ge=1, le=16)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> list[str]:
        return [stop] if isinstance(stop, str) else list(stop or [])

    def calls_wanted(self, calls: list) -> list:
        """The tool calls the request asks to be returned, of those read from a reply."""
        if not self.tools or self.tool_choice == "none":
            return []
        if isinstance(self.tool_choice, NamedToolChoice):
            calls = [c for c in calls if c.name == self.tool_choice.function.name]
        return calls[:1] if self.parallel_tool_calls is False else calls

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def plain_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


# ---------------------------------------------------------------------------------------------- the server

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
            body = _parse(await _read(request))
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


def _parse(raw: bytes) -> ChatRequest:
    try:
        data = json.loads(raw)
    except RecursionError:
        raise RequestError(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise RequestError("the body must be a JSON object")
    _check_values(data)
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = _where(first)
        message = ("unsupported field" if first["type"] == "extra_forbidden" else first["msg"])
        raise RequestError(f"{where}: {message}", param=where) from None


def _where(error: dict) -> str:
    """A validation error's field as the request names it: ``messages.2.content``, not pydantic's
    ``messages.2.user.content`` (which names the union member by its role)."""
    loc, path = error["loc"], []
    for i, part in enumerate(loc):
        if not (i and isinstance(loc[i - 1], int) and part in ROLES):
            path.append(str(part))
    if error["type"] in ("union_tag_invalid", "union_tag_not_found"):
        path.append("role")
    return ".".join(path)


def _check_values(data: Any) -> None:
    """Refuse what would fail past validation: nesting too deep to walk, text that is not Unicode (a lone
    surrogate, which JSON's escapes allow and no tokenizer encodes)."""
    todo = [(data, 1, "")]
    while todo:
        value, depth, where = todo.pop()
        if depth > MAX_DEPTH:
            raise RequestError(f"{where.lstrip('.')}: nests deeper than {MAX_DEPTH} levels", param=where.lstrip("."))
        if isinstance(value, dict):
            todo += [(v, depth + 1, f"{where}.{k}") for k, v in value.items()]
            keys = "".join(value)
            texts = [keys] if not keys.isascii() else []
        elif isinstance(value, list):
            todo += [(v, depth + 1, f"{where}.{i}") for i, v in enumerate(value)]
            texts = []
        else:
            texts = [value] if isinstance(value, str) and not value.isascii() else []
        for text in texts:
            try:
                text.encode()
            except UnicodeEncodeError:
                raise RequestError(f"{where.lstrip('.')}: not valid Unicode (a lone surrogate)",
                                   param=where.lstrip(".")) from None


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


def _object(arguments: str) -> Any:
    """Tool-call arguments as the template expects them: the JSON object, or the text if it is not one."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def openapi() -> dict[str, Any]:
    """The gateway's OpenAPI document, from the request models themselves (what fuzzers and clients read)."""
    schema = ChatRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    components = {**schema.pop("$defs", {}), "ChatRequest": schema}
    error = {"description": "an OpenAI-shaped error naming the field at fault",
             "content": {"application/json": {"schema": {"type": "object", "required": ["error"]}}}}
    episode = {"name": "episode", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "streamrl agent gateway", "version": "1"},
        "components": {"schemas": components,
                       "securitySchemes": {"episode_key": {"type": "http", "scheme": "bearer"}}},
        "security": [{"episode_key": []}],
        "paths": {
            "/e/{episode}/v1/chat/completions": {"post": {
                "operationId": "chat", "parameters": [episode],
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ChatRequest"}}}},
                "responses": {"200": {"description": "the completion (or its server-sent events)"},
                              **{code: error for code in ("400", "401", "404", "413")}}}},
            "/e/{episode}/v1/models": {"get": {
                "operationId": "models", "parameters": [episode],
                "responses": {"200": {"description": "the one model: the policy"}, "401": error, "404": error}}},
        },
    }
