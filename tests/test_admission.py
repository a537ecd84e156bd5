import multiprocessing as mp
import threading
import time

import pytest

from streamrl.buffer import Admission, Namespace, PolicyVersion, ReplayStream, StreamReader
from streamrl.testing import synthetic_group


def test_the_bound_follows_the_learner_version(ns):
    # (max_staleness + V + 1) * groups_per_step = (1 + 0 + 1) * 4 = 8 slots at version 0
    admission, stream = Admission(ns, max_staleness=1, groups_per_step=4), ReplayStream(ns)
    groups = [synthetic_group(2, 8, prompt_len=2) for _ in range(12)]
    assert [admission.try_admit(g.group_id) for g in groups[:9]] == [True] * 8 + [False]
    for g in groups[:3]:
        stream.put(g)  # put closes the lease; accepted + running stays 8
    assert admission.running() == 5
    assert not admission.try_admit(groups[8].group_id)
    PolicyVersion(ns).set(1)  # one more step of room
    assert [admission.try_admit(g.group_id) for g in groups[8:]] == [True] * 4
    assert not admission.try_admit("one-too-many")
    assert admission.counters() == {"admitted": 12, "accepted": 3, "abandoned": 0, "expired": 0,
                                         "dropped_stale": 0, "dropped_no_signal": 0, "dead": 0, "refused": 3}
    assert admission.refusals() == 3  # each turn-away is counted: the bound, not generation, held them back


def test_a_version_watch_wakes_on_the_next_version_and_times_out_without_one(ns):
    version = PolicyVersion(ns)
    watch = version.watch()
    assert watch.wait(0.2) is False  # nothing published (the subscribe reply is not a version)
    threading.Timer(0.1, version.set, args=(1,)).start()
    assert watch.wait(30.0) is True  # woken by the learner's set, long before the timeout
    assert version.get() == 1 and watch.wait(0.1) is False  # one wake per version
    watch.close()


def test_readmitting_a_running_group_renews_instead_of_taking_a_slot(ns):
    admission = Admission(ns, max_staleness=0, groups_per_step=1)
    assert admission.try_admit("g")
    assert admission.try_admit("g")
    assert admission.running() == 1
    assert not admission.try_admit("h")


def test_abandon_frees_the_slot_and_is_counted(ns):
    admission = Admission(ns, max_staleness=0, groups_per_step=1)
    assert admission.try_admit("g") and not admission.try_admit("h")
    assert admission.abandon("g") and not admission.abandon("g")
    assert admission.try_admit("h")
    assert admission.counters()["abandoned"] == 1


def test_a_dead_workers_lease_expires(ns):
    admission = Admission(ns, max_staleness=0, groups_per_step=1, lease_s=0.2)
    assert admission.try_admit("from-a-worker-that-died")
    assert not admission.try_admit("g")
    time.sleep(0.3)
    assert admission.try_admit("g")
    assert admission.counters()["expired"] == 1


def test_a_renewed_lease_outlives_its_first_deadline_and_an_expired_one_stays_expired(ns):
    admission = Admission(ns, max_staleness=0, groups_per_step=2, lease_s=0.4)
    assert admission.try_admit("slow") and admission.try_admit("gone")
    time.sleep(0.25)
    assert admission.renew(["slow"]) == 1
    time.sleep(0.25)  # past the first deadline of both
    assert admission.try_admit("new")  # "gone" expired and gave its slot ...
    assert not admission.try_admit("newer")  # ... "slow" still holds its own
    assert admission.counters()["expired"] == 1
    time.sleep(0.5)
    assert admission.renew(["slow", "never-admitted"]) == 0  # a lapsed lease is not revived


def test_dropped_stale_counter(ns):
    admission = Admission(ns, max_staleness=0, groups_per_step=1)
    admission.count_dropped_stale(3)
    assert admission.counters()["dropped_stale"] == 3


@pytest.mark.parametrize("drop", ["stale", "no_signal", "dead"])
def test_a_group_the_learner_drops_gives_its_slot_back(ns, drop):
    admission, stream = Admission(ns, max_staleness=0, groups_per_step=1), ReplayStream(ns)
    group = synthetic_group(2, 8, prompt_id="g")
    assert admission.try_admit(group.group_id)
    entry = stream.put(group)  # accepted: the step's one slot is taken
    assert not admission.try_admit("next")
    if drop == "dead":  # the learner cannot train it (a sequence past every micro-batch, say): twice, once counted
        for _ in range(2):
            StreamReader(ns).dead_letter(entry, "a sequence of 140 tokens exceeds learner.micro_batch_tokens = 128")
    else:
        getattr(admission, f"count_dropped_{drop}")(1)  # never trained: another group may take its place
    assert admission.try_admit("next")
    assert not admission.try_admit("after")


def _race(url: str, run: str, worker: int, barrier, results) -> None:
    admission = Admission(Namespace.open(url, run), max_staleness=2, groups_per_step=10)
    barrier.wait()
    results.put(sum(admission.try_admit(f"{worker}-{i}") for i in range(60)))


def test_concurrent_workers_never_exceed_the_bound(ns, redis_server):
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(redis_server.url, ns.run, w, barrier, results)) for w in range(4)]
    for p in procs:
        p.start()
    admitted = sum(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
    assert admitted == (2 + 0 + 1) * 10
    assert Admission(ns, max_staleness=2, groups_per_step=10).running() == 30


def test_bad_parameters_are_refused(ns):
    with pytest.raises(ValueError, match="groups_per_step >= 1"):
        Admission(ns, max_staleness=0, groups_per_step=0)


def test_a_restarted_worker_takes_back_the_slots_of_its_earlier_life_only(ns):
    from streamrl.buffer.admission import group_id

    admission = Admission(ns, max_staleness=0, groups_per_step=4)
    old, sibling, new = group_id("w0", "life-a"), group_id("w01", "life-a"), group_id("w0", "life-b")
    assert old.startswith("w0/life-a/") and all(admission.try_admit(g) for g in (old, sibling, new))
    assert admission.reclaim("w0", "life-b") == 1  # w0's earlier life; not w01's, not its own
    assert admission.running() == 2 and admission.try_admit(group_id("w0", "life-b"))  # the slot is free again
    assert admission.counters()["abandoned:worker_restarted"] == 1
    assert admission.reclaim("w0", "life-b") == 0


def test_a_published_bound_moves_the_admission_limit_for_every_worker(ns):
    """max_staleness: auto: the learner publishes the bound in force; admissions read it at once, so a lowered
    bound admits nothing until the groups in flight fit under it."""
    learner, worker = (Admission(ns, max_staleness=8, groups_per_step=2) for _ in range(2))
    assert learner.published() is None and worker.bound() == 8  # nothing published: the given bound
    learner.set_bound(1)  # (1 + 0 + 1) * 2 = 4 slots
    assert worker.bound() == 1
    assert [worker.try_admit(f"g{i}") for i in range(5)] == [True] * 4 + [False]
    learner.set_bound(2)  # 6 slots
    assert [worker.try_admit(f"h{i}") for i in range(3)] == [True, True, False]
    learner.set_bound(0)  # 2 slots, 6 held: none until four are put or given back
    for i in range(4):
        assert not worker.try_admit(f"k{i}")
        worker.abandon(f"g{i}")
    assert not worker.try_admit("k4")  # 2 held, 2 slots
    worker.abandon("h0")
    assert worker.try_admit("k5")
    with pytest.raises(ValueError, match="a staleness bound is >= 0"):
        learner.set_bound(-1)


def test_generation_is_held_only_while_every_slot_is_taken_and_no_group_runs(ns):
    # (0 + V + 1) * 2 slots: 2 at version 0
    admission, stream = Admission(ns, max_staleness=0, groups_per_step=2), ReplayStream(ns)
    groups = [synthetic_group(2, 8, prompt_len=2) for _ in range(3)]
    assert not admission.held()  # slots free: a worker may start a group
    assert admission.try_admit(groups[0].group_id) and admission.try_admit(groups[1].group_id)
    assert not admission.held()  # full, but two groups still generate
    stream.put(groups[0])
    assert not admission.held()
    stream.put(groups[1])
    assert admission.held()  # full and nothing running: nothing generates until the version moves
    assert admission.refusals() == 0  # asking refuses nobody
    PolicyVersion(ns).set(1)
    assert not admission.held()
    assert admission.try_admit(groups[2].group_id) and not admission.held()
    admission.abandon(groups[2].group_id)
    assert not admission.held()  # its slot is free again
