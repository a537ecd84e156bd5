"""Reading tool calls out of generated text, for the agent gateway's ``tool_calls``.

A parser takes the reply's text and returns its content (what is left for ``message.content``) and the calls
it found, each a function name and its arguments as a JSON string (OpenAI's shape). Text that does not hold a
well-formed call stays content: a model that writes a broken call sees its own text again, not an error.

Shipped: ``hermes`` (Hermes, Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of
them) and ``json`` (the whole reply is one call object, or a list of them, optionally in a ```json fence).
Others plug in by entry point (group ``streamrl.tool_parsers``) or ``module:function``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from streamrl.envs.registry import load_plugin

GROUP = "streamrl.tool_parsers"
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
JSON_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


Parser = Callable[[str], ParsedReply]


def hermes(text: str) -> ParsedReply:
    calls, spans = [], []
    for match in HERMES_CALL.finditer(text):
        call = _call(match.group(1))
        if call is not None:
            calls.append(call)
            spans.append(match.span())
    if not calls:
        return ParsedReply(text)
    kept, last = [], 0
    for start, end in spans:
        kept.append(text[last:start])
        last = end
    content = ("".join(kept) + text[last:]).strip()
    return ParsedReply(content or None, calls)


def json_calls(text: str) -> ParsedReply:
    body = text.strip()
    fenced = JSON_FENCE.match(body)
    try:
        value = json.loads(fenced.group(1) if fenced else body)
    except (ValueError, RecursionError):
        return ParsedReply(text)
    objects = value if isinstance(value, list) else [value]
    calls = [_call_from(obj) for obj in objects]
    if not objects or any(c is None for c in calls):
        return ParsedReply(text)
    return ParsedReply(None, calls)


BUILTIN: dict[str, Parser] = {"hermes": hermes, "json": json_calls}


def load_parser(name: str) -> Parser:
    """A shipped parser by name, an installed one (entry point), or ``module:function``."""
    if name in BUILTIN:
        return BUILTIN[name]
    parser = load_plugin(name, GROUP, "tool parser")
    if not callable(parser):
        raise ValueError(f"tool parser {name!r} is {parser!r}, not a function of the reply's text")
    return parser


def _call(text: str) -> ToolCall | None:
    try:
        return _call_from(json.loads(text))
    except (ValueError, RecursionError):  # a policy can write JSON nested past Python's recursion limit
        return None


def _call_from(obj: Any) -> ToolCall | None:
    """``{"name": str, "arguments": {...}}`` (``parameters`` also read) as a call; anything else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # already JSON text: kept as written if it is an object
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except (ValueError, RecursionError):
            return None
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
