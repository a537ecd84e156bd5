"""The run's record: frames that round-trip the groups bit for bit, a learner restart that cuts the record back to
its checkpoint, retention, and a truncated or damaged record named by its step; what a replay may not change."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.config import load_config
from streamrl.learner import record
from streamrl.learner.replay import refused
from streamrl.protocol import decode_group, encode_group
from streamrl.testing import synthetic_group


def _step(version: int, landed: int = 1, groups: int = 2, seed: int = 0) -> record.Step:
    rng = np.random.default_rng(seed + version)
    return record.Step(version=version, trained=[synthetic_group(4, 40, prompt_len=8, vocab=200, rng=rng,
                                                                 prompt_id=f"{version}-{i}") for i in range(groups)],
                       outcomes={f"late-{version}": "dropped:stale"}, bound=2, partition=[[[[0, 1]], [[2]]]],
                       cursor=f"{version + 1}-0", landed=landed, weights=f"hash-{version}", info={"dropped_stale": 1})


def _write(root, steps, chunk_steps=50, resumed=0, keep_steps=None):
    writer = record.Recorder(root, resumed, chunk_steps=chunk_steps, keep_steps=keep_steps)
    for step in steps:
        writer.append(step)
    writer.close()


def test_a_frame_keeps_the_groups_as_the_stream_carried_them(tmp_path):
    steps = [_step(0), _step(1, landed=0), _step(1)]  # a step whose update was skipped keeps the version
    _write(tmp_path, steps)
    read = list(record.read(tmp_path))
    assert [(s.version, s.landed) for s in read] == [(0, 1), (1, 0), (1, 1)]
    for mine, theirs in zip(steps, read):
        assert theirs.trained == [encode_group(g) for g in mine.trained]
        first = decode_group(theirs.trained[0])
        assert np.array_equal(first.samples[0].tokens, mine.trained[0].samples[0].tokens)
        assert np.array_equal(first.samples[0].logprobs, mine.trained[0].samples[0].logprobs)
        assert (theirs.outcomes, theirs.partition, theirs.weights) == (mine.outcomes, mine.partition, mine.weights)
    assert record.span(tmp_path) == (0, 2)
    assert record.count(tmp_path, 1, 2) == (2, 2)  # both steps planned at version 1


@settings(max_examples=30, deadline=None)
@given(landed=st.lists(st.booleans(), min_size=1, max_size=12), chunk=st.integers(1, 5),
       resume=st.integers(0, 12))
def test_a_resumed_learner_keeps_exactly_the_steps_its_checkpoint_covers(tmp_path_factory, landed, chunk, resume):
    root = tmp_path_factory.mktemp("record")
    steps, version = [], 0
    for ok in landed:
        steps.append(_step(version, landed=int(ok), groups=1))
        version += ok
    _write(root, steps, chunk_steps=chunk)
    resume = min(resume, version)
    _write(root, [], chunk_steps=chunk, resumed=resume)  # the restart cuts, records nothing yet
    kept = [s for s in steps if s.version < resume]
    assert [(s.version, s.landed) for s in record.read(root)] == [(s.version, s.landed) for s in kept] if kept \
        else not record.chunks(root)
    again = [s for s in steps if s.version >= resume]  # the resumed learner records them anew
    _write(root, again, chunk_steps=chunk, resumed=resume)
    assert [(s.version, s.landed, s.weights) for s in record.read(root)] == \
        [(s.version, s.landed, s.weights) for s in steps]
    names = [int(p.stem) for p in record.chunks(root)]
    assert names == sorted(set(names))


def test_a_tail_the_learner_died_writing_is_cut_on_restart(tmp_path):
    _write(tmp_path, [_step(v) for v in range(4)])
    chunk = record.chunks(tmp_path)[0]
    chunk.write_bytes(chunk.read_bytes()[:-10])  # killed mid-frame
    _write(tmp_path, [], resumed=4)
    assert [s.version for s in record.read(tmp_path)] == [0, 1, 2]


def test_keep_steps_deletes_whole_old_chunks(tmp_path):
    _write(tmp_path, [_step(v, groups=1) for v in range(10)], chunk_steps=3, keep_steps=4)
    versions = [s.version for s in record.read(tmp_path)]
    assert versions[-1] == 9 and versions[0] > 0 and 9 - versions[0] >= 4
    assert versions == list(range(versions[0], 10))


def test_a_truncated_record_is_named_by_its_step(tmp_path):
    _write(tmp_path, [_step(v) for v in range(4)])
    chunk = record.chunks(tmp_path)[0]
    chunk.write_bytes(chunk.read_bytes()[:-10])
    with pytest.raises(record.RecordError, match="the frame of step 4 is cut off.*truncated"):
        record.span(tmp_path)


def test_a_damaged_frame_is_named_by_its_step(tmp_path):
    _write(tmp_path, [_step(v) for v in range(4)])
    chunk = record.chunks(tmp_path)[0]
    data = bytearray(chunk.read_bytes())
    frames = list(record._frames(chunk))
    data[frames[2][0] + record.HEADER.size + 5] ^= 0x10  # one bit inside step 3's payload
    chunk.write_bytes(bytes(data))
    with pytest.raises(record.RecordError, match="step 3 fails its checksum"):
        list(record.read(tmp_path))


def test_a_missing_step_is_named(tmp_path):
    _write(tmp_path, [_step(0), _step(1), _step(3)])
    with pytest.raises(record.RecordError, match="has no step 3"):
        record.span(tmp_path)


def test_a_replay_refuses_what_would_change_the_data_and_takes_what_trains_on_it():
    run = load_config("configs/quickstart.yaml")
    assert refused(run, load_config("configs/quickstart.yaml", ["learner.lr=1e-3", "off_policy.correction=tis",
                                                                 "learner.algorithm=grpo", "learner.nproc=2"])) == []
    problems = refused(run, load_config("configs/quickstart.yaml", [
        "rollout.sampling.n=4", "learner.groups_per_step=4", "off_policy.max_staleness=4", "weight_sync.verify=false"]))
    assert [p.split(":")[0] for p in problems] == ["learner.groups_per_step", "off_policy.max_staleness",
                                                   "rollout.sampling.n", "weight_sync.verify"]
    assert "dropped as stale" in problems[1] and "runs the learner alone" in problems[3]
