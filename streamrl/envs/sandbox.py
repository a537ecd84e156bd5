"""Running code a model wrote: a separate process with time, memory, file and process limits.

The child is a fresh ``python -I`` (isolated: no site packages from the user, no env vars)
in an empty temporary directory that is deleted afterwards, with an empty environment and
rlimits on CPU seconds, address space, file size, open files and processes; as root it
drops to ``nobody``. A wall-clock timeout kills its whole process group. This bounds a
runaway or greedy program; it is not a boundary against a determined attacker, for which
a container runtime (gVisor, firejail, nsjail) belongs around the rollout workers.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import sys
import tempfile
from dataclasses import dataclass, field

NOBODY = 65534


def _system_python() -> str:
    """The interpreter for model code: the system's (runnable by ``nobody``; the code needs only the stdlib)."""
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


@dataclass(frozen=True)
class Limits:
    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 256
    file_mb: int = 1
    open_files: int = 32
    processes: int = 16
    output_bytes: int = 8192
    python: str = field(default_factory=_system_python)


@dataclass(frozen=True)
class Outcome:
    stdout: str
    stderr: str
    returncode: int | None
    killed: str | None = None  # the limit that stopped it: "wall time", "cpu time" or "file size"

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed is None


async def run_python(code: str, limits: Limits = Limits()) -> Outcome:
    """Run ``code`` under ``limits``; never raises for anything the code does."""
    with tempfile.TemporaryDirectory(prefix="streamrl-sandbox-") as cwd:
        if os.geteuid() == 0:
            os.chown(cwd, NOBODY, NOBODY)
        try:
            proc = await asyncio.create_subprocess_exec(
                limits.python, "-I", "-c", code, cwd=cwd, env={}, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                preexec_fn=lambda: _confine(limits), start_new_session=True)
        except PermissionError:
            raise RuntimeError(f"the sandbox cannot run {limits.python} as 'nobody': give Limits.python an "
                               "interpreter every user may execute (e.g. /usr/bin/python3)") from None
        killed = None
        try:
            out, err = await asyncio.wait_for(proc.communicate(), limits.wall_s)
        except asyncio.TimeoutError:
            killed = "wall time"
            _kill_group(proc.pid)
            out, err = await proc.communicate()
        finally:
            if proc.returncode is None:  # cancelled: leave nothing running
                _kill_group(proc.pid)
        _kill_group(proc.pid)  # anything it forked and left behind
    cut = limits.output_bytes
    killed = killed or _RLIMIT_SIGNALS.get(proc.returncode)
    return Outcome(out[:cut].decode(errors="replace"), err[-cut:].decode(errors="replace"), proc.returncode, killed)


# the kernel's answer to a process past RLIMIT_CPU (SIGXCPU, then SIGKILL at the hard limit) or RLIMIT_FSIZE
_RLIMIT_SIGNALS = {-signal.SIGXCPU: "cpu time", -signal.SIGKILL: "cpu time", -signal.SIGXFSZ: "file size"}


def _confine(limits: Limits) -> None:
    """In the child, before exec: rlimits, then (as root) become nobody."""
    mb = 2**20
    for what, value in ((resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_AS, limits.memory_mb * mb),
                        (resource.RLIMIT_FSIZE, limits.file_mb * mb), (resource.RLIMIT_NOFILE, limits.open_files),
                        (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(what, (value, value))
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))  # counts per user: after setuid


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
