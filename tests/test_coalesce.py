"""Sibling requests with the same context become one request with n; others stay apart."""

import asyncio

from streamrl.generation import Completion, SamplingParams
from streamrl.rollout.coalesce import Coalescer

P = SamplingParams(max_new_tokens=4)


class RecordingSend:
    """Stands in for the HTTP call: records (context, n) and numbers the samples it returns."""

    def __init__(self, fail: bool = False):
        self.calls: list[tuple[tuple[int, ...], int]] = []
        self.priorities: list[int] = []
        self.fail = fail

    async def __call__(self, input_ids, params, n, priority=0):
        self.calls.append((tuple(input_ids), n))
        self.priorities.append(priority)
        await asyncio.sleep(0.01)
        if self.fail:
            raise RuntimeError("router down")
        return [Completion(output_ids=[len(self.calls), i]) for i in range(n)]


def test_identical_contexts_within_the_window_share_one_request():
    send = RecordingSend()

    async def main():
        co = Coalescer(send, window_s=0.02)
        return await asyncio.gather(*[co.generate([1, 2], P) for _ in range(5)], co.generate([3], P),
                                    co.generate([1, 2], SamplingParams(max_new_tokens=8)))

    outs = asyncio.run(main())
    assert sorted(send.calls) == [((1, 2), 1), ((1, 2), 5), ((3,), 1)]
    same = [tuple(o.output_ids) for o in outs[:5]]
    assert len(set(same)) == 5 and len({s[0] for s in same}) == 1  # five distinct samples of one request


def test_requests_of_different_priority_stay_apart_and_keep_theirs():
    send = RecordingSend()

    async def main():
        co = Coalescer(send, window_s=0.02)
        await asyncio.gather(co.generate([1], P, priority=-3), co.generate([1], P, priority=-3), co.generate([1], P))

    asyncio.run(main())
    assert sorted(zip(send.priorities, send.calls)) == [(-3, ((1,), 2)), (0, ((1,), 1))]


def test_a_request_after_the_window_goes_separately():
    send = RecordingSend()

    async def main():
        co = Coalescer(send, window_s=0.005)
        first = asyncio.create_task(co.generate([1], P))
        await asyncio.sleep(0.05)
        return await asyncio.gather(first, co.generate([1], P))

    asyncio.run(main())
    assert send.calls == [((1,), 1), ((1,), 1)]


def test_window_zero_never_merges():
    send = RecordingSend()

    async def main():
        co = Coalescer(send, window_s=0)
        await asyncio.gather(*[co.generate([1], P) for _ in range(3)])

    asyncio.run(main())
    assert send.calls == [((1,), 1)] * 3


def test_a_failure_reaches_every_sibling_and_a_cancelled_one_is_not_asked_for():
    send = RecordingSend(fail=True)

    async def main():
        co = Coalescer(send, window_s=0.02)
        tasks = [asyncio.create_task(co.generate([7], P)) for _ in range(4)]
        await asyncio.sleep(0)
        tasks[0].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[0], asyncio.CancelledError)
    assert all(isinstance(r, RuntimeError) and "router down" in str(r) for r in results[1:])
    assert send.calls == [((7,), 3)]


def test_requests_told_of_siblings_wait_past_the_window_for_them_and_go_as_soon_as_all_came():
    send = RecordingSend()

    async def main():
        co = Coalescer(send, window_s=0.002)

        async def late(delay):  # an agent's opening call: the openai client takes a few ms for each
            await asyncio.sleep(delay)
            return await co.generate([1, 2], P, siblings=3)

        t0 = asyncio.get_running_loop().time()
        await asyncio.gather(late(0.0), late(0.01), late(0.02))
        together = asyncio.get_running_loop().time() - t0
        await asyncio.gather(late(0.0), late(0.01))  # one sibling never comes: they go after SIBLINGS_WAIT_S
        return together

    together = asyncio.run(main())
    assert send.calls == [((1, 2), 3), ((1, 2), 2)]
    assert together < 0.045  # sent when the third came (0.02 s), plus the send's own 0.01 s; not at 0.05 s


def test_seeded_siblings_go_out_alone_each_with_its_seed():
    """Merged into one request with n, the second sibling would sample with seed + 1: the same seeded call would be
    answered differently for each sibling."""
    sent = []

    async def send(input_ids, params, n, priority=0):
        sent.append((tuple(input_ids), n, params.seed))
        return [Completion(output_ids=[params.seed])] * n

    async def main():
        co = Coalescer(send, window_s=0.02)
        seeded = SamplingParams(max_new_tokens=4, seed=7)
        return await asyncio.gather(*[co.generate([1, 2], seeded, siblings=2) for _ in range(2)])

    outs = asyncio.run(main())
    assert sent == [((1, 2), 1, 7), ((1, 2), 1, 7)] and [o.output_ids for o in outs] == [[7], [7]]


def test_a_request_every_waiter_gave_up_on_is_cancelled_and_one_a_sibling_still_waits_for_is_not():
    started, cancelled = asyncio.Event(), []

    async def send(input_ids, params, n, priority=0):
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(n)
            raise
        return [Completion(output_ids=[i]) for i in range(n)]

    async def main():
        co = Coalescer(send, window_s=0.01)
        alone = asyncio.ensure_future(co.generate([1], P))  # an agent's call that then hangs up
        await started.wait()
        alone.cancel()
        await asyncio.sleep(0.01)
        assert cancelled == [1]  # the HTTP request goes too, and with it the generation at the server
        started.clear()
        pair = [asyncio.ensure_future(co.generate([2], P)) for _ in range(2)]
        await started.wait()
        pair[0].cancel()
        await asyncio.sleep(0.01)
        assert cancelled == [1]  # the other sibling still waits for its sample
        pair[1].cancel()
        await asyncio.sleep(0.01)
        assert cancelled == [1, 2]

    asyncio.run(main())
