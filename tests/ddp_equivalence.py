"""Run under torchrun: a Policy step skipped for a non-finite loss on one rank (under ZeRO-1/2 one for a non-finite
gradient too), then one step on a fixed
batch split unevenly over the ranks (with KL to the reference in the loss when kl > 0: under ZeRO-3 the
reference is sharded too, and rank 0's empty micro-batch runs its stand-in forward; with lora 1 the policy is a
LoRA adapter and the reference its base; with ess 1 the learning rate is scaled by the effective sample size of
every rank's importance weights); rank 0 saves the weights and the step's figures."""

import os
import sys
from dataclasses import replace

import deepspeed
import numpy as np
import torch
import torch.distributed as dist

from streamrl.config import load_config
from streamrl.learner import batching
from streamrl.learner.policy import Policy
from streamrl.learner.updates import train
from streamrl.protocol import Group, Sample

model_dir, out, agg, zero, kl, lora, ess = sys.argv[1:8]
deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
cfg = load_config(None, [f"model.path={model_dir}", "learner.optimizer=sgd", "learner.lr=1.0", "learner.grad_clip=1e9",
                         "off_policy.correction=none", f"learner.loss_agg={agg}", f"learner.zero_stage={zero}",
                         f"learner.kl_coef={kl}", f"off_policy.ess_lr={ess == '1'}",
                         *(["learner.kl_estimator=k1"] if float(kl) > 0 else []),  # k1: a gradient at the reference too
                         *(["learner.lora.rank=4", "learner.lora.target_modules=[q_proj,v_proj,up_proj]"]
                           if lora == "1" else [])])  # the reference: the base under the adapter
torch.manual_seed(0)  # PEFT draws A at random: the same on every rank and in every run (B starts at zero)
engine = Policy(cfg, model_dir)
rng = np.random.default_rng(0)
lengths = [40, 6, 9, 7, 5, 8, 12]  # one long sequence, six short ones
prompt = rng.integers(3, 200, 3)  # one group's samples share their prompt (forwarded once per micro-batch)
samples = []
for n in lengths:
    mask = np.r_[np.zeros(3), np.ones(n - 3)].astype(np.uint8)
    samples.append(Sample(tokens=np.r_[prompt, rng.integers(3, 200, n - 3)], loss_mask=mask,
                          logprobs=np.where(mask == 1, -rng.random(n) - 0.1, 0), versions=np.where(mask == 1, 0, -1),
                          reward=float(rng.random())))
seqs = batching.sequences([Group("p", "e", samples)], version=0, algorithm="rloo")
global_tokens = int(sum(s.mask.sum() for s in seqs))
# two ranks: rank 0's second micro-batch is empty (fewer sequences than slots); under ZeRO-3 it must still
# run a forward, as rank 1 does in its second micro-batch
split = {1: [[0, 1, 2, 3, 4, 5, 6]], 2: {0: [[0], []], 1: [[1, 2, 3, 4, 5], [6]]}}
mine = split[1] if world == 1 else split[2][rank]
shard = [[seqs[i] for i in mb] for mb in mine]
poisoned = [[replace(s, advantages=np.full_like(s.advantages, np.nan)) if i == 6 else s for i, s in zip(mb, ms)]
            for mb, ms in zip(mine, shard)]  # a non-finite loss on the last rank only: every rank skips
assert train(engine, [(poisoned, global_tokens, len(seqs))], epochs=1)[0]["skipped"] == 1.0
if zero in ("1", "2"):  # a finite loss, a NaN gradient on the last rank: ZeRO holds it in its partitions, not in
    # p.grad, and its own check must skip the update on every rank
    first = next(engine.module.parameters())
    hook = first.register_hook(lambda g: torch.full_like(g, float("nan"))) if rank == world - 1 else None
    before = [p.detach().clone() for p in engine.module.parameters()]
    assert train(engine, [(shard, global_tokens, len(seqs))], epochs=1)[0]["skipped"] == 1.0
    assert all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
    if hook is not None:
        hook.remove()
stats = train(engine, [(shard, global_tokens, len(seqs))], epochs=1)[0]
assert stats["skipped"] == 0.0
assert (stats.get("lr_scale", 1.0) < 0.9) == (ess == "1")  # the behaviour logprobs are far off the policy's
with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=zero == "3"):  # every rank
    weights = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
if rank == 0:  # with the step's figures: of every rank's tokens, as one rank's of all of them
    figures = ("loss", "tokens", "clip_frac", "ratio_mean", "entropy", "mismatch_abs", "mismatch_max", "adv_mean",
               "adv_abs_max", "is_weight_max", "is_ess", "kl")
    torch.save({"weights": weights, "stats": {k: stats[k] for k in figures if k in stats}}, out)
if zero == "3":  # PPO's critic under ZeRO-3, with rank 0's empty micro-batch: its forwards must keep step too
    from streamrl.learner.critic import Critic

    critic = Critic(cfg, model_dir)
    assert critic.update(critic.prepare(shard), global_tokens)["value_loss"] >= 0
    # a model with dropout gets a separate proximal forward per micro-batch: rank 0's empty one included
    engine.random_forward, engine.cfg.off_policy.correction = True, "decoupled"
    assert train(engine, [(shard, global_tokens, len(seqs))], epochs=1)[0]["skipped"] == 0.0
    # ... and over two minibatches for two epochs: each proximal is filled once, before the first update,
    # so rank 0's stand-in forwards and rank 1's proximal ones stay paired in the second epoch too
    assert train(engine, [(shard, global_tokens, len(seqs))] * 2, epochs=2)[1] == 2
dist.barrier()
dist.destroy_process_group()  # an exit with the group up can abort in a gloo thread ("terminate called ...")
# ... and even after it, once in a few hundred runs, in the interpreter's teardown (exit -6 with every assertion
# passed and the weights saved): the work is done, so leave without it
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
