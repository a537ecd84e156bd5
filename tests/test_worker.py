"""Rollout workers against real parts: redis-server, sglang-router, two hf servers."""

import json
import signal
import time
from pathlib import Path

import pytest

from streamrl.buffer import Admission, StreamReader

pytestmark = pytest.mark.slow


def _groups(cluster) -> list:
    reader, entries = StreamReader(cluster.ns), []
    while chunk := reader.read(100):
        entries += chunk
    return [e.group for e in entries]


def _until(predicate, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.2)


def _worker(cluster, *args, name="w0"):
    return cluster.start("launch-rollout", *cluster.common, f"rollout.router_url={cluster.router_url}",
                         "rollout.sampling.max_new_tokens=8", "rollout.sampling.n=3", "rollout.concurrency=8",
                         "rollout.metrics_every_s=1", *args, "--name", name)


@pytest.fixture
def fleet(cluster):
    cluster.servers(2)
    cluster.router()
    return cluster


@pytest.mark.parametrize("env, args", [
    ("arithmetic", []), ("calculator", []), ("guess", []),
    ("gem", ["rollout.env_args={env_id: 'game:GuessTheNumber-v0-easy', max_turns: 3}"]),
])
def test_groups_of_the_builtin_envs_land_with_masks_logprobs_and_versions(fleet, env, args):
    if env == "gem":
        pytest.importorskip("gem", reason="gem-llm is not installed (pip install 'streamrl[gem]')")
    proc = _worker(fleet, f"rollout.env={env}", *args, "learner.groups_per_step=50", "--groups", "4")
    assert proc.wait(120) == 0
    groups = _groups(fleet)
    assert len(groups) == 4
    assert sorted(int(g.prompt_id) for g in groups) == [0, 1, 2, 3]
    for g in groups:
        assert g.env == env and len(g.samples) == 3
        for s in g.samples:
            generated = s.loss_mask.astype(bool)
            assert generated.any() and not generated[0]  # the prompt is not the policy's
            assert (s.versions[generated] == 0).all() and (s.logprobs[generated] < 0).all()
            assert s.env_info["turns"] >= 1 and len(s.turn_rewards) == s.env_info["turns"]
    records = [json.loads(x) for x in (fleet.run_path / "metrics" / "rollout-w0.jsonl").read_text().splitlines()]
    opening, last = records[0], records[-1]  # the opening report marks when generation began (benchmarks' clock)
    assert opening.get("episodes", 0) == 0 and opening["ledger"]["accepted"] == 0
    assert last["ledger"]["accepted"] == 4


def test_a_killed_worker_restarts_without_losing_or_repeating_a_prompt(fleet):
    # Admission bounds the run: (max_staleness 0 + version 0 + 1) * 12 groups, then the worker waits. The
    # restarted worker takes back the slots of the groups that died with it at once: leases of 600 s never lapse.
    # Episodes take 2 s, so groups land in waves of 4 and the kill lands mid-run (unpaced, the first worker could
    # land all 12 before it, and the restarted one be stopped before it has set up its signal handlers)
    args = ["off_policy.max_staleness=0", "learner.groups_per_step=12", "rollout.env=streamrl.testing:Slow"]
    proc = _worker(fleet, *args)
    _until(lambda: len(_groups(fleet)) >= 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    restarted = _worker(fleet, *args)
    _until(lambda: len(_groups(fleet)) == 12, timeout_s=120)
    time.sleep(1.0)
    restarted.send_signal(signal.SIGTERM)
    assert restarted.wait(60) == 0
    groups = _groups(fleet)
    assert len({g.group_id.split("/")[1] for g in groups}) == 2  # both lives landed groups
    prompts = [int(g.prompt_id) for g in groups]
    assert len(groups) == 12 and len(set(g.group_id for g in groups)) == 12
    assert len(set(prompts)) == 12  # no prompt twice ...
    assert sorted(prompts) == list(range(12))  # ... and none skipped
    counters = Admission(fleet.ns, max_staleness=0, groups_per_step=12).counters()
    assert counters["expired"] == 0 and counters["accepted"] == 12
    assert counters["admitted"] == 12 + counters.get("abandoned:worker_restarted", 0)


def test_a_group_slower_than_its_lease_keeps_its_slot_and_its_prompt(fleet):
    # Episodes take 2 s and leases last 0.9 s: only renewal keeps the bound at 4 groups.
    proc = _worker(fleet, "rollout.env=streamrl.testing:Slow", "off_policy.max_staleness=0",
                   "learner.groups_per_step=4", "rollout.group_lease_s=0.9", "rollout.prompt_lease_s=0.9")
    admission = Admission(fleet.ns, max_staleness=0, groups_per_step=4)
    _until(lambda: admission.counters()["accepted"] >= 4)
    time.sleep(3)  # a second wave would have started and landed by now
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert admission.counters()["expired"] == 0
    assert sorted(int(g.prompt_id) for g in _groups(fleet)) == [0, 1, 2, 3]


def test_admission_holds_the_bound_while_the_version_stands_still(fleet):
    proc = _worker(fleet, "off_policy.max_staleness=1", "learner.groups_per_step=3")
    admission = Admission(fleet.ns, max_staleness=1, groups_per_step=3)
    bound = (1 + 0 + 1) * 3
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        c = admission.counters()
        seen.append(c["accepted"] + admission.running())
        if c["accepted"] == bound:
            break
        time.sleep(0.1)
    time.sleep(2)  # the worker keeps asking, and keeps being told to wait
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert max(seen) <= bound
    assert admission.counters()["accepted"] == bound == len(_groups(fleet))


def test_a_raising_env_is_counted_not_fatal(fleet):
    proc = _worker(fleet, "rollout.env=streamrl.testing:Flaky", "learner.groups_per_step=50", "--groups", "6")
    assert proc.wait(120) == 0
    groups = _groups(fleet)
    assert groups, "no group made it despite most episodes succeeding"
    failed = sum(g.meta["failed"] for g in groups)
    assert failed > 0 and all(len(g.samples) >= 2 for g in groups)


def test_agent_episodes_land_token_exact_and_a_raising_agent_is_counted_not_fatal(fleet, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from streamrl.testing import learner_logprob_gap

    agents = Path(__file__).parent / "user_agents.py"
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"question": f"what is {i} plus {i}"}) + "\n" for i in range(20)))
    proc = _worker(fleet, f"rollout.env={agents}:tool_user", "rollout.env_args={fail_rate: 0.15}",
                   f"rollout.tool_parser={agents}:every_reply_calls_echo", f"rollout.dataset={questions}",
                   "rollout.max_context=1024", "learner.groups_per_step=50", "--groups", "16")
    assert proc.wait(120) == 0
    groups = _groups(fleet)
    # Some episodes raised and the worker went on. A group lands with one of its 3 episodes failed with
    # probability 0.44, so none of 16 does 1 time in 10^4 (of 6, 1 in 30: CI met it once).
    assert groups and sum(g.meta["failed"] for g in groups) > 0
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for s in (s for g in groups for s in g.samples):
        assert s.seq_lens is None and s.turn_rewards == [1.0, 1.0, 1.0] and s.env_info["turns"] == 3
        generated = s.loss_mask.astype(bool)
        assert (s.versions[generated] == 0).all() and (s.versions[~generated] == -1).all()
        assert learner_logprob_gap(model, s) <= 1e-4  # re-scored by a teacher-forced forward


def test_rlhf_groups_are_scored_by_a_reward_model_server(fleet, reward_dir, tmp_path):
    from streamrl.buffer.redis_server import free_port
    from streamrl.rollout.client import wait_healthy

    port = free_port()
    server = fleet.start("serve-reward", f"reward.model_path={reward_dir}", f"reward.port={port}")
    wait_healthy(f"http://127.0.0.1:{port}", server)
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"tell me about {w}"}) for w in ("foxes", "dogs", "tools")))
    proc = _worker(fleet, "rollout.env=reward_model", f"rollout.dataset={data}",
                   f"rollout.env_args={{url: 'http://127.0.0.1:{port}'}}", "learner.groups_per_step=50", "--groups", "3")
    assert proc.wait(120) == 0
    groups = _groups(fleet)
    assert sorted(int(g.prompt_id) for g in groups) == [0, 1, 2]
    rewards = [s.reward for g in groups for s in g.samples]
    assert all(s.env_info["rm_score"] == s.reward for g in groups for s in g.samples)
    assert len(set(rewards)) > 1  # real scores of different replies, not a constant


def test_a_worker_outlasts_a_redis_outage_longer_than_its_clients_retries(fleet, tmp_path):
    """Redis dies while the worker waits at the staleness bound, and comes back (from its AOF) after the client's
    own retries (cut here to ~0.5 s) are spent: the worker waits it out, takes the slots the next version frees,
    loses nothing."""
    from streamrl.buffer import EmbeddedRedis, Namespace, PolicyVersion
    from streamrl.buffer.redis_server import free_port

    own = EmbeddedRedis(tmp_path / "redis", port=free_port(), appendfsync="always")  # nothing acked is lost
    own.start()
    log = tmp_path / "worker.log"
    proc = fleet.start("launch-rollout", *fleet.common, f"redis.url={own.url}", f"rollout.router_url={fleet.router_url}",
                       "rollout.sampling.max_new_tokens=8", "rollout.sampling.n=3", "off_policy.max_staleness=0",
                       "learner.groups_per_step=2", "redis.retries=3", "redis.retry_cap_s=0.2", "--name", "w0",
                       "--groups", "4", log=log.open("w"))
    try:
        fleet.ns = Namespace.open(own.url, fleet.run)
        _until(lambda: len(_groups(fleet)) == 2)  # the bound at version 0: the worker now asks for a slot, twice a second
        time.sleep(1)
        own.proc.kill()
        own.proc.wait()
        time.sleep(5)  # past the retries of both calls the waiting worker makes (the version watch's, then admit's)
        assert proc.poll() is None, log.read_text()
        own.start()
        PolicyVersion(fleet.ns).set(1)  # two more slots
        assert proc.wait(120) == 0, log.read_text()
        assert sorted(int(g.prompt_id) for g in _groups(fleet)) == [0, 1, 2, 3]
        assert "retrying in" in log.read_text()
    finally:
        proc.kill()
        own.proc.kill()
