"""Where a run's CPU time goes: the share of the machine's cores each kind of work took over a window.

A sampler thread reads, every ``interval_s``, the CPU seconds (user + system) of every process on the machine
and files each under the first role that its command line or an ancestor's matches (vLLM's engine and worker
processes, spawned by multiprocessing like TRL's rollout worker, under the server that started them). A role's share of a window is the CPU seconds its
processes spent inside it over ``wall × cores``; what no role took is idle. A process that exits between two
samples loses at most one interval of its time.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import psutil

Roles = dict[str, Callable[[list[str]], bool]]  # role -> whether a command line is that role's

# streamrl up: servers generate, the learner trains, the rest (workers, router, evaluator, Redis) feed them
STREAMRL: Roles = {
    "generating": lambda argv: _streamrl(argv, "serve"),
    "training": lambda argv: _streamrl(argv, "launch-learner"),
    "other": lambda argv: _streamrl(argv) or argv[0].endswith("redis-server"),
}


def _streamrl(argv: list[str], command: str | None = None) -> bool:
    """A streamrl process (``python -m streamrl`` or the script), running ``command`` if given; not a benchmark."""
    ours = argv[1:3] == ["-m", "streamrl"] or (len(argv) > 1 and argv[1].endswith("/streamrl"))
    return ours and "bench" not in argv and (command is None or command in argv)


def trl(trainer_pid: int) -> Roles:
    """TRL's AsyncGRPOTrainer: its vLLM server generates, the trainer (in process ``trainer_pid``) trains, and the
    rollout worker it spawns (posting requests, scoring groups) is the rest."""
    trainer = psutil.Process(trainer_pid).cmdline()
    return {"generating": lambda argv: "vllm.entrypoints.openai.api_server" in argv,
            "other": lambda argv: any("spawn_main" in a or a == "--multiprocessing-fork" for a in argv),
            "training": lambda argv: argv == trainer}


class CpuShare:
    def __init__(self, roles: Roles, interval_s: float = 0.5):
        self.roles, self.interval_s = roles, interval_s
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []  # (time, pid -> (role, cpu s))
        self._known: dict[int, str | None] = {}  # pid -> its role (None: none), decided once per process
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-share", daemon=True)

    def __enter__(self) -> CpuShare:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.samples.append(self._sample())
            if self._stop.wait(self.interval_s):
                self.samples.append(self._sample())
                return

    def _sample(self) -> tuple[float, dict[int, tuple[str, float]]]:
        now, seen = time.time(), {}
        for proc in psutil.process_iter():
            try:
                role = self._role(proc)
                if role is not None:
                    times = proc.cpu_times()
                    seen[proc.pid] = (role, times.user + times.system)
            except psutil.Error:  # gone while read
                continue
        return now, seen

    def _role(self, proc: psutil.Process) -> str | None:
        if proc.pid not in self._known:
            self._known[proc.pid] = self._match(proc)
        return self._known[proc.pid]

    def _match(self, proc: psutil.Process) -> str | None:
        """The first role (in ``roles``' order) of the process or any of its ancestors: vLLM's spawned engine
        processes go under the server that started them, whatever their own command lines look like."""
        lineage = []
        while proc is not None and proc.pid > 1:
            lineage.append(proc.cmdline())
            proc = proc.parent()
        return next((role for role, test in self.roles.items() if any(argv and test(argv) for argv in lineage)), None)

    def seconds(self, start: float | None = None, end: float | None = None) -> tuple[dict[str, float], float]:
        """Each role's CPU seconds between ``start`` and ``end`` (``time.time()``; default: all that was sampled),
        and the window's wall seconds."""
        window = [s for s in self.samples if (start is None or s[0] >= start) and (end is None or s[0] <= end)]
        if len(window) < 2:
            raise ValueError("fewer than two samples in the window: sample more often or over a longer run")
        first, last, role_of = {}, {}, {}
        for i, (_, seen) in enumerate(window):
            for pid, (role, cpu) in seen.items():
                first.setdefault(pid, cpu if i == 0 else 0.0)  # one born inside the window counts from zero
                last[pid], role_of[pid] = cpu, role
        spent = dict.fromkeys(self.roles, 0.0)
        for pid, cpu in last.items():
            spent[role_of[pid]] += cpu - first[pid]
        return spent, window[-1][0] - window[0][0]

    def shares(self, start: float | None = None, end: float | None = None) -> dict[str, float]:
        """Each role's share of the machine's cores over the window, and ``idle``: what none took."""
        spent, wall = self.seconds(start, end)
        out = {role: s / (wall * (os.cpu_count() or 1)) for role, s in spent.items()}
        out["idle"] = max(0.0, 1.0 - sum(out.values()))
        return out
