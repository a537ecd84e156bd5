"""The real-model path (`configs/smollm2.yaml`, SmolLM2-135M-Instruct) through every part, a few steps long:
it trains (the weights move and the servers get them), whatever its speed."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from streamrl.buffer.redis_server import free_port
from streamrl.rollout.evaluate import read_records


@pytest.mark.slow
def test_smollm2_trains_a_few_steps_through_every_part(tmp_path):
    run_path, model = tmp_path / "smollm2", tmp_path / "model"
    argv = [sys.executable, "-m", "streamrl", "up", "configs/smollm2.yaml", f"run.dir={tmp_path}", "run.name=smollm2",
            f"prepare.args.model_dir={model}", "prepare.args.eval_size=8", "prepare.args.train_size=64",
            f"router.port={free_port()}", f"router.prometheus_port={free_port()}", f"server.base_port={free_port()}",
            "learner.groups_per_step=2", "learner.max_steps=3", "learner.export_every=3", "eval.every=3",
            "eval.size=8", "rollout.sampling.n=4", "rollout.sampling.max_new_tokens=8", "rollout.concurrency=8",
            "learner.drop_no_signal=true", "supervise.display=plain"]  # every step trains on groups with signal
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]

    steps = [r for r in read_records(run_path / "metrics" / "learner.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["updates"] == 1 and not r["skipped"] and r["tokens_global"] > 0 and r["grad_norm"] > 0 for r in steps)
    assert all(r["push_s"] > 0 for r in steps[1:])  # every version after the first reached the server
    evals = read_records(run_path / "metrics" / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 3] and evals[-1]["eval/version_min"] == 3

    before = load_file(str(model / "model.safetensors"))
    after = load_file(str(next((run_path / "export").rglob("model.safetensors"))))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # three RL steps moved the weights
