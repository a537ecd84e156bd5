"""streamrl against TRL's GRPOTrainer on the real-model task: SmolLM2-135M-Instruct learning two-digit addition
(``configs/smollm2.yaml``), on the same machine.

Both sides get the same model, training prompts (each side reads them in an order drawn from its seed), group
size (``n``), groups per step, max new tokens, temperature (1.0, no top-p/top-k), learning rate (constant,
AdamW, no weight decay), no KL term, and number of samples (steps × groups × n). Prompts and rewards come from
the config's env on both sides: TRL's prompts are the env's first observation of each row, and its reward
function plays the env's ``step`` on each completion. Loss: token-level, normalised by the batch's token count
on both sides (TRL ``loss_type="dapo"``); advantages r - mean (TRL ``scale_rewards="none"``) against
streamrl's RLOO, the same times n/(n-1).

TRL runs one process on every core; its generation backend is chosen with ``--trl-generation``: ``hf``
(``model.generate``, its default), ``paged`` (transformers' continuous batching) or ``vllm`` (vLLM colocated
in the trainer's process). ``hf`` is TRL's fastest here: ``paged`` took 46 s a step against its 37 s (the
first 3 steps), and ``vllm`` does not run: TRL 1.16 supports vLLM 0.22-0.31, and with 0.32's CPU build (the
one built for this torch) its colocated engine fails at the first weight sync (``'Parameter' object has no
attribute 'weight_loader'``, vLLM issue 34201). TRL's GRPOTrainer has no padding-free option (its SFT and DPO
trainers have one). streamrl runs ``streamrl up`` (every part its own process) with the recipe's settings and
any ``--streamrl-set`` overrides; the table's title names its mode and max staleness. streamrl leaves the
sequences of groups without signal (all rewards equal: zero advantages) out of its forwards and backwards and
still counts their tokens in the loss's mean (``learner.skip_zero_advantage``: the same update); TRL trains on
them.

Precision (``--precision``, and ``--trl-precision`` for TRL when it differs): ``fp32``, or ``bf16`` mixed
precision: fp32 weights and AdamW, matmuls under bf16 autocast (streamrl ``model.dtype=bfloat16
learner.mixed_precision=true``, its servers serving bf16 copies; TRL ``bf16=True``). bf16 weights themselves
(streamrl without ``mixed_precision``) learned less in 20 steps: lr 1e-5 moves a weight by less than its bf16
rounding step. Which precision is TRL's best depends on the CPU: on an Intel core with AMX its fp32 ran 20
steps in 581 s against 784 s in bf16 (seed 0); on an AMD EPYC core with AVX512-BF16 its ``model.generate``
runs 170 tokens/s under bf16 autocast against 135 in fp32. Both final models are saved, loaded back and scored
in fp32: the same way matters, since TRL's seed-2 weights score 0.637 under bf16 autocast and 0.563 in fp32.

Clocks: TRL's from the start of its training loop to its end; streamrl's from its rollout worker's opening
report (every part started, the version-0 eval done) to the learner's last step. The final weights of both
are then scored by one greedy evaluation, off the clock: the first ``max_new_tokens`` greedy tokens of
SmolLM2 (``model.generate``) on the recipe's held-out questions, scored by the env. Repeat r runs both
sides at seed r (``--first-seed S``: from seed S on, joining the runs of other seeds already in the results
file, so seeds can be added later); the accuracy difference is paired by seed.

The bound: a sample costs at least 2N FLOPs a token to generate (prompt and completion) and 6N a token to
train on, at this machine's fp32 and bf16 matmul rates (measured first, on every core); each system's
samples/s is reported as a fraction of what each rate allows (a side computing in bf16 can pass the fp32 one,
and one that skips the samples without signal the bound of training on every sample).

streamrl's side may take extra config overrides (``--streamrl-set mode=sync``, repeatable), recorded in the
JSON: a study of one setting's effect against the same TRL runs.

    python -m benchmarks.against_trl [--quick] [--trl-generation G] [--precision P] [--trl-precision P]
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks import cpu_share
from benchmarks.common import (
    chat_prompt_ids,
    cli,
    console,
    earlier_results,
    join_seeds,
    matmul_flops,
    median,
    new_figure,
    paired_difference,
    percent,
    points,
    print_table,
    save_figure,
    settings,
    write_json,
)
from benchmarks.cpu_share import CpuShare
from benchmarks.smollm2 import CONFIG, play, prepare_shared, rows, score_final, streamrl_run
from streamrl.config import Config, ConfigError, load_config


def require_trl() -> None:
    """Fail before any run, not after streamrl's: TRL is an optional dependency."""
    if importlib.util.find_spec("trl") is None:
        raise SystemExit("`streamrl bench trl` needs TRL: pip install 'streamrl[bench]'")


def trl_args(cfg: Config, out: Path, steps: int, seed: int, generation: str, precision: str):
    from trl import GRPOConfig

    s = cfg.rollout.sampling
    backend = {"hf": {}, "paged": {"use_transformers_continuous_batching": True},
               "vllm": {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": cfg.rollout.max_context}}
    return GRPOConfig(output_dir=str(out), per_device_train_batch_size=cfg.learner.groups_per_step * s.n,
                      num_generations=s.n, max_completion_length=s.max_new_tokens, temperature=s.temperature,
                      top_p=1.0, learning_rate=cfg.learner.lr, weight_decay=cfg.learner.weight_decay,
                      lr_scheduler_type="constant", warmup_steps=0, max_steps=steps, beta=0.0, scale_rewards="none",
                      loss_type="dapo", use_cpu=True, report_to=[],
                      logging_steps=1, save_strategy="no", seed=seed, disable_tqdm=True, bf16=precision == "bf16",
                      **backend[generation])


def trl_run(cfg: Config, prepared: Path, out: Path, *, steps: int, seed: int, generation: str,
            precision: str) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    model_dir = Path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    train = rows(prepared / "train.jsonl")
    data = Dataset.from_list([{"prompt": p, "row": json.dumps(r)} for p, r in zip(play(cfg, train), train)])

    def env_reward(completions, row, **_):
        return [v.reward for v in play(cfg, [json.loads(x) for x in row], [c[0]["content"] for c in completions])]

    clock = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            clock["start"] = time.time()

        def on_train_end(self, *a, **kw):
            clock["end"] = time.time()

    args = trl_args(cfg, out, steps, seed, generation, precision)
    trainer = GRPOTrainer(model=model, reward_funcs=env_reward, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)  # a dict per step on stdout would bury the benchmark's own log
    trainer.train()
    trainer.save_model(str(out / "final"))  # its fp32 weights and tokenizer, scored as streamrl's export is
    wall = clock["end"] - clock["start"]
    samples = steps * args.per_device_train_batch_size
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    lengths = [r["completions/mean_length"] for r in trainer.state.log_history if "completions/mean_length" in r]
    given = {k: getattr(args, k) for k in ("per_device_train_batch_size", "num_generations", "max_completion_length",
                                           "temperature", "top_p", "learning_rate", "weight_decay", "max_steps",
                                           "beta", "scale_rewards", "loss_type", "num_iterations", "use_vllm",
                                           "use_transformers_continuous_batching", "bf16")}
    given["versions"] = {name: importlib.metadata.version(name) for name in ("trl", "transformers", "torch")}
    return {"wall_s": wall, "window": [clock["start"], clock["end"]], "samples": samples,
            "samples_per_s": samples / wall, "completion_tokens": sum(lengths) / len(lengths),
            "train_reward_last5": sum(rewards[-5:]) / max(1, len(rewards[-5:])), "train_rewards": rewards,
            "held_out_final": score_final(cfg, out / "final", rows(prepared / "eval.jsonl")), "settings": given}


def bound(cfg: Config, prepared: Path) -> dict:
    """The compute bound of a sample: generating it (2N FLOPs a token, prompt and completion) and training on it
    (6N a token), at this machine's measured fp32 matmul rate; what each system adds (padding, the ops that are
    not matmuls) counts against it. The bf16 rate is measured too: a side computing in bf16 can pass the bound."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(cfg.model.path)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
                     .parameters())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conversations = play(cfg, rows(prepared / "train.jsonl")[:256])
    prompt = sum(map(len, chat_prompt_ids(tokenizer, conversations))) / len(conversations)
    return {"params": params, "prompt_tokens": prompt, **matmul_rates()}


def matmul_rates(earlier: dict | None = None) -> dict:
    """The fp32 and bf16 matmul rates, each the higher of this reading and ``earlier``'s: a ceiling read before
    and after the runs is not lowered by what else ran during one reading."""
    import torch

    rates = {"matmul_flops": matmul_flops(), "matmul_flops_bf16": matmul_flops(dtype=torch.bfloat16)}
    return {k: max(v, (earlier or {}).get(k, 0.0)) for k, v in rates.items()}


def fraction_of_bound(row: dict, b: dict) -> float:
    flops_per_sample = 8 * b["params"] * (b["prompt_tokens"] + row["completion_tokens"])
    return row["samples_per_s"] * flops_per_sample / b["matmul_flops"]


def run(quick: bool, repeats: int | None, steps: int | None, generation: str, precision: dict[str, str],
        overrides: tuple[str, ...] = (), trainer: str = "sync", config: str = CONFIG, first_seed: int = 0,
        trl_tune: dict[str, int] | None = None) -> dict:
    repeats = repeats or (1 if quick else 3)
    steps = steps or (3 if quick else 20)
    results = {"streamrl": [], "trl": []}
    if trainer == "async":  # both sides generate with vLLM's CPU build
        overrides = ("server.engine=vllm", *overrides)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg, prepared = prepare_shared(tmp)
        # the recipe's settings with the prepared model; TRL's async trainer shares the overrides (max staleness)
        shared = overrides if trainer == "async" else ()
        cfg = load_config(config, [f"model.path={cfg.model.path}", *shared])
        held_out = rows(prepared / "eval.jsonl")
        limit = bound(cfg, prepared)
        console.log(f"matmul rate fp32 {limit['matmul_flops'] / 1e9:.0f} GFLOP/s, bf16 "
                    f"{limit['matmul_flops_bf16'] / 1e9:.0f} GFLOP/s; {limit['params'] / 1e6:.1f}M params, "
                    f"{limit['prompt_tokens']:.1f} prompt tokens a sample")
        console.log(f"base model: greedy accuracy on {len(held_out)} held-out questions")
        before = score_final(cfg, Path(cfg.model.path), held_out)
        for r in range(first_seed, first_seed + repeats):
            for side in (("streamrl", "trl") if r % 2 == 0 else ("trl", "streamrl")):  # who goes first rotates
                with CpuShare(cpu_share.STREAMRL if side == "streamrl" else cpu_share.trl(os.getpid())) as cores:
                    if side == "trl" and trainer == "async":
                        from benchmarks.trl_async import trl_async_run

                        row = trl_async_run(cfg, prepared, tmp / f"trl-{r}", steps=steps, seed=r, tune=trl_tune)
                    elif side == "trl":
                        row = trl_run(cfg, prepared, tmp / f"trl-{r}", steps=steps, seed=r, generation=generation,
                                      precision=precision["trl"])
                    else:
                        row = streamrl_run(cfg, prepared, tmp / "runs", steps=steps, seed=r,
                                           precision=precision["streamrl"], overrides=overrides, config=config)
                row["cpu_share"] = cores.shares(*row["window"])  # where the cores went while the clock ran
                row["seed"] = r
                results[side].append(row)
                console.log(f"{side} seed {r}: {row['samples_per_s']:.2f} samples/s over {row['wall_s']:.0f} s, "
                            f"held-out {before:.3f} → {row['held_out_final']:.3f}")
    limit.update(matmul_rates(limit))  # read again after the runs: the bound is the higher reading
    for row in results["streamrl"] + results["trl"]:
        row["fraction_of_bound"] = fraction_of_bound(row, limit)
    ran = load_config(config, list(overrides))  # streamrl's side as it ran
    return {"study": "trl", "config": config, "trl_trainer": trainer, "lora": ran.learner.lora is not None,
            "max_steps": steps, "trl_generation": generation, "precision": precision,
            "samples": results["trl"][0]["samples"], "held_out": len(held_out), "held_out_before": before,
            "bound": limit,
            "streamrl_settings": {"mode": ran.mode, "max_staleness": ran.off_policy.max_staleness,
                                  "engine": ran.server.engine, "algorithm": ran.learner.algorithm,
                                  "overrides": list(overrides)},
            **({"trl_settings": trl_tune} if trl_tune else {}), **summary(results)}


def summary(results: dict[str, list[dict]]) -> dict:
    """Each side's medians, streamrl's samples/s over TRL's, and held-out accuracy paired by seed."""
    results = {side: sorted(rs, key=lambda x: x["seed"]) for side, rs in results.items()}
    med = {side: {k: median([x[k] for x in rs]) for k in ("samples_per_s", "wall_s", "held_out_final",
                                                           "train_reward_last5", "completion_tokens",
                                                           "fraction_of_bound")}
           for side, rs in results.items()}
    for side, rs in results.items():
        if measured := [x["cpu_share"] for x in rs if "cpu_share" in x]:  # runs from before it was measured have none
            med[side]["cpu_share"] = {role: median([x[role] for x in measured]) for role in measured[0]}
    return {"runs": results, "repeats": len(results["trl"]), "median": med,
            "ratio": med["streamrl"]["samples_per_s"] / med["trl"]["samples_per_s"],
            "held_out_vs_trl": paired_difference([x["held_out_final"] for x in results["streamrl"]],
                                                 [x["held_out_final"] for x in results["trl"]])}


SAME_STUDY = ("config", "trl_trainer", "lora", "max_steps", "trl_generation", "precision", "streamrl_settings",
              "trl_settings")


def more_seeds(earlier: dict, new: dict) -> dict:
    """A run's seeds joined to an earlier run's of the same settings (a seed run again replaces its earlier runs),
    so seeds can be added one session at a time; an earlier run of other settings is replaced."""
    if any(earlier.get(k) != new.get(k) for k in SAME_STUDY):
        return new
    for runs in earlier["runs"].values():  # runs written before seeds were recorded: repeat r was seed r
        for r, x in enumerate(runs):
            x.setdefault("seed", r)
    return {**new, **summary(join_seeds(earlier["runs"], new["runs"]))}


def report(data: dict, out: Path) -> None:
    if earlier := earlier_results(out, result_name(data)):
        data = more_seeds(earlier, data)
    m = data["median"]
    precision = data.get("precision", {"streamrl": "fp32", "trl": "fp32"})
    bf16_share = data["bound"]["matmul_flops"] / data["bound"]["matmul_flops_bf16"]  # the bound at the bf16 rate
    ran = data.get("streamrl_settings", {})
    how = f", {ran['mode']}, max staleness {ran['max_staleness']}" if ran else ""
    print_table(f"streamrl ({precision['streamrl']}{how}) vs {trl_name(data)}, SmolLM2-135M two-digit addition, "
                f"{data['max_steps']} steps ({data['samples']} samples), medians of {data['repeats']}",
                ["system", "samples/s", "train wall s", "completion tokens", "of the fp32 bound", "of the bf16 bound",
                 "train reward (last 5 steps)",
                 f"held-out greedy accuracy ({data['held_out']}; base {data['held_out_before']:.3f})"],
                [[side, m[side]["samples_per_s"], m[side]["wall_s"], m[side]["completion_tokens"],
                  percent(m[side]["fraction_of_bound"]), percent(m[side]["fraction_of_bound"] * bf16_share),
                  m[side]["train_reward_last5"], m[side]["held_out_final"]]
                 for side in ("streamrl", "trl")]
                + [["streamrl / TRL", data["ratio"], "", "", "", "", "", points(data["held_out_vs_trl"])]])
    if all("cpu_share" in m[side] for side in m):
        roles = ["generating", "training", "other", "idle"]
        print_table("Where the cores went while each side's clock ran (share of all cores, medians): generating "
                    "(the servers, vLLM's processes), training (the learner; TRL's trainer process, which also generates "
                    "unless TRL's async trainer runs), other (rollout workers, router, Redis; TRL's rollout worker), idle",
                    ["system", *roles], [[side, *(percent(m[side]["cpu_share"][r]) for r in roles)] for side in m])
    name = result_name(data)
    json_path = write_json(out, name, data)
    fig, (ax1, ax2) = new_figure(2, f"streamrl vs {trl_name(data, settings=False)}: SmolLM2-135M, same samples and machine")
    sides = {"streamrl": f"streamrl ({precision['streamrl']})",
             "trl": f"TRL ({data['trl_generation']}, {precision['trl']})" if name == "trl" else "TRL (vLLM)"}
    for ax, key, label in ((ax1, "samples_per_s", "samples/s"), (ax2, "held_out_final", "held-out greedy accuracy")):
        ax.bar(list(sides.values()), [m[s][key] for s in sides])
        for r in range(data["repeats"]):  # every seed, over the median's bar
            ax.scatter(list(sides.values()), [data["runs"][s][r][key] for s in sides], color="black", zorder=3, s=12)
        ax.set_ylabel(label)
    ax2.axhline(data["held_out_before"], color="grey", linestyle="--", label="base model")
    ax2.legend(loc="upper right", fontsize=8)
    save_figure(fig, out, name, json_path)


def result_name(data: dict) -> str:
    """trl (the synchronous GRPOTrainer), trl_async, or trl_async_lora: each keeps a results file of its own."""
    if data.get("trl_trainer", "sync") == "sync":
        return "trl"
    return "trl_async_lora" if data.get("lora") else "trl_async"


def trl_name(data: dict, settings: bool = True) -> str:
    precision = data.get("precision", {}).get("trl", "fp32")
    if data.get("trl_trainer", "sync") == "sync":
        return f"TRL GRPOTrainer ({data['trl_generation']} generation, {precision})"
    ran = (data.get("runs", {}).get("trl") or [{}])[0].get("settings", {})  # as TRL resolved them
    how = (f"; {ran['max_inflight_tasks']} requests in flight, threads {ran['trainer_threads']} trainer + "
           f"{ran['server_threads']} server" if settings and "trainer_threads" in ran else "")
    return f"TRL AsyncGRPOTrainer (vLLM{', LoRA' if data.get('lora') else ''}, {precision}{how})"


def main(quick: bool = False, out: Path = Path("benchmarks/results"), repeats: int | None = None,
         steps: int | None = None, trl_generation: str = "hf", precision: str = "fp32",
         trl_precision: str | None = None, streamrl_set: tuple[str, ...] = (), trl_trainer: str = "sync",
         lora: bool = False, first_seed: int = 0, trl_set: tuple[str, ...] = ()) -> dict:
    """``trl_trainer``: sync (GRPOTrainer) or async (AsyncGRPOTrainer, benchmarks/trl_async.py); ``lora``: both
    sides train the LoRA recipe's adapter (async only); ``first_seed``: the first run's seed (runs of other seeds
    with the same settings, in the results file already, join these); ``trl_set``: TRL's async trainer's
    ``KEY=VALUE`` settings (``trl_async.TUNABLE``)."""
    require_trl()
    if trl_generation not in ("hf", "paged", "vllm"):
        raise SystemExit(f"--trl-generation: {trl_generation!r} is not one of hf, paged, vllm")
    if trl_trainer not in ("sync", "async"):
        raise SystemExit(f"--trl-trainer: {trl_trainer!r} is not one of sync, async")
    trl_tune = None
    if trl_trainer == "async":
        from benchmarks.trl_async import require_trl_version, tuning

        require_trl_version()
        trl_tune = tuning(tuple(trl_set))
        if precision != "fp32" or trl_precision not in (None, "fp32"):
            raise SystemExit("--trl-trainer async runs in fp32 (TRL's bf16 path needs a GPU's kernels)")
    elif lora or trl_set:
        raise SystemExit(f"{'--lora' if lora else '--trl-set'} runs with --trl-trainer async")
    config = "configs/smollm2-lora.yaml" if lora else CONFIG
    sides = {"streamrl": precision, "trl": trl_precision or precision}
    for flag, value in (("--precision", precision), ("--trl-precision", sides["trl"])):
        if value not in ("fp32", "bf16"):
            raise SystemExit(f"{flag}: {value!r} is not one of fp32, bf16")
    try:
        load_config(config, list(streamrl_set))  # a bad override fails here, before any run
    except ConfigError as e:
        raise SystemExit(f"--streamrl-set: {e}") from None
    settings.update(trl_generation=trl_generation, precision=sides, streamrl_set=list(streamrl_set),
                    trl_trainer=trl_trainer, lora=lora, trl_set=list(trl_set))
    data = run(quick, repeats, steps, trl_generation, sides, tuple(streamrl_set), trl_trainer, config, first_seed,
               trl_tune)
    report(data, out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
