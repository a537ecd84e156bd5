"""The policy under DeepSpeed: one optimizer update over a rank's micro-batches.

Every rank runs the same number of micro-batches (see ``partition``); DeepSpeed's
accumulation boundary is set explicitly on the last one, so an update's size can vary
from one to the next. Each micro-batch's loss is its token sum times
``world_size / N_global``: the data-parallel all-reduce averages, so the update follows
the full minibatch's gradient however unevenly the tokens fell on the ranks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from streamrl.config import Config
from streamrl.learner import adapter, packing, prefix, tally
from streamrl.learner.batching import TrainSequence
from streamrl.learner.cores import Cores, machine_cores
from streamrl.learner.losses import PolicyLoss, effective_sample_size, kl, normaliser
from streamrl.learner.reference import Reference


def weights_dtype(cfg: Config) -> torch.dtype:
    """The dtype the learner holds its weights in: fp32, unless model.dtype is bfloat16 without mixed precision
    (under ``learner.mixed_precision`` the weights stay fp32 and only the compute is bf16)."""
    bf16 = cfg.model.dtype == "bfloat16" and not cfg.learner.mixed_precision
    return torch.bfloat16 if bf16 else torch.float32


def deepspeed_config(cfg: Config) -> dict[str, Any]:
    if cfg.learner.deepspeed_config:
        import json

        given = json.loads(cfg.learner.deepspeed_config.read_text())
        if cfg.learner.mixed_precision and not given.get("torch_autocast", {}).get("enabled"):
            raise ValueError(f"learner.mixed_precision: {cfg.learner.deepspeed_config} has no torch_autocast section "
                             'enabled; add "torch_autocast": {"enabled": true, "dtype": "bfloat16"} to it')
        return given
    bf16 = weights_dtype(cfg) == torch.bfloat16
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,  # boundaries are set per update instead
        "gradient_clipping": cfg.learner.grad_clip,
        "zero_optimization": {"stage": cfg.learner.zero_stage},
        "zero_allow_untested_optimizer": True,  # learner.optimizer=sgd: ZeRO partitions any torch optimizer
        "bf16": {"enabled": bf16},
        # mixed precision: bf16 compute over the fp32 weights inside DeepSpeed's forward (on a GPU it turns off
        # an autocast around it); no module's gradients are reduced in bf16
        "torch_autocast": {"enabled": cfg.learner.mixed_precision, "dtype": "bfloat16",
                           "lower_precision_safe_modules": []},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def adapter_off_reference(cfg: Config) -> bool:
    """Whether the KL reference is the LoRA policy with its adapter off (no second copy of the base). Not under
    ZeRO-3: there its forwards, beside the policy's, put the ranks' parameter gathers out of step when one rank
    has an empty micro-batch (a gloo size mismatch, seen with two ranks), so the reference is a sharded frozen
    copy there, as without LoRA."""
    return cfg.learner.lora is not None and cfg.learner.zero_stage != 3


def init_distributed(**kwargs) -> str:
    """DeepSpeed's process group (NCCL on GPU, gloo on CPU); returns the backend. ``kwargs`` go to
    ``deepspeed.init_distributed`` (rendezvous)."""
    import deepspeed

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        # On CPU DeepSpeed compiles a shared-memory all-reduce op at start (30-60 s, again for every
        # venv) that only its inference_all_reduce uses; training never does. DeepSpeed keeps edits
        # to this table, and without the op it uses torch.distributed as it would anyway.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend, **kwargs)
    return backend


def empty_micro_batch_loss(model, zero_stage: int) -> torch.Tensor:
    """The zero loss of a rank's empty micro-batch. Under ZeRO-3 every forward gathers the weights from all
    ranks, so a rank with nothing to train runs a forward of one token like the others' forwards (skipping
    it breaks their weight gathers); below it, a zero that touches every parameter."""
    if zero_stage != 3:
        return sum(p.sum() * 0.0 for p in model.module.parameters())
    ids = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    out = model(input_ids=ids, position_ids=ids)
    return getattr(out, "logits", out).sum() * 0.0


class Policy:
    """The trained policy: ``model`` is DeepSpeed's engine around it (forward, backward, step), ``module`` the
    bare Hugging Face model."""

    def __init__(self, cfg: Config, model_path: str):
        import deepspeed
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.init_rng = torch.get_rng_state()  # what its random init (a LoRA adapter's) draws from: a replay's too
        compute = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        self.mixed = cfg.learner.mixed_precision
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=weights_dtype(cfg),
                                                     attn_implementation=packing.attention())
        learner = cfg.learner
        if learner.lora is not None:
            model = adapter.wrap(model, learner.lora)
        # torch's optimizers: nothing to compile, the same on CPU and GPU; state for the trained weights only
        optimizer = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[learner.optimizer](
            [p for p in model.parameters() if p.requires_grad], lr=learner.lr, weight_decay=learner.weight_decay)
        warmup = learner.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        self.model, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(cfg))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if self.world_size == 1 and cfg.learner.zero_stage == 0:
            # nothing to average, but DeepSpeed would copy every gradient into a flat buffer and back (ZeRO's
            # optimizers collect their gradients on that path, so they keep it)
            self.model.enable_backward_allreduce = False
        self.loss = PolicyLoss(correction=cfg.off_policy.correction, clip_low=cfg.learner.clip_eps,
                               clip_high=cfg.learner.clip_eps_high, dual_clip=cfg.learner.dual_clip,
                               tis_cap=cfg.off_policy.tis_cap, behav_cap=cfg.off_policy.behav_weight_cap)
        self.temperature = cfg.rollout.sampling.temperature
        self.random_forward = has_dropout(model)
        # every core once generation is held (`Config.learner_widens`)
        widen = cfg.learner_widens and self.device.type == "cpu" and self.world_size == 1
        self.cores = Cores(torch.get_num_threads(), machine_cores() if widen else torch.get_num_threads())
        self.reference = None
        if cfg.learner.kl_coef > 0 and not cfg.learner.kl_in_reward:  # the initial policy, frozen
            self.reference = (Reference.base_of(self.model, self.temperature) if adapter_off_reference(cfg) else
                              Reference.load(model_path, self.device, compute, self.temperature, learner.zero_stage))

    @property
    def module(self) -> torch.nn.Module:
        return self.model.module

    def pushed(self) -> list[tuple[str, torch.Tensor]]:
        """What a weight push sends: every parameter, or with ``learner.lora`` the adapter's alone."""
        if self.cfg.learner.lora is not None:
            return adapter.tensors(self.module)
        return list(self.module.named_parameters())

    def fingerprint(self) -> str:
        """xxh3-128 of the trained weights, name by name: what a replay must reproduce bit for bit. Under ZeRO-3
        each rank hashes its shard and the hash is of the ranks' hashes (a collective); else rank 0's is the
        answer (every rank holds the whole weights)."""
        zero3 = self.cfg.learner.zero_stage == 3
        h = xxhash.xxh3_128()
        for name, p in self.module.named_parameters():
            if p.requires_grad:
                data = (p.ds_tensor if zero3 else p).detach().reshape(-1).view(torch.uint8).cpu()
                h.update(name.encode())
                h.update(memoryview(data.numpy()))
        if not (zero3 and dist.is_initialized() and dist.get_world_size() > 1):
            return h.hexdigest()
        mine = torch.tensor(list(h.digest()), dtype=torch.uint8, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        return xxhash.xxh3_128(b"".join(bytes(t.cpu().tolist()) for t in everyone)).hexdigest()

    @property
    def device(self) -> torch.device:
        """Where rows and collective operands live (NCCL reduces only CUDA tensors)."""
        return self.model.device

    def collate(self, shard: list[list[TrainSequence]]) -> list[dict[str, torch.Tensor] | None]:
        """A rank's micro-batches as packed rows on the device (``packing.collate``), None for an empty one."""
        return [packing.collate(mb, self.device) if mb else None for mb in shard]

    def share_prompts(self, shard: list[list[TrainSequence]], rows: list[dict | None]) -> None:
        """With ``learner.share_prompts``, each row's shared prompts laid out for one forward each, where that
        saves enough (``prefix``). Under ZeRO-3 every rank must run as many forwards (each gathers the weights):
        a micro-batch shares prompts (two forwards) only where it does on every rank."""
        if not self.cfg.learner.share_prompts:
            return
        for mb, row in zip(shard, rows):
            if row is not None and "prompt_ids" not in row:
                row.update(prefix.layout(mb, self.device) or {})
        if self.cfg.learner.zero_stage != 3:
            return
        shared = torch.tensor([float(r is not None and "prompt_ids" in r) for r in rows], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(shared, op=dist.ReduceOp.MIN)
        for row, everywhere in zip(rows, shared.tolist()):
            if row is not None and not everywhere:
                for key in prefix.KEYS:
                    row.pop(key, None)

    @torch.no_grad()
    def proximal(self, rows: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Logprobs of the weights at the version's start (for tis / decoupled)."""
        self.model.eval()
        out = [packing.logprobs(self.model, row, self.temperature, bf16=self.mixed)[0] for row in rows]
        self.model.train()
        return out

    def score_proximal(self, minibatch_rows: list[list[dict | None]]) -> None:
        """The proximal rule, whole. The proximal policy is the weights at the version's start. The first
        minibatch's training forward computes exactly its logprobs (the weights move only at the end of that
        minibatch's accumulation), so ``_loss`` keeps them from there, unless the forward is random (dropout).
        Every other minibatch, and every one with dropout, gets a no-grad forward here, before any update."""
        if self.cfg.off_policy.correction == "none":
            return
        for i, rows in enumerate(minibatch_rows):
            if i or self.random_forward:
                self._fill_proximal(rows)

    def _fill_proximal(self, rows: list[dict | None]) -> None:
        for row in rows:
            if row is None and self.cfg.learner.zero_stage == 3:
                with torch.no_grad():
                    self._empty_loss()  # in step with the other ranks' forwards
            elif row is not None and "proximal" not in row:
                row["proximal"] = self.proximal([row])[0]

    def update(self, rows: list[dict | None], global_tokens: int, global_sequences: int = 0,
               ptx: list[TrainSequence] | None = None, before_update: Callable[[], None] | None = None
               ) -> dict[str, float]:
        """One optimizer update over this rank's packed micro-batches of a minibatch (and its SFT rows); returns
        statistics. ``rows``: ``collate``'s, with the proximal logprobs where a separate forward makes them
        (``score_proximal``) and the shared prompts laid out (``share_prompts``): ``updates.train`` does it all.

        ``global_sequences``: the minibatch's sequence count over every rank (0: counted here, where
        ``loss_agg: sequence`` needs it). ``before_update`` runs after the last backward, before the optimizer
        writes the weights. A non-finite loss or gradient on any rank skips the whole update on every rank
        (reported as ``skipped``): nothing of that minibatch reaches the weights.
        """
        by_sequence = self.cfg.learner.loss_agg == "sequence"
        if by_sequence:
            global_sequences = global_sequences or self._sum_over_ranks(
                float(sum(packing.sequence_count(r) for r in rows if r is not None)))
        scale = normaliser(int(global_sequences) if by_sequence else global_tokens, self.world_size)
        stats = tally.started()
        work = [(row, lambda row: self._loss(row, stats), scale) for row in rows]
        if ptx:
            ptx_row = packing.collate(ptx, self.device)
            ptx_scale = normaliser(self._sum_over_ranks(float(ptx_row["mask"].sum())), self.world_size)
            work.append((ptx_row, lambda row: self._ptx_loss(row, stats), ptx_scale))
        timer = tally.Timer()
        bad = self._backward(work, timer)
        if before_update:
            before_update()
        tally.over_ranks(stats, self.device)
        self.cores.phase()
        with timer("optimizer_s"):
            self._apply(bad, stats)
        stats.update(timer.totals)
        tally.means(stats, global_tokens)
        stats["lr"] = self.scheduler.get_last_lr()[0] if self.scheduler else self.cfg.learner.lr
        return stats

    def _backward(self, work: list[tuple], timer: tally.Timer) -> bool:
        """Every micro-batch's forward and backward, accumulated to one boundary; whether a loss was not finite."""
        bad = False
        for i, (row, loss_of, weight) in enumerate(work):
            last = i == len(work) - 1
            self.model.set_gradient_accumulation_boundary(last)
            self.cores.phase()
            with timer("forward_s"):
                loss = self._empty_micro_batch() if row is None else loss_of(row)
            if not torch.isfinite(loss):
                bad, loss = True, self._discarded(loss)
            self.cores.phase()
            with timer("backward_s"):
                self.model.backward(loss * weight)
            if not last:
                self.model.step()
        return bad

    def _apply(self, bad: bool, stats: dict) -> None:
        """The optimizer's step, or on every rank none where any rank saw a non-finite loss or gradient. Under
        ZeRO the gradients sit in the optimizer's partitions, not in ``p.grad``: its own check of them (DeepSpeed
        skips a step whose gradient norm is not finite, on every rank) has the last word."""
        norm = self._grad_norm()
        if self._any_rank(bad or not math.isfinite(norm)):
            self.model.zero_grad()
            self.model.optimizer.zero_grad()
            stats["skipped"] = 1.0
            return
        rates = [group["lr"] for group in self.model.optimizer.param_groups]
        scale = self._scale_lr(stats) if self.cfg.off_policy.ess_lr else None
        self.model.step()
        if not self.model.was_step_applied():  # nothing reached the weights, nor moved the scheduler
            for group, rate in zip(self.model.optimizer.param_groups, rates):
                group["lr"] = rate  # the ESS scale was this update's, not the next one's
            stats["skipped"] = 1.0
            return
        stats["skipped"] = 0.0
        if scale is not None:
            stats["lr_scale"] = scale
        # ZeRO's optimizers hold the partitioned gradients and measure their global norm themselves
        stats["grad_norm"] = float(self.model.get_global_grad_norm() or norm)

    def _loss(self, row: dict[str, torch.Tensor], stats: dict) -> torch.Tensor:
        """Summed loss of one micro-batch: clipped policy term, minus entropy bonus, plus KL to the reference."""
        logp, entropy = packing.logprobs(self.model, row, self.temperature, entropy=True,
                                         bf16=self.mixed)  # ~3 FLOPs a logit
        prox = row.get("proximal")
        if prox is None and self.cfg.off_policy.correction != "none":  # the first minibatch: see score_proximal
            prox = row["proximal"] = logp.detach()  # kept on the row for later epochs
        mask = row["mask"]
        per_token, s = self.loss(logp, row["logprobs"], prox, row["advantages"], mask)
        tally.add_mismatch(stats, prox if prox is not None else logp.detach(), row)
        if self.cfg.learner.entropy_coef > 0:
            per_token = per_token - self.cfg.learner.entropy_coef * entropy * mask
        stats["entropy"] += float((entropy * mask).sum().detach())
        if self.reference is not None:
            k = kl(logp, self.reference.logprobs(row), self.cfg.learner.kl_estimator)
            per_token = per_token + self.cfg.learner.kl_coef * k * mask
            stats["kl"] += float((k * mask).sum().detach())
        n = float(mask.sum())
        stats["loss"] += float(per_token.sum().detach())
        stats["adv_sum"] = stats.get("adv_sum", 0.0) + float((row["advantages"] * mask).sum())
        stats["adv_abs_max"] = max(stats.get("adv_abs_max", 0.0), float((row["advantages"] * mask).abs().max()))
        for key in ("is_weight_mean", "is_raw_mean", "is_raw_sq_mean"):
            stats[key] = stats.get(key, 0.0) + float(s[key]) * n
        if "is_capped_frac" in s:
            stats["is_capped_frac"] = stats.get("is_capped_frac", 0.0) + float(s["is_capped_frac"]) * n
        stats["tokens"] += n
        stats["clip_frac"] += float(s["clip_frac"]) * n
        stats["ratio_mean"] += float(s["ratio_mean"].detach()) * n
        stats["is_weight_max"] = max(stats["is_weight_max"], float(s["is_weight_max"]))
        if self.cfg.learner.loss_agg == "sequence":  # each sequence's mean, summed
            per_sequence = packing.per_sequence(per_token, row)
            return (per_sequence / packing.per_sequence(mask, row).clamp(min=1)).sum()
        return per_token.sum()

    def _ptx_loss(self, row: dict[str, torch.Tensor], stats: dict) -> torch.Tensor:
        """Summed token cross-entropy on SFT rows, weighted by ``ptx_coef``."""
        nll = -packing.logprobs(self.model, row, 1.0, bf16=self.mixed)[0] * row["mask"]
        stats["ptx_nll"], stats["ptx_tokens"] = float(nll.sum().detach()), float(row["mask"].sum())  # sums: means
        return self.cfg.learner.ptx_coef * nll.sum()

    def _scale_lr(self, stats: dict) -> float:
        """``off_policy.ess_lr``: this update's learning rate times its importance weights' effective sample size
        over every rank's tokens (``stats``: sums over every rank, not yet means), to the power 1/2 under AdamW
        (whose step grows as the square root of the batch), 1 under SGD. The scheduler sets the next update's rate
        afresh."""
        weights, square, tokens = (stats.get(k, 0.0) for k in ("is_raw_mean", "is_raw_sq_mean", "tokens"))
        scale = effective_sample_size(weights, square, tokens) ** (0.5 if self.cfg.learner.optimizer == "adamw" else 1)
        for group in self.model.optimizer.param_groups:
            group["lr"] *= scale
        return scale

    def _sum_over_ranks(self, value: float) -> float:
        return tally.sum_over_ranks(value, self.device)

    def _zero_loss(self) -> torch.Tensor:
        """A zero that still touches every parameter, for an empty or discarded micro-batch (below ZeRO-3)."""
        return sum(p.sum() * 0.0 for p in self.model.module.parameters())

    def _discarded(self, loss: torch.Tensor) -> torch.Tensor:
        """A zero in place of a non-finite loss, whose backward keeps the ranks' collectives in step (the
        update is then skipped). Under ZeRO-3 it must run back through the forward that gathered the weights."""
        return loss * 0.0 if self.cfg.learner.zero_stage == 3 else self._zero_loss()

    def _empty_micro_batch(self) -> torch.Tensor:
        """The zero loss of a rank with nothing to train here; under ZeRO-3 with the forwards the other ranks'
        micro-batches run, in their order (the policy's, then the reference's for KL in the loss)."""
        loss = self._empty_loss()
        if self.reference is not None and self.cfg.learner.zero_stage == 3:
            self.reference.stand_in()
        return loss

    def _empty_loss(self) -> torch.Tensor:
        return empty_micro_batch_loss(self.model, self.cfg.learner.zero_stage)

    def _grad_norm(self) -> float:
        """The norm of the gradients this rank holds, before clipping (non-finite if any is): without ZeRO the
        whole averaged gradient, so the global norm."""
        grads = [p.grad for p in self.model.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0  # one pass, no [P] bool copy

    def _any_rank(self, flag: bool) -> bool:
        t = torch.tensor([float(flag)], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(t)
        return bool(t.item() > 0)


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether a training forward is random: dropout modules, or dropout rates in the model's config
    (attention dropout is often a rate handed to the attention kernel, not a module)."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    rates = config.to_dict().items() if config is not None else ()
    return any("dropout" in k and isinstance(v, (int, float)) and v > 0 for k, v in rates)
