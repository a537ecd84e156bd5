"""streamrl against TRL's GRPOTrainer: same model, task, samples and machine.

Both start from the quickstart's warm-started model and train on the same prompts (reverse a
word, exact-match reward) for the same number of samples (steps × groups × n; 40 steps, the
quickstart's length, by which both have converged) with the same learning rate, no KL term and
temperature 1.0. TRL (``pip install trl``; CPU, its own
``model.generate``) generates a batch, then trains on it; streamrl runs ``streamrl up`` (async,
max staleness 2). Advantages: TRL's GRPO with ``scale_rewards="none"`` is ``r - mean``, RLOO is
the same times n/(n-1). Time to the target eval accuracy counts only training: TRL's evaluation
pauses its clock; streamrl's evaluator runs beside training (so it is charged to streamrl). Start-up
is off both clocks: TRL's starts when its training loop starts (model loaded, trainer built, baseline
evaluated); streamrl's when its rollout worker begins generating (every part started up, baseline
evaluated; whatever is left of the learner's start-up is on the clock). "Steady" samples/s is
streamrl's rate between the ends of step 2 and the last step, once its pipeline is full; TRL has no
pipeline to fill, so its steady rate is its overall rate. After training, both
final models are scored greedily on the same 512 held-out prompts, off the clock.

    python -m benchmarks.against_trl [--quick]      (or: streamrl bench trl)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    cli,
    console,
    new_figure,
    paired_difference,
    points,
    print_table,
    save_figure,
    write_json,
)
from benchmarks.e2e import (
    HELD_OUT,
    TARGET,
    greedy_accuracy,
    held_out_rows,
    medians,
    one_run,
    prepare_shared,
)


def require_trl() -> None:
    """Fail before any run, not after streamrl's: TRL is an optional dependency."""
    if importlib.util.find_spec("trl") is None:
        raise SystemExit("`streamrl bench trl` needs TRL: pip install 'streamrl[bench]'")


def trl_run(prepared: Path, out: Path, *, steps: int, groups: int, n: int, lr: float, eval_every: int,
            seed: int) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(prepared / "model", padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(prepared / "model")
    train = [json.loads(x) for x in (prepared / "train.jsonl").read_text().splitlines()]
    held_out = held_out_rows(prepared)[:64]  # as streamrl's online eval.size
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                              for r in train])

    def exact_match(completions, answer, **_):
        return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]

    evals, paused = [], [0.0]
    start = [0.0]

    class Evaluate(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            start[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % eval_every == 0 or state.global_step == steps:
                t0 = time.perf_counter()
                acc = greedy_accuracy(kw["model"], tokenizer, held_out)
                paused[0] += time.perf_counter() - t0
                evals.append({"step": state.global_step, "accuracy": acc,
                              "train_s": t0 - start[0] - (paused[0] - (time.perf_counter() - t0))})

    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=groups * n, num_generations=n,
                      max_completion_length=12, learning_rate=lr, lr_scheduler_type="constant", max_steps=steps,
                      beta=0.0, temperature=1.0, scale_rewards="none", loss_type="dapo", use_cpu=True,
                      report_to=[], logging_steps=1, save_strategy="no", seed=seed, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Evaluate()])
    trainer.remove_callback(PrinterCallback)  # a dict per step on stdout would bury the benchmark's own log
    before = greedy_accuracy(model, tokenizer, held_out)
    trainer.train()
    wall = time.perf_counter() - start[0] - paused[0]
    reached = [e for e in evals if e["accuracy"] >= TARGET]
    samples = steps * groups * n
    settings = {k: getattr(args, k) for k in ("per_device_train_batch_size", "num_generations",
                                              "max_completion_length", "learning_rate", "max_steps", "beta",
                                              "temperature", "scale_rewards", "loss_type", "num_iterations")}
    settings["versions"] = {name: importlib.metadata.version(name) for name in ("trl", "transformers", "torch")}
    return {"wall_s": wall, "samples": samples, "samples_per_s": samples / wall, "steady_samples_per_s": samples / wall,
            "eval_first": before, "held_out_final": greedy_accuracy(model, tokenizer, held_out_rows(prepared)),
            "eval_final": evals[-1]["accuracy"], "time_to_target_s": reached[0]["train_s"] if reached else None,
            "evals": evals, "settings": settings}


def run(quick: bool, repeats: int | None = None) -> dict:
    default_repeats, steps = (1, 12) if quick else (3, 40)  # 40: the quickstart's length, as in e2e
    repeats = repeats or default_repeats
    results = {"streamrl": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        console.log("warm start (once, shared by both systems)")
        cfg, prepared = prepare_shared(tmp)
        groups, n, lr = cfg.learner.groups_per_step, cfg.rollout.sampling.n, cfg.learner.lr
        for r in range(repeats):
            for side in (("streamrl", "trl") if r % 2 == 0 else ("trl", "streamrl")):
                if side == "trl":
                    row = trl_run(prepared, tmp / f"trl-{r}", steps=steps, groups=groups, n=n, lr=lr,
                                  eval_every=max(1, steps // 4), seed=r)
                else:
                    row = one_run(tmp / "runs", prepared, "single-turn", "async", steps, 2, seed=r)
                results[side].append(row)
                console.log(f"{side}: {row['samples_per_s']:.1f} samples/s, eval {row['eval_first']:.2f} → "
                            f"{row['eval_final']:.2f}")
    med = {side: medians(rows) for side, rows in results.items()}
    return {"study": "trl", "repeats": repeats, "max_steps": steps, "target": TARGET,
            "streamrl_settings": {"config": "configs/quickstart.yaml", "mode": "async", "max_staleness": 2,
                                  "groups_per_step": groups, "n": n, "lr": lr},
            "runs": results, "median": med, "ratio": med["streamrl"]["samples_per_s"] / med["trl"]["samples_per_s"],
            "steady_ratio": med["streamrl"]["steady_samples_per_s"] / med["trl"]["steady_samples_per_s"],
            "held_out_vs_trl": paired_difference([x["held_out_final"] for x in results["streamrl"]],
                                                 [x["held_out_final"] for x in results["trl"]])}


def report(data: dict, out: Path) -> None:
    m = data["median"]
    print_table(f"streamrl vs TRL GRPOTrainer, {data['max_steps']} steps, same samples, medians of {data['repeats']}",
                ["system", "samples/s", "steady samples/s", "train wall s", f"s to eval ≥ {data['target']}",
                 "final eval (64)", f"final held-out ({HELD_OUT})"],
                [[side, m[side]["samples_per_s"], m[side]["steady_samples_per_s"], m[side]["wall_s"],
                  f"{m[side]['time_to_target_s']:.0f} ({m[side]['reached_target']})", m[side]["eval_final"],
                  m[side]["held_out_final"]]
                 for side in ("streamrl", "trl")]
                + [["streamrl / TRL", data["ratio"], data["steady_ratio"], "", "", "", points(data["held_out_vs_trl"])]])
    json_path = write_json(out, "trl", data)
    fig, (ax,) = new_figure(1, "Samples/s on the quickstart task (same model, samples, machine)")
    ax.bar(["streamrl (async)", "TRL GRPOTrainer"], [m["streamrl"]["samples_per_s"], m["trl"]["samples_per_s"]])
    ax.set_ylabel("samples/s")
    save_figure(fig, out, "trl", json_path)


def main(quick: bool = False, out: Path = Path("benchmarks/results"), repeats: int | None = None) -> dict:
    require_trl()
    data = run(quick, repeats)
    report(data, out)
    return data


if __name__ == "__main__":
    cli(main, __doc__)
