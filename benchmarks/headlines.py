"""The table that opens ``docs/benchmarks.md``: the figures people ask for first, each beside its baseline.

Every row is one figure and a baseline measured in the same invocation on the same machine, their ratio, that
machine, and the command that measures both again. A study's figures come from its results (``NAME.json``: the
study's own fields, or the tables it printed), or, for a study whose results are not at hand, from the tables of
its section on the page as it was (a section states when and on how many cores it ran). Where the two sides of a
figure ran in different invocations, the table shows both numbers and no ratio, and a note says why; where a
side itself spans invocations, the figure is left out and a note says so.
"""

from __future__ import annotations

import re
from itertools import takewhile
from pathlib import Path

from benchmarks.common import median, points

# Published runs that joined seeds from more than one invocation before runs were stamped with theirs: the study
# and its results' time (the last invocation's), and what ran where. A later run of the study (another time) is
# judged on its own.
JOINED = {("trl_async", "2026-11-27T12:44:09+0000"): "seeds 0 and 1 ran in one invocation, seed 2 in a later one",
          ("engines", "2026-11-27T16:26:54+0000"): "seeds 0 and 1 ran in one invocation, seed 2 in a later one"}
COLUMNS = ["figure", "measured", "baseline (same invocation)", "ratio", "machine", "reproduce"]
RUN = re.compile(r"^Run (\S+) on (\d+) CPU cores(?: \((.*?)\))?[ .(]", re.M)


def from_section(section: str) -> dict:
    """A section of the page as a study's results: its machine (from the line saying when it ran) and its tables."""
    machine = {}
    if m := RUN.search(section):
        machine = {"time": m[1], "cpu_count": int(m[2]), **({"cpu": m[3]} if m[3] else {})}
    tables, lines = [], section.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("*") and line.endswith("*") and i + 3 < len(lines) and lines[i + 2].startswith("| "):
            block = list(takewhile(lambda row: row.startswith("|"), lines[i + 2:]))
            head, *body = [[c.strip() for c in row.strip()[1:-1].split("|")] for row in block[:1] + block[2:]]
            tables.append({"title": line[1:-1], "columns": head, "rows": [r for r in body if len(r) == len(head)]})
    return {"machine": machine, "tables": tables}


def machine(m: dict) -> str:
    """``2 CPU cores (AMD EPYC), run 2026-12-04 13:11``."""
    cores = f"{m['cpu_count']} CPU cores" if "cpu_count" in m else "cores not recorded"
    cpu = f" ({m['cpu']})" if m.get("cpu") else ""
    gpu = " + GPU" if m.get("cuda") else ""
    return f"{cores}{cpu}{gpu}, run {m.get('time', '')[:16].replace('T', ' ')}"


def invocation(stamp: str) -> str:
    """A run's invocation stamp (``2026-11-29T06:41:45+0000 (Intel(R) Xeon(R) Processor)``) as a machine cell."""
    if not stamp:
        return "an invocation not recorded"
    when, _, cpu = stamp.partition(" (")
    return f"{cpu.rstrip(')') or 'CPU not recorded'}, run {when[:16].replace('T', ' ')}"


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("x×%"))
    except ValueError:
        return None


def fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def table(data: dict, title: str) -> tuple[list[str], list[list[str]]] | None:
    """The first of a study's tables whose title starts with ``title``: its columns and rows."""
    t = next((t for t in data.get("tables", []) if t["title"].startswith(title)), None)
    return (t["columns"], t["rows"]) if t else None


def cells(data: dict, title: str, **match: str) -> dict[str, str] | None:
    """The first row of the table ``title`` whose named columns hold the given values, by column."""
    if not (t := table(data, title)):
        return None
    columns, rows = t
    for row in rows:
        named = dict(zip(columns, row))
        if all(named.get(k.replace("_", " ")) == v for k, v in match.items()):
            return named
    return None


class Rows:
    """The table's rows and notes as they are added."""

    def __init__(self) -> None:
        self.rows: list[list[str]] = []
        self.notes: list[str] = []

    def note(self, text: str) -> str:
        self.notes.append(text)
        return f"none (note {len(self.notes)})"

    def add(self, figure: str, measured: str, baseline: str, ratio: str, where: str, command: str) -> None:
        self.rows.append([figure, measured, baseline, ratio, where, f"`streamrl bench {command}`"])

    def pair(self, name: str, data: dict, figure: str, measured: float, baseline: float, ratio: float | str,
             command: str, unit: str = "") -> None:
        """A figure of a study whose two sides ran side by side, unless its runs are known to span invocations."""
        joined = JOINED.get((name, data["machine"].get("time")))
        shown = (self.note(f"{figure}: no ratio, {joined} (both sides in each); a ratio of the medians would "
                           "divide runs from different invocations. The study's section gives the ratio of its medians.")
                 if joined else ratio if isinstance(ratio, str) else f"{ratio:.2f}×")
        self.add(figure, fmt(measured) + unit, fmt(baseline) + unit, shown, machine(data["machine"]), command)


def e2e_rows(out: Rows, name: str, data: dict, model: str, command: str) -> None:
    """Async at each workload's shipped bound against sync: samples/s and held-out accuracy."""
    import yaml

    for workload, s in data.get("summary", {}).items():
        config = Path(data.get("workloads", {}).get(workload, ""))
        shipped = (yaml.safe_load(config.read_text()) or {}).get("off_policy", {}).get("max_staleness") \
            if config.is_file() else None
        modes = data.get("staleness_modes", {"async": data.get("max_staleness")})
        mode = next((m for m, b in modes.items() if b == shipped), "async")
        if mode not in s or "sync" not in s:
            continue
        ratios = s.get("ratios", {"async": s}).get(mode, {})
        runs = data.get("runs", {}).get(workload, {})
        stamps = {arm: {x.get("invocation", "") for x in runs.get(arm, [])} for arm in ("sync", mode)}
        what = f"{model}{workload}: async (max staleness {modes[mode]}, as shipped) / sync"
        cmd = f"{command} --workload {workload}"
        if stamps["sync"] | stamps[mode] <= {""} or stamps["sync"] == stamps[mode] and len(stamps[mode]) == 1:
            stamp = next(iter(stamps[mode]), "")
            where = invocation(stamp) if stamp else machine(data["machine"])
            out.add(f"{what}, samples/s", fmt(s[mode]["samples_per_s"]), fmt(s["sync"]["samples_per_s"]),
                    f"{ratios.get('ratio', s[mode]['samples_per_s'] / s['sync']['samples_per_s']):.2f}×", where, cmd)
            if "held_out_final" in s[mode]:
                diff = ratios.get("held_out_final_vs_sync")
                out.add(f"{what}, held-out first-try accuracy", f"{s[mode]['held_out_final']:.3f}",
                        f"{s['sync']['held_out_final']:.3f}", f"difference {points(diff)}" if diff else "",
                        where, cmd)
        elif all(len(stamps[arm]) == 1 for arm in stamps):
            note = out.note(f"{what}: no ratio, its sync runs and its async runs ran in different invocations "
                            f"({'; '.join(invocation(next(iter(stamps[a]))) + f' ({a[:5]})' for a in ('sync', mode))}); "
                            "each number is the median of runs from one invocation (a run's stamp names its CPU, "
                            "not its cores).")
            out.add(f"{what}, samples/s", fmt(s[mode]["samples_per_s"]), fmt(s["sync"]["samples_per_s"]), note,
                    f"{invocation(next(iter(stamps[mode])))} (async); {invocation(next(iter(stamps['sync'])))} (sync)",
                    cmd)
        else:
            out.note(f"Left out: {what}: its runs come from {len(stamps['sync'] | stamps[mode])} invocations "
                     "(a side's median spans more than one), so neither number is from one invocation.")


def trl_rows(out: Rows, name: str, data: dict, who: str, command: str) -> None:
    streamrl, trl, ratio = (cells(data, "streamrl (", system=s) for s in ("streamrl", "trl", "streamrl / TRL"))
    if streamrl and trl and ratio:
        out.pair(name, data, f"streamrl / TRL {who}, SmolLM2-135M two-digit addition, samples/s",
                 number(streamrl["samples/s"]), number(trl["samples/s"]), number(ratio["samples/s"]), command)


def rows(studies: dict[str, dict]) -> Rows:
    """The table's rows from each study's results (``studies``: by name, those at hand)."""
    out = Rows()
    if e2e := studies.get("e2e"):
        e2e_rows(out, "e2e", e2e, "toy ", "e2e")
    if e2e := studies.get("e2e_smollm2"):
        e2e_rows(out, "e2e_smollm2", e2e, "SmolLM2-135M ", "e2e --real-model")
    if data := studies.get("trl"):
        trl_rows(out, "trl", data, "GRPOTrainer", "trl")
    if data := studies.get("trl_async"):
        trl_rows(out, "trl_async", data, "AsyncGRPOTrainer (vLLM)", "trl --trl-trainer async")
    if (data := studies.get("weight_push")) and (t := table(data, "Seconds per weight push")):
        columns, body = t
        named = [dict(zip(columns, r)) for r in body if r[2:4] == ["1", "idle"]]
        for engine in ("hf", "vllm"):
            if row := next((r for r in reversed(named) if r["engine"] == engine), None):
                pushes = [number(v) for k, v in row.items() if k.endswith("bucket s") and number(v) is not None]
                out.pair("weight_push", data, f"weight push, {row['params']} params into one {engine} server, "
                         "seconds (best bucket size; baseline: one raw gloo broadcast of the same bytes)",
                         min(pushes), number(row["raw broadcast s"]), f"{number(row['best ratio']):.2f} (bound / push)",
                         "weight-push", " s")
    if data := studies.get("weight_push_verification"):
        for row in data.get("rows", []):  # a section read back from the page has tables alone: no row here
            for arm in ("digest", "digest+probe 256"):
                checked, plain = row["median_s"][arm], row["median_s"]["off"]
                out.pair("weight_push_verification", data, f"weight push, SmolLM2-135M into one {row['engine']} "
                         f"server, checked ({arm}) / unchecked, seconds", checked, plain, f"{checked / plain:.2f}×",
                         "weight-push --study verification", " s")
    if (data := studies.get("weight_push_fleet")) and "row" in data:
        row = data["row"]
        waves, once = row["median"]["waves of half"], row["median"]["all at once"]
        out.pair("weight_push_fleet", data, f"weight push, {row['servers']} {row['engine']} servers: seconds every "
                 "server is paused at once, per push (waves of half / all at once; most of the fleet paused at once: "
                 f"{waves['peak_paused_share']:.0%} / {once['peak_paused_share']:.0%})", waves["all_paused_s"],
                 once["all_paused_s"], f"{waves['all_paused_s'] / once['all_paused_s']:.2f}×" if once["all_paused_s"]
                 else "no pause at once on either side", "weight-push --study fleet", " s")
    if data := studies.get("lora"):
        for figure, what, unit, study in (("push into vllm: seconds", "push into a vllm server, seconds", " s", "push"),
                                          ("learner: trained tokens/s", "learner, trained tokens/s", "", "learner")):
            if row := cells(data, "LoRA (rank", figure=figure):
                ratio = number(row["LoRA / full"].split(" (")[0])
                out.pair("lora", data, f"LoRA (rank 16) / full fine-tuning, SmolLM2-135M: {what}",
                         number(row["LoRA"]), number(row["full"]), f"{ratio:.3g}×", f"lora --study {study}",
                         unit)
    if data := studies.get("engines"):
        vllm, hf, ratio = (cells(data, "configs/smollm2.yaml on each engine", engine=e) for e in ("vllm", "hf", "vllm / hf"))
        if vllm and hf and ratio:
            out.pair("engines", data, "vllm / hf engine, configs/smollm2.yaml for 60 steps, samples/s",
                     number(vllm["samples/s"]), number(hf["samples/s"]), number(ratio["samples/s"]), "engines")
    if data := studies.get("agent"):
        for model, m in data.get("models", {}).items():
            s = m["summary"]
            out.add(f"agent gateway / Env, {model}, the calculator task through one worker, samples/s",
                    fmt(s["agent"]["samples_per_s"]), fmt(s["env"]["samples_per_s"]),
                    f"{m['agent_over_env']:.2f}× (median of each repeat's)", machine(data["machine"]), "agent")
    if (data := studies.get("queue")) and (row := cells(data, "Replay stream throughput", group="16x4k", op="put")):
        out.pair("queue", data, "replay stream put, 16 samples of 4 KB a group, MB/s (baseline: raw redis-py XADD)",
                 number(row["streamrl MB/s"]), number(row["raw redis-py MB/s"]), number(row["streamrl/raw"]), "queue")
    if data := studies.get("learner"):
        ours = cells(data, "Learner step", workload="smollm2", side="streamrl, shared prompts")
        plain = cells(data, "Learner step", workload="smollm2", side="plain loop, packed")
        if ours and plain:
            out.pair("learner", data, "learner step, SmolLM2-135M, real tokens/s (baseline: a plain PyTorch loop on "
                     "the same packed rows)", number(ours["tokens/s"]), number(plain["tokens/s"]),
                     f"{number(ours['vs plain packed']):.2f}× (median of each repeat's)", "learner")
    if (data := studies.get("learner")) and (row := cells(data, "What recording costs", workload="smollm2-recipe")):
        out.pair("learner", data, "learner step, configs/smollm2.yaml's batch, recorded (weights' hash and the "
                 "record's frame written) / not, seconds", number(row["step with (s)"]),
                 number(row["step without (s)"]), f"{row['cost']} (median of each repeat's)", "learner", " s")
    if (data := studies.get("counterfactual")) and "arms" in data:  # not a section read back from the page
        arm = data["arms"]["decoupled"]
        recorded = median([r["recorded_train_s"] for r in data["runs"]])
        replayed = median([r["arms"]["decoupled"]["train_s"] for r in data["runs"]])
        out.pair("counterfactual", data, "streamrl replay / the recorded run's learner, agentic toy, seconds of "
                 f"training per step ({'bit for bit identical' if arm['identical'] else 'NOT identical'})", replayed,
                 recorded, f"{arm['replay_vs_recorded_speed']:.2f}× speed (median of each run's)", "counterfactual",
                 " s")
    if (data := studies.get("soak")) and (t := table(data, "Memory per part")):
        columns, body = t
        parts = [dict(zip(columns, r)) for r in body]
        if worst := max(parts, key=lambda p: number(p["growth"]) or 0.0, default=None):
            minutes = re.search(r"over a (\d+)-minute", table_title(data, "Memory per part"))
            out.pair("soak", data, f"soak: the largest memory growth after warm-up"
                     f"{f' over {minutes[1]} minutes' if minutes else ''} ({worst['part']}), MB (baseline: "
                     "the same part just after warm-up)", number(worst["end MB"]), number(worst["after warm-up MB"]),
                     f"{worst['growth']} growth", "soak", " MB")
    return out


def table_title(data: dict, title: str) -> str:
    return next((t["title"] for t in data.get("tables", []) if t["title"].startswith(title)), "")


def markdown(studies: dict[str, dict]) -> str:
    """The table, its notes, and how to read it; empty without a figure."""
    out = rows(studies)
    if not out.rows:
        return ""
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    text = ("## Headlines\n\nThe figures asked for first. Each stands beside a baseline measured in the same "
            "invocation on the same machine, and no ratio divides runs from different machines or invocations; "
            "medians of the repeats its study's section names. The studies follow, with every figure.\n\n"
            + head + "".join("| " + " | ".join(r) + " |\n" for r in out.rows))
    if out.notes:
        text += "\n" + "".join(f"{i}. {n}\n" for i, n in enumerate(out.notes, 1))
    return text
