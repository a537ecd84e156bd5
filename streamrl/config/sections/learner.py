"""The learner's sections: algorithm, loss, optimizer and cadence, and the LoRA adapter it may train.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from streamrl.config.sections.base import Section


class LoraConfig(Section):
    """A LoRA adapter trained in place of the whole model (PEFT): only the adapter trains and is pushed; the
    base with the adapter switched off is the KL reference. Unset by default (full fine-tuning); setting any of
    its fields (`learner.lora.rank=16`) turns it on."""

    rank: int = Field(16, ge=1, description="rank r of each adapter matrix pair")
    alpha: float = Field(32.0, gt=0, description="scaling numerator: the update is (alpha / rank) * B @ A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="modules that get an adapter: PEFT's names (e.g. [q_proj, v_proj]) or "
                                  "all-linear (every linear layer but the output head)")
    name: str = Field("policy", pattern=r"^[A-Za-z0-9_.]+$", description="adapter name on the servers: "
                      "version N is served as NAME-vN")


class LearnerConfig(Section):
    """The DeepSpeed learner (``streamrl launch-learner``): algorithm, loss, optimizer and its cadence."""

    nproc: int = Field(1, ge=1, description="data-parallel ranks `streamrl up` starts (under torchrun, its world size)")
    algorithm: Literal["rloo", "grpo", "ppo"] = Field("rloo", description="advantage estimator: rloo (leave-one-out "
                                                     "group baseline), grpo (group mean and std), ppo (a critic)")
    credit: Literal["episode", "turn"] = Field("episode", description="rloo/grpo on multi-turn episodes: one "
                                               "advantage per episode, or one per turn (see turn_lam)")
    turn_gamma: float = Field(1.0, ge=0, le=1, description="credit=turn: discount from one turn to the next")
    turn_lam: float = Field(1.0, ge=0, le=1, description="credit=turn: 1 scores a turn by its own episode's "
                            "later rewards, 0 by the group's mean of them (a lucky retry vouches less)")
    groups_per_step: int = Field(8, ge=1, description="groups in one learner step's batch (a step makes one policy "
                                 "version: epochs x minibatches optimizer steps)")
    lr: float = Field(1e-5, gt=0, description="learning rate (constant after warmup)")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="optimizer of the policy (a PPO critic uses AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="weight decay of the policy's and critic's optimizers "
                                "(AdamW's is decoupled)")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear learning-rate warmup")
    max_steps: int = Field(100, ge=1, description="learner steps (policy versions); the run ends after the last")
    epochs: int = Field(1, ge=1, description="passes over each batch (PPO epochs)")
    minibatches: int = Field(1, ge=1, description="optimizer steps per pass, each on a share of the batch's groups "
                             "(PPO minibatches): the clip acts from the second on")
    micro_batch_tokens: int = Field(8192, ge=1, description="tokens of one micro-batch: its sequences concatenated "
                                    "into one row, no padding")
    balance: Literal["tokens", "flops"] = Field("tokens", description="what the partitioner evens out over "
                                                "micro-batches and ranks: tokens, or a FLOP estimate (attention "
                                                "grows with length²)")
    drop_no_signal: bool = Field(False, description="DAPO's dynamic sampling: leave out groups whose rewards are "
                                 "all equal (RLOO and GRPO give them no gradient) and read on until groups_per_step "
                                 "groups with signal")
    skip_zero_advantage: bool = Field(True, description="leave out of the forwards and backwards the sequences "
                                      "whose advantage is zero on every generated token (a group without signal) "
                                      "where that makes their gradient zero: rloo or grpo, no entropy bonus, no KL "
                                      "term in the loss. They still count in the loss's mean: the update is the same")
    share_prompts: bool = Field(True, description="forward each prompt once per micro-batch, not once per sample "
                                "(off: for models whose forward cannot continue from a KV cache)")
    mismatch_warn_kl: float = Field(0.01, ge=0, description="warn when KL(behaviour || learner) on tokens generated "
                                    "at the learner's own version exceeds this (the same weights on both sides: a "
                                    "dtype, chat-template or engine-logprob bug)")
    mixed_precision: bool = Field(False, description="with model.dtype bfloat16: the policy's weights and AdamW stay "
                                  "fp32 and its forwards and backwards run under bfloat16 autocast (the servers "
                                  "serve bfloat16 copies of each push); off, the weights themselves are bfloat16 and "
                                  "an update smaller than their rounding step waits for the fp32 master copy to "
                                  "cross it")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage")
    grad_clip: float = Field(1.0, gt=0, description="largest gradient norm")
    clip_eps: float = Field(0.2, gt=0, description="PPO ratio clip")
    clip_eps_high: float | None = Field(None, gt=0, description="upper clip (DAPO's clip-higher); default clip_eps")
    dual_clip: float | None = Field(None, gt=1, description="bound the loss of negative advantages at c|A|")
    loss_agg: Literal["token", "sequence"] = Field("token", description="mean over all tokens, or of sequence means")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="estimator of KL to the initial policy "
                                                    "(Schulman's k1, k2, k3)")
    kl_coef: float = Field(0.0, ge=0, description="weight of KL to the initial policy (0: none)")
    kl_in_reward: bool = Field(False, description="subtract the KL from rewards instead of adding it to the loss")
    gamma: float = Field(1.0, ge=0, le=1, description="PPO: discount over generated tokens")
    lam: float = Field(0.95, ge=0, le=1, description="PPO: GAE lambda")
    critic_path: str | None = Field(None, description="PPO: value model start (default: the policy)")
    critic_lr: float = Field(1e-5, gt=0, description="PPO: critic learning rate")
    value_clip: float = Field(0.2, gt=0, description="PPO: clip of the value update")
    whiten_advantages: bool = Field(True, description="PPO: normalise advantages over the global batch")
    entropy_coef: float = Field(0.0, ge=0, description="weight of an entropy bonus (0: none)")
    checkpoint_every: int = Field(50, ge=1, description="learner steps between checkpoints")
    resume: Literal["auto", "never"] = Field("auto", description="auto: continue from the newest checkpoint")
    export_every: int = Field(50, ge=1, description="learner steps between plain HF exports (and one at the end)")
    tensorboard: bool = Field(False, description="also write metrics to runs/NAME/tensorboard")
    wandb_project: str | None = Field(None, description="also log metrics to this W&B project")
    deepspeed_config: Path | None = Field(None, description="user DeepSpeed JSON, used as is")
    ptx_dataset: str | None = Field(None, description="SFT rows mixed into each step (prompt/completion or text)")
    ptx_coef: float = Field(0.0, ge=0, description="weight of the SFT loss (mean token cross-entropy)")
    ptx_per_rank: int = Field(2, ge=1, description="SFT rows per rank per step")
    lora: LoraConfig | None = Field(None, description="train a LoRA adapter instead of every weight (empty: "
                                    "full fine-tuning)")


class RecordConfig(Section):
    """The run's record (``RUN/record/``): every learner step's input (the groups it trained, in order, what it
    dropped and why, its staleness bound and partition) and a hash of the weights it ended with, written beside
    training; ``streamrl replay RUN`` retrains the run from it, bit for bit or with other settings."""

    enabled: bool = Field(True, description="record every learner step (rank 0 writes, in a thread of its own)")
    chunk_steps: int = Field(50, ge=1, description="steps per chunk file (record/NNNNNNNN.rec): the unit "
                             "keep_steps deletes")
    keep_steps: int | None = Field(None, ge=1, description="keep at least the newest this many steps and delete "
                                   "older chunks (empty: keep every step; a replay needs a checkpoint inside what "
                                   "is kept)")
    deterministic: bool = Field(False, description="run the learner with torch's deterministic algorithms, which a "
                                "bit-for-bit replay (`streamrl replay --verify`) of a CUDA run needs (atomic adds in "
                                "CUDA backward kernels reorder sums); on CPU every step is deterministic without it")
