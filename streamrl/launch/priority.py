"""Who goes first where the learner and the servers share this machine's cores.

On a machine without GPUs the servers' generation and the learner's training compete for the same cores.
Under the staleness bound a run goes at the pace of its slower side: the faster side only runs ahead until
admission (generation) or the queue (the learner) holds it. So the cores should go first to the side that
sets the pace. Without a priority they go to neither: while generation runs, the learner's step is stretched;
while admission holds generation, its cores idle.

``supervise.server_nice: auto`` watches the learner. When it waited under ``YIELD_BELOW`` of its last
``WINDOW`` steps (the learner sets the pace), every process of every server (vLLM's engine processes too)
is reniced to ``AUTO_NICE``: the kernel gives the learner its cores first and the servers what it leaves.
When it waits over ``RESUME_ABOVE`` (generation sets the pace), they go back to 0 where this process may lower
a niceness (root; else the first yield holds for the rest of the run, and says so). A number holds the servers
at it once the run is up. Parts Ray places, and servers with GPUs of their own, are left alone: they do not
share the learner's cores. Each change is said, and kept in ``RUN/metrics/server_nice.jsonl`` with the step
and the wait share that decided it.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import psutil

from streamrl.launch.supervisor import Part, process_tree

AUTO_NICE = 10  # the kernel then gives a nice-0 thread about 10× a nice-10 one's time on a shared core
WINDOW = 5  # learner steps judged at a time
YIELD_BELOW = 0.10  # waited under this share of its last steps: the learner sets the pace
RESUME_ABOVE = 0.25  # waited over this share: generation does


def wait_share(lines: list[dict]) -> float | None:
    """The share of the learner's clock spent waiting for data over its trained lines after the first (whose
    wait holds the run's start-up); None until there are ``WINDOW`` of them."""
    if len(lines) < WINDOW + 1:
        return None
    first, window = lines[-WINDOW - 1], lines[-WINDOW:]
    span = window[-1]["time"] - first["time"]
    return sum(r.get("wait_s", 0.0) for r in window) / span if span > 0 else None


class ServerPriority:
    def __init__(self, setting: int | str, metrics: Path, say: Callable[[str], None]):
        """``setting``: ``supervise.server_nice``; ``metrics``: the learner's metrics file."""
        self.auto = setting == "auto"
        self.nice = 0 if self.auto else int(setting)
        self.metrics, self.say = metrics, say
        self._offset = metrics.stat().st_size if metrics.exists() else 0  # a resumed run's earlier steps: not judged
        self._lines: deque[dict] = deque(maxlen=WINDOW + 1)
        self.can_lower = may_lower_niceness()

    def watch(self, parts: list[Part]) -> None:
        """One round: with ``auto``, judge the learner's newest steps; then hold every local server process
        (a restarted server's, vLLM's children started since) at the niceness in force."""
        if self.auto:
            self._judge()
        for part in parts:
            if part.kind == "server" and isinstance(part.proc, subprocess.Popen) and part.alive():
                self._renice(part)

    def _judge(self) -> None:
        self._read()
        share = wait_share(list(self._lines))
        if share is None:
            return
        if self.nice == 0 and share < YIELD_BELOW:
            self.nice = AUTO_NICE
            self.say(f"the learner sets the pace (it waited {share:.0%} of its last {WINDOW} steps): the servers "
                     f"yield the cores to it (niceness {AUTO_NICE}"
                     f"{'' if self.can_lower else ', for the rest of the run: lowering it back takes root'})")
        elif self.nice and self.can_lower and share > RESUME_ABOVE:
            self.nice = 0
            self.say(f"generation sets the pace (the learner waited {share:.0%} of its last {WINDOW} steps): the "
                     "servers share the cores with it again (niceness 0)")
        else:
            return
        with self.metrics.with_name("server_nice.jsonl").open("a") as f:  # the run keeps what was decided, and when
            f.write(json.dumps({"time": time.time(), "step": self._lines[-1]["step"], "niceness": self.nice,
                                "wait_share": share}) + "\n")
        self._lines.clear()  # the next judgement sees steps taken under the new priority only

    def _read(self) -> None:
        """The learner's trained lines written since the last round (a torn last line waits for the next)."""
        try:
            with self.metrics.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        done = chunk.rfind(b"\n") + 1
        self._offset += done
        for raw in chunk[:done].splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if "loss" in line and "time" in line:
                self._lines.append(line)

    def _renice(self, part: Part) -> None:
        """Every thread of every process of the part: Linux keeps a niceness per thread, and a thread takes its
        creator's only when it is made (vLLM's engine threads are long made when ``auto`` yields)."""
        for proc in process_tree(part.pid):
            try:
                threads = [t.id for t in proc.threads()]
            except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone; or a process not ours
                continue
            for tid in threads:
                try:
                    if os.getpriority(os.PRIO_PROCESS, tid) != self.nice:
                        os.setpriority(os.PRIO_PROCESS, tid, self.nice)
                except (ProcessLookupError, PermissionError):
                    continue


def may_lower_niceness() -> bool:
    """Whether this process may take a niceness back down to 0: root, or a soft RLIMIT_NICE of 20 or more
    (the floor it allows is 20 minus the limit)."""
    limit = resource.getrlimit(resource.RLIMIT_NICE)[0]
    return os.geteuid() == 0 or limit == resource.RLIM_INFINITY or limit >= 20
