"""The OpenAI chat-completions request as the agent gateway takes it: typed models that refuse what the gateway
cannot honour, naming the field, and the OpenAPI document built from them.

A request is parsed in three steps: JSON (malformed, too deep: 400), a walk over its values (nesting and text that
no tokenizer can encode), then the models. Every refusal is a ``RequestError`` whose message starts with the field.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_DEPTH = 64  # JSON nesting: a chat request nests about 8 deep, a tool's parameters schema a few more


class RequestError(ValueError):
    """A request the gateway refuses: 400, with the field at fault when there is one."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class MessageToolCall(_Strict):
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
    tool_calls: list[MessageToolCall] | None = None
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
        text = json.dumps(schema, sort_keys=True)
        problem = _schema_problem(text) if len(text) <= 65536 else _schema_problem.__wrapped__(text)
        if problem:
            raise ValueError(problem)
        return schema


@functools.lru_cache(maxsize=1024)
def _schema_problem(schema_json: str) -> str | None:
    """What is wrong with a tool's parameters schema, by its JSON text: an agent sends the same tools with every
    call, and checking one costs ~1.4 ms (its text, ~10 us)."""
    import jsonschema

    schema = json.loads(schema_json)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        return f"not a valid JSON schema: {e.message}"
    except Exception as e:  # jsonschema's own failures on odd input ($schema not a string): still the schema's fault
        return f"not a valid JSON schema: {type(e).__name__}: {e}"
    if schema.get("type", "object") != "object":
        return "a function's parameters are a JSON schema of type object"
    return None


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
    max_tokens: int | None = Field(None, ge=1, strict=True)  # strict: true is not 1
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    stop: Stop | Annotated[list[Stop], Field(max_length=4)] | None = None
    n: int = Field(1, ge=1, le=16, strict=True)
    seed: int | None = Field(None, ge=0, lt=2**63, strict=True)
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


def parse(raw: bytes) -> ChatRequest:
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
    ``messages.2.user.content`` or ``messages.2.content.str`` (which name the union member tried)."""
    loc, path = error["loc"], []
    for i, part in enumerate(loc):
        member = isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict"))
        if not (member or (i and isinstance(loc[i - 1], int) and part in ROLES)):
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


def _object(arguments: str) -> Any:
    """Tool-call arguments as the template expects them: the JSON object, or the text if it is not one."""
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
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
