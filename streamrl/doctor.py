"""``streamrl doctor RUN``: the ledger of a run, and whether it balances; of a replay, whether it matched.

Reads ``RUN/config.yaml`` for the Redis URL and run name. When that Redis is gone (an embedded
one stops with its run), the run's own append-only file is opened in a temporary redis-server. A replay's
directory (``streamrl replay``) has no Redis: its ``replay.json`` and metrics say what it trained.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import redis
from rich.console import Console
from rich.table import Table

from streamrl.buffer import EmbeddedRedis, Ledger, LedgerReport, Namespace
from streamrl.config import Config, load_config


def diagnose(run_dir: Path) -> LedgerReport:
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(f"{config} does not exist: give the directory of a run started by `streamrl up`")
    cfg = load_config(config, [])
    with _redis_of(cfg, run_dir) as url:
        return Ledger(Namespace.open(url, cfg.run.name, retries=0)).report()


@contextlib.contextmanager
def _redis_of(cfg: Config, run_dir: Path) -> Iterator[str]:
    if cfg.redis.url and _answers(cfg.redis.url):
        yield cfg.redis.url
        return
    data = run_dir / "redis"
    if not any(data.glob("appendonly*")):
        raise ConnectionError(f"Redis at {cfg.redis.url} does not answer and {data} holds no append-only file")
    with EmbeddedRedis(data, password=cfg.redis.password) as server:  # the run's data, on a free port
        yield server.url


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def show(report: LedgerReport, console: Console) -> None:
    table = Table(title="ledger", show_header=True)
    table.add_column("groups")
    table.add_column("count", justify="right")
    r, learned = report.rollout, report.learner
    rows = [("started (admitted by a worker)", r["admitted"]), ("pushed into the replay stream", r["accepted"]),
            *((f"  {k.replace('abandoned:', 'abandoned: ')}", v) for k, v in r.items() if k.startswith("abandoned:")),
            ("  lease expired (worker died mid-group)", r["expired"]), ("  pushed after its lease expired", r.get("late", 0)),
            ("  still being generated", report.running),
            ("trained", learned["trained"]), ("dropped: stale", learned["dropped:stale"]), ("dropped: dead-lettered", learned["dropped:dead"]),
            ("dropped: step skipped (non-finite)", learned["dropped:skipped"]),
            ("dropped: no signal (all rewards equal)", learned["dropped:no_signal"]),
            ("  trained or dropped, settled by a checkpoint", learned["settled"]),
            ("pending after the learner's cursor", report.pending), ("recorded twice", learned["twice"]), ("undecodable stream entries", r["dead"])]
    for name, value in rows:
        table.add_row(name, str(value))
    console.print(table)
    if report.balanced:
        console.print(f"[green]balanced[/]: every pushed group was trained once, dropped with a reason, or is pending "
                      f"(cursor {report.cursor})")
    for problem in report.problems:
        console.print(f"[red]imbalance:[/] {problem}")
    for push, reason in sorted(report.refused.items(), key=lambda kv: int(kv[0].split("@")[0])):
        version, server = push.split("@", 1)
        console.print(f"[yellow]push refused:[/] {server} rolled back version {version}: {reason}")


def show_record(run_dir: Path, console: Console) -> None:
    """One line on the run's record: the steps it holds, and how to check them."""
    from streamrl.learner import record

    root = run_dir / "record"
    if not record.chunks(root):
        console.print("record: none (record.enabled: false): this run cannot be replayed")
        return
    try:
        first, last = record.span(root)
    except record.RecordError as e:
        console.print(f"[red]record:[/] {e}")
        return
    size = sum(p.stat().st_size for p in record.chunks(root)) / 2**20
    console.print(f"record: steps {first + 1}-{last} ({size:.1f} MB); `streamrl replay {run_dir} --verify` "
                  "retrains them and compares every step's weights")


def show_replay(run_dir: Path, console: Console) -> bool:
    """A replay's account: what it replayed, and whether its weights matched the run's; False if they differ."""
    import json

    from streamrl.learner.replay import verdict

    summary = json.loads((run_dir / "replay.json").read_text())
    lines = [json.loads(x) for x in (run_dir / "metrics" / "learner.jsonl").read_text().splitlines() if x.strip()]
    table = Table(title=f"replay of {summary['source']}", show_header=True)
    table.add_column("")
    table.add_column("", justify="right")
    rows = [("started from the checkpoint of version", summary["start"]), ("steps replayed", len(lines)),
            ("version reached", summary["version"]), ("groups trained", sum(r.get("groups", 0) for r in lines)),
            ("groups the run dropped (stale)", sum(r.get("dropped_stale", 0) for r in lines)),
            ("groups the run dropped (no signal)", sum(r.get("dropped_no_signal", 0) for r in lines))]
    for name, value in rows:
        table.add_row(name, str(value))
    console.print(table)
    same, line = verdict(summary)
    console.print(f"{'[green]' if same else '[yellow]'}weights: {line}[/]")
    return same


def show_coverage(run_dir: Path, console: Console) -> None:
    """Who was trained: each quartile's trained share of the groups read, by generation time and by mean reward
    (``learner.coverage``); 1.00 is the run's own share, lower is a part of the data the run trained less."""
    import json

    from streamrl.learner import coverage

    path = run_dir / "metrics" / "learner.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if '"groups_read"' in x] if path.is_file() else []
    rows = coverage.from_lines(lines)
    found = {axis: coverage.quartiles(rows, axis) for axis in coverage.AXES}
    if not any(found.values()):
        return
    table = Table(title="who was trained: each quartile's trained share over the run's", show_header=True)
    for column in ("quartile of", "", "range", "groups read", "trained", "ratio"):
        table.add_column(column, justify="left" if column in ("quartile of", "") else "right")
    for axis, quarters in found.items():
        for name, q in zip(coverage.QUARTILES, quarters or []):
            table.add_row(coverage.AXES[axis] if name == "q1" else "", name, f"{q['low']:.3g}-{q['high']:.3g}",
                          str(q["groups"]), f"{q['trained_share']:.0%}", f"{q['ratio']:.2f}")
    console.print(table)
    for axis in coverage.AXES:
        if line := coverage.summary(rows, axis):
            console.print(f"trained share by {line}")
