import signal
import subprocess
import sys
import time

import pytest
import redis

from streamrl.cli import app

STREAMRL = [sys.executable, "-m", "streamrl"]
SUBCOMMANDS = [c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands]


def _run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*STREAMRL, *args], capture_output=True, text=True, timeout=120, **kw)


def test_help_lists_every_subcommand():
    out = _run("--help")
    assert out.returncode == 0
    for name in SUBCOMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_subcommand_has_help(name):
    out = _run(name, "--help")
    assert out.returncode == 0 and "Usage" in out.stdout


def test_up_with_a_bad_config_fails_before_starting_anything(tmp_path):
    out = _run("up", "configs/quickstart.yaml", "learner.max_step=3", f"run.dir={tmp_path}")
    assert out.returncode == 2 and "did you mean 'learner.max_steps'" in out.stderr
    assert not any(tmp_path.iterdir())


def test_config_prints_the_resolved_tree_with_overrides():
    out = _run("config", "configs/quickstart.yaml", "learner.lr=0.5")
    assert out.returncode == 0
    assert "lr: 0.5" in out.stdout and "name: quickstart" in out.stdout


def test_config_errors_are_readable_and_exit_2():
    out = _run("config", "configs/quickstart.yaml", "learner.lr=fast")
    assert out.returncode == 2
    assert "config error" in out.stderr and "learner.lr" in out.stderr and "'fast'" in out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_benchmark_is_refused():
    out = _run("bench", "nope")
    assert out.returncode == 2 and "available: queue, generate, partition, learner" in out.stderr


def test_a_benchmark_option_the_study_does_not_take_is_refused():
    out = _run("bench", "queue", "--repeats", "3")
    assert out.returncode == 2 and "--repeats does not apply to queue" in out.stderr
    out = _run("bench", "e2e", "--trl-set", "server_threads=2")
    assert out.returncode == 2 and "--trl-set does not apply to e2e" in out.stderr


def test_redis_subcommand_serves_until_terminated(tmp_path):
    proc = subprocess.Popen([*STREAMRL, "redis", f"run.dir={tmp_path}", "redis.password=pw"],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert "redis-server ready: redis://:***@127.0.0.1:" in line
        port = int(line.split("127.0.0.1:")[1].split("/")[0])
        assert redis.Redis(port=port, password="pw").ping()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    time.sleep(0.2)
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, password="pw", socket_connect_timeout=1).ping()
    assert (tmp_path / "default" / "redis" / "redis.log").exists()


def test_serve_without_a_model_path_says_so():
    out = _run("serve", "configs/quickstart.yaml")
    assert out.returncode == 2 and "model.path is not set" in out.stderr


def test_launch_rollout_without_redis_says_so():
    out = _run("launch-rollout", "configs/quickstart.yaml", "model.path=/nonexistent")
    assert out.returncode == 2 and "redis.url is not set" in out.stderr


def test_launch_learner_without_redis_says_so():
    out = _run("launch-learner", "configs/quickstart.yaml")
    assert out.returncode == 2 and "redis.url is not set" in out.stderr


def test_error_text_is_printed_literally_not_as_markup():
    out = _run("config", "run.name=[bold]x")
    assert out.returncode == 2 and "'[bold]x'" in out.stderr
