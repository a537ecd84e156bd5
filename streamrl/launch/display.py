"""What `streamrl up` shows: a live rich panel on a terminal, plain log lines otherwise, then a summary.

Everything shown is read from where the parts already report it: the learner's and the
evaluator's metrics files, the rollout workers' metrics files, Redis (version, admission
counters, stream length) and the supervisor (per-part health).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from streamrl.config import Config
from streamrl.rollout.evaluate import read_records


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "–" if value is None else format(value, spec)


def _run_rate(reports: list[dict]) -> float:
    """A worker's tokens/s from its opening report to its last: each report's rate covers the span since the one
    before (the live figure is the last span's alone, 0 once the worker has stopped)."""
    tokens = sum(r.get("tokens_per_s", 0.0) * (r["time"] - before["time"]) for before, r in zip(reports, reports[1:]))
    return tokens / max(reports[-1]["time"] - reports[0]["time"], 1e-9)


STALE_WARNING = 0.05  # share of finished groups dropped as stale past which the summary says what to do


class Dashboard:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.console = Console(stderr=False)
        live = cfg.supervise.display == "live" or (cfg.supervise.display == "auto" and sys.stdout.isatty())
        self.live = Live(console=self.console, refresh_per_second=2, transient=False) if live else None
        self.started = time.time()
        self.last_plain = 0.0
        self.supervisor = None
        self.final: dict[str, Any] = {}
        self.changes_said = 0  # bound changes already on screen
        self.refusals_said = 0  # refused pushes already on screen

    def connect(self, redis_url: str, supervisor) -> None:
        from streamrl.buffer import Admission, Namespace, PolicyVersion

        # no retries: the supervisor's loop refreshes the dashboard, and waiting out a Redis that is down there would
        # hold up Redis's own restart, past the reconnect budget of every part (the figures fall back on the files)
        ns = Namespace.open(redis_url, self.cfg.run.name, retries=0)
        self.ns, self.policy_version = ns, PolicyVersion(ns)
        self.admission = Admission(ns, max_staleness=self.cfg.admission_bound,
                                   groups_per_step=self.cfg.learner.groups_per_step)
        self.supervisor = supervisor
        if self.live is not None:
            self.live.start()

    def say(self, message: str) -> None:
        """A line of news; plain text (log tails hold brackets that rich would read as markup)."""
        stamp = time.strftime("%H:%M:%S")
        (self.live.console if self.live is not None else self.console).print(f"[dim]{stamp}[/] {escape(message)}",
                                                                             highlight=False, soft_wrap=True)

    # ------------------------------------------------------------------ figures

    def stats(self) -> dict[str, Any]:
        run = Path(self.cfg.run.path)
        lines = read_records(run / "metrics" / "learner.jsonl")
        learner = [r for r in lines if "loss" in r]
        pushes = [r for r in lines if "push_s" in r]
        evals = read_records(run / "metrics" / "eval.jsonl")
        # a worker's first report only marks its start (no rates yet): show a rate from its second on
        reports = [rs for rs in (read_records(p) for p in sorted((run / "metrics").glob("rollout-*.jsonl")))
                   if len(rs) > 1]
        workers = [rs[-1] for rs in reports]
        out: dict[str, Any] = {"elapsed": time.time() - self.started}
        try:
            out["version"] = self.policy_version.get()
            counters = self.admission.counters()
            out["running"] = self.admission.running()
            out["queue"] = max(0, counters.get("accepted", 0) - sum(
                r.get("groups", 0) + r.get("dropped_stale", 0) + r.get("dropped_no_signal", 0) for r in learner))
            out["accepted"] = counters.get("accepted", 0)
            out["dropped_stale"] = counters.get("dropped_stale", 0)
            out["bound"] = self.admission.bound()  # with max_staleness: auto, the learner's of the moment
        except Exception:  # Redis restarting: show what the files say
            pass
        out["bound_changes"] = [r["staleness_change"] for r in lines if "staleness_change" in r]
        out["refusals"] = [r["push_refusal"] for r in lines if "push_refusal" in r]
        if learner:
            last = learner[-1]
            out.update(step=last["step"], reward=last.get("reward_mean"), loss=last.get("loss"),
                       staleness_max=max(r.get("staleness_max", 0) for r in learner),
                       train_tok_s=last.get("tokens_per_s"), first_reward=learner[0].get("reward_mean"),
                       mismatch=last.get("mismatch_abs"), fresh_mismatch=last.get("fresh_mismatch_abs"),
                       no_signal=last.get("groups_no_signal"), groups=last.get("groups"),
                       widened=sum("wide_from" in r for r in learner))  # steps the learner took every core in
            if "staleness_bound" in last:  # Redis gone (after teardown): the auto bound of the last step
                out.setdefault("bound", last["staleness_bound"])
        if pushes:
            out["push_s"] = pushes[-1]["push_s"]
            out["pushes_served"] = sum(r.get("push_targets", 0) for r in pushes)
            out["pushes_refused"] = sum(r.get("push_rejected", 0) for r in pushes)
        waits = [r["push_wait_s"] for r in lines if "push_wait_s" in r]
        if waits:  # how long the learner stalled on it (a background push overlaps its step)
            out["push_wait_s"] = waits[-1]
        if evals:
            out["eval_first"], out["eval_last"] = evals[0], evals[-1]
        if workers:
            out["gen_tok_s"] = sum(w.get("tokens_per_s", 0.0) for w in workers)
            out["gen_tok_s_run"] = sum(map(_run_rate, reports))
            out["worker_reward"] = workers[-1].get("reward_mean")
        timed = [r for r in learner if "train_s" in r]  # a step whose every update was skipped has no time
        if timed:
            out["train_tok_s_run"] = sum(r["tokens_global"] for r in timed) / max(sum(r["train_s"] for r in timed), 1e-9)
        return out

    def _health(self) -> Table:
        table = Table(title="parts", expand=False)
        parts = self.supervisor.parts if self.supervisor else []
        nodes = any(part.host not in (None, "127.0.0.1") for part in parts)  # a column only where Ray spread them
        for col in ("part", *(["node"] if nodes else []), "pid", "state", "restarts", "up"):
            table.add_column(col)
        for part in parts:
            state = ("done" if part.finished else "placing" if part.placing else "running" if part.alive()
                     else f"exited {part.proc.returncode}" if part.proc else "waiting")
            colour = {"running": "green", "done": "blue", "placing": "yellow"}.get(state, "red")
            table.add_row(part.name, *([part.host or "–"] if nodes else []), str(part.pid or "–"),
                          f"[{colour}]{state}[/]", str(part.restarts),
                          f"{time.time() - part.started_at:.0f}s" if part.started_at else "–")
        return table

    def _progress(self, s: dict[str, Any]) -> Table:
        table = Table(title=f"streamrl · {self.cfg.run.name} · {self.cfg.mode} · {s['elapsed']:.0f}s", expand=False)
        table.add_column("figure")
        table.add_column("value", justify="right")
        first, last = s.get("eval_first"), s.get("eval_last")
        rows = [
            ("step / max", f"{s.get('step', 0)} / {self.cfg.learner.max_steps}"),
            ("policy version", str(s.get("version", "–"))),
            ("train reward (last step)", _fmt(s.get("reward"))),
            ("eval accuracy (first → last)", f"{_fmt(first and first['eval/accuracy'])} → "
                                             f"{_fmt(last and last['eval/accuracy'])}"
                                             + (f" @ step {last['step']}" if last else "")),
            ("staleness max (bound)", f"{s.get('staleness_max', '–')} ({self._bound(s)})"),
            ("queue (groups waiting)", str(s.get("queue", "–"))),
            ("in flight / dropped stale", f"{s.get('running', '–')} / {s.get('dropped_stale', '–')}"),
            ("generation tokens/s", _fmt(s.get("gen_tok_s"), ".0f")),
            ("training tokens/s", _fmt(s.get("train_tok_s"), ".0f")),
            ("weight push s (learner waited)", f"{_fmt(s.get('push_s'))} ({_fmt(s.get('push_wait_s'))})"),
            ("pushes served / refused by a probe", f"{s.get('pushes_served', 0):.0f} / {s.get('pushes_refused', 0):.0f}"),
            ("groups without signal (last step)", f"{s.get('no_signal', '–')} of {s.get('groups', '–')}"),
            ("|Δ logprob| learner vs rollout (fresh)", f"{_fmt(s.get('mismatch'), '.1e')} "
                                                      f"({_fmt(s.get('fresh_mismatch'), '.1e')})"),
        ]
        for name, value in rows:
            table.add_row(name, value)
        return table

    def _bound(self, s: dict[str, Any]) -> str:
        bound = s.get("bound", self.cfg.admission_bound)
        return f"auto: {bound}" if self.cfg.off_policy.adaptive else str(bound)

    def refresh(self) -> None:
        s = self.stats()
        for change in s["bound_changes"][self.changes_said:]:  # each move of an auto bound, with its cause
            self.say(change)
        self.changes_said = len(s["bound_changes"])
        for refusal in s["refusals"][self.refusals_said:]:  # a server whose weights failed their probe
            self.say(f"weight push {refusal}")
        self.refusals_said = len(s["refusals"])
        if self.live is not None:
            self.live.update(Group(self._progress(s), self._health()))
        elif time.time() - self.last_plain >= 10:
            self.last_plain = time.time()
            last = s.get("eval_last")
            self.say(f"step {s.get('step', 0)}/{self.cfg.learner.max_steps}  version {s.get('version', '–')}  "
                     f"reward {_fmt(s.get('reward'))}  eval {_fmt(last and last['eval/accuracy'])}  "
                     f"staleness≤{s.get('staleness_max', '–')}  queue {s.get('queue', '–')}  "
                     f"gen {_fmt(s.get('gen_tok_s'), '.0f')} tok/s  train {_fmt(s.get('train_tok_s'), '.0f')} tok/s  "
                     f"push {_fmt(s.get('push_s'))}s (waited {_fmt(s.get('push_wait_s'))}s)  "
                     f"mismatch {_fmt(s.get('mismatch'), '.1e')}")

    def close(self) -> None:
        """Freeze the figures while Redis is still up (the summary comes after teardown)."""
        if self.supervisor is not None:
            self.final = self.stats()
        if self.live is not None:
            self.refresh()
            self.live.stop()

    def summary(self, seconds: float, code: int) -> None:
        s = self.final
        table = Table(title=f"run {self.cfg.run.name}: {'finished' if code == 0 else f'stopped (exit {code})'} "
                            f"in {seconds:.0f}s")
        table.add_column("figure")
        table.add_column("value", justify="right")
        first, last = s.get("eval_first"), s.get("eval_last")
        if first and last:
            table.add_row(f"eval accuracy before RL (step {first['step']})", _fmt(first["eval/accuracy"]))
            table.add_row(f"eval accuracy after (step {last['step']})", _fmt(last["eval/accuracy"]))
        table.add_row("steps", str(s.get("step", 0)))
        table.add_row("generated tokens/s (whole run)", _fmt(s.get("gen_tok_s_run"), ".0f"))
        table.add_row("trained tokens/s (learner's time)", _fmt(s.get("train_tok_s_run"), ".0f"))
        table.add_row("train reward first → last", f"{_fmt(s.get('first_reward'))} → {_fmt(s.get('reward'))}")
        table.add_row("max staleness seen (bound)", f"{s.get('staleness_max', '–')} ({self._bound(s)})")
        if s.get("bound_changes"):
            table.add_row("bound changes (auto)", str(len(s["bound_changes"])))
        if s.get("widened"):  # generation was held and the learner took its cores (supervise.learner_threads)
            table.add_row("steps the learner took every core in", f"{s['widened']} of {s.get('step', 0)}")
        dropped, finished = s.get("dropped_stale"), s.get("accepted")
        table.add_row("groups dropped as stale", f"{dropped} of {finished} finished" if finished else str(dropped or "–"))
        table.add_row("run directory", str(self.cfg.run.path))
        self.console.print(table)
        if finished and dropped / finished > STALE_WARNING:  # generated in vain, and not at random: the slow ones
            bound, off_policy = s.get("bound", self.cfg.admission_bound), self.cfg.off_policy
            self.say(f"{100 * dropped / finished:.0f}% of the finished groups were dropped as stale: episodes "
                     f"outlasted {bound} learner step{'s' if bound != 1 else ''}. {_stale_advice(off_policy)}")


def _stale_advice(off_policy) -> str:
    """What to change where many groups were dropped as stale."""
    if not off_policy.adaptive:
        return "Raise off_policy.max_staleness, or train late groups with the correction (off_policy.stale=keep)"
    if off_policy.auto.late == "drop":
        return "Keep late groups under the correction (off_policy.auto.late=keep), or raise off_policy.auto.low"
    return (f"Under auto they were older than off_policy.auto.high ({off_policy.auto.high}) or came after a cut "
            "for degraded data: raise off_policy.auto.high, or train every late group (off_policy.stale=keep)")
