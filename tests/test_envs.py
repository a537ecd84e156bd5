import asyncio
import itertools

import pytest

from streamrl.envs import Action, Env, env_class, env_factory
from streamrl.envs.arithmetic import Arithmetic
from streamrl.envs.calculator import Calculator, calculate
from streamrl.envs.guess import GuessNumber


def _act(text: str) -> Action:
    return Action(text=text, token_ids=[])


def test_builtin_envs_are_found_by_entry_point_and_by_path():
    assert env_class("arithmetic") is Arithmetic
    assert env_class("streamrl.envs.guess:GuessNumber") is GuessNumber
    assert isinstance(env_factory("calculator", {"digits": 2})(), Calculator)


@pytest.mark.parametrize("name, message", [
    ("nope", "unknown env .nope.; installed: arithmetic, calculator, gem, guess, python_tool, retry, reward_model, single_turn"),
    ("os:path", "not a subclass of streamrl.envs.Env"),
    ("no_such_module:X", "cannot load env"),
])
def test_bad_env_names_are_explained(name, message):
    with pytest.raises(ValueError, match=message):
        env_class(name)


def test_bad_env_args_fail_at_construction():
    with pytest.raises(ValueError, match="digits >= 1"):
        env_factory("arithmetic", {"digits": 0})


def test_arithmetic_rewards_the_right_number_and_the_format():
    env = Arithmetic(digits=2)
    item = next(env.items(seed=3))
    obs = asyncio.run(env.reset(item))
    assert item["question"] in obs.messages[0]["content"]
    answer = item["answer"]
    assert asyncio.run(env.step(_act(f"{answer}"))).reward == pytest.approx(1.1)
    assert asyncio.run(env.step(_act(f"It is {answer}."))).reward == pytest.approx(1.0)
    assert asyncio.run(env.step(_act(f"{answer + 1}"))).reward == pytest.approx(0.1)
    assert asyncio.run(env.step(_act("no idea"))).reward == 0.0


def test_arithmetic_items_are_deterministic_per_seed():
    a = list(itertools.islice(Arithmetic().items(seed=1), 5))
    assert a == list(itertools.islice(Arithmetic().items(seed=1), 5)) != list(itertools.islice(Arithmetic().items(2), 5))


def test_calculator_runs_the_tool_then_scores_the_answer():
    env = Calculator()
    asyncio.run(env.reset({"question": "What is 12 * 3 + 4?", "answer": 40}))
    first = asyncio.run(env.step(_act("<calc>12*3+4</calc>")))
    assert not first.done and first.observation.messages[0]["content"] == "Result: 40"
    final = asyncio.run(env.step(_act("40")))
    assert final.done and final.reward == 1.0 and final.info["calls"] == 1


@pytest.mark.parametrize("expr, result", [("2+3*4", "14"), ("(1+2)/4", "0.75"), ("7//2", "3"), ("-3", "-3"),
                                          ("1/0", "error: division by zero"),
                                          ("__import__('os')", "error: only numbers"),
                                          ("2**10", "error: only numbers"), ("9" * 300, "error: expression too long"),
                                          ("1e13*1e13", "error: numbers too large")])
def test_calculator_parses_arithmetic_and_nothing_else(expr, result):
    assert calculate(expr).startswith(result)


def test_guess_gives_feedback_and_rewards_fewer_turns():
    env = GuessNumber(high=10, max_turns=3)
    asyncio.run(env.reset({"secret": 7}))
    low = asyncio.run(env.step(_act("5")))
    assert not low.done and low.observation.messages[0]["content"] == "Higher"
    high = asyncio.run(env.step(_act("9")))
    assert high.observation.messages[0]["content"] == "Lower"
    win = asyncio.run(env.step(_act("7")))
    assert win.done and win.reward == pytest.approx(0.8)
    asyncio.run(env.reset({"secret": 7}))
    for _ in range(2):
        asyncio.run(env.step(_act("1")))
    lost = asyncio.run(env.step(_act("2")))
    assert lost.done and lost.reward == 0.0
    asyncio.run(env.reset({"secret": 7}))
    first = asyncio.run(env.step(_act("7")))
    assert first.done and first.reward > win.reward  # fewer turns, more reward


def test_a_user_env_in_a_few_lines():
    class Echo(Env):
        async def reset(self, item):
            from streamrl.envs import Observation
            return Observation(messages=[{"role": "user", "content": item["say"]}])

        async def step(self, action):
            from streamrl.envs import StepResult
            return StepResult(reward=float(action.text == "hi"))

    env = Echo()
    asyncio.run(env.reset({"say": "hi"}))
    assert asyncio.run(env.step(_act("hi"))).reward == 1.0


def test_gem_envs_play_through_the_adapter():
    pytest.importorskip("gem", reason="gem-llm is not installed (pip install 'streamrl[gem]')")
    env = env_factory("gem", {"env_id": "game:GuessTheNumber-v0-easy"})()
    obs = asyncio.run(env.reset({"seed": 3}))
    assert "Guess The Number" in obs.messages[0]["content"]
    for guess in range(1, 11):  # the easy game has 10 numbers and enough turns to bisect; sweep instead
        result = asyncio.run(env.step(_act(f"\\boxed{{{guess}}}")))
        if result.done:
            break
        assert result.observation.messages[0]["content"]
    assert result.done


def test_gem_bad_env_id_is_explained():
    pytest.importorskip("gem", reason="gem-llm is not installed (pip install 'streamrl[gem]')")
    with pytest.raises(ValueError, match="gem.make"):
        env_factory("gem", {"env_id": "game:NoSuchGame-v0"})


def length_reward(item, response):  # a user's reward function, found by module:function
    return len(response) / 10


def test_single_turn_with_builtin_and_user_reward_functions():
    env = env_factory("single_turn", {"reward": "last_number", "system": "Be brief."})()
    obs = asyncio.run(env.reset({"prompt": "2+3?", "answer": 5}))
    assert [m["role"] for m in obs.messages] == ["system", "user"]
    assert asyncio.run(env.step(_act("it is 5"))).reward == 1.0
    env = env_factory("single_turn", {"reward": "test_envs:length_reward"})()
    asyncio.run(env.reset({"messages": [{"role": "user", "content": "hi"}]}))
    assert asyncio.run(env.step(_act("12345"))).reward == 0.5
    with pytest.raises(ValueError, match="unknown reward function 'nope'; installed: exact_match, last_number"):
        env_factory("single_turn", {"reward": "nope"})
    with pytest.raises(ValueError, match="needs 'prompt' or 'messages'"):
        asyncio.run(env.reset({"question": "?"}))


def test_retry_gives_a_wrong_reply_feedback_and_another_try_after_the_checker_s_latency():
    import asyncio
    import time

    from streamrl.envs.base import Action
    from streamrl.envs.retry import RetryWithFeedback

    async def play(replies, discount=1.0):
        env = RetryWithFeedback(env="single_turn", env_args={"reward": "exact_match"}, turns=2, latency_s=0.05,
                                jitter=0.0, discount=discount)
        first = await env.reset({"prompt": "Reverse: abc", "answer": "cba"})
        assert first.messages[-1]["content"] == "Reverse: abc"
        results = []
        for text in replies:
            results.append(await env.step(Action(text=text, token_ids=[1])))
            if results[-1].done:
                break
        return results

    t0 = time.perf_counter()
    right = asyncio.run(play(["cba"]))
    assert time.perf_counter() - t0 >= 0.05  # the checker took its time
    assert [(r.reward, r.done) for r in right] == [(1.0, True)]
    retried = asyncio.run(play(["abc", "cba"]))
    assert [(r.reward, r.done) for r in retried] == [(0.0, False), (1.0, True)]
    assert retried[0].observation.messages == [{"role": "user", "content": "That is not right. Reverse: abc"}]
    wrong = asyncio.run(play(["abc", "abc", "cba"]))
    assert [(r.reward, r.done) for r in wrong] == [(0.0, False), (0.0, True)]  # two tries, then it ends
    assert (retried[-1].info["tries"], retried[-1].info["correct"], wrong[-1].info["correct"]) == (2, True, False)
    # a discount pays a right second try less than a right first one; the first try is not discounted
    assert [r.reward for r in asyncio.run(play(["abc", "cba"], discount=0.5))] == [0.0, 0.5]
    assert [r.reward for r in asyncio.run(play(["cba"], discount=0.5))] == [1.0]
    with pytest.raises(ValueError, match="0 < discount <= 1; got .*discount=0"):
        RetryWithFeedback(discount=0)


def test_single_turn_scores_built_in_rewards_on_the_event_loop_and_any_other_in_a_thread(monkeypatch):
    import threading

    from streamrl.envs.single_turn import SingleTurn

    seen = []

    def slow_user_reward(item, text):
        seen.append(threading.current_thread() is threading.main_thread())
        return float(text == item["answer"])

    async def score(env, text):
        await env.reset({"prompt": "reverse abc", "answer": "cba"})
        return (await env.step(Action(text=text, token_ids=[]))).reward

    hops = []
    to_thread = asyncio.to_thread
    monkeypatch.setattr(asyncio, "to_thread", lambda fn, *a: hops.append(fn) or to_thread(fn, *a))
    builtin, custom = SingleTurn("exact_match"), SingleTurn("exact_match")
    custom.score = slow_user_reward
    assert asyncio.run(score(builtin, " cba ")) == 1.0 and asyncio.run(score(builtin, "abc")) == 0.0
    assert hops == []
    assert asyncio.run(score(custom, "cba")) == 1.0
    assert hops == [slow_user_reward] and seen == [False]  # not on the loop's thread
