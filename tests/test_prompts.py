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


def test_a_renewed_claim_is_not_taken_over_and_a_worker_renews_only_its_own(ns):
    runner = PromptClaims(ns, "w0", lease_s=0.4, life="1")
    other = PromptClaims(ns, "w1", lease_s=0.4, life="1")
    assert runner.claim() == 0 and other.claim() == 1
    time.sleep(0.25)
    assert runner.renew([0, 1]) == 1  # w1's claim is not w0's to keep
    assert PromptClaims(ns, "w0", life="2").renew([0]) == 0  # nor an earlier life's
    time.sleep(0.25)
    assert other.claim() == 1  # its own claim lapsed; w0's renewed one is not free
    assert other.claim() == 2
