"""Agents as environments: the user's own agent code plays the episode through an OpenAI-compatible client,
and every call it makes is recorded token-exactly.

An agent is an async function ``run(client, item, **env_args)`` returning the episode's reward, or
``(reward, info)``; ``info["turn_rewards"]`` may score each call. ``client`` is an ``openai.AsyncOpenAI``
bound to this episode's URL on the worker's gateway (``client.base_url``, ``client.api_key`` for other
clients).

Each call's messages are rendered with the chat template (``tools`` included) and generated through the router
like any rollout. The trajectory follows ``streamrl.rollout.episode``'s rules. A reply the gateway returned is
known by its message: when the agent sends it back, it stands for the tokens generated, not for a re-rendering
of its text and tool calls. When a call's messages are the previous call's, that reply and new messages, the
new turn extends the context token for token (loss mask 0 on what the policy did not generate). Otherwise
(the agent edited its history, or the template rewrote it) a new sequence starts from a fresh rendering.
With ``n`` > 1 the trajectory follows the choice the next call continues, else the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from typing import Any

import jinja2

from streamrl.generation import Completion, SamplingParams
from streamrl.protocol import Sample
from streamrl.rollout.chat_api import ChatRequest, RequestError
from streamrl.rollout.client import GenerateError
from streamrl.rollout.episode import (
    ChatRenderer,
    EnvFault,
    EpisodeAborted,
    Generate,
    Sequences,
    closed_text,
    plain_info,
)
from streamrl.rollout.gateway import Deliver, Gateway
from streamrl.rollout.tool_calls import Parser


class Aborted(RequestError):
    """The engine aborted the generation (a worker or server stopping): the episode ends here."""

    def __init__(self):
        super().__init__("the episode was aborted: generation stopped (the rollout is shutting down)", status=503)


@dataclass
class _Call:
    """A call whose choices await the agent's next move."""

    messages: list[dict]  # as rendered
    tools: list[dict] | None
    text: str  # the context's text it generated from
    choices: list[Completion]
    raw: list[str]  # each choice's text as generated


@dataclass
class _Plan:
    """What a call does to the trajectory, decided before anything changes: applied only once its answer has
    reached the agent, so a call that fails for any reason leaves the episode as it was."""

    messages: list[dict]
    tools: list[dict] | None
    commit: int | None  # the pending call's choice that joins the trajectory
    new_sequence: bool
    ids: list[int]  # observation tokens that open the new turn
    text: str
    context: list[int]  # what the call generates from: the trajectory's context once the plan is applied


class AgentEpisode:
    """One episode's calls: the trajectory they build, and the answers the gateway returns."""

    def __init__(self, *, generate: Generate, renderer: ChatRenderer, parser: Parser, params: SamplingParams,
                 temperature: float, max_context: int, max_calls: int, opening: Generate | None = None):
        self.generate, self.renderer, self.parser = generate, renderer, parser
        self.opening = opening or generate  # for the first call: it waits for the group's siblings to join it
        self.params, self.temperature = params, temperature
        self.max_context, self.max_calls = max_context, max_calls
        self.seqs = Sequences()
        self.pending: _Call | None = None
        self.mine: dict[tuple, str] = {}  # each returned reply's message (its key) -> the text generated
        self.turns: list[Completion] = []  # the choices in the trajectory, in order
        self.calls, self.failed_calls, self.aborted, self.closed = 0, 0, False, False
        self._out: set[asyncio.Task] = set()  # the calls being answered, waiting their turn included
        self.generate_s, self.last_active = 0.0, time.monotonic()
        self._lock = asyncio.Lock()  # calls of one episode are ordered: each builds on the last

    # ------------------------------------------------------------------ the gateway's side

    async def complete(self, request: ChatRequest, deliver: Deliver) -> None:
        """Generate the call's choices, hand them to ``deliver`` (which raises if they cannot reach the agent),
        and only then record the call. Raises ``RequestError`` for a call the episode refuses."""
        if self.closed:
            raise RequestError("the episode has ended: the agent returned", status=404)
        task = asyncio.current_task()
        self._out.add(task)
        try:
            async with self._lock:
                await self._complete(request, deliver)
        except BaseException:
            self.failed_calls += 1  # counted, never recorded
            raise
        finally:
            self._out.discard(task)
            self.last_active = time.monotonic()

    async def close(self) -> None:
        """The agent has returned: a call it left running is cancelled, and counted as failed."""
        self.closed = True
        out = [t for t in self._out if t is not asyncio.current_task()]
        for task in out:
            task.cancel()
        if out:  # bounded: a call that swallows its cancellation cannot hold the episode open
            await asyncio.wait(out, timeout=5)

    async def _complete(self, request: ChatRequest, deliver: Deliver) -> None:
        if self.aborted:
            raise Aborted()
        if self.calls >= self.max_calls:
            raise RequestError(f"this episode made its {self.max_calls} calls (rollout.agent_max_calls)")
        params = self._params(request)
        try:
            plan = self._plan(request)
        except jinja2.TemplateError as e:  # the template's own checks (role order, say): the messages' fault
            raise RequestError(f"messages: the model's chat template refused them: {e}", param="messages") from None
        room = self.max_context - len(plan.context)
        if room < 1 or (request.limit or 0) > room:
            raise RequestError(f"the context holds {self.max_context} tokens (rollout.max_context) and the messages "
                               f"take {len(plan.context)}: max_tokens can be at most {max(room, 0)}",
                               param="max_tokens" if room >= 1 else "messages")
        params = replace(params, max_new_tokens=min(request.limit or params.max_new_tokens, room))
        generate = self.opening if self.pending is None and request.n == 1 else self.generate
        self.calls += 1  # failed calls count too: the limit bounds what an agent can make the engine do
        t0 = time.perf_counter()
        try:
            choices = await _all([generate(plan.context, _choice(params, i)) for i in range(request.n)])
        except GenerateError as e:
            if e.status is None or e.status >= 500:
                raise
            # the server refused what the call asks (a prompt past the model's own context, say): the call's fault
            raise RequestError(f"the model server refused the call: {e}", param="messages") from None
        finally:
            self.generate_s += time.perf_counter() - t0
        if any(c.finish_type == "abort" for c in choices):
            self.aborted = True
            raise Aborted()
        raw = [self.renderer.reply_text(c.output_ids) for c in choices]
        answers = [self._answer(c, text, request) for c, text in zip(choices, raw)]
        completion = sum(len(c.output_ids) for c in choices)
        await deliver(answers, {"prompt_tokens": len(plan.context), "completion_tokens": completion,
                                "total_tokens": len(plan.context) + completion})
        self._apply(plan)  # the agent has the answer: now, and only now, the call joins the trajectory
        self.pending = _Call(plan.messages, plan.tools, plan.text, list(choices), raw)
        self.mine.update((reply_key(a["message"]), text) for a, text in zip(answers, raw))

    def _params(self, request: ChatRequest) -> SamplingParams:
        if request.temperature is not None and request.temperature != self.temperature:
            raise RequestError(f"temperature {request.temperature} differs from the run's {self.temperature} "
                               "(rollout.sampling.temperature): the learner scores every token at that one "
                               "temperature; leave it out", param="temperature")
        return replace(self.params, top_p=request.top_p if request.top_p is not None else self.params.top_p,
                       stop=tuple(request.stop or ()), seed=request.seed)

    def _answer(self, out: Completion, text: str, request: ChatRequest) -> dict[str, Any]:
        # OpenAI leaves the stop string out, and what follows it in the token that completed it
        content = _before_stop(text, request.stop or [])
        parsed = self.parser(content) if request.tools and request.tool_choice != "none" else None
        calls = request.calls_wanted(parsed.calls) if parsed else []
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content if calls else content}
        if calls:
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        finish = "tool_calls" if "tool_calls" in message else "length" if out.finish_type == "length" else "stop"
        return {"message": message, "finish_reason": finish}

    # ------------------------------------------------------------------ the trajectory

    def _plan(self, request: ChatRequest) -> _Plan:
        messages, tools = [self._as_rendered(m.plain()) for m in request.messages], request.plain_tools()
        prev, k = self.pending, None
        if prev is not None:
            k = self._continued(prev, messages, tools)
            if k is not None:
                new = messages[len(prev.messages) + 1:]
                cont = self.renderer.after_reply(prev.messages, prev.choices[k].output_ids, prev.text, new, tools)
                if cont is not None:
                    tail, ids = cont
                    text = closed_text(prev.text, prev.choices[k], prev.raw[k], self.renderer) + tail
                    return _Plan(messages, tools, k, False, ids, text,
                                 self.seqs.context + prev.choices[k].output_ids + ids)
        text = self.renderer.render(messages, True, tools)
        commit = None if prev is None else k if k is not None else 0
        ids = self.renderer.encode(text)
        return _Plan(messages, tools, commit, prev is not None, ids, text, ids)

    def _as_rendered(self, message: dict) -> dict:
        """A reply this episode returned stands for its generated text; other messages render as they are."""
        if message["role"] == "assistant":
            raw = self.mine.get(reply_key(message))
            if raw is not None:
                return {"role": "assistant", "content": raw}
        return message

    @staticmethod
    def _continued(prev: _Call, messages: list[dict], tools: list[dict] | None) -> int | None:
        n = len(prev.messages)
        if tools != prev.tools or len(messages) <= n or messages[:n] != prev.messages:
            return None
        reply = messages[n]
        return next((k for k, raw in enumerate(prev.raw) if reply == {"role": "assistant", "content": raw}), None)

    def _apply(self, plan: _Plan) -> None:
        if plan.commit is not None:
            self._commit(plan.commit)
        if plan.new_sequence:
            self.seqs.new_sequence()
        self.seqs.observe(plan.ids)

    def _commit(self, k: int) -> None:
        choice = self.pending.choices[k]
        self.seqs.act(choice)
        self.turns.append(choice)
        self.pending = None

    def sample(self, result: Any, elapsed_s: float) -> Sample:
        """The trajectory, scored by what the agent returned."""
        if self.pending is not None:
            self._commit(0)
        if self.aborted:  # whatever the agent made of it, the episode was cut off, not played out
            raise EpisodeAborted(f"the episode was aborted after {len(self.turns)} answered call(s)" if self.turns
                                 else "the episode was aborted before any call was answered")
        if not self.turns:
            raise EnvFault("the agent returned without a successful call to the model")
        reward, info = _reward(result, len(self.turns))
        turn_rewards = info.pop("turn_rewards", None) or [0.0] * (len(self.turns) - 1) + [reward]
        return self.seqs.sample(reward=reward, finish_reason=self.turns[-1].finish_type,
                                turn_rewards=[float(r) for r in turn_rewards],
                                env_info={**plain_info(info), "turns": len(self.turns),
                                          "failed_calls": self.failed_calls},
                                timings={"generate_s": self.generate_s, "env_s": max(elapsed_s - self.generate_s, 0.0)})

    def idle_s(self) -> float:
        """How long the agent has run its own code since its last call returned (0 while a call is out)."""
        return 0.0 if self._out else time.monotonic() - self.last_active  # a call waiting its turn is not the agent's


async def _all(calls: list[Awaitable[Completion]]) -> list[Completion]:
    """Every choice, or the first failure with the rest cancelled (a failed call asks the engine for nothing more)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


def _choice(params: SamplingParams, i: int) -> SamplingParams:
    """Choice ``i`` of a call with a ``seed`` samples with ``seed + i``: a server's own rule for ``n``, kept per
    choice so that siblings' identical seeded calls are answered alike, never merged into one request."""
    return params if params.seed is None or i == 0 else replace(params, seed=(params.seed + i) % 2**63)


def _before_stop(text: str, stops: list[str]) -> str:
    """The text up to the first stop string, wherever the token that completed it ends."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(cuts)] if cuts else text


def reply_key(message: dict) -> tuple:
    """What identifies an assistant message the gateway returned, however the agent's client re-serialises it."""
    calls = tuple((c["function"]["name"], _canonical(c["function"]["arguments"])) for c in message.get("tool_calls") or ())
    return message.get("content") or "", calls


def _canonical(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return arguments
    return json.dumps(arguments, sort_keys=True)


def _reward(result: Any, turns: int) -> tuple[float, dict]:
    """``reward`` or ``(reward, info)``; ``info["turn_rewards"]``, if given, has one number per call."""
    reward, info = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EnvFault(f"the agent returned {result!r}: expected a finite reward, or (reward, info)")
    if not isinstance(info, dict):
        raise EnvFault(f"the agent's info is {type(info).__name__}, expected a dict")
    info = dict(info)
    per_turn = info.get("turn_rewards")
    if per_turn is not None and (not isinstance(per_turn, list) or len(per_turn) != turns or not all(
            isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) for r in per_turn)):
        raise EnvFault(f"info['turn_rewards'] must be {turns} finite numbers, one per recorded call; got {per_turn!r}")
    return float(reward), info


class AgentRunner:
    """Plays episodes of one agent function, each through its own URL on a shared gateway."""

    def __init__(self, fn, args: dict[str, Any], *, renderer: ChatRenderer, parser: Parser, temperature: float,
                 max_context: int, max_calls: int, timeout_s: float):
        self.fn, self.args = fn, dict(args)
        self.renderer, self.parser, self.temperature = renderer, parser, temperature
        self.max_context, self.max_calls, self.timeout_s = max_context, max_calls, timeout_s
        self.gateway = Gateway()
        self._http = self._platform = None
        self._started = asyncio.Lock()

    async def play(self, item: dict[str, Any], *, generate: Generate, params: SamplingParams,
                   opening: Generate | None = None) -> Sample:
        """One episode; ``opening`` generates its first call (one that waits for its group's siblings)."""
        import openai

        await self._start()
        episode = AgentEpisode(generate=generate, renderer=self.renderer, parser=self.parser, params=params,
                               temperature=self.temperature, max_context=self.max_context, max_calls=self.max_calls,
                               opening=opening)
        eid, url, key = self.gateway.open(episode)
        client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, http_client=self._http)
        if hasattr(client, "_platform"):  # else each new client asks a thread for what never changes
            client._platform = self._platform
        t0 = time.perf_counter()
        try:
            result = await self._supervise(self.fn(client, item, **self.args), episode)
        except Exception as e:
            if not episode.aborted:  # an agent failing (or stalling) on an aborted call has done nothing wrong
                if isinstance(e, EnvFault):
                    raise
                raise EnvFault(f"the agent raised {type(e).__name__}: {e}") from e
            result = None  # ``sample`` drops the aborted episode
        finally:
            await episode.close()
            self.gateway.forget(eid)
        return episode.sample(result, time.perf_counter() - t0)

    async def _supervise(self, coro, episode: AgentEpisode) -> Any:
        """The agent's result; EnvFault once it has run ``timeout_s`` of its own without calling the model."""
        task = asyncio.ensure_future(coro)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=max(self.timeout_s - episode.idle_s(), 0.01))
                if done:
                    return task.result()
                if episode.idle_s() >= self.timeout_s:
                    raise EnvFault(f"the agent ran {self.timeout_s:.0f}s without calling the model or returning "
                                   "(rollout.env_timeout_s)")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def _start(self) -> None:
        if self.gateway.port is not None:
            return
        async with self._started:
            if self.gateway.port is None:
                from openai._base_client import get_platform

                await self.gateway.start()
                # httpx2 logs every request at INFO: a line per model call of an agent that makes its own client
                logging.getLogger("httpx2").setLevel(logging.WARNING)
                # The client handed to each agent reaches the gateway in-process: no sockets, no server round
                # trip (over loopback HTTP a call cost 1.2 ms against 0.8 ms). Its base URL serves other clients.
                self._http = self.gateway.client()
                self._platform = await asyncio.to_thread(get_platform)

    async def close(self) -> None:
        await self.gateway.close()
        if self._http is not None:
            await self._http.aclose()
