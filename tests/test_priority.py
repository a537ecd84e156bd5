"""Who goes first on shared cores: the learner's wait share judged from its metrics, real server processes
(and a child each, as vLLM's engine processes are) reniced, and back."""

import json
import os
import signal
import sys
import time

import psutil
import pytest

from streamrl.config import ConfigError, load_config
from streamrl.launch.priority import AUTO_NICE, WINDOW, ServerPriority, may_lower_niceness, wait_share
from streamrl.launch.supervisor import Part, Supervisor

# a server that starts a child of its own, as vLLM's engine does, and the child a thread, both made long before
# any renice (a thread takes its creator's niceness only when it is made)
FAMILY = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
          "'import threading, time; threading.Thread(target=time.sleep, args=(120,)).start(); time.sleep(120)']); "
          "print('up', flush=True); time.sleep(120)"]


def _lines(waits: list[float], step_s: float = 2.0, start: float = 1000.0) -> list[dict]:
    """Steps every ``step_s`` seconds, numbered as if the first one ended at 1000 s."""
    return [{"step": int((start - 1000.0) / step_s) + i + 1, "time": start + i * step_s, "wait_s": w, "loss": 0.1}
            for i, w in enumerate(waits)]


def test_the_wait_share_is_the_waiting_over_the_clock_of_the_last_steps():
    assert wait_share(_lines([0.0] * WINDOW)) is None  # the first line's wait holds the start-up: not judged
    # six lines 2 s apart: the last five span 10 s and waited 0.5 + 1 + 0 + 0 + 1.5 = 3 s
    assert wait_share(_lines([90.0, 0.5, 1.0, 0.0, 0.0, 1.5])) == pytest.approx(0.3)
    assert wait_share(_lines([5.0, 9.0, 0.0, 0.0, 0.0, 0.0, 0.0])) == 0.0  # only the last WINDOW count


def _family(tmp_path, name: str = "server-0", kind: str = "server") -> tuple[Supervisor, Part, list[psutil.Process]]:
    sup = Supervisor(["server"], 1, 20, say=lambda m: None)
    part = sup.start(Part(name, kind, FAMILY, tmp_path / f"{name}.log"))
    root = psutil.Process(part.pid)
    deadline = time.time() + 20
    while not (root.children() and root.children()[0].num_threads() > 1) and time.time() < deadline:
        time.sleep(0.05)
    return sup, part, [root, *root.children()]


def _niceness(procs: list[psutil.Process]) -> list[int]:
    """Each process's niceness, where every thread of it has the same (else the thread's, in a list)."""
    out = []
    for p in procs:
        each = {os.getpriority(os.PRIO_PROCESS, t.id) for t in p.threads()}
        out.append(each.pop() if len(each) == 1 else sorted(each))
    return out


def _write(path, lines: list[dict]) -> None:
    with path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)


def test_servers_yield_while_the_learner_sets_the_pace_and_share_again_when_generation_does(tmp_path):
    if not may_lower_niceness():
        pytest.skip("taking a niceness back to 0 needs root")
    metrics, said = tmp_path / "learner.jsonl", []
    sup, part, procs = _family(tmp_path)
    learner = sup.start(Part("learner", "learner", FAMILY, tmp_path / "learner.log"))
    try:
        priority = ServerPriority("auto", metrics, said.append)
        _write(metrics, [{"step": 0, "time": 999.0, "eval": 1}])  # not a trained line: not judged
        _write(metrics, _lines([60.0, 0.1, 0.0, 0.1, 0.0]))  # one short of a judgement
        priority.watch(sup.parts)
        assert _niceness(procs) == [0, 0] and not said
        _write(metrics, _lines([0.2], start=1010.0))  # the learner waited 0.4 s of 10: it sets the pace
        priority.watch(sup.parts)
        assert _niceness(procs) == [AUTO_NICE, AUTO_NICE]
        assert psutil.Process(learner.pid).nice() == 0  # the learner keeps its own
        assert "the learner sets the pace (it waited 4% of its last 5 steps)" in said[0]
        assert [(r["step"], r["niceness"]) for r in map(json.loads, (tmp_path / "server_nice.jsonl").open())] == [(6, 10)]
        # judged again on steps taken since: the queue runs dry, the learner waits 1.5 s of each 2-s step
        _write(metrics, _lines([1.5] * WINDOW, start=1012.0))  # five lines: the first only opens the window
        priority.watch(sup.parts)
        assert _niceness(procs) == [AUTO_NICE, AUTO_NICE]
        _write(metrics, _lines([1.5], start=1022.0))
        priority.watch(sup.parts)
        assert _niceness(procs) == [0, 0] and "generation sets the pace" in said[1]
    finally:
        sup.stop(timeout_s=5)


def test_a_resumed_runs_earlier_steps_are_not_judged(tmp_path):
    metrics, said = tmp_path / "learner.jsonl", []
    _write(metrics, _lines([0.0] * (WINDOW + 1)))  # an earlier `streamrl up` of this run, learner-bound
    priority = ServerPriority("auto", metrics, said.append)
    priority.watch([])
    assert priority.nice == 0 and not said
    _write(metrics, _lines([30.0] + [0.0] * WINDOW, start=5000.0))  # this one's: judged from its own start
    priority.watch([])
    assert priority.nice == AUTO_NICE and "waited 0%" in said[0]


def test_a_fixed_niceness_holds_every_server_process_and_no_other_part(tmp_path):
    sup, part, procs = _family(tmp_path)
    worker = sup.start(Part("rollout-0", "rollout", FAMILY, tmp_path / "rollout-0.log"))
    try:
        priority = ServerPriority(5, tmp_path / "none.jsonl", lambda m: None)
        priority.watch(sup.parts)
        assert _niceness(procs) == [5, 5]
        assert psutil.Process(worker.pid).nice() == 0
        os.kill(part.pid, signal.SIGKILL)  # restarted under a new pid: held at the setting from the next round
        part.proc.wait()
        sup.check()
        assert part.restarts == 1
        priority.watch(sup.parts)
        assert psutil.Process(part.pid).nice() == 5
    finally:
        sup.stop(timeout_s=5)


def test_the_setting_is_refused_where_it_would_not_act():
    assert load_config(None, []).supervise.server_nice == 0
    for bad in ("supervise.server_nice=20", "supervise.server_nice=-1", "supervise.server_nice=high"):
        with pytest.raises(ConfigError, match="server_nice"):
            load_config(None, [bad])
    for setting in ("10", "auto"):
        with pytest.raises(ConfigError, match="Ray gives each part its own reserved CPUs"):
            load_config(None, ["launcher=ray", f"supervise.server_nice={setting}"])
    assert load_config(None, ["launcher=ray"]).supervise.server_nice == 0


def test_up_leaves_auto_out_where_the_learner_takes_every_core_or_the_parts_have_cores_of_their_own(tmp_path):
    from streamrl.launch.local import _server_priority

    said = []

    def made(*overrides: str, gpus: tuple[str, ...] = ()) -> ServerPriority | None:
        cfg = load_config(None, [f"run.dir={tmp_path}", *overrides])
        return _server_priority(cfg, None, list(gpus), said.append)

    every = f"supervise.learner_threads={os.cpu_count()}"
    assert made() is None and not said  # the default: an even share, nothing to do
    assert made(every, "supervise.server_nice=auto") is None  # first on every core, it would starve generation
    assert "the learner's threads take all" in said[-1]
    assert made(every, "supervise.server_nice=5").nice == 5  # a number is the user's to give
    assert made("supervise.server_nice=auto", gpus=("0",)) is None and "has GPUs" in said[-1]
    if (os.cpu_count() or 1) > 1:
        assert made("supervise.server_nice=auto").auto
