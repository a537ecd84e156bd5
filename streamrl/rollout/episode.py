"""One episode of one environment, kept token-exact.

The context is a list of token ids that only ever grows: the first prompt rendered
with the chat template, then each reply exactly as the engine generated it, then
each observation rendered *once*, as the text the template puts between the reply
and the next assistant turn. Text is never re-tokenised, so the tokens the learner
trains on are the tokens the policy saw and produced.

When the template would render the conversation so far differently from what the
context holds (it rewrites earlier turns), the next observation cannot continue the
context: the episode starts a new sequence from a fresh rendering, and the sample
records where each sequence ends (``seq_lens``).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from streamrl.envs.base import Action, Env, Message, Observation
from streamrl.generation import Completion, SamplingParams
from streamrl.protocol import Sample

Generate = Callable[[list[int], SamplingParams], Awaitable[Completion]]


class EnvFault(RuntimeError):
    """An env (or an agent) raised, timed out, or returned something that is not an observation or a reward."""


class EpisodeAborted(RuntimeError):
    """A generation of the episode was aborted (a server or worker stopping, an engine error): how the episode
    would have ended is unknown, so it has no outcome of the policy's to score. Its sample is dropped, never scored
    on the cut-off text."""


_REPLY = "\u2063streamrl-reply\u2063"  # stands in for the assistant's content while rendering


class ChatRenderer:
    """Chat template + tokenizer: the first prompt, and the tokens between a reply and the next turn."""

    def __init__(self, tokenizer: Any, stop_ids: set[int] | frozenset[int] = frozenset()):
        """``stop_ids``: the other ids an engine ends a reply with (``models.stop_token_ids``): kept out of the text
        an env scores (``answer_text``), kept in the reply's text in the conversation (the template closes a turn
        with the tokenizer's own end of sequence, ``end_ids``, after whatever the reply holds: so the next turn's
        rendering still extends the tokens generated)."""
        self.tokenizer = tokenizer
        self.end_ids = {tokenizer.eos_token_id} - {None}
        self.stop_ids = self.end_ids | set(stop_ids)
        # a group's n episodes open with the same prompt, and feedback texts repeat: render (a Jinja template,
        # the worker's costliest step per episode) and tokenise each once
        self._encoded = functools.lru_cache(maxsize=4096)(
            lambda text: tuple(tokenizer(text, add_special_tokens=False).input_ids))
        self._rendered = functools.lru_cache(maxsize=4096)(
            lambda key, prompt: self._template(*json.loads(key), generation_prompt=prompt))

    def render(self, messages: list[Message], generation_prompt: bool, tools: list[dict] | None = None) -> str:
        """The chat template's text of ``messages`` (with ``tools``, the functions an agent offers)."""
        try:
            key = json.dumps([messages, tools])
        except (TypeError, ValueError):  # an env's own objects in its messages: rendered as they are, uncached
            return self._template(messages, tools, generation_prompt=generation_prompt)
        return self._rendered(key, generation_prompt)

    def _template(self, messages: list[Message], tools: list[dict] | None, *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self._encoded(text))

    def reply_text(self, ids: list[int]) -> str:
        """The reply as message content: its text without the end-of-turn token it may end with."""
        return self._text(ids, self.end_ids)

    def answer_text(self, ids: list[int]) -> str:
        """The reply as an env scores it: its text without whichever stop id ended it."""
        return self._text(ids, self.stop_ids)

    def _text(self, ids: list[int], ends: set[int]) -> str:
        if ids and ids[-1] in ends:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def after_reply(self, history: list[Message], reply_ids: list[int], context_text: str,
                    new: list[Message], tools: list[dict] | None = None) -> tuple[str, list[int]] | None:
        """(text, tokens) that follow the reply and open the next assistant turn.

        None when the template renders ``history`` as something other than
        ``context_text`` (the text the context already holds): not a continuation.
        """
        with_reply = [*history, {"role": "assistant", "content": _REPLY}]
        closed = self.render(with_reply, False, tools)
        cut = closed.find(_REPLY)
        if cut < 0 or closed[:cut] != context_text:
            return None
        full = self.render(with_reply + new, True, tools)
        if not full.startswith(closed[: cut + len(_REPLY)]):
            return None
        tail = full[cut + len(_REPLY):]
        if reply_ids and reply_ids[-1] in self.end_ids:  # the model already wrote its end-of-turn
            end = self.tokenizer.decode(reply_ids[-1:], skip_special_tokens=False)
            tail = tail[len(end):] if tail.startswith(end) else tail
        return tail, self.encode(tail)


@dataclass
class Sequences:
    """The growing trajectory: per-token arrays plus where each sequence ends."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    start: int = 0  # where the current sequence begins
    replied: tuple[int, int, int] | None = None  # (tokens, sequences, start) as the last reply left them

    def observe(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def act(self, out: Completion) -> None:
        self.tokens += out.output_ids
        self.mask += [1] * len(out.output_ids)
        self.logprobs += out.logprobs
        self.versions += out.versions
        self.replied = (len(self.tokens), len(self.seq_lens), self.start)

    def drop_unanswered(self) -> None:
        """Cut what came after the last reply (an observation no turn answered): nothing in it is trained, and it
        can take the sequence past the context, and so past every micro-batch the learner plans."""
        if self.replied is None:
            return
        n, sequences, self.start = self.replied
        del self.tokens[n:], self.mask[n:], self.logprobs[n:], self.versions[n:], self.seq_lens[sequences:]

    def new_sequence(self) -> None:
        self.seq_lens.append(len(self.tokens) - self.start)
        self.start = len(self.tokens)

    @property
    def context(self) -> list[int]:
        return self.tokens[self.start:]

    def sample(self, **kw) -> Sample:
        lens = [*self.seq_lens, len(self.tokens) - self.start]
        return Sample(tokens=np.array(self.tokens), loss_mask=np.array(self.mask), logprobs=np.array(self.logprobs),
                      versions=np.array(self.versions), seq_lens=np.array(lens) if len(lens) > 1 else None, **kw)


async def run_episode(env: Env, item: dict[str, Any], *, generate: Generate, renderer: ChatRenderer,
                      params: SamplingParams, max_context: int) -> Sample:
    """Play one episode; the returned sample holds every token, mask, logprob and version."""
    timings = {"generate_s": 0.0, "env_s": 0.0}
    t0 = time.perf_counter()
    obs = await env.reset(item)
    timings["env_s"] += time.perf_counter() - t0

    seqs, history = Sequences(), list(obs.messages)
    context_text = _start(seqs, obs, renderer)
    turn_rewards: list[float] = []
    finish, info = "stop", {}
    for turn in range(max(1, env.max_turns)):
        budget = min(params.max_new_tokens, max_context - len(seqs.context))
        if budget < 1:
            finish = "length"
            seqs.drop_unanswered()
            break
        t0 = time.perf_counter()
        out = await generate(seqs.context, _with_budget(params, budget))
        timings["generate_s"] += time.perf_counter() - t0
        if out.finish_type == "abort":
            raise EpisodeAborted(f"turn {turn + 1}'s generation was aborted "
                                 f"({out.finish_reason.get('message') or 'no reason given'})")
        seqs.act(out)
        reply = renderer.reply_text(out.output_ids)
        finish = out.finish_type

        t0 = time.perf_counter()
        action = Action(text=renderer.answer_text(out.output_ids), token_ids=list(out.output_ids), finish_reason=finish)
        result = await env.step(action)
        timings["env_s"] += time.perf_counter() - t0
        turn_rewards.append(float(result.reward))
        info = result.info
        if result.done:
            break
        if result.observation is None:
            raise ValueError(f"{type(env).__name__}.step returned done=False without an observation")
        context_text = _continue(seqs, history, out, reply, context_text, result.observation, renderer)
    else:
        finish = "length" if finish == "stop" else finish  # turns ran out mid-conversation
        seqs.drop_unanswered()

    return seqs.sample(reward=sum(turn_rewards), finish_reason=finish, turn_rewards=turn_rewards,
                       env_info={**plain_info(info), "turns": len(turn_rewards)}, timings=timings)


def _start(seqs: Sequences, obs: Observation, renderer: ChatRenderer) -> str:
    if obs.token_ids is not None:
        seqs.observe(list(obs.token_ids))
        return renderer.tokenizer.decode(obs.token_ids, skip_special_tokens=False)
    text = renderer.render(obs.messages, True)
    seqs.observe(renderer.encode(text))
    return text


def _continue(seqs: Sequences, history: list[Message], out: Completion, reply: str, context_text: str,
              obs: Observation, renderer: ChatRenderer) -> str:
    """Append the next observation; returns the text the context now holds."""
    if obs.token_ids is not None:  # raw tokens go in as they are
        history.append({"role": "assistant", "content": reply})
        seqs.observe(list(obs.token_ids))
        return context_text + renderer.tokenizer.decode(out.output_ids + list(obs.token_ids), skip_special_tokens=False)
    cont = renderer.after_reply(history, out.output_ids, context_text, obs.messages)
    history.append({"role": "assistant", "content": reply})
    history.extend(obs.messages)
    if cont is not None:
        tail, ids = cont
        seqs.observe(ids)
        return closed_text(context_text, out, reply, renderer) + tail
    seqs.new_sequence()  # the template rewrote history: start over from a fresh rendering
    text = renderer.render(history, True)
    seqs.observe(renderer.encode(text))
    return text


def closed_text(context_text: str, out: Completion, reply: str, renderer: ChatRenderer) -> str:
    """The context's text after the reply: what it held, the reply, and its end-of-turn if generated."""
    end = ""
    if out.output_ids and out.output_ids[-1] in renderer.end_ids:
        end = renderer.tokenizer.decode(out.output_ids[-1:], skip_special_tokens=False)
    return context_text + reply + end


def _with_budget(params: SamplingParams, budget: int) -> SamplingParams:
    return params if budget >= params.max_new_tokens else replace(params, max_new_tokens=budget)


def plain_info(info: dict[str, Any]) -> dict[str, Any]:
    """env info as msgpack-able values (anything else as its repr)."""
    ok = (str, int, float, bool, type(None))
    return {str(k): v if isinstance(v, ok) else repr(v) for k, v in info.items()}
