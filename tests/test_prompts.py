import time

from streamrl.buffer import PromptClaims, ReplayStream
from streamrl.testing import synthetic_group


def test_indices_are_claimed_once_and_finished_by_the_put(ns):
    a, b = PromptClaims(ns, "w0", life="1"), PromptClaims(ns, "w1", life="1")
    assert [a.claim(), b.claim(), a.claim()] == [0, 1, 2]
    ReplayStream(ns).put(synthetic_group(2, 8, prompt_len=2), prompt_index=1)
    assert a.outstanding() == 2
    a.release(0)
    assert a.outstanding() == 1 and b.claim() == 3


def test_a_restarted_worker_takes_back_its_own_claims_first(ns):
    before = PromptClaims(ns, "w0", life="old")
    assert [before.claim(), before.claim()] == [0, 1]
    ReplayStream(ns).put(synthetic_group(2, 8, prompt_len=2), prompt_index=0)
    after = PromptClaims(ns, "w0", life="new")  # same worker name, new process
    other = PromptClaims(ns, "w1", life="x")
    assert other.claim() == 2  # another worker does not steal an unexpired claim
    assert after.claim() == 1  # the unfinished one, at once
    assert after.claim() == 3


def test_an_expired_claim_goes_to_another_worker(ns):
    dead = PromptClaims(ns, "w0", lease_s=0.2, life="1")
    assert dead.claim() == 0
    other = PromptClaims(ns, "w1", life="1")
    assert other.claim() == 1
    time.sleep(0.3)
    assert other.claim() == 0
