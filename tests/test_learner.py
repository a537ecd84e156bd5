"""The learner process: sequences from the stream's groups, rank shards without pickle, two-rank training from
the replay stream and resuming from a checkpoint, and the data-parallel split's gradient against one rank."""

import json
import subprocess
import sys
import uuid

import msgpack
import numpy as np
import pytest
import torch

from streamrl.buffer import Namespace, PolicyVersion, ReplayStream
from streamrl.buffer.redis_server import free_port
from streamrl.learner import batching, packing
from streamrl.learner.reference import Reference
from streamrl.protocol import Group, Sample
from streamrl.testing import synthetic_group

# two learner ranks: gloo on a CPU, a GPU each under CUDA (NCCL puts one rank on a device)
two_ranks = pytest.mark.skipif(0 < torch.cuda.device_count() < 2,
                               reason="two learner ranks under CUDA need two GPUs; this machine has one")


def _sample(reward, versions=(0, 0), seq_lens=None):
    return Sample(tokens=[1, 2, 3, 4], loss_mask=[0, 1, 0, 1], logprobs=[0, -1, 0, -1],
                  versions=[-1, versions[0], -1, versions[1]], reward=reward, seq_lens=seq_lens)


def test_sequences_carry_their_samples_rloo_advantage_and_staleness():
    group = Group("p", "e", [_sample(1.0, seq_lens=[2, 2]), _sample(0.0, versions=(3, 4))])
    seqs = batching.sequences([group], version=5, algorithm="rloo")
    assert [len(s) for s in seqs] == [2, 2, 4]  # the split trajectory became two sequences
    assert [float(s.advantages[0]) for s in seqs] == [1.0, 1.0, -1.0]
    assert [s.staleness for s in seqs] == [5, 5, 2]
    assert batching.stale(group, version=5, max_staleness=2) and not batching.stale(group, 5, max_staleness=5)


def test_rank_shards_round_trip_without_pickle():
    seqs = batching.sequences([synthetic_group(3, 10, prompt_len=4)], version=1, algorithm="grpo")
    payload = batching.encode_shard([[seqs[0], seqs[1]], [seqs[2]]], global_tokens=18, global_sequences=3)
    shard, n, n_seqs = batching.decode_shard(payload)
    assert (n, n_seqs) == (18, 3) and [len(mb) for mb in shard] == [2, 1]
    for got, sent in zip([s for mb in shard for s in mb], seqs):  # every field of every sequence
        assert vars(got).keys() == vars(sent).keys()
        assert all(np.array_equal(getattr(got, k), getattr(sent, k)) for k in vars(sent))
    assert isinstance(msgpack.unpackb(payload, raw=False), dict | list)  # plain msgpack, no pickle
    batch = packing.collate(shard[0])
    assert batch["input_ids"].shape == (1, 20) and batch["mask"].sum() == 12


@two_ranks
@pytest.mark.slow
@pytest.mark.parametrize("zero_stage, launcher, minibatches", [(0, "torchrun", 1), (3, "deepspeed", 2)])
def test_two_rank_learner_trains_from_the_replay_stream(redis_server, tiny_model_dir, tmp_path, zero_stage, launcher,
                                                        minibatches):
    ns = Namespace.open(redis_server.url, f"learner-e2e-{zero_stage}-{uuid.uuid4().hex[:6]}")
    stream, rng = ReplayStream(ns), np.random.default_rng(0)
    ids = []
    for i in range(15):
        vocab = 10_000 if i in (3, 9) else 200  # two groups the model cannot embed
        length = 140 if i == 6 else int(rng.integers(20, 60))  # and one no micro-batch of 128 tokens holds
        ids.append(stream.put(synthetic_group(4, length, prompt_len=8, vocab=vocab, rng=rng, prompt_id=str(i))))
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "streamrl"]
              if launcher == "torchrun" else
              [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
               "--module", "streamrl"])
    out = subprocess.run(
        [*launch, "launch-learner",
         f"model.path={tiny_model_dir}", f"redis.url={redis_server.url}", f"run.name={ns.run}",
         f"run.dir={tmp_path}", "learner.groups_per_step=4", "learner.micro_batch_tokens=128",
         "rollout.max_context=128", f"learner.zero_stage={zero_stage}", f"learner.minibatches={minibatches}", "off_policy.max_staleness=8",
         "--steps", "3"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / ns.run / "metrics" / "learner.jsonl").open()]
    records = [r for r in records if "loss" in r]  # step lines (a last push may add a line of its own)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["groups"] == 4 and r["tokens"] > 0 and np.isfinite(r["loss"]) for r in records)
    assert all(r["updates"] == minibatches for r in records)  # one version per step, however many updates
    assert records[-1]["cursor"] == ids[-1]  # 12 good groups + 3 dead-lettered = all 15 entries
    assert PolicyVersion(ns).get() == 3
    dead = ns.conn.xrange(ns.key("dead"))
    assert [f[b"src"].decode() for _, f in dead] == [ids[3], ids[6], ids[9]]
    assert b"vocab size" in dead[0][1][b"reason"]
    assert b"a sequence of 140 tokens exceeds learner.micro_batch_tokens = 128" in dead[1][1][b"reason"]
    export = tmp_path / ns.run / "export"  # under ZeRO-3 the shards are gathered first
    assert (export / "latest").read_text() == "version-3"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(export / "version-3")  # a plain HF directory
    AutoTokenizer.from_pretrained(export / "version-3")
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert any(not torch.equal(a, b) for a, b in zip(exported.parameters(), original.parameters()))
    assert exported.config.use_cache and original.config.use_cache  # served as given: generation keeps its cache


@pytest.mark.slow
def test_dynamic_sampling_leaves_out_groups_without_signal_and_accounts_for_each(redis_server, tiny_model_dir,
                                                                                 tmp_path):
    from streamrl.buffer import Admission, Ledger

    ns = Namespace.open(redis_server.url, f"learner-no-signal-{uuid.uuid4().hex[:6]}")
    stream, rng = ReplayStream(ns), np.random.default_rng(2)
    silent = {1, 2, 5}  # every sample of these groups got the same reward
    for i in range(8):
        group = synthetic_group(4, 24, prompt_len=8, vocab=200, rng=rng, prompt_id=str(i))
        for j, sample in enumerate(group.samples):
            sample.reward = 1.0 if i in silent else float(j % 2)
        stream.put(group)
    assert not Admission(ns, max_staleness=0, groups_per_step=1).try_admit("refused-before-the-learner-waits")
    out = subprocess.run(
        [sys.executable, "-m", "streamrl", "launch-learner", f"model.path={tiny_model_dir}",
         f"redis.url={redis_server.url}", f"run.name={ns.run}", f"run.dir={tmp_path}", "learner.groups_per_step=2",
         "learner.drop_no_signal=true", "learner.micro_batch_tokens=256", "rollout.max_context=256",
         "--steps", "2"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / ns.run / "metrics" / "learner.jsonl").open()]
    records = [r for r in records if "loss" in r]
    assert [r["groups"] for r in records] == [2, 2]  # two groups with signal per step, whatever was read
    # step 1 trains groups 0 and 3, leaving out 1 and 2; step 2 trains 4 and 6, leaving out 5; 7 is pending
    assert [r["dropped_no_signal"] for r in records] == [2, 1]
    assert [r["groups_no_signal"] for r in records] == [2, 1]
    assert [r["admission_refused"] for r in records] == [0, 0]  # only refusals while it waited count
    assert Admission(ns, max_staleness=2, groups_per_step=2).counters()["dropped_no_signal"] == 3
    report = Ledger(ns).report()
    assert report.balanced, report.problems
    assert report.learner["dropped:no_signal"] == 3 and report.learner["trained"] == 4 and report.pending == 1


@pytest.mark.slow
def test_sequences_without_signal_are_skipped_and_the_update_is_the_same(redis_server, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(4)
    groups = [synthetic_group(4, 24, prompt_len=8, vocab=200, rng=rng, prompt_id=str(i)) for i in range(4)]
    for i, group in enumerate(groups):
        for j, sample in enumerate(group.samples):  # groups 1, 2 and 3 without signal: step 2 has none at all
            sample.reward = 0.1 if i else float(j % 2)

    def learn(skip: bool) -> tuple[list[dict], dict]:
        ns = Namespace.open(redis_server.url, f"learner-skip-{skip}-{uuid.uuid4().hex[:6]}")
        for group in groups:
            ReplayStream(ns).put(group)
        out = subprocess.run(
            [sys.executable, "-m", "streamrl", "launch-learner", f"model.path={tiny_model_dir}",
             f"redis.url={redis_server.url}", f"run.name={ns.run}", f"run.dir={tmp_path}", "learner.groups_per_step=2",
             f"learner.skip_zero_advantage={str(skip).lower()}", "learner.optimizer=sgd", "learner.lr=0.5",
             "learner.micro_batch_tokens=64", "rollout.max_context=64", "--steps", "2"],
            capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        records = [json.loads(line) for line in (tmp_path / ns.run / "metrics" / "learner.jsonl").open()]
        weights = AutoModelForCausalLM.from_pretrained(tmp_path / ns.run / "export" / "version-2").state_dict()
        return [r for r in records if "loss" in r], weights

    (skipping, skipped), (training, trained) = learn(True), learn(False)
    assert [r["zero_advantage_skipped"] for r in skipping] == [4, 8]
    assert [r["zero_advantage_skipped"] for r in training] == [0, 0]
    assert [r["tokens"] for r in skipping] == [r["tokens"] / 2 for r in training[:1]] + [0]
    assert [r["tokens_global"] for r in skipping] == [r["tokens_global"] for r in training]
    assert [r["loss"] for r in skipping] == pytest.approx([r["loss"] for r in training], abs=1e-7)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert max((trained[k] - initial[k]).abs().max().item() for k in trained) > 1e-3
    for k in trained:  # the same update: the skipped sequences still count in the loss's mean
        assert torch.allclose(skipped[k], trained[k], atol=1e-6), k


@two_ranks
@pytest.mark.slow
def test_a_killed_learner_resumes_from_its_checkpoint_applying_every_group_exactly_once(
        redis_server, tiny_model_dir, tmp_path):
    import os
    import signal
    import time

    ns = Namespace.open(redis_server.url, f"learner-kill-{uuid.uuid4().hex[:6]}")  # this session's Redis: a fresh name
    stream, rng = ReplayStream(ns), np.random.default_rng(1)

    def put(n):
        for _ in range(n):
            stream.put(synthetic_group(4, int(rng.integers(20, 60)), prompt_len=8, vocab=200, rng=rng))

    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "streamrl", "launch-learner",
            f"model.path={tiny_model_dir}", f"redis.url={redis_server.url}", f"run.name={ns.run}",
            f"run.dir={tmp_path}", "learner.groups_per_step=4", "learner.micro_batch_tokens=128",
            "rollout.max_context=128", "off_policy.max_staleness=99", "learner.checkpoint_every=2", "--steps", "5"]
    metrics = tmp_path / ns.run / "metrics" / "learner.jsonl"

    def records():
        lines = [json.loads(line) for line in metrics.open()] if metrics.exists() else []
        return [r for r in lines if "loss" in r]  # step lines only

    put(12)  # three steps' worth: the learner checkpoints at version 2, trains step 3, then waits for data
    first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while len(records()) < 3:
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    import psutil

    ranks = psutil.Process(first.pid).children(recursive=True)  # torchrun starts ranks in their own groups
    os.killpg(first.pid, signal.SIGKILL)  # the launcher and every rank, step 3 applied but not checkpointed
    for rank in ranks:
        rank.kill()
    psutil.wait_procs(ranks, timeout=30)
    first.wait()
    killed_run = records()
    put(8)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    resumed_run = records()[len(killed_run):]
    assert [r["step"] for r in killed_run] == [1, 2, 3] and [r["step"] for r in resumed_run] == [3, 4, 5]
    applied = [g for r in killed_run[:2] + resumed_run for g in r["group_ids"]]  # what the final weights hold
    assert len(applied) == len(set(applied)) == 20
    assert resumed_run[0]["group_ids"] == killed_run[2]["group_ids"]  # step 3 replayed from the checkpoint
    assert resumed_run[0]["loss"] == pytest.approx(killed_run[2]["loss"], rel=1e-5)  # with the same weights
    assert PolicyVersion(ns).get() == 5


def test_kl_in_the_reward_is_the_behaviour_minus_reference_logprob_sum(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokens = [5, 9, 14, 20, 33]
    with torch.no_grad():
        ref = torch.log_softmax(reference(input_ids=torch.tensor([tokens])).logits[0, :-1], -1)
    ref_lp = ref[torch.arange(4), torch.tensor(tokens[1:])].numpy()
    mask = [0, 0, 1, 1, 1]

    def sample(shift, reward):
        lp = np.zeros(5, np.float32)
        lp[2:] = ref_lp[1:] + shift  # behaviour logprobs of the generated tokens
        return Sample(tokens=tokens, loss_mask=mask, logprobs=lp, versions=[-1, -1, 0, 0, 0], reward=reward)

    group = Group("p", "e", [sample(0.0, 1.0), sample(-0.1, 1.0)])
    ref_model = Reference.load(tiny_model_dir, "cpu", torch.float32, temperature=1.0)
    [penalties] = ref_model.kl_penalties([group], coef=0.5, estimator="k1", token_budget=16)  # one packed row
    assert penalties == pytest.approx([0.0, 0.5 * 3 * -0.1], abs=1e-5)  # coef * sum over 3 generated tokens
    seqs = batching.sequences([group], version=0, algorithm="rloo", penalties=[penalties])
    assert [float(s.advantages[0]) for s in seqs] == pytest.approx([-0.15, 0.15], abs=1e-5)


@two_ranks
@pytest.mark.slow
@pytest.mark.parametrize("agg, zero, kl, lora, ess", [("token", 0, 0, 0, 0), ("sequence", 2, 0, 0, 1),
                                                       ("token", 3, 0.5, 0, 0), ("token", 3, 0.5, 1, 0)])  # ZeRO-3 with KL runs its path without too
def test_the_deepspeed_step_on_an_uneven_two_rank_split_equals_one_rank_on_the_whole_batch(tiny_model_dir, tmp_path,
                                                                                          agg, zero, kl, lora, ess):
    # Rank 1 gets five short sequences that share a prompt worth forwarding once, then one more; rank 0 one
    # long one, then nothing; one rank alone the seven (not worth sharing beside the long reply): shared
    # against plain forwards. Under ZeRO-3 the ranks must still run as many forwards (rank 1 sharing alone,
    # or rank 0 skipping its empty micro-batch, would break the weight gathers). First a step whose loss is
    # not finite on one rank only: skipped on every rank, weights untouched (under ZeRO-3 its stand-in zero
    # must run back through the forward that gathered the weights); under ZeRO-2, whose gradients sit in its
    # partitions, a finite loss with a NaN gradient on one rank is skipped too. At ZeRO-3, PPO's critic also takes a step
    # on the shard with the empty micro-batch (without a stand-in forward it hangs), and so do a step with
    # the separate proximal forwards of a model with dropout and two epochs over two minibatches of it. With
    # ess the learning rate follows the importance weights' ESS over both ranks' tokens, not each rank's own, and
    # the step's figures (loss, clip fraction, ESS, mismatch: what the auto bound judges) are both ranks' too.
    script = str(__import__("pathlib").Path(__file__).parent / "ddp_equivalence.py")
    for ranks in (1, 2):
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                              "--master_port", str(free_port()), script, tiny_model_dir, str(tmp_path / f"{ranks}.pt"),
                              agg, str(zero), str(kl), str(lora), str(ess)],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
    (one, one_stats), (two, two_stats) = (torch.load(tmp_path / f"{n}.pt").values() for n in (1, 2))
    assert one_stats.keys() == two_stats.keys() and {"loss", "clip_frac", "mismatch_abs"} <= one_stats.keys()
    assert two_stats == pytest.approx(one_stats, rel=1e-5, abs=1e-7)  # the figures of both ranks' tokens
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    if lora:  # the base stays as it was; the adapter moved (its B starts at zero)
        base = {k: v for k, v in one.items() if ".lora_" not in k}
        assert all(torch.equal(v, initial[k.replace("base_model.model.", "").replace(".base_layer", "")])
                   for k, v in base.items())
        initial = {k: torch.zeros_like(v) for k, v in one.items() if ".lora_B" in k}
    assert max((one[k] - initial[k]).abs().max().item() for k in initial) > 1e-4
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-6), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: checks the reference sits on the learner's GPU")
def test_the_reference_runs_on_the_learners_gpu_in_its_dtype(tiny_model_dir):
    reference = Reference.load(tiny_model_dir, "cuda", torch.bfloat16, temperature=1.0)
    assert {(p.device.type, p.dtype) for p in reference.model.parameters()} == {("cuda", torch.bfloat16)}
    seqs = batching.sequences([synthetic_group(3, 12, prompt_len=4, vocab=200)], version=1, algorithm="grpo")
    batch = packing.collate(seqs, "cuda")
    logprobs = reference.logprobs(batch)
    assert logprobs.device.type == "cuda" and logprobs.shape == batch["input_ids"].shape


FREED = """
import gc, sys, weakref
from streamrl.config import load_config
from streamrl.learner.coordinator import Coordinator
from streamrl.learner.main import Learner, init_rank

cfg = load_config(None, sys.argv[1:])
init_rank(True)
learner = Learner(cfg, lambda policy, resumed: Coordinator(cfg, cfg.redis.url, policy, resumed))
learner.coordinator.announce(learner.step())
learner.finish()
policy = weakref.ref(learner.policy)
gc.collect()  # the garbage of the run so far (imports' tracebacks hold frames of the learner's start)
gc.disable()  # from here only references may free it, as at the end of `launch`, before the process group goes
del learner
print("freed" if policy() is None else "alive")
"""


@pytest.mark.slow
def test_a_finished_learner_is_freed_before_its_process_group_is_destroyed(redis_server, tiny_model_dir, tmp_path):
    # held in a reference cycle, DeepSpeed's engine outlived `destroy_process_group` and was torn down at
    # interpreter exit, where a backend thread could abort the process ("terminate called", exit status 250)
    ns = Namespace.open(redis_server.url, f"freed-{uuid.uuid4().hex[:6]}")
    stream, rng = ReplayStream(ns), np.random.default_rng(0)
    for _ in range(4):
        stream.put(synthetic_group(4, 30, prompt_len=8, vocab=200, rng=rng, version=0))
    out = subprocess.run([sys.executable, "-c", FREED, f"model.path={tiny_model_dir}", f"redis.url={redis_server.url}",
                          f"run.name={ns.run}", f"run.dir={tmp_path}", "learner.groups_per_step=4",
                          "learner.micro_batch_tokens=128", "rollout.max_context=128"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "freed"
