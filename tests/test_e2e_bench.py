"""``streamrl bench e2e``: how its seeds and arms join, pair and report."""

import json
import math

import pytest


def row(seed: int, samples_per_s: float, held_out: float = 0.5) -> dict:
    """One run's summary, as ``e2e_run.summarise`` gives it, with what the joins and pairings read."""
    return {"seed": seed, "samples_per_s": samples_per_s, "steady_samples_per_s": samples_per_s, "wall_s": 1.0,
            "eval_final": 0.9, "held_out_final": held_out, "held_out_reward": held_out, "dropped_fraction": 0.0,
            "time_to_target_s": None}


def test_the_real_model_e2e_study_has_its_own_section_and_headline_rows_beside_the_toys(tmp_path):
    from benchmarks import report

    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\n## Headlines\n\n- **async (max staleness 4) / sync, env-latency**: 3.78×\n")
    results = tmp_path / "results"
    results.mkdir()
    machine = {"platform": "test", "cpu_count": 2, "torch": "x", "cuda": False, "time": "2026-12-01T10:00:00+0000"}
    ratio = {"ratio": 3.1, "steady_ratio": 3.3, "held_out_final_vs_sync": {"mean": 0.01, "ci95": 0.02, "pairs": 3}}
    summary = {"env-latency": {"sync": {"samples_per_s": 1.0, "held_out_final": 0.5},
                               "async": {"samples_per_s": 3.1, "held_out_final": 0.51}, "ratios": {"async": ratio}}}
    (results / "e2e_smollm2.json").write_text(json.dumps({
        "machine": machine, "repeats": 3, "max_staleness": 4, "staleness_modes": {"async": 4}, "summary": summary,
        "tables": [{"title": "smollm2 e2e", "columns": ["a"], "rows": [["1"]]}]}))
    (results / "e2e_smollm2.png").write_bytes(b"png")
    text = report.build(results, page).read_text()
    assert "3.78×" not in text  # the old bullets are gone
    assert ("| SmolLM2-135M env-latency: async (max staleness 4, as shipped) / sync, samples/s | 3.10 | 1.00 | 3.10× "
            "| 2 CPU cores, run 2026-12-01 10:00 | `streamrl bench e2e --real-model --workload env-latency` |") in text
    assert "| 0.510 | 0.500 | difference +1.0 ± 2.0 pts (3 pairs) |" in text
    section = text[text.index("## End to end on SmolLM2-135M: async vs sync (`streamrl bench e2e --real-model`)"):]
    assert "*smollm2 e2e*" in section and "benchmarks/e2e_smollm2.png" in section and "--real-model" in section


def test_e2e_seeds_join_an_earlier_run_of_the_same_study_and_pair_by_seed(tmp_path, monkeypatch):
    from benchmarks import e2e

    def study(seeds: dict[int, tuple]) -> dict:
        runs = {"agentic": {"sync": [row(s, 1.0, a) for s, (a, _) in seeds.items()],
                            "async": [row(s, 3.0, b) for s, (_, b) in seeds.items()]}}
        return {"max_steps": 20, "staleness_modes": {"async": 4}, "workloads": {"agentic": "x.yaml"},
                **e2e.summarise_modes(runs)}

    earlier = study({0: (0.5, 0.6), 1: (0.5, 0.4)})
    joined = e2e.more_seeds(earlier, study({1: (0.5, 0.5), 2: (0.6, 0.6)}))  # seed 1 again replaces it
    assert joined["repeats"] == 3 and [x["seed"] for x in joined["runs"]["agentic"]["async"]] == [0, 1, 2]
    assert joined["summary"]["agentic"]["held_out_final_vs_sync"]["mean"] == pytest.approx((0.1 + 0.0 + 0.0) / 3)
    other = {**study({3: (0.5, 0.5)}), "max_steps": 40}
    assert e2e.more_seeds(earlier, other) is other  # another study: not joined

    # an arm run later on one of the seeds joins beside the others, paired with sync on that seed alone
    auto = {"max_steps": 20, "staleness_modes": {"async-auto": "auto"}, "workloads": {"agentic": "x.yaml"},
            **e2e.summarise_modes({"agentic": {"sync": [row(1, 1.2, 0.7)], "async-auto": [row(1, 2.4, 0.8)]}})}
    both = e2e.more_seeds(joined, auto)
    assert list(both["runs"]["agentic"]) == ["sync", "async", "async-auto"]
    assert both["staleness_modes"] == {"async": 4, "async-auto": "auto"}
    assert [x["samples_per_s"] for x in both["runs"]["agentic"]["sync"]] == [1.0, 1.2, 1.0]  # seed 1 rerun
    s = both["summary"]["agentic"]
    assert s["async-auto"]["runs"] == 1 and s["ratios"]["async-auto"]["ratio"] == pytest.approx(2.4 / 1.0)
    assert s["ratios"]["async-auto"]["held_out_final_vs_sync"]["mean"] == pytest.approx(0.1)
    assert s["ratios"]["async-auto"]["held_out_final_vs_sync"]["pairs"] == 1
    assert s["auto_vs_best_fixed"] == {"best": "async", "ratio": pytest.approx(2.4 / 3.0),  # the measure
                                       "one_invocation": True}
    assert "auto_vs_best_fixed" not in joined["summary"]["agentic"]  # no auto arm: nothing to compare
    with pytest.raises(SystemExit, match="--staleness 3"):
        e2e.bounds_of(("auto", "3"))
    assert e2e.bounds_of(("4", "auto")) == (4, "auto")


def test_auto_is_paired_by_seed_with_each_fixed_bound_as_a_geometric_mean_with_its_interval(tmp_path):
    from benchmarks import common, e2e

    # per seed 0.9 and 1.1: logs -0.1054 and 0.0953, mean -0.00503 (geometric mean sqrt(0.99) = 0.995), their
    # standard deviation 0.1419, t at 1 degree of freedom 12.706: half-width 12.706 x 0.1419 / sqrt(2) = 1.2749
    p = common.paired_ratio([0.9, 2.2], [1.0, 2.0])
    assert p["ratio"] == pytest.approx(0.99 ** 0.5) and p["per_seed"] == pytest.approx([0.9, 1.1])
    assert p["low"] == pytest.approx(math.exp(-0.005025 - 1.2749), rel=1e-3)
    assert p["high"] == pytest.approx(math.exp(-0.005025 + 1.2749), rel=1e-3) and p["pairs"] == 2
    one = common.paired_ratio([3.0], [2.0])
    assert one["ratio"] == pytest.approx(1.5) and one["low"] != one["low"]  # one pair: no interval

    # seeds only auto ran (3), or only a fixed bound ran (0), pair with nothing
    by_mode = {"sync": [row(s, 1.0) for s in (0, 1, 2)], "async": [row(s, 2.0) for s in (0, 1, 2)],
               "async-s2": [row(0, 1.0), row(1, 4.0), row(2, 2.0)],
               "async-auto": [row(1, 2.2), row(2, 1.8), row(3, 9.0)]}
    s = e2e.summarise_modes({"w": by_mode})["summary"]["w"]
    assert s["auto_vs_fixed"]["async"]["per_seed"] == pytest.approx([1.1, 0.9])
    assert s["auto_vs_fixed"]["async-s2"]["per_seed"] == pytest.approx([0.55, 0.9])
    assert s["auto_vs_fixed"]["async-s2"]["ratio"] == pytest.approx((0.55 * 0.9) ** 0.5)
    assert "auto_vs_fixed" not in e2e.summarise_modes({"w": {k: by_mode[k] for k in ("sync", "async")}})["summary"]["w"]
    data = {"max_steps": 20, "staleness_modes": {"async": 4, "async-s2": 2, "async-auto": "auto"}, "repeats": 3,
            "target": 0.8, "max_staleness": 4, **e2e.summarise_modes({"w": by_mode})}
    e2e.report(data, tmp_path)
    table = json.loads((tmp_path / "e2e.json").read_text())["tables"][1]
    assert table["title"] == "End to end, auto's samples/s over each fixed bound's, paired by seed"
    assert table["rows"][0][:3] == ["w", "4", "1.10, 0.90"] and table["rows"][1][:3] == ["w", "2", "0.55, 0.90"]
    assert table["rows"][0][4] == f"{math.exp(-0.005025 - 1.2749):.2f}–{math.exp(-0.005025 + 1.2749):.2f}"


def test_e2e_sync_arm_run_with_other_settings_replaces_the_earlier_sync_runs_and_keeps_the_async_ones():
    from benchmarks import e2e

    def study(runs: dict, sync_overrides: list[str], modes=None) -> dict:
        return {"max_steps": 20, "staleness_modes": {"async": 4} if modes is None else modes,
                "workloads": {"agentic": "x.yaml"}, "sync_overrides": sync_overrides,
                **e2e.summarise_modes({"agentic": runs})}

    earlier = study({"sync": [row(0, 1.0)], "async": [row(0, 3.0)]}, [])  # sync at the launcher's threads
    both2 = ["supervise.threads=2"]
    seed1 = e2e.more_seeds(earlier, study({"sync": [row(1, 1.5)], "async": [row(1, 3.0)]}, both2))
    runs = seed1["runs"]["agentic"]
    assert [x["seed"] for x in runs["sync"]] == [1] and [x["seed"] for x in runs["async"]] == [0, 1]
    assert seed1["summary"]["agentic"]["ratios"]["async"]["held_out_final_vs_sync"]["pairs"] == 1
    assert e2e.bounds_of((), sync_only=True) == () and e2e.bounds_of(()) is None
    with pytest.raises(SystemExit, match="--sync-only"):
        e2e.bounds_of(("4",), sync_only=True)
    # sync alone, on seed 0 again with its new settings: it joins, and the async arms stay as they were
    seed0 = e2e.more_seeds(seed1, study({"sync": [row(0, 1.4)]}, both2, modes={}))
    runs = seed0["runs"]["agentic"]
    assert [x["samples_per_s"] for x in runs["sync"]] == [1.4, 1.5] and len(runs["async"]) == 2
    assert seed0["staleness_modes"] == {"async": 4}
    assert seed0["summary"]["agentic"]["ratios"]["async"]["ratio"] == pytest.approx(3.0 / 1.45)  # medians
    # seed 0 again with the async arms' settings changed: their other seeds' runs go, sync's stay
    rethreaded = {**study({"sync": [row(0, 1.3)], "async": [row(0, 2.0)]}, both2),
                  "async_overrides": ["supervise.learner_threads=2"]}
    runs = e2e.more_seeds(seed0, rethreaded)["runs"]["agentic"]
    assert [x["samples_per_s"] for x in runs["async"]] == [2.0] and [x["samples_per_s"] for x in runs["sync"]] == [1.3, 1.5]
    assert e2e.RECIPES["smollm2"].overrides("async") == e2e.RECIPES["smollm2"].async_overrides != ()
    assert e2e.RECIPES["toy"].overrides("async") == e2e.RECIPES["toy"].overrides("sync") == ()


def test_e2e_async_arms_alone_pair_with_the_earlier_sync_runs_and_are_refused_without_them(tmp_path):
    from benchmarks import e2e

    recipe, workloads = e2e.RECIPES["smollm2"], e2e.RECIPES["smollm2"].workloads
    w = next(iter(workloads))
    earlier = {"max_steps": recipe.steps, "staleness_modes": {"async": 4}, "workloads": workloads,
               **e2e.summarise_modes({w: {"sync": [row(0, 1.0, 0.6), row(1, 2.0, 0.7)], "async": [row(0, 3.0, 0.6)]}})}
    e2e.sync_to_pair(earlier, recipe, recipe.steps)  # sync runs of the same study: accepted
    for wrong, why in ((None, "no results"), (earlier, "other steps"), ({**earlier, "workloads": {}}, "other workloads")):
        with pytest.raises(SystemExit, match="--async-only pairs its runs with the sync runs of an earlier "
                                             f"e2e_smollm2.json of {recipe.steps + (why == 'other steps')} steps"):
            e2e.sync_to_pair(wrong, recipe, recipe.steps + (why == "other steps"))
    later = "2026-12-04T13:11:48+0000 (AMD EPYC)"  # the earlier runs are from before runs were stamped
    auto = {"max_steps": recipe.steps, "staleness_modes": {"async-auto": "auto"}, "workloads": workloads,
            "runs": {w: {"async-auto": [{**row(0, 2.4, 0.65), "invocation": later},
                                        {**row(1, 2.2, 0.6), "invocation": later}]}}}  # run() without sync
    joined = e2e.more_seeds(earlier, auto)
    runs, s = joined["runs"][w], joined["summary"][w]
    assert [x["samples_per_s"] for x in runs["sync"]] == [1.0, 2.0] and len(runs["async"]) == 1  # both stay
    assert s["ratios"]["async-auto"]["ratio"] == pytest.approx(2.3 / 1.5)  # medians against the earlier sync
    pairs = s["ratios"]["async-auto"]["held_out_final_vs_sync"]
    assert pairs["pairs"] == 2 and pairs["mean"] == pytest.approx(((0.65 - 0.6) + (0.6 - 0.7)) / 2)
    assert s["auto_vs_best_fixed"] == {"best": "async", "ratio": pytest.approx(2.3 / 3.0), "one_invocation": False}
    assert not s["ratios"]["async-auto"]["one_invocation"] and s["ratios"]["async"]["one_invocation"]
    e2e.report({**joined, "target": recipe.target, "max_staleness": "auto", "result": recipe.result}, tmp_path)
    # a ratio across invocations is marked, and the invocations named
    table = json.loads((tmp_path / "e2e_smollm2.json").read_text())["tables"][0]
    assert f"runs from 2 invocations ({later}, unrecorded): a ratio of two arms that ran a seed in different ones" in table["title"]
    marked = [r[0] for r in table["rows"] if r[0].endswith(e2e.ACROSS)]
    assert marked == [f"{w}: async-auto / sync{e2e.ACROSS}", f"{w}: async-auto / async (the fastest fixed bound){e2e.ACROSS}"]
    from benchmarks import report

    data = json.loads((tmp_path / "e2e_smollm2.json").read_text())
    head = report.headlines.rows({"e2e_smollm2": data})  # no arm at the shipped bound (1): max staleness 4's
    assert [r[3] for r in head.rows if r[0].endswith("samples/s")] == ["2.00×"] and not head.notes
    # the headline table divides no runs of two invocations: auto's (stamped) and sync's (unrecorded) stand apart
    head = report.headlines.rows({"e2e_smollm2": {**data, "staleness_modes": {"async": 4, "async-auto": 1}}})
    assert [r[1:4] for r in head.rows] == [["2.30", "1.50", "none (note 1)"]]
    assert "no ratio, its sync runs and its async runs ran in different invocations" in head.notes[0]
    with pytest.raises(SystemExit, match="choose one"):
        e2e.main(sync_only=True, async_only=True)
    # seeds added by a later invocation pair among themselves: each seed's two runs ran side by side
    from benchmarks.common import one_invocation

    first, second = "2026-12-04T15:18:56+0000 (AMD EPYC)", "2026-12-05T09:00:00+0000 (Intel Xeon)"
    fixed = [{**row(0, 2.0), "invocation": first}, {**row(1, 2.1), "invocation": first},
             {**row(2, 1.9), "invocation": second}]
    assert one_invocation([{**row(0, 2.4), "invocation": first}, {**row(2, 2.2), "invocation": second}], fixed)
    assert not one_invocation([{**row(2, 2.2), "invocation": first}], fixed)  # seed 2's pair ran apart


def test_e2e_one_workload_joins_the_study_and_leaves_the_others_runs_alone(tmp_path):
    from benchmarks import e2e

    recipe = e2e.RECIPES["smollm2"]
    single, agentic = recipe.workloads
    earlier = {"max_steps": recipe.steps, "staleness_modes": {"async": 4}, "workloads": recipe.workloads,
               **e2e.summarise_modes({w: {"sync": [row(0, 1.0, 0.6)], "async": [row(0, 3.0, 0.6)]}
                                      for w in (single, agentic)})}
    fixed1 = {"max_steps": recipe.steps, "staleness_modes": {"async-s1": 1}, "workloads": recipe.workloads,
              "max_staleness": 1, "target": recipe.target, "held_out": recipe.held_out, "result": recipe.result,
              "runs": {agentic: {"async-s1": [row(0, 2.0, 0.7)]}}}  # run() with workloads=(agentic,), no sync
    joined = e2e.more_seeds(earlier, fixed1)
    assert set(joined["runs"][single]) == {"sync", "async"}  # not run again: as it was, without the new arm
    assert [x["samples_per_s"] for x in joined["runs"][single]["async"]] == [3.0]
    assert set(joined["runs"][agentic]) == {"sync", "async", "async-s1"}
    assert joined["summary"][agentic]["ratios"]["async-s1"]["ratio"] == pytest.approx(2.0)
    assert "async-s1" not in joined["summary"][single]["ratios"]
    e2e.report(joined, tmp_path)  # its table and plot, with the arm missing on one workload
    assert (tmp_path / "e2e_smollm2.png").is_file()
    with pytest.raises(SystemExit, match="--workload agentic: the study's workloads are single-turn, env-latency"):
        e2e.main(real_model=True, workload=("agentic",))
    e2e.one_workload_joins({**earlier, "sync_overrides": list(recipe.sync_overrides),
                            "async_overrides": list(recipe.async_overrides)}, recipe, recipe.steps)
    for wrong in (None, earlier, {**earlier, "max_steps": 3}):  # none; the arms' settings changed; another length
        with pytest.raises(SystemExit, match="--workload joins an earlier e2e_smollm2.json of 20 steps and the same"):
            e2e.one_workload_joins(wrong, recipe, recipe.steps)


def test_the_e2e_report_tables_each_auto_runs_bound_changes_with_their_causes(tmp_path):
    from benchmarks import e2e

    change = "max staleness raised 1 -> 2 at step 4: the learner waited 80% of its step ..."
    auto = [{**row(0, 2.4), "changes": [change]}, {**row(1, 2.2), "changes": []}]
    data = {"max_steps": 40, "max_staleness": 4, "target": 0.9, "staleness_modes": {"async": 4, "async-auto": "auto"},
            **e2e.summarise_modes({"agentic": {"sync": [row(0, 1.0), row(1, 1.1)], "async": [row(0, 3.0), row(1, 2.9)],
                                              "async-auto": auto}})}
    e2e.report(data, tmp_path)
    tables = json.loads((tmp_path / "e2e.json").read_text())["tables"]
    assert [t["rows"] for t in tables if "each change of the auto bound" in t["title"]] == [[["agentic", "0", change]]]
    for x in auto:
        x.pop("changes")  # results from before runs kept them: no table
    e2e.report(data, tmp_path)
    assert not [t for t in json.loads((tmp_path / "e2e.json").read_text())["tables"] if "each change" in t["title"]]


def test_an_e2e_study_cut_short_keeps_the_seeds_it_finished(tmp_path, monkeypatch):
    from benchmarks import e2e

    ran = []

    def one_run(runs, prepared, workload, mode, steps, staleness, seed, recipe, overrides):
        if seed == 1 and ran.count(1) == 1:
            raise KeyboardInterrupt  # cut short on seed 1's second run
        ran.append(seed)
        return {**row(seed, 2.0 if mode == "async" else 1.0), "reached_target": 1, "eval_first": 0.1,
                "bound_by_step": None, "changes": []}

    monkeypatch.setattr(e2e, "one_run", one_run)
    monkeypatch.setattr(e2e, "prepare_shared", lambda tmp, recipe: (None, tmp))
    with pytest.raises(KeyboardInterrupt):
        e2e.main(out=tmp_path, repeats=3, staleness=("4",), workload=())
    saved = json.loads((tmp_path / "e2e.json").read_text())
    assert ran == [0, 0, 0, 0, 1]  # seed 0 on both workloads, both arms; then one run of seed 1
    assert {m: [x["seed"] for x in rows] for m, rows in saved["runs"]["env-latency"].items()} == {
        "sync": [0], "async": [0]}
    assert saved["repeats"] == 1 and saved["summary"]["single-turn"]["ratio"] == pytest.approx(2.0)
