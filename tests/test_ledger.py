"""The ledger against a real redis-server: balances, catches a lost or twice-trained group, rolls back."""

import subprocess
import sys

import yaml

from streamrl.buffer import Admission, Ledger, ReplayStream, StreamReader
from streamrl.testing import synthetic_group


def _run(ns, admitted: int, put: int, abandon: int = 0):
    admission, stream = Admission(ns, max_staleness=4, groups_per_step=8), ReplayStream(ns)
    groups = [synthetic_group(2, 8, prompt_len=2) for _ in range(admitted)]
    for g in groups:
        assert admission.try_admit(g.group_id)
    for g in groups[:put]:
        stream.put(g)
    for g in groups[put:put + abandon]:
        admission.abandon(g.group_id, "failed_samples")
    return groups, StreamReader(ns)


def test_a_whole_run_balances_with_every_kind_of_outcome(ns):
    groups, reader = _run(ns, admitted=7, put=5, abandon=1)
    ledger = Ledger(ns)
    first = [e.group.group_id for e in reader.read(3)]
    assert ledger.record(1, reader.cursor, {first[0]: "trained", first[1]: "trained", first[2]: "dropped:stale"}) == 0
    second = [e.group.group_id for e in reader.read(1)]
    ledger.record(2, reader.cursor, {second[0]: "dropped:skipped"})

    report = ledger.report()
    assert report.balanced, report.problems
    assert report.learner == {"trained": 2, "dropped:stale": 1, "dropped:dead": 0, "dropped:skipped": 1,
                              "dropped:no_signal": 0, "twice": 0, "settled": 0}
    assert report.rollout["admitted"] == 7 and report.rollout["accepted"] == 5
    assert report.rollout["abandoned:failed_samples"] == 1 and report.running == 1 and report.pending == 1


def test_a_group_read_but_never_recorded_is_reported_lost(ns):
    _, reader = _run(ns, admitted=2, put=2)
    entries = reader.read(2)
    Ledger(ns).record(1, reader.cursor, {entries[0].group.group_id: "trained"})  # the second vanished
    report = Ledger(ns).report()
    assert not report.balanced
    assert any("+1 pushed groups are neither trained, dropped nor pending" in p for p in report.problems)


def test_training_a_group_twice_without_a_rollback_is_caught(ns):
    _, reader = _run(ns, admitted=1, put=1)
    gid = reader.read(1)[0].group.group_id
    ledger = Ledger(ns)
    ledger.record(1, reader.cursor, {gid: "trained"})
    assert ledger.record(2, reader.cursor, {gid: "trained"}) == 1
    report = ledger.report()
    assert report.learner["twice"] == 1
    assert any("recorded twice" in p and gid in p for p in report.problems)


def test_a_resumed_learner_rolls_back_uncheckpointed_steps_and_replays_them(ns):
    _, reader = _run(ns, admitted=4, put=4)
    ledger = Ledger(ns)
    for version in (1, 2):
        ids = [e.group.group_id for e in reader.read(2)]
        ledger.record(version, reader.cursor, dict.fromkeys(ids, "trained"))
        if version == 1:
            ledger.settle(1)  # a checkpoint at version 1, with the cursor after the first two groups
            checkpoint_cursor = reader.cursor

    # the learner dies after step 2 and resumes from the checkpoint at version 1
    assert ledger.rollback(1, checkpoint_cursor) == 2
    assert ledger.rollback(0, checkpoint_cursor) == 0  # steps a checkpoint covers are settled: never forgotten
    assert ledger.report().pending == 2
    replay = StreamReader(ns, cursor=checkpoint_cursor)
    ids = [e.group.group_id for e in replay.read(2)]
    assert ledger.record(2, replay.cursor, dict.fromkeys(ids, "trained")) == 0
    report = ledger.report()
    assert report.balanced, report.problems
    assert report.learner["trained"] == 4 and report.pending == 0


def test_a_resumed_learner_counts_each_drop_once_for_admission(ns):
    """Admission frees a dropped group's slot as the learner reads it; a learner that resumes reads the groups after
    its checkpoint again, and drops them again: each drop must free one slot, not one per reading."""
    groups, reader = _run(ns, admitted=6, put=6)
    admission, ledger = Admission(ns, max_staleness=4, groups_per_step=8), Ledger(ns)

    def step(version: int) -> None:  # trains the first group read, drops the second as stale
        ids = [e.group.group_id for e in reader.read(2)]
        admission.count_dropped_stale(1)  # as the coordinator counts it: at once
        ledger.record(version, reader.cursor, {ids[0]: "trained", ids[1]: "dropped:stale"})

    step(1)
    ledger.settle(1)  # a checkpoint at version 1
    checkpoint_cursor = reader.cursor
    step(2)
    reader.read(2)
    admission.count_dropped_stale(1)  # step 3 dropped one and died before it was recorded
    assert admission.counters()["dropped_stale"] == 3

    ledger.rollback(1, checkpoint_cursor)
    assert admission.counters()["dropped_stale"] == 1  # the checkpoint's own drop; the others are pending again
    reader = StreamReader(ns, cursor=checkpoint_cursor)
    step(2)
    step(3)
    report = ledger.report()
    assert report.balanced, report.problems
    assert admission.counters()["dropped_stale"] == report.learner["dropped:stale"] == 3


def test_a_checkpoint_folds_the_outcomes_it_covers_into_counts(ns):
    _, reader = _run(ns, admitted=6, put=6)
    ledger = Ledger(ns)
    for version in (1, 2, 3):
        ids = [e.group.group_id for e in reader.read(2)]
        ledger.record(version, reader.cursor, dict.fromkeys(ids, "trained"))
        if version == 2:
            checkpoint_cursor = reader.cursor
    assert ledger.settle(2) == 4  # a checkpoint at version 2
    assert ns.conn.hlen(ns.key("ledger:outcome")) == 2  # only the ids a rollback may still need
    report = ledger.report()
    assert report.balanced, report.problems
    assert report.learner["trained"] == 6 and report.learner["settled"] == 4

    assert ledger.rollback(2, checkpoint_cursor) == 2  # the learner dies after step 3 and resumes
    replay = StreamReader(ns, cursor=checkpoint_cursor)
    ids = [e.group.group_id for e in replay.read(2)]
    ledger.record(3, replay.cursor, dict.fromkeys(ids, "trained"))
    report = ledger.report()
    assert report.balanced, report.problems
    assert report.learner["trained"] == 6 and report.learner["twice"] == 0 and report.pending == 0


def test_doctor_prints_the_ledger_and_exits_by_balance(ns, redis_server, tmp_path):
    _, reader = _run(ns, admitted=2, put=2)
    ids = [e.group.group_id for e in reader.read(2)]
    Ledger(ns).record(1, reader.cursor, dict.fromkeys(ids, "trained"))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"run": {"name": ns.run, "dir": str(tmp_path.parent)},
                                                          "redis": {"url": redis_server.url}}))
    doctor = [sys.executable, "-m", "streamrl", "doctor", str(tmp_path)]
    out = subprocess.run(doctor, capture_output=True, text=True, env={"COLUMNS": "120", "PATH": ""})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "balanced" in out.stdout and "trained" in out.stdout

    Ledger(ns).record(2, reader.cursor, {ids[0]: "trained"})  # a replay without rollback
    out = subprocess.run(doctor, capture_output=True, text=True, env={"COLUMNS": "120", "PATH": ""})
    assert out.returncode == 1 and "recorded twice" in out.stdout


def test_doctor_names_what_is_missing(tmp_path):
    out = subprocess.run([sys.executable, "-m", "streamrl", "doctor", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 2 and "config.yaml does not exist" in out.stderr


def test_a_refused_push_is_in_the_ledger_with_its_reason_and_leaves_it_balanced(ns, redis_server, tmp_path):
    _, reader = _run(ns, admitted=2, put=2)
    ids = [e.group.group_id for e in reader.read(2)]
    ledger = Ledger(ns)
    ledger.record(1, reader.cursor, dict.fromkeys(ids, "trained"))
    ledger.refuse(2, "http://10.0.0.2:31000", "version 2 failed its probe: token 5 off by 3e-01")
    report = ledger.report()
    assert report.balanced and report.refused == {"2@http://10.0.0.2:31000": "version 2 failed its probe: token 5 "
                                                                              "off by 3e-01"}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"run": {"name": ns.run, "dir": str(tmp_path.parent)},
                                                          "redis": {"url": redis_server.url}}))
    out = subprocess.run([sys.executable, "-m", "streamrl", "doctor", str(tmp_path)], capture_output=True, text=True,
                         env={"COLUMNS": "200", "PATH": ""})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "push refused: http://10.0.0.2:31000 rolled back version 2: version 2 failed its probe" in out.stdout
