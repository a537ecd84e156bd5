import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.protocol import SCHEMA, Group, Sample, WireError, decode_group, encode_group
from streamrl.testing import synthetic_group


def _sample(**kw) -> Sample:
    fields = dict(
        tokens=[5, 6, 7, 8, 9],
        loss_mask=[0, 0, 1, 1, 1],
        logprobs=[0.0, 0.0, -0.1, -2.0, -0.5],
        versions=[-1, -1, 3, 3, 4],
        reward=1.0,
    )
    fields.update(kw)
    return Sample(**fields)


def test_round_trip_keeps_every_field():
    multi = _sample(
        tokens=[1, 2, 3, 4, 5, 6], loss_mask=[0, 1, 1, 0, 0, 1], logprobs=[0, -1, -1, 0, 0, -3],
        versions=[-1, 7, 7, -1, -1, 8], seq_lens=[3, 3], turn_rewards=[0.5, 1.0],
        finish_reason="length", env_info={"turns": 2, "tool": {"name": "calc", "ok": True}},
        timings={"generate_s": 0.25, "env_s": 0.125}, reward=-0.5,
    )
    group = Group(prompt_id="q17", env="calc", samples=[_sample(), multi], meta={"split": "train"})
    back = decode_group(encode_group(group))

    assert (back.group_id, back.prompt_id, back.env, back.meta) == (group.group_id, "q17", "calc", {"split": "train"})
    for want, got in zip(group.samples, back.samples):
        for name, dtype in [("tokens", np.int32), ("loss_mask", np.uint8), ("logprobs", np.float32),
                            ("versions", np.int32)]:
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
            assert getattr(got, name).dtype == dtype
        assert (got.reward, got.finish_reason, got.turn_rewards) == (want.reward, want.finish_reason, want.turn_rewards)
        assert (got.env_info, got.timings) == (want.env_info, want.timings)
    assert back.samples[0].seq_lens is None
    assert back.samples[1].seq_lens.tolist() == [3, 3]
    assert [(s.start, s.stop) for s in back.samples[1].sequences()] == [(0, 3), (3, 6)]
    assert back.version_range() == (3, 8)
    assert back.num_tokens == 11


def test_payload_is_plain_msgpack_with_typed_bytes():
    raw = msgpack.unpackb(encode_group(synthetic_group(2, 16, prompt_len=4)))
    assert raw["schema"] == SCHEMA
    assert isinstance(raw["tokens"], bytes) and len(raw["tokens"]) == 2 * 16 * 4
    assert np.frombuffer(raw["lengths"], "<i4").tolist() == [16, 16]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(loss_mask=[0, 0, 1, 2, 1]), "loss_mask must be 0 or 1"),
        (dict(loss_mask=[0, 0, 0, 0, 0], versions=[-1] * 5, logprobs=[0.0] * 5), "no generated token"),
        (dict(versions=[0, -1, 3, 3, 4]), "did not generate must have version -1"),
        (dict(versions=[-1, -1, -2, 3, 4]), "negative policy version"),
        (dict(logprobs=[0.0, 0.0, float("nan"), -1, -1]), "finite and <= 0"),
        (dict(logprobs=[0.0, 0.0, 0.5, -1, -1]), "finite and <= 0"),
        (dict(logprobs=[0.0, -1.0, -0.1, -1, -1]), "did not generate must be 0"),
        (dict(tokens=[5, -6, 7, 8, 9]), "negative token id"),
        (dict(reward=float("inf")), "reward inf is not finite"),
        (dict(finish_reason="done"), "finish_reason 'done'"),
        (dict(seq_lens=[2, 2]), "must be positive and sum to 5"),
        (dict(loss_mask=[1, 0, 1, 1, 1], versions=[3, -1, 3, 3, 4], logprobs=[-0.1, 0.0, -0.1, -2.0, -0.5]),
         "first token is marked generated"),
        (dict(seq_lens=[2, 3]), "first token is marked generated"),  # the second sequence opens on a reply
        (dict(turn_rewards=[float("nan")]), "turn_rewards"),
        (dict(versions=[-1, -1, 3, 3]), "versions has shape"),
    ],
)
def test_invalid_samples_are_refused_on_encode(change, message):
    group = Group(prompt_id="p", env="e", samples=[_sample(), _sample(**change)])
    with pytest.raises(WireError, match=message) as info:
        encode_group(group)
    assert "samples[1]" in str(info.value) or "samples [1]" in str(info.value)


def _payload(**edits) -> bytes:
    raw = msgpack.unpackb(encode_group(synthetic_group(2, 8, prompt_len=2)))
    for key, value in edits.items():
        if value is None:
            del raw[key]
        else:
            raw[key] = value
    return msgpack.packb(raw)


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\xc1garbage", "not a msgpack payload"),
        (msgpack.packb([1, 2]), "must be a map"),
        (_payload(schema=99), "unsupported schema 99"),
        (_payload(group_id=None), "group.group_id is missing"),
        (_payload(tokens=b"\x00" * 7), "not a whole number"),
        (_payload(tokens=b"\x00" * 12), "lengths add up to 16"),
        (_payload(lengths=np.array([8, 0], "<i4").tobytes()), "lengths must be positive"),
        (_payload(rewards=[1.0]), "1 entries for 2 samples"),
        (_payload(rewards=[True, 1.0]), r"rewards\[0\] has type bool"),
        (_payload(seq_lens=[["a"], None]), "malformed per-sample field"),
        (_payload(meta=[]), "group.meta has type list"),
    ],
)
def test_malformed_payloads_raise_wire_error(payload, message):
    with pytest.raises(WireError, match=message):
        decode_group(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_escape_as_another_error(data):
    try:
        decode_group(data)
    except WireError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_payloads_decode_validly_or_raise_wire_error(data):
    payload = bytearray(encode_group(synthetic_group(2, 8, prompt_len=2)))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.integers(0, 255))
    try:
        group = decode_group(bytes(payload))
    except WireError:
        return
    encode_group(group)  # anything that decodes is a valid group that encodes again
