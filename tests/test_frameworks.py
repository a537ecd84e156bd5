"""Agents as frameworks write them (examples/frameworks/: LangGraph, the OpenAI Agents SDK, pydantic-ai), unchanged
but for base_url and api_key: recorded token for token through the gateway, and trained by `streamrl up`.

The tiny test model writes no tool-call markup, so a tool parser stands in for it: in the episode tests it reads a
calculator call out of the first reply and plain text out of the rest; in the training run, out of every reply of
odd length.
"""

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.generation import SamplingParams
from streamrl.inference.engines.hf import HFEngine
from streamrl.rollout.agent import AgentRunner
from streamrl.rollout.episode import ChatRenderer
from streamrl.rollout.tool_calls import ParsedReply, ToolCall
from streamrl.testing import learner_logprob_gap

ROOT = Path(__file__).parent.parent
FRAMEWORKS = {"langgraph": "langgraph_agent", "openai-agents": "openai_agents_agent", "pydantic-ai": "pydantic_ai_agent"}
CALL = ToolCall("calculator", json.dumps({"expression": "3 * 4 + 5"}))


def example(name: str):
    path = ROOT / "examples" / "frameworks" / f"{FRAMEWORKS[name]}.py"
    spec = importlib.util.spec_from_file_location(FRAMEWORKS[name], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine = HFEngine(model, tokenizer=tokenizer)
    yield model, tokenizer, engine
    engine.shutdown()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_framework_agent_is_recorded_token_for_token(parts, framework):
    model, tokenizer, engine = parts
    replies = []

    def first_reply_calls(text: str) -> ParsedReply:
        replies.append(text)
        return ParsedReply(None, [CALL]) if len(replies) == 1 else ParsedReply(text)

    calls = []

    async def generate(ids, params):
        out = await engine.generate(uuid.uuid4().hex, ids, params)
        calls.append((list(ids), out))
        return out

    runner = AgentRunner(example(framework).solve, {}, renderer=ChatRenderer(tokenizer), parser=first_reply_calls,
                         temperature=1.0, max_context=1024, max_calls=8, timeout_s=60)

    async def main():
        try:
            return await runner.play({"question": "What is 3 * 4 + 5?", "answer": "17"}, generate=generate,
                                     params=SamplingParams(max_new_tokens=8))
        finally:
            await runner.close()

    sample = asyncio.run(main())
    assert len(calls) == 2 and sample.env_info["turns"] == 2  # the call, the tool's result, the answer
    assert sample.seq_lens is None  # the second call extended the first: the reply came back as generated
    for ids, _ in calls:
        assert sample.tokens[: len(ids)].tolist() == ids
    generated = [t for _, out in calls for t in out.output_ids]
    assert sample.tokens[sample.loss_mask.astype(bool)].tolist() == generated
    assert "17" in tokenizer.decode(calls[1][0][len(calls[0][0]):])  # the calculator's result, rendered
    assert learner_logprob_gap(model, sample) <= 1e-4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_three_framework_agents_train_with_up(tmp_path, tiny_model_dir):
    """One `streamrl up` run whose prompts cycle through the three frameworks: each one's episodes are trained."""
    from streamrl.buffer.redis_server import free_port
    from streamrl.rollout.evaluate import read_records

    rows = [{"question": f"What is {a} * 2 + 1?", "answer": str(2 * a + 1), "framework": f}
            for a in range(30) for f in FRAMEWORKS]
    dataset = tmp_path / "questions.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [sys.executable, "-m", "streamrl", "up", "configs/agent.yaml", f"run.dir={tmp_path}", "run.name=fw",
            "prepare.fn=null", "prepare.args={}", f"model.path={tiny_model_dir}", f"rollout.dataset={dataset}", "rollout.shuffle=false",
            "eval.dataset=null", f"rollout.env={Path(__file__).parent / 'user_agents.py'}:by_framework",
            f"rollout.tool_parser={Path(__file__).parent / 'user_agents.py'}:odd_replies_call_the_calculator",
            "rollout.sampling.n=4", "rollout.sampling.temperature=1.0", "rollout.sampling.max_new_tokens=12",
            f"rollout.env_args.log={tmp_path / 'episodes.jsonl'}", "rollout.concurrency=12",
            "learner.groups_per_step=3", "learner.max_steps=3",
            f"router.port={free_port()}", f"router.prometheus_port={free_port()}", f"server.base_port={free_port()}",
            "supervise.display=plain"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    steps = [s for s in read_records(tmp_path / "fw" / "metrics" / "learner.jsonl") if "groups" in s]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert sum(s["groups"] - s["groups_no_signal"] for s in steps) > 0  # some groups' rewards differed: gradients
    episodes = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert {e["framework"] for e in episodes} == set(FRAMEWORKS), episodes[:3]
    workers = read_records(tmp_path / "fw" / "metrics" / "rollout-worker-0.jsonl")
    assert sum(r.get("episodes", 0) for r in workers) >= 3 * 3 * 4  # what three steps of three groups of 4 took
