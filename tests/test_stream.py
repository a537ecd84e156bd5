import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import redis

from streamrl.buffer import BufferUnavailable, EmbeddedRedis, Namespace, ReplayStream, StreamReader
from streamrl.protocol import encode_group
from streamrl.testing import synthetic_group


def _drain(reader: StreamReader, batch: int = 100) -> list:
    entries = []
    while chunk := reader.read(batch):
        entries += chunk
    return entries


def test_put_then_read_round_trips_a_group(ns):
    group = synthetic_group(4, 64, prompt_len=16, version=5)
    entry_id = ReplayStream(ns).put(group)
    [entry] = StreamReader(ns).read(10)
    assert entry.id == entry_id
    assert encode_group(entry.group) == encode_group(group)
    fields = ns.conn.xrange(ns.key("groups"))[0][1]
    assert (int(fields[b"v_min"]), int(fields[b"v_max"]), int(fields[b"ntok"])) == (5, 6, 256)
    assert fields[b"gid"].decode() == group.group_id


def test_a_put_retried_after_its_reply_was_lost_stores_the_group_once(ns):
    stream, group = ReplayStream(ns), synthetic_group(2, 16, prompt_len=4)
    store = stream._put

    def reply_lost(**kw):
        store(**kw)
        raise redis.ConnectionError("connection reset")

    stream._put = reply_lost
    with pytest.raises(BufferUnavailable):
        stream.put(group)
    stream._put = store
    first = ns.conn.xrange(ns.key("groups"))[0][0].decode()
    assert stream.put(group) == first  # the caller's retry
    assert len(stream) == 1 and ns.conn.hget(ns.key("counters"), "accepted") == b"1"
    assert not ns.conn.exists(ns.key(f"gid:{group.group_id}"))  # acknowledged: forgotten, Redis does not grow


@pytest.mark.slow
def test_ten_thousand_groups_none_lost_none_duplicated(ns):
    stream, rng = ReplayStream(ns), np.random.default_rng(0)
    sent = []
    for i in range(10_000):
        group = synthetic_group(2, 8, prompt_len=2, rng=rng, prompt_id=str(i))
        stream.put(group)
        sent.append(group.group_id)
    received = [e.group.group_id for e in _drain(StreamReader(ns), batch=512)]
    assert received == sent


def test_blocking_read_waits_for_a_writer_and_times_out_empty(ns):
    reader = StreamReader(ns)
    t0 = time.monotonic()
    assert reader.read(10, block_ms=300) == []
    assert time.monotonic() - t0 >= 0.25
    group = synthetic_group(2, 8, prompt_len=2)
    threading.Timer(0.2, ReplayStream(ns).put, args=[group]).start()
    [entry] = reader.read(10, block_ms=5000)
    assert entry.group.group_id == group.group_id


def test_malformed_entries_go_to_the_dead_letter_stream_once(ns):
    stream = ReplayStream(ns)
    good = [synthetic_group(2, 8, prompt_len=2) for _ in range(2)]
    stream.put(good[0])
    bad_garbage = ns.conn.xadd(stream.key, {"d": b"\x00garbage", "gid": "x", "v_min": 0, "v_max": 0, "ntok": 1, "schema": 1})
    bad_header = ns.conn.xadd(stream.key, {"d": encode_group(good[1]), "gid": good[1].group_id,
                                           "v_min": 0, "v_max": 0, "ntok": 999, "schema": 1})
    no_payload = ns.conn.xadd(stream.key, {"hello": "world"})
    stream.put(good[1])

    reader = StreamReader(ns)
    assert [e.group.group_id for e in reader.read(10)] == [g.group_id for g in good]
    assert reader.cursor == ns.conn.xrevrange(stream.key, count=1)[0][0].decode()
    dead = ns.conn.xrange(ns.key("dead"))
    assert [f[b"src"] for _, f in dead] == [bad_garbage, bad_header, no_payload]
    reasons = [f[b"reason"].decode() for _, f in dead]
    assert "not a msgpack payload" in reasons[0]
    assert "disagrees with its payload" in reasons[1]
    assert "no payload" in reasons[2]

    _drain(StreamReader(ns))  # a restarted reader replays the same entries ...
    assert ns.conn.xlen(ns.key("dead")) == 3  # ... without filing them twice
    assert ns.conn.hget(ns.key("counters"), "dead") == b"3"


def test_trim_keeps_everything_after_the_covered_cursor(ns):
    stream = ReplayStream(ns)
    ids = [stream.put(synthetic_group(2, 8, prompt_len=2)) for _ in range(10)]
    assert stream.trim(ids[3]) == 4
    assert len(stream) == 6
    rest = _drain(StreamReader(ns, cursor=ids[3]))
    assert [e.id for e in rest] == ids[4:]


def test_bad_cursor_is_refused(ns):
    with pytest.raises(ValueError, match="cursor must look like"):
        StreamReader(ns, cursor="latest")


# A learner-like consumer: applies batches and checkpoints (cursor, applied ids) atomically.
CONSUMER = textwrap.dedent("""
    import json, os, sys, time
    from streamrl.buffer import Namespace, StreamReader
    url, run, ckpt = sys.argv[1:4]
    state = json.load(open(ckpt)) if os.path.exists(ckpt) else {"cursor": "0-0", "applied": []}
    reader = StreamReader(Namespace.open(url, run), cursor=state["cursor"])
    while entries := reader.read(7):
        state["applied"] += [e.group.group_id for e in entries]
        state["cursor"] = reader.cursor
        time.sleep(0.02)
        with open(ckpt + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(ckpt + ".tmp", ckpt)
    print("done", flush=True)
""")


def test_reader_killed_and_restarted_from_its_checkpoint_sees_exactly_the_rest(ns, redis_server, tmp_path):
    stream, groups = ReplayStream(ns), [synthetic_group(2, 8, prompt_len=2) for _ in range(200)]
    for group in groups:
        stream.put(group)
    sent = [g.group_id for g in groups]
    script, ckpt = tmp_path / "consumer.py", tmp_path / "ckpt.json"
    script.write_text(CONSUMER)
    argv = [sys.executable, str(script), redis_server.url, ns.run, str(ckpt)]

    kills = 0
    for delay in (0.3, 0.5, 0.4):
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
        time.sleep(delay)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert kills >= 1
    assert json.load(open(ckpt))["applied"] == sent


def _writer(url: str, run: str, writer: int, count: int) -> None:
    stream = ReplayStream(Namespace.open(url, run))
    for i in range(count):
        stream.put(synthetic_group(2, 8, prompt_len=2, prompt_id=f"{writer}:{i}"))


def test_concurrent_writers_in_several_processes(ns, redis_server):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(redis_server.url, ns.run, w, 300)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    prompts = [e.group.prompt_id for e in _drain(StreamReader(ns))]
    assert len(prompts) == len(set(prompts)) == 1200
    for w in range(4):  # each writer's groups keep their order
        mine = [int(p.split(":")[1]) for p in prompts if p.startswith(f"{w}:")]
        assert mine == list(range(300))


def test_puts_survive_a_redis_crash_and_restart(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always")  # the config's default: no acknowledged put is lost
    server.start()
    ns = Namespace.open(server.url, "crash", retries=20, retry_cap_s=0.5)
    stream, groups, errors = ReplayStream(ns), [synthetic_group(2, 8, prompt_len=2) for _ in range(300)], []

    def write():
        try:
            for g in groups:
                stream.put(g)
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    writer = threading.Thread(target=write)
    writer.start()
    while int(ns.conn.hget(ns.key("counters"), "accepted") or 0) < 100:
        time.sleep(0.01)
    server.kill()
    time.sleep(0.5)
    server.start()  # same port, same AOF
    writer.join(60)
    try:
        assert not errors
        gids = [e.group.group_id for e in _drain(StreamReader(ns))]
        assert gids == [g.group_id for g in groups]
    finally:
        server.stop()


def test_unreachable_redis_gives_a_clear_error():
    from streamrl.buffer.redis_server import free_port

    ns = Namespace.open(f"redis://:secret@127.0.0.1:{free_port()}/0", "x", retries=2, retry_cap_s=0.05)
    with pytest.raises(BufferUnavailable, match=r"Redis at redis://:\*\*\*@127.0.0.1:\d+/0 unreachable while trying to put group"):
        ReplayStream(ns).put(synthetic_group(2, 8, prompt_len=2))


def test_a_server_that_accepts_and_drops_connections_is_tried_retries_plus_one_squared_times():
    """What ``redis.retries`` says: a command is retried, and each retry's reconnect as often (redis-py's one
    ``Retry`` at both levels)."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted = []

    def hang_up() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            accepted.append(1)
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        for retries in (0, 2):
            accepted.clear()
            url = f"redis://127.0.0.1:{server.getsockname()[1]}/0"
            ns = Namespace.open(url, "x", retries=retries, retry_cap_s=0.001)
            with pytest.raises(BufferUnavailable), ns.reachable("ping"):
                ns.conn.ping()
            assert len(accepted) == (retries + 1) ** 2
    finally:
        server.close()
