"""``supervise.learner_threads: auto``: the learner's threads per phase of a step, widened to every core from the
first phase at which generation is held, and a replay's phases on the threads the run recorded."""

import pytest
import torch

from streamrl.learner.cores import Cores


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _threads_per_phase(cores: Cores, phases: int) -> list[int]:
    seen = []
    for _ in range(phases):
        cores.phase()
        seen.append(torch.get_num_threads())
    return seen


def test_a_step_widens_from_the_first_phase_generation_is_held_and_the_next_step_starts_on_the_share(one_thread):
    answers, asked = iter([False, False, True]), []
    cores = Cores(1, 2, held=lambda: asked.append(1) or next(answers))
    assert _threads_per_phase(cores, 5) == [1, 1, 2, 2, 2]
    assert len(asked) == 3  # not asked again once widened: generation stays held until the next version
    assert cores.end() == 2 and torch.get_num_threads() == 1
    answers = iter([False] * 4)
    assert _threads_per_phase(cores, 4) == [1, 1, 1, 1]
    assert cores.end() is None and torch.get_num_threads() == 1


def test_a_replay_follows_the_recorded_phase_whatever_admission_says(one_thread):
    cores = Cores(1, 2, held=None)
    cores.follow(3)
    assert _threads_per_phase(cores, 5) == [1, 1, 1, 2, 2]
    assert cores.end() == 3
    cores.follow(None)
    assert _threads_per_phase(cores, 3) == [1, 1, 1] and cores.end() is None


def test_a_learner_whose_share_is_every_core_never_asks(one_thread):
    cores = Cores(1, 1, held=lambda: pytest.fail("asked"))
    assert _threads_per_phase(cores, 3) == [1, 1, 1] and cores.end() is None


def test_an_async_run_of_one_local_rank_widens_by_default_and_nothing_else_does():
    from streamrl.config import load_config

    def widens(*overrides):
        return load_config(None, list(overrides)).learner_widens

    assert widens() and widens("supervise.learner_threads=auto")
    assert not widens("mode=sync")  # generation and training take turns: each keeps its share
    assert not widens("learner.nproc=2") and not widens("launcher=ray") and not widens("supervise.learner_threads=1")
    assert widens("mode=sync", "supervise.learner_threads=auto")  # asked for
