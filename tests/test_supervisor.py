"""The supervisor with real child processes: restarts, fatal exits, readiness, whole-tree teardown."""

import os
import signal
import sys
import time

import psutil
import pytest

from streamrl.launch.supervisor import Part, PartFailed, Supervisor

SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"]


def _supervisor(tmp_path, **kw) -> Supervisor:
    return Supervisor(kw.pop("restart", ["rollout"]), kw.pop("max_restarts", 1), kw.pop("ready_timeout_s", 20),
                      say=lambda m: None, state_path=tmp_path / "parts.json", **kw)


def test_a_dead_restartable_part_comes_back_until_its_budget_is_spent(tmp_path):
    sup = _supervisor(tmp_path)
    part = sup.start(Part("rollout-0", "rollout", SLEEPER, tmp_path / "logs" / "rollout-0.log"))
    try:
        first = part.pid
        os.kill(first, signal.SIGKILL)
        part.proc.wait()
        sup.check()
        assert part.alive() and part.pid != first and part.restarts == 1
        assert '"restarts": 1' in (tmp_path / "parts.json").read_text()
        os.kill(part.pid, signal.SIGKILL)
        part.proc.wait()
        with pytest.raises(PartFailed, match="rollout-0 .* exited with -9"):
            sup.check()
    finally:
        sup.stop()


def test_a_learner_that_ends_well_is_done_and_one_that_fails_stops_the_run_with_its_log(tmp_path):
    sup = _supervisor(tmp_path)
    done = sup.start(Part("learner", "learner", [sys.executable, "-c", "print('trained')"], tmp_path / "a.log"))
    done.proc.wait()
    sup.check()
    assert done.finished
    bad = sup.start(Part("learner-b", "learner", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
                         tmp_path / "b.log"))
    bad.proc.wait()
    with pytest.raises(PartFailed, match=r"(?s)exited with 3.*boom"):
        sup.check()


def test_a_part_that_dies_before_it_is_ready_fails_with_its_log(tmp_path):
    sup = _supervisor(tmp_path)
    part = Part("server-0", "server", [sys.executable, "-c", "raise SystemExit('no model here')"],
                tmp_path / "s.log", ready=lambda: False)
    with pytest.raises(PartFailed, match=r"(?s)before it was ready.*no model here"):
        sup.start(part)


def test_stop_kills_the_whole_tree_even_children_in_their_own_session(tmp_path):
    # like torchrun's ranks: a grandchild that ignores SIGTERM, in a session of its own
    code = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'], start_new_session=True); "
            "time.sleep(120)")
    sup = _supervisor(tmp_path)
    part = sup.start(Part("learner", "learner", [sys.executable, "-c", code], tmp_path / "l.log"))
    deadline = time.monotonic() + 10
    while len(psutil.Process(part.pid).children(recursive=True)) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    tree = [part.pid, *(c.pid for c in psutil.Process(part.pid).children(recursive=True))]
    sup.stop(timeout_s=1)
    time.sleep(0.2)
    assert not [p for p in tree if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_stop_signals_every_process_of_a_part_once(tmp_path, monkeypatch):
    # a second SIGTERM can land inside a handler still busy with the first (it made the test below flaky)
    from streamrl.launch import supervisor

    code = ("import subprocess, sys, time; "
            "[subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=s) "
            "for s in (False, True)]; time.sleep(120)")
    sup = _supervisor(tmp_path)
    part = sup.start(Part("server", "server", [sys.executable, "-c", code], tmp_path / "s.log"))
    deadline = time.monotonic() + 10
    while len(psutil.Process(part.pid).children()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    tree = [part.pid, *(c.pid for c in psutil.Process(part.pid).children())]
    terms = []
    real_signal, real_killpg = supervisor._signal, os.killpg
    monkeypatch.setattr(supervisor, "_signal", lambda proc, sig: (sig != signal.SIGTERM or terms.append(proc.pid),
                                                                 real_signal(proc, sig)))
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: (
        sig != signal.SIGTERM or terms.extend(p for p in tree if psutil.pid_exists(p) and os.getpgid(p) == pgid),
        real_killpg(pgid, sig)))
    sup.stop(timeout_s=5)
    assert sorted(terms) == sorted(tree)


def test_rollout_workers_stop_first_and_redis_last(tmp_path):
    # each part records, when it is told to stop, which of the others are still running
    code = ("import os, signal, sys, time\n"
            "def bye(*_):\n"
            "    os.remove(sys.argv[1] + '.up')\n"
            "    time.sleep(0.3)  # parts told to stop at the same time are all down by now\n"
            "    alive = [p for p in sys.argv[2:] if os.path.exists(p)]\n"
            "    open(sys.argv[1], 'w').write(' '.join(os.path.basename(p) for p in alive))\n"
            "    sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye)\n"
            "open(sys.argv[1] + '.up', 'w').close()\n"
            "time.sleep(120)\n")
    sup = _supervisor(tmp_path)
    names = ("redis", "server", "rollout")
    for name in names:  # started in this order, as `streamrl up` does
        others = [str(tmp_path / f"{o}.up") for o in names if o != name]
        sup.start(Part(name, name, [sys.executable, "-c", code, str(tmp_path / name), *others],
                       tmp_path / f"{name}.log", ready=lambda name=name: (tmp_path / f"{name}.up").exists()))
    sup.stop(timeout_s=10)
    assert (tmp_path / "rollout").read_text() == "redis.up server.up"  # the servers were still there
    assert (tmp_path / "server").read_text() == "redis.up"
    assert (tmp_path / "redis").read_text() == ""


def test_news_with_brackets_from_a_log_tail_is_printed_as_text(tmp_path, capsys):
    from streamrl.config import load_config
    from streamrl.launch.display import Dashboard

    cfg = load_config(None, [f"run.dir={tmp_path}", "supervise.display=plain"])
    Dashboard(cfg).say("server-0 exited; its log: [/__w/gloo/pair.cc:553] Connection closed by peer [bold]")
    assert "[/__w/gloo/pair.cc:553] Connection closed by peer [bold]" in capsys.readouterr().out


def test_a_refresh_of_the_dashboard_tries_a_redis_that_is_down_once(tmp_path):
    """The supervisor's loop refreshes the dashboard and restarts a dead Redis: a refresh that waited out
    reconnects would hold up that restart past the reconnect budget of every part, which then gives up."""
    import socket
    import threading

    from streamrl.config import load_config
    from streamrl.launch.display import Dashboard

    attempts = []
    with socket.create_server(("127.0.0.1", 0)) as down:  # accepts each connection and hangs up: a Redis dying

        def hang_up():
            while True:
                try:
                    conn, _ = down.accept()
                except OSError:  # closed: the test is over
                    return
                attempts.append(conn)
                conn.close()

        threading.Thread(target=hang_up, daemon=True).start()
        cfg = load_config(None, [f"run.dir={tmp_path}", "supervise.display=plain", "redis.retries=8"])
        dashboard = Dashboard(cfg)
        dashboard.connect(f"redis://127.0.0.1:{down.getsockname()[1]}/0", supervisor=None)
        figures = dashboard.stats()
    assert "version" not in figures  # the files' figures alone
    assert len(attempts) == 1
