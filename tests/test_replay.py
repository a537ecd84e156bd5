"""``streamrl replay``: a learner run retrained from its record bit for bit (one rank, two under every ZeRO stage,
across a learner killed and resumed, the quickstart under ``streamrl up``), a counterfactual that trains on the same
data to other weights, and a record that is cut or damaged named by its step."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import torch

from streamrl.buffer import Namespace, ReplayStream
from streamrl.buffer.redis_server import free_port
from streamrl.learner import record
from streamrl.learner.cores import machine_cores
from streamrl.testing import synthetic_group

pytestmark = pytest.mark.slow
two_ranks = pytest.mark.skipif(0 < torch.cuda.device_count() < 2,
                               reason="two learner ranks under CUDA need two GPUs; this machine has one")
STREAMRL = [sys.executable, "-m", "streamrl"]


def _put(stream: ReplayStream, rng, n: int, version: int) -> None:
    for _ in range(n):
        stream.put(synthetic_group(4, int(rng.integers(20, 60)), prompt_len=8, vocab=200, rng=rng, version=version))


def _learner(redis_url, model, run_dir, name, ranks=1, *overrides):
    launch = STREAMRL if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                          str(ranks), "-m", "streamrl"]
    return [*launch, "launch-learner", f"model.path={model}", f"redis.url={redis_url}", f"run.name={name}",
            f"run.dir={run_dir}", "learner.groups_per_step=4", "learner.micro_batch_tokens=128",
            "rollout.max_context=128", "off_policy.max_staleness=2", "learner.checkpoint_every=2", *overrides]


def _replay(*args):
    return subprocess.run([*STREAMRL, "replay", *map(str, args)], capture_output=True, text=True, timeout=600)


def _steps(run):
    return [json.loads(x) for x in (run / "metrics" / "learner.jsonl").read_text().splitlines() if '"loss"' in x]


def _recorded_run(redis_url, model, run_dir, ranks=1, *overrides):
    """Five learner steps on groups of each version in turn, with two groups too old for the bound among them."""
    ns = Namespace.open(redis_url, f"replay-{uuid.uuid4().hex[:6]}")
    stream, rng = ReplayStream(ns), np.random.default_rng(0)
    for version in range(5):
        _put(stream, rng, 4, version)
        if version == 3:
            _put(stream, rng, 2, 0)  # read at version 3: stale, dropped
    out = subprocess.run([*_learner(redis_url, model, run_dir, ns.run, ranks, *overrides), "--steps", "5"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir / ns.run


def test_a_learner_run_replays_bit_for_bit_from_its_start_and_from_a_checkpoint(redis_server, tiny_model_dir,
                                                                                tmp_path):
    run = _recorded_run(redis_server.url, tiny_model_dir, tmp_path)
    steps = list(record.read(run / "record"))
    assert sum(o == "dropped:stale" for s in steps for o in s.outcomes.values()) == 2
    out = _replay(run, "--verify", "--out", tmp_path / "all")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "identical through step 5" in out.stdout
    assert [r["loss"] for r in _steps(tmp_path / "all")] == [r["loss"] for r in _steps(run)]  # to the last bit
    assert [r["dropped_stale"] for r in _steps(tmp_path / "all")] == [r["dropped_stale"] for r in _steps(run)]
    assert (tmp_path / "all" / "export" / "latest").read_text() == "version-5"

    out = _replay(run, "--verify", "--from", 3, "--out", tmp_path / "late")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "from version 2" in out.stderr and "identical through step 5" in out.stdout  # the checkpoint at 2
    assert [r["step"] for r in _steps(tmp_path / "late")] == [3, 4, 5]


@pytest.mark.skipif(machine_cores() < 2, reason="widening the learner needs a second core")
def test_a_learner_widened_while_generation_was_held_replays_each_phase_on_the_run_s_threads(
        redis_server, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the learner's share; every core once generation is held
    run = _recorded_run(redis_server.url, tiny_model_dir, tmp_path, 1, "supervise.learner_threads=auto")
    # no worker runs, and the 22 groups put fill every slot of versions 0-2 ((2 + V + 1) * 4 slots): held from each
    # step's first phase; from version 3 slots are free (two groups were dropped)
    assert [s.wide_from for s in record.read(run / "record")] == [0, 0, 0, None, None]
    assert json.loads((run / "record" / "meta.json").read_text())["starts"][0]["cores"] == machine_cores()
    out = _replay(run, "--verify", "--out", tmp_path / "again")
    assert out.returncode == 0 and "identical through step 5" in out.stdout, out.stderr[-3000:]
    assert [r.get("wide_from") for r in _steps(tmp_path / "again")] == [0, 0, 0, None, None]


def test_a_counterfactual_trains_other_weights_on_the_same_data_and_bad_overrides_are_refused(
        redis_server, tiny_model_dir, tmp_path):
    run = _recorded_run(redis_server.url, tiny_model_dir, tmp_path)
    other = tmp_path / "tis"
    out = _replay(run, "learner.lr=1e-3", "off_policy.correction=tis", "--out", other)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "a counterfactual" in out.stdout and "part from the run's at step 1" in out.stdout
    mine, theirs = _steps(other), _steps(run)
    assert [r["group_ids"] for r in mine] == [r["group_ids"] for r in theirs]  # the very same data
    assert all(r["identical"] is False and np.isfinite(r["loss"]) for r in mine)
    assert "lr: 0.001" in (other / "config.yaml").read_text()
    assert subprocess.run([*STREAMRL, "plot", str(other)], capture_output=True).returncode == 0
    assert (other / "plots.png").is_file()
    doctor = subprocess.run([*STREAMRL, "doctor", str(other)], capture_output=True, text=True)
    assert doctor.returncode == 0 and "groups trained" in doctor.stdout, doctor.stdout
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(other / "export" / "version-5")  # a valid run's export

    out = _replay(run, "learner.groups_per_step=8", "rollout.sampling.n=2")
    assert out.returncode == 2 and "learner.groups_per_step: it decided which groups made each step" in out.stderr
    assert "rollout.sampling.n" in out.stderr
    out = _replay(run, "--verify", "learner.lr=1e-3")
    assert out.returncode == 2 and "takes no overrides" in out.stderr


def test_a_record_cut_short_or_damaged_is_named_by_its_step(redis_server, tiny_model_dir, tmp_path):
    run = _recorded_run(redis_server.url, tiny_model_dir, tmp_path)
    chunk = record.chunks(run / "record")[0]
    whole = chunk.read_bytes()
    fourth = list(record._frames(chunk))[3][0]
    damaged = bytearray(whole)
    damaged[fourth + record.HEADER.size + 7] ^= 1
    chunk.write_bytes(bytes(damaged))
    out = _replay(run, "--verify")
    assert out.returncode == 2 and "step 4 fails its checksum" in out.stderr, out.stderr[-2000:]
    chunk.write_bytes(whole[: len(whole) - 100])
    out = _replay(run, "--verify")
    assert out.returncode == 2 and "step 5 is cut off" in out.stderr and "truncated" in out.stderr


@two_ranks
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_two_ranks_replay_bit_for_bit_under_every_zero_stage(redis_server, tiny_model_dir, tmp_path, zero_stage):
    run = _recorded_run(redis_server.url, tiny_model_dir, tmp_path, 2, f"learner.zero_stage={zero_stage}")
    assert json.loads((run / "record" / "meta.json").read_text())["starts"][0]["world"] == 2
    out = _replay(run, "--verify")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "2 rank(s)" in out.stderr and "identical through step 5" in out.stdout


def test_a_learner_killed_and_resumed_replays_bit_for_bit(redis_server, tiny_model_dir, tmp_path):
    ns = Namespace.open(redis_server.url, f"replay-kill-{uuid.uuid4().hex[:6]}")
    stream, rng = ReplayStream(ns), np.random.default_rng(3)
    _put(stream, rng, 12, 0)  # three steps' worth: a checkpoint at 2, step 3 applied, then it waits for data
    argv = [*_learner(redis_server.url, tiny_model_dir, tmp_path, ns.run, 1, "off_policy.max_staleness=99"),
            "--steps", "5"]
    run = tmp_path / ns.run
    first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not (run / "metrics" / "learner.jsonl").exists() or len(_steps(run)) < 3:
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    _put(stream, rng, 8, 2)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stderr
    assert [s.version for s in record.read(run / "record")] == [0, 1, 2, 3, 4]  # step 3 recorded once, anew
    out = _replay(run, "--verify")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "identical through step 5" in out.stdout


@two_ranks
@pytest.mark.timeout(1500)  # the quickstart's warm start (a session fixture) may be made here
def test_the_quickstart_on_two_ranks_replays_bit_for_bit(tmp_path, quickstart_prepared):
    """`streamrl up` of the quickstart with two learner ranks (servers, workers, in-flight pushes: the data depend on
    timing), then the learner alone from its record: the same weights at every step. (One rank: the quickstart's
    own documented run, in tests/test_documented_commands.py.)"""
    ranks, run = 2, tmp_path / "quick"
    shutil.copytree(quickstart_prepared, run / "prepared")
    up = subprocess.run([*STREAMRL, "up", "configs/quickstart.yaml", f"run.dir={tmp_path}", "run.name=quick",
                         f"learner.nproc={ranks}", "learner.max_steps=10", "learner.checkpoint_every=4",
                         f"router.port={free_port()}", f"router.prometheus_port={free_port()}",
                         f"server.base_port={free_port()}", "supervise.display=plain"],
                        capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "200"})
    assert up.returncode == 0, up.stdout[-4000:]
    out = _replay(run, "--verify")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "identical through step 10" in out.stdout
    doctor = subprocess.run([*STREAMRL, "doctor", str(run)], capture_output=True, text=True)
    assert "record: steps 1-10" in doctor.stdout, doctor.stdout


def test_a_lora_run_replays_bit_for_bit(redis_server, tiny_model_dir, tmp_path):
    """Only the adapter trains, and its weights are what each step hashes; its random init is drawn again."""
    run = _recorded_run(redis_server.url, tiny_model_dir, tmp_path, 1, "learner.lora.rank=4", "learner.lr=1e-3")
    out = _replay(run, "--verify")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "identical through step 5" in out.stdout
