"""``streamrl bench report``: every study's results as one Markdown page with its plots.

Reads ``benchmarks/results/NAME.json`` (the tables each study printed are saved in it) and
``NAME.png``, copies both next to the page (where a study's later seeds find its runs), and writes
``docs/benchmarks.md``. A study with no
results file keeps its section and headlines from the page as it was (each section states the date
it ran), so the studies can be rerun one at a time.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

from benchmarks.common import ACROSS, console, points

TITLES = {"queue": "Replay stream", "partition": "Micro-batch partitioning", "generate": "Generation",
          "learner": "Learner", "weight_push": "Weight push", "e2e": "End to end: async vs sync",
          "e2e_smollm2": "End to end on SmolLM2-135M: async vs sync",
          "ablation": "Ablations on the agentic workload", "trl": "Against TRL", "simulate": "Simulated fleets",
          "soak": "Soak: memory over a long run", "agent": "Agents through the gateway",
          "nodes": "One node or two on Ray", "lora": "LoRA against full fine-tuning",
          "trl_async": "Against TRL's AsyncGRPOTrainer", "trl_async_lora": "Against TRL's AsyncGRPOTrainer, LoRA",
          "trl_tune": "TRL's AsyncGRPOTrainer: its settings here", "engines": "The real-model recipe on each engine",
          "stress": "Stale data on purpose: the auto staleness bound under stress"}
MODULES = {"queue": "replay_stream", "trl": "against_trl", "e2e_smollm2": "e2e"}  # a study's module, where not its own name
COMMANDS = {"e2e_smollm2": "e2e --real-model", "trl_async": "trl --trl-trainer async", "trl_async_lora": "trl --trl-trainer async --lora"}
HEADLINES = {"e2e": "- **async (", "e2e_smollm2": "- **SmolLM2-135M: async (", "ablation": "- **ablation `", "trl": "- **streamrl / TRL GRPOTrainer",
             "trl_async": "- **streamrl / TRL AsyncGRPOTrainer (vLLM)**",
             "trl_async_lora": "- **streamrl / TRL AsyncGRPOTrainer (vLLM, LoRA)**", "soak": "- **soak**",
             "agent": "- **agent gateway", "lora": "- **LoRA / full", "engines": "- **vllm / hf engine",
             "stress": "- **stress"}


def about(name: str) -> str:
    """What a study measures and how: its module's docstring, in Markdown, without the usage line."""
    if name == "trl_async_lora":  # the async study's text, with what changes for an adapter
        return (about("trl_async") + "\nHere both sides train `configs/smollm2-lora.yaml`'s adapter (rank 16, every "
                "linear layer, its learning rate): streamrl pushes it into its vLLM server's LoRA slots, TRL loads "
                "each version through vLLM's LoRA routes (`trl-policy-vN`).\n")
    if name == "e2e_smollm2":  # the toy study's method (its section above), on the real model's workloads
        real = next(p for p in about("e2e").split("\n\n") if p.startswith("With `--real-model`"))
        return "The end-to-end study of the section above. " + real + "\n"
    path = Path(__file__).parent / f"{MODULES.get(name, name)}.py"
    text = ast.get_docstring(ast.parse(path.read_text())) or ""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("python -m benchmarks")]
    return "\n".join(lines).strip().replace("``", "`") + "\n"


def markdown_table(table: dict) -> str:
    head = "| " + " | ".join(table["columns"]) + " |\n|" + "---|" * len(table["columns"]) + "\n"
    return f"*{table['title']}*\n\n" + head + "".join("| " + " | ".join(row) + " |\n" for row in table["rows"])


def heading(name: str) -> str:
    return f"## {TITLES[name]} (`streamrl bench {COMMANDS.get(name, name.replace('_', '-'))}`)"


def previous(page: Path) -> tuple[dict[str, str], list[str]]:
    """The page as it was: each study's section by name, and its headline lines."""
    text = page.read_text() if page.is_file() else ""
    chunks = ["## " + c for c in text.split("\n## ")[1:]]
    sections = {name: c.rstrip("\n") + "\n" for name in TITLES for c in chunks if c.startswith(heading(name) + "\n")}
    lines = [line for c in chunks if c.startswith("## Headlines\n") for line in c.splitlines() if line.startswith("- ")]
    return sections, lines


def _peak(arm: dict) -> float:
    """A LoRA study arm's peak memory (``peak_rss_gb`` in runs written before GPU figures were kept apart)."""
    return arm.get("peak_memory_gb", arm.get("peak_rss_gb"))


def headlines(results: Path) -> list[str]:
    """The few figures people ask for first, from the studies that have run."""
    def load(name: str) -> dict | None:
        path = results / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    lines = []
    for name, model in (("e2e", ""), ("e2e_smollm2", "SmolLM2-135M: ")):
        if not (e2e := load(name)):
            continue
        for workload, s in e2e["summary"].items():
            bounds = e2e.get("staleness_modes", {"async": e2e["max_staleness"]})
            runs = [x for rows in e2e.get("runs", {}).get(workload, {}).values() for x in rows]
            two_scores = any(x.get("held_out_reward", x.get("held_out_final")) != x.get("held_out_final") for x in runs)
            for mode, r in s.get("ratios", {"async": s}).items():
                across = "" if r.get("one_invocation", True) else ACROSS
                line = (f"- **{model}async (max staleness {bounds[mode]}) / sync, {workload}**{across}: "
                        f"{r['ratio']:.2f}× samples/s "
                        f"(steady state {r['steady_ratio']:.2f}×), medians of {s[mode].get('runs', e2e['repeats'])}")
                for key, what in (("held_out_final", "final first-try accuracy"), ("held_out_reward", "final reward")):
                    if key in s[mode] and (key == "held_out_final" or two_scores):
                        diff = f" (paired difference {points(r[key + '_vs_sync'])})" if key + "_vs_sync" in r else ""
                        line += f"; {what} {s[mode][key]:.3f} vs {s['sync'][key]:.3f}{diff}"
                lines.append(line)
    if ablation := load("ablation"):
        for study, result in ablation["studies"].items():
            arms = result["arms"]
            for arm, s in arms.items():
                for base, a in s["against"].items():
                    if s["mode"] != "sync" and arms[base]["mode"] == "sync":  # the async/sync trade, side by side
                        lines.append(f"- **ablation `{study}`, {arm} / {base}**: {a['ratio']:.2f}× samples/s; final "
                                     f"first-try accuracy {s['held_out_final']:.3f} vs {arms[base]['held_out_final']:.3f}"
                                     f" (paired difference {points(a['held_out_final'])})")
    for name in ("trl", "trl_async", "trl_async_lora"):
        if trl := load(name):
            lines.append(trl_headline(name, trl))
    if agent := load("agent"):
        for name, m in agent.get("models", {}).items():
            s = m["summary"]
            lines.append(f"- **agent gateway / Env, {name}** (the calculator task, one worker): "
                         f"{m['agent_over_env']:.2f}× samples/s ({s['agent']['samples_per_s']:.3g} vs "
                         f"{s['env']['samples_per_s']:.3g}; medians of {agent['repeats']})")
    if stress := load("stress"):
        lines.extend(stress_headline(key, data) for key, data in stress["variants"].items())
    if lora := load("lora"):
        push = ", ".join(f"{p['lora']['median_s']:.2f} vs {p['full']['median_s']:.2f} s into {engine}"
                         for engine, p in lora.get("push", {}).items())
        line = f"- **LoRA / full fine-tuning, SmolLM2-135M** (rank 16, every linear layer): push {push}"
        if large := lora.get("push_large"):
            p = large["vllm"]
            line += f" (at {large['size']}: {p['lora']['median_s']:.2f} vs {p['full']['median_s']:.2f} s)"
        if learner := lora.get("learner"):
            line += (f"; learner {learner['lora']['tokens_per_s'] / learner['full']['tokens_per_s']:.2f}× tokens/s, "
                     f"peak memory {_peak(learner['lora']):.1f} vs {_peak(learner['full']):.1f} GB")
        if acc := lora.get("accuracy"):
            m = acc["median"]
            line += (f"; held-out accuracy {m['lora']['held_out_final']:.3f} vs {m['full']['held_out_final']:.3f} "
                     f"(paired difference {points(acc['held_out_lora_vs_full'])})")
        lines.append(line)
    if engines := load("engines"):
        lines.append(engines_headline(engines))
    if soak := load("soak"):
        worst = max(soak["growth"].items(), key=lambda kv: kv[1]["growth"], default=None)
        if worst:
            lines.append(f"- **soak**: {soak['minutes']:.0f} min; largest memory growth after warm-up "
                         f"{worst[1]['growth']:+.1%} ({worst[0]})")
    return lines


def engines_headline(engines: dict) -> str:
    m, n = engines["median"], len(engines["runs"]["hf"])
    reached = {e: f"{m[e]['time_to_target'] / 60:.1f} min ({m[e]['reached']}/{n} runs)" if m[e]["reached"]
               else "not reached" for e in m}
    return (f"{HEADLINES['engines']}, configs/smollm2.yaml** ({engines['steps']} steps): {engines['speedup']:.2f}× "
            f"samples/s ({m['vllm']['samples_per_s']:.3g} vs {m['hf']['samples_per_s']:.3g}; medians of {n}), time to "
            f"{engines['target']} {reached['vllm']} vs {reached['hf']}, held-out accuracy "
            f"{m['vllm']['held_out_final']:.3f} vs {m['hf']['held_out_final']:.3f} "
            f"(paired difference {points(engines['held_out_vllm_vs_hf'])})")


def stress_headline(key: str, stress: dict) -> str:
    """One variant's line (``key``: its overrides, or "as shipped")."""
    s, (first, every, seconds) = stress["summary"], stress["pauses"]
    return (f"{HEADLINES['stress']}, {key} (the toy's agentic workload, the learner stopped {seconds:.0f} s every "
            f"{every} steps from step {first})**: held-out accuracy auto {s['auto']['held_out_final']:.3f} "
            f"({points(s['auto']['vs_sync'])} from sync), fixed 8 {s['fixed 8']['held_out_final']:.3f} "
            f"({points(s['fixed 8']['vs_sync'])}), sync {s['sync']['held_out_final']:.3f}; lowest ESS "
            f"{s['auto']['ess_min']:.2f} vs {s['fixed 8']['ess_min']:.2f}; samples/s {s['auto']['samples_per_s']:.3g} "
            f"vs {s['fixed 8']['samples_per_s']:.3g}; medians of {stress['repeats']}")


def trl_headline(name: str, trl: dict) -> str:
    m = trl["median"]
    steady = f", steady state {trl['steady_ratio']:.2f}×" if "steady_ratio" in trl else ""
    ran = trl.get("streamrl_settings")
    if name == "trl":
        task = " on SmolLM2-135M" if trl.get("config") == "configs/smollm2.yaml" else ""
        head = HEADLINES[name] + task + "**"
    else:
        head = HEADLINES[name]
    how = f" (streamrl {ran['mode']}, max staleness {ran['max_staleness']})" if ran else ""
    return (f"{head}{how}: {trl['ratio']:.2f}× samples/s{steady} ({m['streamrl']['samples_per_s']:.3g} vs "
            f"{m['trl']['samples_per_s']:.3g}; medians of {trl['repeats']})"
            + (f", final accuracy {m['streamrl']['held_out_final']:.2f} vs {m['trl']['held_out_final']:.2f}"
               if "held_out_final" in m["trl"] else "")
            + (f" (paired difference {points(trl['held_out_vs_trl'])})" if "held_out_vs_trl" in trl else ""))


def build(results: Path, page: Path) -> Path:
    rerun = [name for name in TITLES if (results / f"{name}.json").is_file()]
    if not rerun:
        raise FileNotFoundError(f"no study results in {results}: run `streamrl bench NAME` first")
    kept, old_headlines = previous(page)
    plots = page.parent / "benchmarks"
    plots.mkdir(parents=True, exist_ok=True)
    machine = json.loads((results / f"{rerun[0]}.json").read_text())["machine"]
    parts = ["# Benchmarks\n",
             f"Measured on {machine['platform']}, {machine['cpu_count']} CPU cores, torch {machine['torch']} "
             f"({'CUDA' if machine['cuda'] else 'no GPU'}). Every figure stands beside a baseline measured in the "
             "same run on the same machine; figures are medians of the repeats each table names. "
             "Regenerate with `streamrl bench NAME` for each study, then `streamrl bench report`. Each study's "
             "runs, figure by figure, are in `docs/benchmarks/NAME.json`, beside its plot.\n"]
    new_headlines = headlines(results)
    lines = [line for name, prefix in HEADLINES.items() for line in (new_headlines if name in rerun else old_headlines)
             if line.startswith(prefix)]
    if lines:
        parts.extend(["## Headlines\n", "\n".join(lines) + "\n"])
    for name in TITLES:
        if name not in rerun:
            if name in kept:
                parts.append(kept[name])
            continue
        data = json.loads((results / f"{name}.json").read_text())
        shutil.copy(results / f"{name}.json", plots / f"{name}.json")  # the runs themselves, for later seeds to join
        parts.append(heading(name) + "\n")
        m = data["machine"]
        parts.append(f"Run {m['time']} on {m['cpu_count']} CPU cores" + (f" ({m['cpu']})" if "cpu" in m else "")
                     + (" (quick setting: fewer repeats and sizes)" if data.get("quick") else "") + ".\n")
        parts.append(about(name))
        parts.extend(markdown_table(t) for t in data.get("tables", []))
        for png in sorted(results.glob(f"{name}*.png")):  # the study's plot, then any extra ones (NAME_x.png)
            if png.stem != name and (not png.stem.startswith(name + "_") or png.stem in TITLES):
                continue
            shutil.copy(png, plots / png.name)
            parts.append(f"![{TITLES[name]}](benchmarks/{png.name})\n")
    page.write_text("\n".join(parts))
    console.print(f"wrote {page} ({len(rerun)} studies from {results}, {len(kept.keys() - set(rerun))} kept from the page)")
    return page


def main(quick: bool = False, out: Path = Path("benchmarks/results")) -> Path:
    return build(out, Path("docs/benchmarks.md"))


if __name__ == "__main__":
    from benchmarks.common import cli

    cli(main, __doc__)
