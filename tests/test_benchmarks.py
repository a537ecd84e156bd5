import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import run_suite


@pytest.mark.slow
def test_queue_benchmark_quick_writes_table_json_and_plot(tmp_path, capsys):
    run_suite("queue", quick=True, out=tmp_path)
    data = json.loads((tmp_path / "queue.json").read_text())
    assert {"machine", "results", "repeats"} <= set(data)
    for row in data["results"]:
        assert len(row["seconds"]["ours_put"]) == len(row["seconds"]["raw_put"]) == data["repeats"]
        assert row["ratio_put"] > 0 and row["ratio_read"] > 0
    assert (tmp_path / "queue.png").stat().st_size > 10_000
    assert "Replay stream throughput" in capsys.readouterr().out


def test_partition_benchmark_quick(tmp_path):
    data = run_suite("partition", quick=True, out=tmp_path)
    for case in data["cases"]:  # KK is never worse than a random equal-count split
        assert case["median"]["KK"] <= case["median"]["equal"]
    assert (tmp_path / "partition.png").exists() and (tmp_path / "partition.json").exists()


def test_paired_difference_is_the_mean_difference_with_a_t_interval():
    from benchmarks.common import paired_difference, points

    d = paired_difference([1.0, 2.5, 3.0], [0.0, 0.5, 0.0])  # differences 1, 2, 3: mean 2, sd 1
    assert d["mean"] == pytest.approx(2.0)
    assert d["ci95"] == pytest.approx(4.303 / 3**0.5, rel=1e-3)  # t(0.975, 2 df) * sd / sqrt(n)
    assert d["pairs"] == 3
    assert points(paired_difference([0.92, 0.95], [0.93, 0.94])) == "+0.0 ± 12.7 pts (2 pairs)"
    one = paired_difference([0.9], [0.8])
    assert one["mean"] == pytest.approx(0.1) and one["ci95"] != one["ci95"]  # one pair: no interval
    assert points(one) == "+10.0 pts (1 pair)"
    with pytest.raises(ValueError, match="paired runs: 2 against 1"):
        paired_difference([0.1, 0.2], [0.1])


def test_learner_study_counts_what_each_side_computes():
    from benchmarks.learner import WORKLOADS, computed_per_real, make_sequences, padded_bands

    shape = WORKLOADS["smollm2"]
    seqs = make_sequences(shape, 200, seed=1)
    lengths = [len(s) for s in seqs]
    assert min(lengths) >= shape["lengths"][0] and max(lengths) <= shape["lengths"][1]
    bands = padded_bands(lengths, shape["budget"])
    assert sorted(i for band in bands for i in band) == list(range(len(seqs)))
    assert all(len(band) * max(lengths[i] for i in band) <= shape["budget"] for band in bands)
    computed = computed_per_real(seqs, shape["budget"])
    assert computed["streamrl"] == 1.0 < computed["plain-padded"]  # packing computes no padding

def test_held_out_episodes_are_the_envs_own_first_try_accuracy_and_discounted_reward():
    """The retry env around exact-match questions: a wrong reply hears the feedback and the question again."""
    from benchmarks.scoring import play_episodes
    from streamrl.config import load_config

    cfg = load_config("configs/agentic.yaml", ["rollout.env_args.latency_s=0"])
    rows = [{"prompt": "Reverse: ab", "answer": "ba"}, {"prompt": "Reverse: cd", "answer": "dc"},
            {"prompt": "Reverse: ef", "answer": "fe"}]
    seen = []

    def reply(conversations):  # right first on row 0, right second on row 1, never on row 2
        seen.append(conversations)
        return [{"Reverse: ab": "ba", "Reverse: cd": "cd" if len(c) == 1 else "dc"}.get(c[0]["content"], "x")
                for c in conversations]

    assert play_episodes(cfg, rows, reply) == {"accuracy": 1 / 3, "reward": (1 + 0.5 + 0) / 3}
    assert [len(batch) for batch in seen] == [3, 2]  # only the wrong ones try again
    assert seen[1][0][1:] == [{"role": "assistant", "content": "cd"},
                              {"role": "user", "content": "That is not right. Reverse: cd"}]
    one_try = load_config("configs/quickstart.yaml")
    assert play_episodes(one_try, rows, reply) == {"accuracy": 1 / 3, "reward": 1 / 3}  # the reward is the accuracy


def test_the_report_says_what_each_study_measures_from_its_module_docstring():
    from benchmarks import report

    for name in report.TITLES:
        text = report.about(name)
        assert len(text) > 100 and "python -m benchmarks" not in text and "``" not in text, name
    assert "discount: 0.5" in report.about("e2e") and "XADD" in report.about("queue")
    assert "smollm2-agentic.yaml" in report.about("e2e_smollm2") and "discount" not in report.about("e2e_smollm2")


def test_ablation_pairs_arms_by_seed_and_writes_table_json_and_plot(tmp_path, capsys):
    from benchmarks import ablation

    arms = {"base": ("sync", 0, (), ()), "change": ("async", 2, ("learner.credit=turn",), ("base",))}

    def run(seed, samples_per_s, held_out):
        return {"seed": seed, "samples_per_s": samples_per_s, "dropped_fraction": 0.1 * seed,
                "held_out_final": held_out, "held_out_reward": held_out - 0.01}

    rows = {"base": [run(0, 10.0, 0.90), run(1, 12.0, 0.95), run(2, 11.0, 0.92)],
            "change": [run(2, 30.0, 0.93), run(0, 33.0, 0.90), run(1, 36.0, 0.93)]}  # in any order: paired by seed
    summary = ablation.summarise(arms, rows)
    against = summary["change"]["against"]["base"]
    assert against["ratio"] == pytest.approx(33.0 / 11.0)
    assert against["held_out_final"]["mean"] == pytest.approx((0.0 - 0.02 + 0.01) / 3)
    assert against["held_out_final"]["pairs"] == 3 and summary["base"]["against"] == {}
    assert summary["change"]["dropped_fraction"] == pytest.approx(0.1)
    ablation.report({"study": "ablation", "studies": {"credit": {"max_steps": 40, "arms": summary, "runs": rows}}},
                    tmp_path)
    saved = json.loads((tmp_path / "ablation.json").read_text())
    assert [row[0].strip() for row in saved["tables"][0]["rows"]] == ["base", "change", "change / base"]
    assert saved["tables"][0]["rows"][2][1] == "3.00×" and "Ablation `credit`" in capsys.readouterr().out
    assert saved["studies"]["credit"]["arms"]["change"]["against"]["base"]["ratio"] == pytest.approx(3.0)
    assert (tmp_path / "ablation.png").stat().st_size > 10_000
    with pytest.raises(SystemExit, match="unknown study 'nope'"):
        ablation.main(out=tmp_path, study="nope")


def test_trl_study_stops_before_any_run_when_trl_is_missing(monkeypatch):
    import importlib.util

    from benchmarks import against_trl

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    monkeypatch.setattr(against_trl, "run", lambda *a, **k: pytest.fail("ran without TRL"))
    with pytest.raises(SystemExit, match=r"streamrl\[bench\]"):
        against_trl.main(quick=True)


TRL_COLUMNS = ["system", "samples/s", "held-out greedy accuracy"]


def trl_table(title: str, ours: str, theirs: str, ratio: str) -> dict:
    return {"title": title, "columns": TRL_COLUMNS, "rows": [["streamrl", ours, "0.6"], ["trl", theirs, "0.6"],
                                                             ["streamrl / TRL", ratio, ""]]}


def test_the_report_keeps_the_sections_of_studies_not_rerun_and_opens_with_one_headline_table(tmp_path):
    from benchmarks import report

    page = tmp_path / "docs" / "benchmarks.md"
    page.parent.mkdir()
    page.write_text("# Benchmarks\n\nold intro\n\n## Headlines\n\n- **async (max staleness 2) / sync, x**: 3.00×\n"
                    "- **streamrl / TRL GRPOTrainer**: 1.10× samples/s\n\n"
                    "## Replay stream (`streamrl bench queue`)\n\nRun 2026-11-22T10:17:08+0000 on 2 CPU cores.\n\n"
                    "*Replay stream throughput, medians of 5 runs*\n\n"
                    "| group | op | streamrl MB/s | raw redis-py MB/s | streamrl/raw |\n|---|---|---|---|---|\n"
                    "| 16x4k | put | 128.17 | 520.12 | 0.25 |\n| 16x4k | read | 210.97 | 367.92 | 0.57 |\n\n"
                    "## Against TRL (`streamrl bench trl`)\n\nold trl table\n")
    results = tmp_path / "results"
    results.mkdir()
    machine = {"platform": "test", "cpu_count": 2, "cpu": "AMD EPYC", "torch": "x", "cuda": False,
               "time": "2026-12-01T10:00:00+0000"}
    (results / "trl.json").write_text(json.dumps({
        "machine": machine, "repeats": 3, "ratio": 1.34, "median": {},
        "tables": [trl_table("streamrl (bf16) vs TRL GRPOTrainer", "579.00", "432.00", "1.34")]}))
    text = report.build(results, page).read_text()
    assert "old queue table" not in text and "| 16x4k | read | 210.97 |" in text and "old trl table" not in text
    assert "3.00×" not in text and "1.10×" not in text and "\n- **" not in text  # the bullets are gone
    head = text[text.index("## Headlines"):text.index("## Replay stream")]
    rows = [line for line in head.splitlines() if line.startswith("| ")]
    assert rows[0] == "| " + " | ".join(report.headlines.COLUMNS) + " |"
    trl = next(r for r in rows if "TRL GRPOTrainer" in r)  # from the new results
    assert "| 579.0 | 432.0 | 1.34× | 2 CPU cores (AMD EPYC), run 2026-12-01 10:00 | `streamrl bench trl` |" in trl
    queue = next(r for r in rows if "replay stream put" in r)  # from the section the page kept
    assert "| 128.2 | 520.1 | 0.25× | 2 CPU cores, run 2026-11-22 10:17 | `streamrl bench queue` |" in queue
    assert text.index("## Headlines") < text.index("## Replay stream") < text.index("## Against TRL")

    # TRL's async trainer: a section of its own, and no plot of its under the sync one
    (results / "trl_async.json").write_text(json.dumps({
        "machine": machine, "repeats": 3, "ratio": 1.6, "trl_trainer": "async",
        "tables": [trl_table("streamrl (fp32) vs TRL AsyncGRPOTrainer", "2.00", "1.25", "1.60")]}))
    for name in ("trl", "trl_async"):
        (results / f"{name}.png").write_bytes(b"png")
    text = report.build(results, page).read_text()
    assert "| 2.00 | 1.25 | 1.60× |" in text and "| 579.0 | 432.0 | 1.34× |" in text
    sync = text[text.index("## Against TRL (`streamrl bench trl`)"):text.index("## Against TRL's AsyncGRPOTrainer")]
    assert "trl.png" in sync and "trl_async.png" not in sync
    assert "## Against TRL's AsyncGRPOTrainer (`streamrl bench trl --trl-trainer async`)" in text
    assert "benchmarks/trl_async.png" in text
    assert report.build(results, page).read_text() == text  # a page rebuilt from itself is the same
    # the published runs that joined seeds of two invocations: their two numbers, no ratio, and a note why
    joined = {**machine, "time": "2026-11-27T12:44:09+0000"}
    (results / "trl_async.json").write_text(json.dumps({"machine": joined, "tables": [
        trl_table("streamrl (fp32) vs TRL AsyncGRPOTrainer", "2.95", "1.73", "1.70")]}))
    text = report.build(results, page).read_text()
    assert "| 2.95 | 1.73 | none (note 1) |" in text and "1.70×" not in text
    assert "\n1. streamrl / TRL AsyncGRPOTrainer (vLLM), SmolLM2-135M two-digit addition, samples/s: no ratio" in text
    # the published results alone (``--out docs/benchmarks``): nothing to copy onto itself
    assert report.build(page.parent / "benchmarks", page).read_text() == text


def test_published_results_are_what_later_seeds_join_where_the_results_folder_is_empty(tmp_path, monkeypatch):
    from benchmarks import report
    from benchmarks.common import RESULTS, earlier_results

    monkeypatch.chdir(tmp_path)  # a fresh checkout: the page and its published results, no benchmarks/results
    RESULTS.mkdir(parents=True)
    machine = {"platform": "test", "cpu_count": 2, "torch": "x", "cuda": False, "time": "today"}
    ran = {"machine": machine, "repeats": 1, "ratio": 1.3, "runs": {"x": [{"seed": 0}]},
           "median": {"streamrl": {"samples_per_s": 2.6}, "trl": {"samples_per_s": 2.0}}}
    (RESULTS / "trl.json").write_text(json.dumps(ran))
    report.build(RESULTS, Path("docs/benchmarks.md"))
    assert json.loads(Path("docs/benchmarks/trl.json").read_text()) == ran  # published beside the page
    (RESULTS / "trl.json").unlink()
    assert earlier_results(RESULTS, "trl") == ran  # the study's own folder empty: the published runs
    assert earlier_results(tmp_path / "elsewhere", "trl") is None  # another folder is a study of its own
    (RESULTS / "trl.json").write_text(json.dumps({**ran, "ratio": 2.0}))
    assert earlier_results(RESULTS, "trl")["ratio"] == 2.0  # runs not yet published come first


def test_trl_study_gives_trl_the_envs_prompts_and_rewards_and_counts_the_bound(tmp_path):
    from benchmarks.against_trl import fraction_of_bound
    from benchmarks.smollm2 import play
    from streamrl.config import load_config

    cfg = load_config("configs/smollm2.yaml", [f"run.dir={tmp_path}"])
    items = [{"question": "What is 12 + 30?", "answer": 42}, {"question": "What is 1 + 1?", "answer": 2}]
    assert play(cfg, items)[0] == [{"role": "user", "content": "What is 12 + 30? Answer with the number only."}]
    verdicts = play(cfg, items, ["42", "The answer is 3"])
    assert [v.reward for v in verdicts] == [pytest.approx(1.1), 0.0]  # right and bare; wrong
    assert [v.info["correct"] for v in verdicts] == [True, False]
    # 2 samples/s of (30 + 10) tokens at 8 FLOPs per parameter a token, 100 params, on 128 kFLOP/s: half the bound
    b = {"params": 100, "prompt_tokens": 30.0, "matmul_flops": 128_000.0}
    assert fraction_of_bound({"samples_per_s": 2.0, "completion_tokens": 10.0}, b) == pytest.approx(0.5)


def test_the_matmul_bound_is_read_on_every_core_and_leaves_the_callers_threads(monkeypatch):
    """A learner or TRL's trainer may have set the process's torch threads to its own share: the machine's bound
    is every core's rate all the same."""
    import torch

    from benchmarks.common import matmul_flops

    seen, randn, threads = [], torch.randn, torch.get_num_threads()
    monkeypatch.setattr(torch, "randn", lambda *a, **k: seen.append(torch.get_num_threads()) or randn(*a, **k))
    torch.set_num_threads(1)
    try:
        assert matmul_flops(size=64, seconds=0.02, windows=2) > 0
        assert seen == [os.cpu_count()] * 2 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_the_bound_read_after_the_runs_keeps_the_higher_of_each_reading(monkeypatch):
    from benchmarks import against_trl

    monkeypatch.setattr(against_trl, "matmul_flops", lambda dtype=None: 5.0 if dtype is None else 7.0)
    before = {"matmul_flops": 9.0, "matmul_flops_bf16": 1.0}  # fp32's first reading was the higher, bf16's the lower
    assert against_trl.matmul_rates(before) == {"matmul_flops": 9.0, "matmul_flops_bf16": 7.0}
    assert against_trl.matmul_rates() == {"matmul_flops": 5.0, "matmul_flops_bf16": 7.0}


def test_chat_prompt_ids_are_the_rendered_prompts_tokens(tmp_path):
    from transformers import AutoTokenizer

    from benchmarks.common import chat_prompt_ids
    from streamrl.models import make_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "m"))
    chat = [{"role": "user", "content": "What is 12 + 30?"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    want = tokenizer(text, add_special_tokens=False).input_ids
    assert len(want) > 10 and chat_prompt_ids(tokenizer, [chat, chat]) == [want, want]


def test_lora_study_merges_its_studies_figures_into_one_table(tmp_path, capsys):
    from benchmarks import lora

    with pytest.raises(SystemExit, match="not one of push, push-large, learner, accuracy"):
        lora.main(study="nope", out=tmp_path)
    push = {"full": {"median_s": 0.8, "bytes": 500 * 2**20}, "lora": {"median_s": 0.1, "bytes": 20 * 2**20},
            "time_ratio": 0.125, "byte_ratio": 0.04}
    lora.report({"steps": 60, "push": {"vllm": push}}, tmp_path)
    cpu = json.loads((tmp_path / "lora.json").read_text())["machine"]
    learner = {arm: {"tokens_per_s": t, "peak_rss_gb": 9.0, "trained_params": p}  # a run's from before GPUs
               for arm, t, p in (("full", 200.0, 135e6), ("lora", 260.0, 4.9e6))}
    lora.report({"learner": learner}, tmp_path)  # a later run of another study: both in the table
    printed = capsys.readouterr().out
    assert "push into vllm: seconds" in printed and "0.125 (1/8)" in printed and "1.30" in printed
    data = json.loads((tmp_path / "lora.json").read_text())
    assert data["push"]["vllm"]["time_ratio"] == 0.125 and data["learner"]["lora"]["tokens_per_s"] == 260.0
    assert (tmp_path / "lora.png").is_file()

    gpu = {"machine": {"cpu_count": 16, "cuda": True}, **{
        arm: {"tokens_per_s": t, "peak_memory_gb": m, "trained_params": 1.0, "device": "NVIDIA H200"}
        for arm, t, m in (("full", 16000.0, 8.0), ("lora", 11200.0, 6.8))}}
    large = {"full": {"median_s": 8.0, "bytes": 6800 * 2**20}, "lora": {"median_s": 0.2, "bytes": 70 * 2**20},
             "time_ratio": 0.025, "byte_ratio": 0.01}
    lora.report({"learner_gpu": gpu, "push_large": {"size": "1.7B", "vllm": large}}, tmp_path)
    data = json.loads((tmp_path / "lora.json").read_text())
    rows = {row[0]: row[1:] for row in data["tables"][-1]["rows"]}
    assert rows["learner on NVIDIA H200: trained tokens/s"][2] == "0.70"
    assert rows["learner on NVIDIA H200: peak memory GB (GPU, peak allocated)"][2] == "0.85"
    assert rows["learner: trained tokens/s"][2] == "1.30"  # the CPU's figures stay beside the GPU's
    assert rows["push into vllm at 1.7B: seconds"][2] == "0.025 (1/40)" and rows["push: MB"][2] == "0.040"
    assert data["machine"] == cpu and data["learner_gpu"]["machine"]["cuda"]  # each study keeps its machine


def test_lora_accuracy_seeds_added_later_join_the_earlier_seeds_pairs(tmp_path, capsys):
    from benchmarks import lora

    def study(seeds, full, adapter, steps=60):
        runs = {arm: [{"seed": s, "held_out_final": acc, "samples_per_s": 3.0, "wall_s": 900.0}
                      for s, acc in zip(seeds, accs)] for arm, accs in (("full", full), ("lora", adapter))}
        return {"steps": steps, "held_out_before": 0.1, "accuracy": lora.summary(runs)}

    lora.report(study([0], [0.60], [0.65]), tmp_path)
    lora.report(study([1, 2], [0.70, 0.50], [0.70, 0.56]), tmp_path)  # --first-seed 1 --repeats 2
    acc = json.loads((tmp_path / "lora.json").read_text())["accuracy"]
    assert [r["seed"] for r in acc["runs"]["lora"]] == [0, 1, 2]
    diff = acc["held_out_lora_vs_full"]
    assert diff["pairs"] == 3 and diff["mean"] == pytest.approx((0.05 + 0.0 + 0.06) / 3)
    assert acc["median"]["full"]["held_out_final"] == 0.60 and acc["median"]["lora"]["held_out_final"] == 0.65
    lora.report(study([1], [0.40], [0.40]), tmp_path)  # a seed run again replaces its earlier runs
    acc = json.loads((tmp_path / "lora.json").read_text())["accuracy"]
    assert [r["held_out_final"] for r in acc["runs"]["full"]] == [0.60, 0.40, 0.50]
    lora.report(study([0], [0.3], [0.3], steps=4), tmp_path)  # other steps: nothing to pair with
    assert json.loads((tmp_path / "lora.json").read_text())["accuracy"]["held_out_lora_vs_full"]["pairs"] == 1
    assert "3 seeds" in capsys.readouterr().out


def test_trl_seeds_added_later_join_the_earlier_seeds_pairs():
    from benchmarks.against_trl import more_seeds, summary

    def study(seeds, streamrl, trl, steps=20, seeded=True):
        runs = {side: [{**({"seed": s} if seeded else {}), "held_out_final": acc, "samples_per_s": rate,
                        "wall_s": 1.0, "train_reward_last5": 0.5, "completion_tokens": 9.0, "fraction_of_bound": 0.1}
                       for s, (acc, rate) in zip(seeds, rows)] for side, rows in (("streamrl", streamrl), ("trl", trl))}
        if seeded:
            return {"config": "c", "trl_trainer": "async", "max_steps": steps, **summary(runs)}
        return {"config": "c", "trl_trainer": "async", "max_steps": steps, "runs": runs}

    earlier = study([0], [(0.60, 2.0)], [(0.50, 1.0)], seeded=False)  # written before seeds were recorded
    joined = more_seeds(earlier, study([1, 2], [(0.70, 3.0), (0.40, 2.5)], [(0.70, 1.5), (0.45, 1.0)]))
    assert [x["seed"] for x in joined["runs"]["trl"]] == [0, 1, 2] and joined["repeats"] == 3
    assert joined["median"]["streamrl"]["samples_per_s"] == 2.5 and joined["ratio"] == pytest.approx(2.5 / 1.0)
    assert joined["held_out_vs_trl"]["pairs"] == 3
    assert joined["held_out_vs_trl"]["mean"] == pytest.approx((0.10 + 0.0 - 0.05) / 3)
    again = more_seeds(joined, study([1], [(0.20, 3.0)], [(0.20, 3.0)]))  # a seed run again replaces its runs
    assert [x["held_out_final"] for x in again["runs"]["streamrl"]] == [0.60, 0.20, 0.40]
    other = more_seeds(joined, study([0], [(0.3, 1.0)], [(0.3, 1.0)], steps=3))  # other settings: nothing joins
    assert other["repeats"] == 1 and "cpu_share" not in other["median"]["trl"]  # not measured in these runs
    for side in other["runs"].values():
        side[0]["cpu_share"] = {"generating": 0.5, "training": 0.25, "other": 0.05, "idle": 0.2}
    assert summary(other["runs"])["median"]["streamrl"]["cpu_share"]["training"] == 0.25


def test_cpu_share_files_each_process_under_its_own_or_its_ancestors_role():
    """A role's CPU time includes its children's (vLLM's engine under the server); a process of no role, and a
    role that only sleeps, take nothing."""
    from benchmarks.cpu_share import CpuShare

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    parent = ("import subprocess, sys\nsubprocess.run([sys.executable, '-c', sys.argv[1]])\n")  # a child spins
    roles = {"busy": lambda argv: "busy-role" in argv, "asleep": lambda argv: "asleep-role" in argv}
    with CpuShare(roles, interval_s=0.05) as share:
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)", "asleep-role"])
        subprocess.run([sys.executable, "-c", parent, spin, "busy-role"], check=True)
        subprocess.run([sys.executable, "-c", spin], check=True)  # no role: not counted
        sleeper.kill()
        sleeper.wait()
    spent, wall = share.seconds()
    # the grandchild's spin, and at most the start-ups beside it; a sampler on a loaded machine may miss its last
    # interval or two before it exits (its time is read while it lives)
    assert 0.25 <= spent["busy"] < 0.4 + 2.0
    assert spent["asleep"] < 0.3  # an interpreter's start-up alone
    shares = share.shares()
    assert shares["busy"] == pytest.approx(spent["busy"] / (wall * os.cpu_count()))
    assert shares["idle"] == pytest.approx(max(0.0, 1 - shares["busy"] - shares["asleep"]))


def _engine_run(seed: int, engine: str, samples_per_s: float, held_out: float, evals: list) -> dict:
    from benchmarks.engines import TARGET, time_to

    return {"seed": seed, "wall_s": 1280 / samples_per_s, "samples_per_s": samples_per_s, "eval_online_final":
            evals[-1][2], "held_out_final": held_out, "evals": evals, "time_to_target": time_to(TARGET, evals)}


def test_engines_study_times_the_first_evaluation_at_the_target_and_pairs_engines_by_seed(tmp_path, monkeypatch):
    from benchmarks import engines as recipe

    assert recipe.time_to(0.5, [[0.0, 0, 0.1], [60.0, 10, 0.5], [120.0, 20, 0.4]]) == 60.0  # the first crossing
    assert recipe.time_to(0.9, [[0.0, 0, 0.1], [60.0, 10, 0.5]]) is None
    slow = [[0.0, 0, 0.1], [900.0, 60, 0.70]]
    fast = [[0.0, 0, 0.1], [300.0, 30, 0.68], [500.0, 60, 0.60]]
    earlier = {"steps": 60, "runs": {"hf": [_engine_run(0, "hf", 1.0, 0.70, slow), _engine_run(1, "hf", 1.0, 0.5, slow)],
                                     "vllm": [_engine_run(0, "vllm", 2.0, 0.60, fast),
                                              _engine_run(1, "vllm", 9.0, 0.9, fast)]}}
    (tmp_path / "engines.json").write_text(json.dumps(earlier))
    cores = {"generating": 0.5, "training": 0.3, "other": 0.05, "idle": 0.15}
    measured = {"cpu_share": cores, "step_train_s": 7.0, "learner_waiting": 0.4}  # seed 0 ran before these were
    monkeypatch.setattr(recipe, "run", lambda seeds, steps: {  # seed 1 again: it replaces the earlier seed 1
        "hf": [_engine_run(1, "hf", 1.0, 0.64, slow) | measured], "vllm": [_engine_run(1, "vllm", 3.0, 0.66, fast)
                                                                           | measured | {"step_train_s": 20.0}]})
    data = recipe.main(out=tmp_path, repeats=1, first_seed=1)
    assert data["median"]["vllm"]["cpu_share"] == cores  # over the runs that measured it alone
    assert data["median"]["vllm"]["step_train_s"] == 20.0 and data["median"]["hf"]["learner_waiting"] == 0.4
    assert [r["seed"] for r in data["runs"]["vllm"]] == [0, 1]
    assert data["speedup"] == pytest.approx(2.5 / 1.0)  # medians (2+3)/2 over 1
    assert data["median"]["vllm"]["time_to_target"] == 300.0 and data["median"]["vllm"]["reached"] == 2
    assert data["median"]["hf"]["time_to_target"] == 900.0
    assert data["held_out_vllm_vs_hf"]["mean"] == pytest.approx(((0.60 - 0.70) + (0.66 - 0.64)) / 2)
    assert (tmp_path / "engines.png").is_file()
    from benchmarks import headlines

    row = next(r for r in headlines.rows({"engines": json.loads((tmp_path / "engines.json").read_text())}).rows)
    assert row[0].startswith("vllm / hf engine") and row[1:4] == ["2.50", "1.00", "2.50×"]
    assert row[5] == "`streamrl bench engines`"


def test_cpu_share_files_a_process_under_its_ancestors_earlier_role_before_its_own():
    """vLLM's engine processes are spawned by multiprocessing, as TRL's rollout worker is: under the server that
    started them they count as generating, not as the worker's role their own command lines also match."""
    from benchmarks.cpu_share import CpuShare

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    parent = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', sys.argv[1], 'fork-role'])\n"
    roles = {"generating": lambda argv: "server-role" in argv, "other": lambda argv: "fork-role" in argv}
    with CpuShare(roles, interval_s=0.05) as share:
        subprocess.run([sys.executable, "-c", parent, spin, "server-role"], check=True)
    spent, _ = share.seconds()
    assert spent["generating"] >= 0.25 and spent["other"] == 0.0


def test_the_fleet_study_reads_pauses_as_hand_computed_and_reports_both_studies(tmp_path, capsys):
    from benchmarks.push_checks import _pause_figures, report_fleet, report_verification

    # two servers: A paused over [0, 2], B over [1, 3]: 4 server-s, both paused during [1, 2]
    figures = _pause_figures([[(0.0, 2.0)], [(1.0, 3.0)]], push_s=4.0)
    assert figures == {"push_s": 4.0, "paused_server_s": 4.0, "all_paused_s": 1.0, "peak_paused_share": 1.0,
                       "paused_share": 0.5}
    waves = _pause_figures([[(0.0, 1.0)], [(2.0, 3.0)]], push_s=4.0)  # one after the other
    assert waves["all_paused_s"] == 0.0 and waves["peak_paused_share"] == 0.5 and waves["paused_share"] == 0.25
    fleet = {"study": "weight-push fleet", "model": "tiny", "row": {
        "engine": "hf", "servers": 2, "params": 1, "samples": {"all at once": [figures], "waves of half": [waves]},
        "median": {"all at once": figures, "waves of half": waves}}}
    report_fleet(fleet, tmp_path)
    medians = {"off": 0.2, "digest": 0.21, "digest+probe 64": 0.3, "digest+probe 256": 0.5}
    verification = {"study": "weight-push verification", "model": "tiny", "rows": [{
        "engine": "hf", "params": 1, "samples": {k: [v] for k, v in medians.items()}, "median_s": medians,
        "learner_probe_s": {"digest+probe 64": 0.1, "digest+probe 256": 0.2}, "probe_gap_max": 1e-6,
        "cost": {k: v / 0.2 - 1 for k, v in medians.items() if k != "off"}}]}
    report_verification(verification, tmp_path)
    for name in ("weight_push_fleet", "weight_push_verification"):
        assert (tmp_path / f"{name}.json").is_file() and (tmp_path / f"{name}.png").is_file()
    tables = {name: json.loads((tmp_path / f"{name}.json").read_text())["tables"][0]["rows"]
              for name in ("weight_push_fleet", "weight_push_verification")}
    assert tables["weight_push_fleet"][1][3:5] == ["0", "50%"]  # waves: never both at once, half at most
    assert tables["weight_push_verification"][0][5:9] == ["+5%", "+50%", "+150%", "0.10"]


def test_the_counterfactual_study_pairs_each_arm_with_the_runs_own_correction_by_recorded_run(tmp_path, capsys):
    from benchmarks import counterfactual

    def arm(held_out, train_s, identical=False):
        return {"held_out_final": held_out, "held_out_reward": held_out, "train_s": train_s, "identical": identical}

    def run(seed, none, decoupled):
        arms = {name: arm(0.5, 1.0) for name in counterfactual.ARMS}
        arms |= {"none": arm(none, 1.0), "decoupled": arm(decoupled, 0.8, identical=True)}
        return {"seed": seed, "recorded_train_s": 1.0, "arms": arms}

    rows = [run(0, 0.80, 0.90), run(1, 0.90, 0.90), run(2, 0.75, 0.95)]
    summary = counterfactual.summarise(rows)
    assert summary["none"]["against"]["held_out_final"]["mean"] == pytest.approx((-0.10 + 0.0 - 0.20) / 3)
    assert summary["none"]["against"]["held_out_final"]["pairs"] == 3 and summary["decoupled"]["against"] is None
    assert summary["decoupled"]["replay_vs_recorded_speed"] == pytest.approx(1.25)  # 1.0 s recorded / 0.8 s replayed
    assert summary["decoupled"]["identical"] and not summary["none"]["identical"]
    counterfactual.report({"study": "counterfactual", "max_steps": 40, "arms": summary, "runs": rows}, tmp_path)
    saved = json.loads((tmp_path / "counterfactual.json").read_text())
    table = saved["tables"][0]
    assert [r[0] for r in table["rows"]] == list(counterfactual.ARMS)
    assert table["rows"][2][-1] == "yes, every step" and table["rows"][0][3].startswith("-10.0 ±")
    assert (tmp_path / "counterfactual.png").stat().st_size > 10_000


def test_the_coverage_study_takes_each_quartiles_median_over_seeds_and_marks_the_goal(tmp_path, capsys):
    from benchmarks import coverage

    def row(seed, slowest, hardest):
        quartile = [{"ratio": r} for r in (1.0, 1.0, 1.0, slowest)]
        by_reward = [{"ratio": r} for r in (hardest, 1.0, 1.0, 1.0)]
        return {"seed": seed, "quartiles": {"time": quartile, "reward": by_reward}, "samples_per_s": 50.0 + seed,
                "dropped_stale": 10 * seed, "late_kept": 0, "held_out_final": 0.9}

    runs = {"fixed 4": [row(0, 0.7, 0.9), row(1, 0.8, 0.92), row(2, 0.75, 1.0)],
            "auto, late drop": [row(0, 0.85, 0.95), row(1, 0.6, 0.9), row(2, 0.95, 0.97)],
            "auto": [row(0, 0.94, 0.99), row(1, 0.93, 1.01), row(2, 1.02, 1.0)]}
    data = coverage.summarise_arms({"study": "coverage", "max_steps": 40, "overrides": ["x=1"], "runs": runs})
    assert data["summary"]["fixed 4"]["time"] == [1.0, 1.0, 1.0, 0.75] and data["repeats"] == 3
    assert data["summary"]["auto, late drop"]["reward"][0] == 0.95 and data["summary"]["fixed 4"]["dropped_stale"] == 10
    assert [m["within_goal"] for m in data["summary"].values()] == [False, False, True]
    coverage.report(data, tmp_path)
    saved = json.loads((tmp_path / "coverage.json").read_text())
    assert [r[0] for r in saved["tables"][0]["rows"]] == list(coverage.ARMS)
    assert saved["tables"][0]["rows"][0][4] == "0.75" and len(saved["tables"][1]["rows"]) == 9
    assert (tmp_path / "coverage.png").stat().st_size > 10_000


def test_the_cores_study_pairs_auto_with_the_even_share_by_seed_and_reports_where_the_cores_went(tmp_path):
    from benchmarks import cores

    def row(seed, rate, idle, widened=()):
        shares = {"generating": 0.5, "training": 0.5 - idle, "other": 0.0, "idle": idle}
        return {"seed": seed, "samples_per_s": rate, "held_out_final": 0.6, "cpu_share": shares,
                "widened": list(widened), "steps": 20}

    runs = {"smollm2": {"even share": [row(0, 4.0, 0.14), row(1, 5.0, 0.12)],
                        "auto": [row(1, 5.5, 0.04, [3, 4, 9]), row(0, 4.8, 0.05, [6])]},
            "toy": {"even share": [row(0, 100.0, 0.13), row(1, 90.0, 0.15)],
                    "auto": [row(0, 99.0, 0.13), row(1, 91.8, 0.14)]}}
    data = cores.summarise_arms({"study": "cores", "staleness": 2, "runs": runs})
    # paired by seed: 4.8/4.0 = 1.2 and 5.5/5.0 = 1.1, median 1.15 (unpaired medians would give 5.15/4.5)
    assert data["summary"]["smollm2"]["ratio"] == pytest.approx(1.15)
    assert data["summary"]["toy"]["ratio"] == pytest.approx(1.005)
    assert data["summary"]["smollm2"]["auto"]["idle"] == pytest.approx(0.045)
    cores.report(data, tmp_path)
    saved = json.loads((tmp_path / "cores.json").read_text())
    assert saved["tables"][0]["rows"][0][:4] == ["smollm2", "even share", "4.50", "50%"]
    assert ["smollm2", "auto", "1", "5.50", "4%", "3 of 20"] == saved["tables"][1]["rows"][2]
    assert (tmp_path / "cores.png").stat().st_size > 10_000
