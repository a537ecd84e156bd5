"""A call that fails leaves the trajectory as it was: random sequences of calls (succeeding, failing, retried,
rewritten, concurrent, with several choices) through the real openai client, gateway and hf engine.

Each call's ``seed`` names it (``100 * call``; its choice ``i`` samples with ``seed + i``), so the engine's hook
knows which call it serves and which to fail. After the episode, the recorded sample must be exactly what the
calls that succeeded make: their chosen replies as the generated tokens, in the order they were served, and each
sequence the chat template's rendering of its last call followed by that call's reply.
"""

import asyncio
import uuid
from dataclasses import dataclass, field

import openai
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.generation import SamplingParams
from streamrl.inference.engines.hf import HFEngine
from streamrl.rollout.agent import AgentRunner
from streamrl.rollout.episode import ChatRenderer, EnvFault
from streamrl.rollout.tool_calls import hermes

PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)
FAILURES = ("engine", "refused", "hangup")  # the engine raises; the gateway refuses the call; the agent hangs up


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), tokenizer=tokenizer)
    yield tokenizer, engine
    engine.shutdown()


@dataclass
class Served:
    """What the engine's hook saw: each generation's call, choice, context and output, in order of starting."""

    fail: dict[int, str] = field(default_factory=dict)  # call -> how its first attempt fails
    log: list[tuple[int, int, list[int], list[int] | None]] = field(default_factory=list)

    def hook(self, engine):
        async def generate(ids, params):
            call, choice = divmod(params.seed, 100)
            entry = [call, choice, list(ids), None]
            self.log.append(entry)
            failure = self.fail.pop(call, None) if choice == 0 else None
            if failure == "engine":
                raise RuntimeError("the engine refused a parameter")
            if failure == "hangup":
                await asyncio.sleep(30)  # the agent's client gives up first
            out = await engine.generate(uuid.uuid4().hex, ids, params)  # unique: a cancelled request is aborted by its id
            entry[3] = list(out.output_ids)
            return out

        return generate

    def outputs(self, call: int) -> list[list[int]]:
        """The choices ``call`` generated, in choice order (a retry is a call of its own)."""
        return [out for _, _, _, out in sorted((e for e in self.log if e[0] == call), key=lambda e: e[1])]


@dataclass
class Delivered:
    call: int
    sent: list[dict]  # the messages as the agent sent them
    contents: list[str]  # each choice's content, as returned


STEP = st.one_of(
    st.tuples(st.just("continue"), st.sampled_from([None, *FAILURES]), st.booleans(), st.integers(1, 2)),
    st.tuples(st.just("rewrite"), st.sampled_from([None, *FAILURES]), st.booleans(), st.integers(1, 2)),
    st.tuples(st.just("concurrent"), st.none(), st.just(False), st.just(1)),
)


def script_agent(steps, served: Served, delivered: list[Delivered], failed: list[str], door: str):
    async def agent(client, item):
        if door == "http":  # a client of the agent's own, as frameworks make: the gateway's HTTP server
            client = openai.AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
        conversation: list[dict] = [{"role": "user", "content": "hello"}]
        call = 0

        async def ask(messages, *, n=1, fail=None) -> Delivered | None:
            nonlocal call
            call += 1
            me = call
            extra = {"temperature": 0.25} if fail == "refused" else {}  # not the run's temperature: a 400
            if fail in ("engine", "hangup"):
                served.fail[me] = fail
            timeout = 0.5 if fail == "hangup" else 60
            try:
                reply = await client.with_options(timeout=timeout).chat.completions.create(
                    model="policy", messages=messages, n=n, seed=100 * me, **extra)
            except (openai.APIStatusError, openai.APITimeoutError) as e:
                assert fail is not None, e
                failed.append(fail)
                return None
            assert fail is None
            done = Delivered(me, list(messages), [c.message.content for c in reply.choices])
            delivered.append(done)
            return done

        for kind, fail, retry, n in steps:
            user = {"role": "user", "content": f"turn {call + 1}"}
            if kind == "concurrent":  # two continuations of one conversation at once: served one after the other
                first, _ = await asyncio.gather(ask([*conversation, user]), ask([*conversation, dict(user)]))
                conversation = [*first.sent, {"role": "assistant", "content": first.contents[0]}]
                continue
            messages = [*conversation, user] if kind == "continue" else [user]
            done = await ask(messages, n=n, fail=fail)
            if done is None and retry:
                done = await ask(messages, n=n)  # the same messages again: as if the failure never happened
            if done is not None:
                conversation = [*done.sent, {"role": "assistant", "content": done.contents[-1]}]
        return 1.0

    return agent


def chosen(calls: list[Delivered], i: int) -> int:
    """The choice of call ``i`` that joins the trajectory: the one the next call continues, else the first."""
    if i + 1 == len(calls):
        return 0
    this, nxt = calls[i], calls[i + 1]
    n = len(this.sent)
    if len(nxt.sent) <= n or nxt.sent[:n] != this.sent:
        return 0
    return next((k for k, c in enumerate(this.contents) if nxt.sent[n] == {"role": "assistant", "content": c}), 0)


def continues(calls: list[Delivered], i: int) -> bool:
    this, prev = calls[i], calls[i - 1]
    n, k = len(prev.sent), chosen(calls, i - 1)
    return (len(this.sent) > n and this.sent[:n] == prev.sent
            and this.sent[n] == {"role": "assistant", "content": prev.contents[k]})


@pytest.mark.parametrize("door", ["in-process", "http"])  # the client the agent is given; one it makes itself
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(STEP, min_size=1, max_size=5))
def test_the_trajectory_is_what_the_calls_that_succeeded_make(parts, door, steps):
    tokenizer, engine = parts
    note(f"steps: {steps}")
    served, delivered, failed = Served(), [], []
    runner = AgentRunner(script_agent(steps, served, delivered, failed, door), {}, renderer=ChatRenderer(tokenizer), parser=hermes,
                         temperature=1.0, max_context=1024, max_calls=64, timeout_s=60)

    async def main():
        try:
            return await runner.play({}, generate=served.hook(engine), params=PARAMS)
        finally:
            await runner.close()

    try:
        sample = asyncio.run(main())
    except EnvFault as e:  # nothing to train on: only when no call succeeded
        assert not delivered and "without a successful call" in str(e)
        return
    # the calls that succeeded, in the order the episode served them (its calls are served one at a time)
    order = {call: i for i, (call, _, _, out) in enumerate(served.log) if out is not None}
    calls = sorted(delivered, key=lambda d: order[d.call])
    picks = [served.outputs(d.call)[chosen(calls, i)] for i, d in enumerate(calls)]
    assert sample.env_info["turns"] == len(calls)
    assert sample.env_info["failed_calls"] == len(failed)  # counted, though none is recorded
    mask = sample.loss_mask.astype(bool)
    assert sample.tokens[mask].tolist() == [t for p in picks for t in p]  # no failed call's tokens, none twice

    starts = [0] + [i for i in range(1, len(calls)) if not continues(calls, i)]
    lens = sample.seq_lens.tolist() if sample.seq_lens is not None else [len(sample.tokens)]
    assert len(lens) == len(starts)
    ends, offset = [*starts[1:], len(calls)], 0
    for length, end in zip(lens, ends):
        last = calls[end - 1]
        rendered = tokenizer.apply_chat_template(last.sent, tokenize=False, add_generation_prompt=True)
        sequence = sample.tokens[offset: offset + length].tolist()
        assert tokenizer.decode(sequence) == rendered + tokenizer.decode(picks[end - 1])
        offset += length


def test_a_call_left_running_when_the_agent_returns_is_cancelled_and_not_recorded(parts):
    tokenizer, engine = parts
    served = Served(fail={2: "hangup"})  # the second call's generation takes longer than the episode

    async def agent(client, item):
        own = openai.AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
        first = [{"role": "user", "content": "one"}]
        await own.chat.completions.create(model="policy", messages=first, seed=100)
        asyncio.ensure_future(own.chat.completions.create(model="policy", messages=first, seed=200))
        await asyncio.sleep(0.3)  # the second call is being generated
        return 1.0

    runner = AgentRunner(agent, {}, renderer=ChatRenderer(tokenizer), parser=hermes, temperature=1.0,
                         max_context=1024, max_calls=8, timeout_s=60)

    async def main():
        try:
            return await runner.play({}, generate=served.hook(engine), params=PARAMS)
        finally:
            await runner.close()

    sample = asyncio.run(main())
    assert [(call, out is not None) for call, _, _, out in served.log] == [(1, True), (2, False)]
    assert sample.env_info["turns"] == 1 and sample.env_info["failed_calls"] == 1
    assert sample.tokens[sample.loss_mask.astype(bool)].tolist() == served.outputs(1)[0]
