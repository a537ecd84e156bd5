"""Token exactness of multi-turn episodes, with a real BPE tokenizer and the real hf engine."""

import asyncio
import json

import numpy as np
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.envs.base import Action, Env, Observation, StepResult
from streamrl.generation import Completion, SamplingParams
from streamrl.inference.engines.hf import HFEngine
from streamrl.models import stop_token_ids
from streamrl.protocol import Group, decode_group, encode_group
from streamrl.rollout.episode import ChatRenderer, EpisodeAborted, run_episode


class Scripted(Env):
    """Three turns; each observation is chat messages (or raw tokens when ``raw`` is set)."""

    max_turns = 3

    def __init__(self, raw: list[int] | None = None):
        self.raw, self.turn = raw, 0

    async def reset(self, item):
        return Observation(messages=[{"role": "user", "content": item["question"]}])

    async def step(self, action: Action) -> StepResult:
        self.turn += 1
        if self.turn == 3:
            return StepResult(reward=1.0, done=True, info={"last": action.text[:10]})
        obs = Observation(token_ids=self.raw) if self.raw else Observation(
            messages=[{"role": "user", "content": f"Result: {123 * self.turn}"}])
        return StepResult(reward=0.25, done=False, observation=obs)


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tokenizer=tokenizer)
    yield tokenizer, engine
    engine.shutdown()


def _play(env, tokenizer, engine, **kw):
    outs = []

    async def generate(ids, params):
        out = await engine.generate(f"r{len(outs)}", ids, params)
        outs.append((list(ids), out))
        return out

    params = kw.pop("params", SamplingParams(max_new_tokens=12, temperature=1.0, seed=1))
    sample = asyncio.run(run_episode(env, {"question": "what is 12 plus 7"}, generate=generate,
                                     renderer=ChatRenderer(tokenizer), params=params, max_context=kw.pop("max_context", 512)))
    return sample, outs


def test_tokens_are_exactly_the_generated_ones_plus_separately_rendered_observations(parts):
    tokenizer, engine = parts
    sample, outs = _play(Scripted(), tokenizer, engine)
    assert len(outs) == 3 and sample.seq_lens is None
    # every generation saw exactly the stored context: prompt, replies, observations so far
    for ids, _ in outs:
        assert sample.tokens[: len(ids)].tolist() == ids
    expected, mask = [], []
    first = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "what is 12 plus 7"}],
                                                    tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False).input_ids
    expected += first
    mask += [0] * len(first)
    for i, (_, out) in enumerate(outs):
        expected += out.output_ids
        mask += [1] * len(out.output_ids)
        if i < 2:
            end_of_turn = "" if out.output_ids[-1] == tokenizer.eos_token_id else "<|im_end|>"
            tail = tokenizer(f"{end_of_turn}\n<|im_start|>user\nResult: {123 * (i + 1)}<|im_end|>\n<|im_start|>assistant\n",
                             add_special_tokens=False).input_ids
            expected += tail
            mask += [0] * len(tail)
    assert sample.tokens.tolist() == expected
    assert sample.loss_mask.tolist() == mask
    generated = sample.loss_mask.astype(bool)
    assert np.allclose(sample.logprobs[generated], [lp for _, o in outs for lp in o.logprobs])
    assert (sample.versions[generated] == 0).all() and (sample.versions[~generated] == -1).all()
    assert sample.turn_rewards == [0.25, 0.25, 1.0] and sample.reward == 1.5
    assert sample.env_info["turns"] == 3
    # re-tokenising the text would not give these tokens: that is why nothing is re-tokenised
    text = tokenizer.decode(sample.tokens.tolist(), skip_special_tokens=False)
    assert tokenizer(text, add_special_tokens=False).input_ids != sample.tokens.tolist()


def test_tokenisation_is_not_additive_for_this_tokenizer(parts):
    tokenizer, _ = parts
    a, b = "the ans", "wer is"
    assert tokenizer(a).input_ids + tokenizer(b).input_ids != tokenizer(a + b).input_ids


def test_raw_token_observations_are_inserted_verbatim(parts):
    tokenizer, engine = parts
    raw = [5, 6, 7, 8]
    sample, outs = _play(Scripted(raw=raw), tokenizer, engine)
    after_first = len(outs[0][0]) + len(outs[0][1].output_ids)
    assert sample.tokens[after_first : after_first + 4].tolist() == raw
    assert sample.loss_mask[after_first : after_first + 4].tolist() == [0, 0, 0, 0]


def test_a_template_that_rewrites_history_starts_a_new_sequence(parts, tiny_model_dir):
    _, engine = parts
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # like reasoning templates: earlier assistant turns are rendered without their content
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}(hidden){% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    sample, outs = _play(Scripted(), tokenizer, engine)
    assert sample.seq_lens is not None and len(sample.seq_lens) >= 2
    assert int(sample.seq_lens.sum()) == sample.num_tokens
    starts = np.r_[0, np.cumsum(sample.seq_lens)[:-1]]
    for ids, _ in outs:  # each generation saw exactly its own sequence so far
        assert any(sample.tokens[s : s + len(ids)].tolist() == ids for s in starts)
    second = sample.tokens[starts[1]:].tolist()
    assert "(hidden)" in tokenizer.decode(second)
    group = Group(prompt_id="p", env="scripted", samples=[sample])
    assert decode_group(encode_group(group)).samples[0].seq_lens.tolist() == sample.seq_lens.tolist()


def test_context_budget_ends_the_episode(parts):
    tokenizer, engine = parts
    sample, outs = _play(Scripted(), tokenizer, engine, max_context=40,
                         params=SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert len(sample.tokens) <= 40 and sample.loss_mask[-1] == 1  # no observation after the last reply
    assert sample.finish_reason == "length"


def test_an_aborted_generation_drops_the_episode_and_the_env_never_scores_the_cut_off_reply(parts):
    """An abort (a server stopping, an engine error) cuts a reply off where the policy did not end it: scored, it
    would train as the policy's own failure. The episode raises instead, and its sample is dropped."""
    tokenizer, engine = parts
    env, outs = Scripted(), []

    async def generate(ids, params):
        task = asyncio.ensure_future(engine.generate(f"x{len(outs)}", ids, params))
        if len(outs) == 1:  # the second turn's generation
            await asyncio.sleep(0)  # submitted
            engine.abort(f"x{len(outs)}")
        outs.append(await task)
        return outs[-1]

    with pytest.raises(EpisodeAborted, match="turn 2's generation was aborted"):
        asyncio.run(run_episode(env, {"question": "what is 12 plus 7"}, generate=generate,
                                renderer=ChatRenderer(tokenizer), params=SamplingParams(max_new_tokens=200,
                                                                                        ignore_eos=True),
                                max_context=512))
    assert outs[1].finish_type == "abort" and env.turn == 1  # the env saw the first reply only


class Answer(Env):
    """One turn, scored by exact match against "19"."""

    async def reset(self, item):
        return Observation(messages=[{"role": "user", "content": item["question"]}])

    async def step(self, action: Action) -> StepResult:
        return StepResult(reward=float(action.text == "19"), done=True)


def test_a_reply_ended_by_any_stop_id_of_the_models_is_scored_on_its_text_alone(parts, tmp_path):
    """Engines stop on every id the generation config lists (Qwen's two, Llama 3.1's three), not only the
    tokenizer's end of sequence: a reply ended by another one is scored without it, and trained with it."""
    tokenizer, _ = parts
    other = tokenizer.eos_token_id + 1
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokenizer.eos_token_id, other]}))
    assert stop_token_ids(tmp_path) == stop_token_ids(None, tmp_path) == {tokenizer.eos_token_id, other}
    assert stop_token_ids(tmp_path / "elsewhere", None) == frozenset()  # no generation config, or no model here
    reply = [*tokenizer.encode("19", add_special_tokens=False), other]

    async def generate(ids, params):
        return Completion(output_ids=reply, logprobs=[-0.5] * len(reply), versions=[0] * len(reply),
                          finish_reason={"type": "stop"})

    def play(renderer: ChatRenderer):
        return asyncio.run(run_episode(Answer(), {"question": "what is 12 plus 7"}, generate=generate,
                                       renderer=renderer, params=SamplingParams(max_new_tokens=8), max_context=512))

    sample = play(ChatRenderer(tokenizer, stop_token_ids(tmp_path)))
    assert sample.reward == 1.0 and sample.tokens[-1] == other and sample.loss_mask[-1] == 1
    assert play(ChatRenderer(tokenizer)).reward == 0.0  # the tokenizer's end alone: "19" and the other id's text
    # in a conversation the reply keeps the stop's text: the template closes the turn after it, and each turn
    # goes on extending the tokens generated
    conversation = asyncio.run(run_episode(Scripted(), {"question": "what is 12 plus 7"}, generate=generate,
                                           renderer=ChatRenderer(tokenizer, stop_token_ids(tmp_path)),
                                           params=SamplingParams(max_new_tokens=8), max_context=512))
    assert conversation.seq_lens is None and conversation.env_info["last"] == "19"


def test_the_renderer_gives_the_templates_own_text_for_each_conversation_however_often_it_has_seen_it(parts):
    tokenizer, _ = parts
    renderer = ChatRenderer(tokenizer)
    history = [{"role": "user", "content": "what is 12 plus 7"}]
    first = renderer.render(history, True)
    history += [{"role": "assistant", "content": "19"}, {"role": "user", "content": "and 3 more?"}]
    grown = renderer.render(history, True)  # the same list, grown in place: not the cached first text
    assert grown != first
    for messages, text in (([history[0]], first), (history, grown)):
        for generation_prompt in (True, False):
            assert renderer.render(messages, generation_prompt) == tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert renderer.render([history[0]], True) == first

    class Question:  # not JSON: rendered as the template renders it, uncached
        def __str__(self):
            return "what is 2 plus 2"

    odd = [{"role": "user", "content": Question()}]
    assert renderer.render(odd, True) == tokenizer.apply_chat_template(odd, tokenize=False, add_generation_prompt=True)
