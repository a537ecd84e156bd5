import asyncio
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from streamrl.buffer.redis_server import free_port
from streamrl.envs import Action
from streamrl.envs.reward_model import RewardModelEnv
from streamrl.inference.reward_server import Pair, RewardModel, create_reward_app
from streamrl.rollout.client import wait_healthy

PAIRS = [Pair(prompt="what is 12 plus 7", response="19"), Pair(prompt="the quick brown fox", response="jumps over"),
         Pair(prompt=[{"role": "user", "content": "guess"}], response="a much longer answer than the others")]


def test_batched_scores_equal_one_at_a_time(reward_dir):
    model = RewardModel.from_pretrained(reward_dir)
    together = model.score(PAIRS)
    alone = [model.score([p])[0] for p in PAIRS]
    assert together == pytest.approx(alone, abs=1e-5)
    assert len(set(round(s, 6) for s in together)) == 3


def test_score_endpoint_validates_and_scores(reward_dir):
    model = RewardModel.from_pretrained(reward_dir)
    with TestClient(create_reward_app(model, max_wait_ms=1)) as client:
        body = {"pairs": [p.model_dump() for p in PAIRS]}
        scores = client.post("/score", json=body).json()["scores"]
        assert scores == pytest.approx(model.score(PAIRS), abs=1e-5)
        assert client.post("/score", json={"pairs": []}).status_code == 422
        assert client.post("/score", json={"pairs": [{"prompt": "x"}]}).status_code == 422


@pytest.mark.slow
def test_the_reward_model_env_scores_through_a_real_server(reward_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "streamrl", "serve-reward", f"reward.model_path={reward_dir}",
                             f"reward.port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        expected = RewardModel.from_pretrained(reward_dir).score(PAIRS[:2])

        async def play(pair):
            env = RewardModelEnv(url=url)
            await env.reset({"prompt": pair.prompt})
            return (await env.step(Action(text=pair.response, token_ids=[]))).reward

        async def both():  # concurrent, so the server batches them
            return await asyncio.gather(*(play(p) for p in PAIRS[:2]))

        assert asyncio.run(both()) == pytest.approx(expected, abs=1e-5)
    finally:
        proc.terminate()
        proc.wait(15)
