"""Model-written code runs in a separate process and is stopped at each limit."""

import asyncio
import os
import time

import psutil
import pytest

from streamrl.envs.base import Action
from streamrl.envs.python_tool import PythonTool
from streamrl.envs.sandbox import Limits, run_python


def run(code: str, **limits):
    return asyncio.run(run_python(code, Limits(**limits)))


def test_ordinary_code_runs_in_an_empty_directory_with_an_empty_environment():
    out = run("import os; print(6 * 7, os.listdir('.'), sorted(set(os.environ) - {'LC_CTYPE'}))")
    assert out.ok and out.stdout.strip() == "42 [] []"  # (LC_CTYPE: Python's own C-locale coercion)


def test_an_endless_loop_is_killed_at_the_wall_clock_limit():
    t0 = time.monotonic()
    out = run("while True: pass", wall_s=1.0, cpu_s=30)
    assert out.killed == "wall time" and not out.ok
    assert time.monotonic() - t0 < 5


def test_cpu_time_is_capped_even_within_the_wall_clock():
    out = run("while True: pass", wall_s=20.0, cpu_s=1)
    assert out.killed == "cpu time" and out.returncode < 0  # the kernel's SIGXCPU / SIGKILL


def test_memory_beyond_the_limit_is_refused():
    out = run("x = bytearray(512 * 2**20)", memory_mb=128)
    assert out.returncode == 1 and "MemoryError" in out.stderr


def test_files_beyond_the_size_limit_cannot_be_written():
    out = run("open('big', 'wb').write(b'x' * (4 * 2**20))", file_mb=1)
    assert "File too large" in out.stderr and not out.ok  # Python ignores SIGXFSZ: the write fails with EFBIG


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to 'nobody' needs root; as a user the OS already refuses")
def test_as_root_the_code_runs_as_nobody_and_cannot_write_system_files():
    out = run("import os; print(os.getuid()); open('/etc/streamrl-sandbox-test', 'w')")
    assert out.stdout.strip() == "65534" and "PermissionError" in out.stderr
    assert not os.path.exists("/etc/streamrl-sandbox-test")


def test_a_fork_bomb_is_capped_and_nothing_it_spawned_survives():
    code = "import os, time\nfor _ in range(50):\n    try: os.fork()\n    except OSError: pass\ntime.sleep(60)"
    before = {p.pid for p in psutil.process_iter()}
    out = run(code, wall_s=2.0, processes=8)
    bomb = [Limits().python, "-I", "-c", code]
    assert out.killed == "wall time"
    time.sleep(0.5)
    # the bomb's own processes only: a test running beside this one may start others (a compiler's `as -I ...`)
    left = [p for p in psutil.process_iter(["cmdline"]) if p.pid not in before and p.info["cmdline"] == bomb
            and p.status() != psutil.STATUS_ZOMBIE]
    assert not left


def test_the_python_tool_env_runs_a_call_then_scores_the_answer():
    env = PythonTool(wall_s=2.0, cpu_s=30)

    async def episode():
        await env.reset({"question": "What is 123 * 45?", "answer": 5535})
        ran = await env.step(Action(text="```python\nprint(123 * 45)\n```", token_ids=[], finish_reason="stop"))
        looped = await env.step(Action(text="```python\nwhile True: pass\n```", token_ids=[], finish_reason="stop"))
        final = await env.step(Action(text="5535", token_ids=[], finish_reason="stop"))
        return ran, looped, final

    ran, looped, final = asyncio.run(episode())
    assert not ran.done and ran.observation.messages[0]["content"] == "5535"
    assert "killed: exceeded the wall time limit" in looped.observation.messages[0]["content"]
    assert final.done and final.reward == 1.0
