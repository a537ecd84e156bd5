"""Parts as processes: start with a readiness check, watch, restart per policy, tear down.

Where a part's process runs is the launcher's business: ``LocalProcesses`` (children of this
process, each in its own session so Ctrl-C reaches only the supervisor) or Ray actors
(``streamrl.launch.ray``). Each part logs to ``RUN/logs/NAME.log``. Teardown kills every
descendant (torchrun's ranks included), so nothing outlives the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

from streamrl.buffer.redis_server import die_with_parent


class PartFailed(RuntimeError):
    """A part died (or never became ready) and the policy says the run stops."""


@dataclass
class Part:
    name: str
    kind: str                      # redis | router | server | rollout | learner | evaluator
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    ready: Callable[[], bool] | None = None  # None: ready once started
    proc: Any = None               # a Popen, or anything with pid, poll() and returncode
    restarts: int = 0
    started_at: float = 0.0
    pending: bool = False          # started, not yet seen placed and ready
    said_waiting: bool = False     # the supervisor said what its placing waits for
    finished: bool = False         # exited 0 on its own: done, not dead

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def host(self) -> str | None:
        """The address of the node the part runs on (None while a launcher is still placing it)."""
        return getattr(self.proc, "host", "127.0.0.1") if self.proc else None

    @property
    def placing(self) -> bool:
        return bool(getattr(self.proc, "placing", False))

    @property
    def where(self) -> str:
        return f"pid {self.pid} on {self.host}" if self.host != "127.0.0.1" else f"pid {self.pid}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class Launcher(Protocol):
    def spawn(self, part: Part) -> Any: ...
    def stop_all(self, parts: list[Part], timeout_s: float) -> None: ...


class LocalProcesses:
    """Parts as children of this process, each leading its own session (process group).

    A part gets SIGTERM if this process dies without tearing down (SIGKILL, OOM), so even
    then none outlives the run by more than its own shutdown.
    """

    def spawn(self, part: Part) -> subprocess.Popen:
        with part.log_path.open("ab") as log:
            return subprocess.Popen(part.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **part.env}, start_new_session=True,
                                    preexec_fn=die_with_parent)

    def stop_all(self, parts: list[Part], timeout_s: float) -> None:
        """SIGTERM every part's tree at once, wait for them together, SIGKILL what is left."""
        trees = [_part_tree(part) for part in parts]
        for part, tree in zip(parts, trees):
            _signal_part(part, tree, signal.SIGTERM)
        _, alive = psutil.wait_procs([p for tree in trees for p in tree], timeout=timeout_s)
        for part, tree in zip(parts, trees):
            _signal_part(part, [p for p in tree if p in alive], signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
        for part in parts:
            part.proc.poll()


def _part_tree(part: Part) -> list[psutil.Process]:
    """A live part's process and descendants; nothing for one already reaped (its pid may be reused)."""
    return process_tree(part.proc.pid) if part.proc.poll() is None else []


def _signal_part(part: Part, tree: list[psutil.Process], sig: int) -> None:
    """Signal each process of a part once: its process group in one call (which also reaches members whose
    parent is gone, so no longer in the tree), and one by one the descendants that left the group.
    Once matters: a second SIGTERM can land inside a handler still busy with the first."""
    for proc in tree:
        if _group(proc) != part.proc.pid:
            _signal(proc, sig)
    try:
        os.killpg(part.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group(proc: psutil.Process) -> int | None:
    try:
        return os.getpgid(proc.pid)
    except ProcessLookupError:
        return None


def kill_tree(pid: int, timeout_s: float) -> None:
    """SIGTERM a process and all its descendants; SIGKILL what is left after ``timeout_s``."""
    tree = process_tree(pid)
    for proc in tree:
        _signal(proc, signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=timeout_s)
    for proc in alive:
        _signal(proc, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5)


class Supervisor:
    def __init__(self, restart: list[str], max_restarts: int, ready_timeout_s: float,
                 say: Callable[[str], None] = print, state_path: Path | None = None,
                 launcher: Launcher | None = None):
        self.launcher = launcher or LocalProcesses()
        self.parts: list[Part] = []
        self.restart_kinds, self.max_restarts, self.ready_timeout_s = set(restart), max_restarts, ready_timeout_s
        self.say, self.state_path = say, state_path

    def start(self, part: Part, wait: bool = True) -> Part:
        """Start ``part``; with ``wait``, return once it is placed and ready (the run's first start, in order).
        Without, ``check`` sees it through placing and readiness on its rounds (restarts, added parts): a part
        that waits for a node must not hold up the watch over the others."""
        if part not in self.parts:
            self.parts.append(part)
        part.log_path.parent.mkdir(parents=True, exist_ok=True)
        part.proc = self.launcher.spawn(part)
        part.started_at, part.pending, part.said_waiting = time.time(), True, False
        part.finished = False
        self._save()
        if wait:
            while part.placing and part.alive():
                self._say_waiting(part)
                time.sleep(0.2)
            self._settle(part)
        return part

    def _say_waiting(self, part: Part) -> None:
        """Once, while the launcher finds no room for a part (Ray: no node with what it asks for, until one
        joins), what it waits for."""
        if not part.said_waiting and (reason := part.proc.waiting_for()):
            self.say(f"{part.name} waits for {reason}")
            part.said_waiting = True

    def _settle(self, part: Part) -> None:
        """A part just placed: record where, then wait until it is ready."""
        part.pending = False
        if part.said_waiting:
            self.say(f"{part.name} placed on {part.host}")
        self._save()
        self._wait_ready(part)

    def _save(self) -> None:
        """``RUN/parts.json``: every part's pid, restarts and log, for people and tools looking in."""
        if self.state_path is None:
            return
        state = {p.name: {"kind": p.kind, "pid": p.pid, "host": p.host, "hosts": getattr(p.proc, "hosts", [p.host]),
                          "restarts": p.restarts, "started_at": p.started_at, "log": str(p.log_path)}
                 for p in self.parts}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.state_path)

    def _wait_ready(self, part: Part) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while part.ready is not None and not part.ready():
            if not part.alive():
                raise PartFailed(f"{part.name} ({part.where}) exited with {part.proc.returncode} before it was "
                                 f"ready; the end of {part.log_path}:\n{part.log_tail()}")
            if time.monotonic() > deadline:
                raise PartFailed(f"{part.name} ({part.where}) was not ready after {self.ready_timeout_s:.0f}s; "
                                 f"the end of {part.log_path}:\n{part.log_tail()}")
            time.sleep(0.2)

    def check(self) -> None:
        """Notice parts that exited: done (status 0 and not meant to run forever), restarted, or fatal."""
        for part in self.parts:
            if part.pending and part.alive():
                if part.placing:
                    self._say_waiting(part)
                    continue
                try:
                    self._settle(part)
                    continue
                except PartFailed:  # it died (or hung) while starting: as any death, per the restart policy
                    if part.alive():
                        self.launcher.stop_all([part], timeout_s=10)
            if part.finished or part.alive():
                continue
            code = part.proc.returncode
            if code == 0 and part.kind in ("learner", "evaluator"):
                part.finished = True
                continue
            if part.kind in self.restart_kinds and part.restarts < self.max_restarts:
                part.restarts += 1
                self.say(f"{part.name} ({part.where}) exited with {code}; restarting "
                         f"({part.restarts}/{self.max_restarts}). The end of its log:\n{part.log_tail(8)}")
                self.start(part, wait=False)
                continue
            raise PartFailed(f"{part.name} ({part.where}) exited with {code}; the end of {part.log_path}:\n"
                             f"{part.log_tail()}")

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop every part: SIGTERM, then SIGKILL for whatever is left of each tree. Rollout workers go first,
        so that the groups they have in flight finish through servers that are still up (a group is put
        whole or not at all); then the rest together; Redis last, so that everyone's writes land."""
        started = [p for p in reversed(self.parts) if p.proc is not None]
        stage = {"rollout": 0, "redis": 2}  # everything else: 1
        for n in range(3):
            group = [p for p in started if stage.get(p.kind, 1) == n]
            if group:
                self.launcher.stop_all(group, timeout_s)


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and every descendant of it (none if it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass
