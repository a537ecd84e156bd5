"""Packed micro-batches against one forward per sequence and against the right-padded computation, in fp32."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from streamrl.learner import batching, packing
from streamrl.protocol import Group, Sample

TOL = 1e-5


def _groups(rng) -> list[Group]:
    """Mixed lengths; one sample is two sequences (a multi-turn episode whose second turn does not continue
    the first), one sequence is a single token."""
    def sample(n, seq_lens=None, fresh=False):  # fresh: generated wholly at the learner's version, 5
        gen = np.arange(n) >= min(3, n - 1)
        return Sample(tokens=rng.integers(3, 200, n), loss_mask=gen.astype(np.uint8),
                      logprobs=np.where(gen, -rng.exponential(1.0, n), 0.0).astype(np.float32),
                      versions=np.where(gen, 5 if fresh else 4 + (np.arange(n) % 2), -1), reward=float(rng.normal()),
                      seq_lens=seq_lens)

    return [Group("a", "e", [sample(7), sample(23, fresh=True), sample(30, seq_lens=[12, 18])]),
            Group("b", "e", [sample(2), sample(41), sample(9, fresh=True)])]


def _sequences(rng):
    return batching.sequences(_groups(rng), version=5, algorithm="rloo")


def _model(model_dir, attention="sdpa"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attention)


def test_a_packed_row_lays_sequences_end_to_end_with_restarting_positions():
    seqs = _sequences(np.random.default_rng(0))
    batch = packing.collate(seqs)
    lengths = [len(s) for s in seqs]
    assert lengths == [7, 23, 12, 18, 2, 41, 9]
    assert batch["input_ids"].shape == (1, sum(lengths))  # no padding
    assert batch["bounds"].tolist() == np.r_[0, np.cumsum(lengths)].tolist()
    assert batch["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]
    assert batch["sequence"][0].tolist() == [i for i, n in enumerate(lengths) for _ in range(n)]
    assert batch["mask"].sum() == sum(int(s.mask.sum()) for s in seqs)
    # fresh: generated tokens of sequences generated wholly at the learner's version (5)
    fresh = [bool(s.staleness == 0) for s in seqs]
    assert batch["fresh"][0].tolist() == [bool(m) and f for s, f in zip(seqs, fresh) for m in s.mask]
    assert True in fresh and False in fresh


def test_token_logprobs_are_the_tempered_logprobs_of_the_scored_tokens_only():
    # sequences [1 2 3] and [4 5 6]; generated: 3, then 4 5 6 (4 starts its sequence: nothing predicts it)
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4, 5, 6]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]]),
             "mask": torch.tensor([[0.0, 0, 1, 1, 1, 1]])}
    assert packing.scored(batch).tolist() == [2, 4, 5]
    logits = torch.randn(3, 7)  # forward's: from positions 1, 3 and 4, predicting tokens 2, 4 and 5
    logp, entropy = packing.token_logprobs(logits, batch, temperature=0.5, entropy=True)
    dist = torch.log_softmax(logits / 0.5, -1)
    for row, t in enumerate((2, 4, 5)):
        assert logp[0, t] == pytest.approx(float(dist[row, t + 1]), abs=1e-6)
        assert entropy[0, t] == pytest.approx(float(-(dist[row].exp() * dist[row]).sum()), abs=1e-5)
    assert logp[0, [0, 1, 3]].tolist() == entropy[0, [0, 1, 3]].tolist() == [0, 0, 0]


@pytest.mark.parametrize("attention", ["sdpa", "varlen", "varlen-one-call"])
@torch.no_grad()
def test_packed_logprobs_equal_one_forward_per_sequence(tiny_model_dir, attention, monkeypatch):
    monkeypatch.setattr(packing, "CHUNK_ELEMENTS", 5000)  # several chunks of the vocabulary's logits
    monkeypatch.setattr(packing, "one_call", lambda query: attention == "varlen-one-call")  # the GPU's way, here
    name = packing.attention() if attention.startswith("varlen") else attention
    model, plain = _model(tiny_model_dir, name), _model(tiny_model_dir)
    seqs = _sequences(np.random.default_rng(1))
    batch = packing.collate(seqs)
    logp, entropy = packing.token_logprobs(packing.forward(model, batch), batch, 0.7, entropy=True)
    for i, s in enumerate(seqs):
        a, b = int(batch["bounds"][i]), int(batch["bounds"][i + 1])
        ids = torch.as_tensor(s.tokens.astype(np.int64))[None]
        dist = torch.log_softmax(plain(input_ids=ids).logits[0, :-1].float() / 0.7, -1)
        want = dist.gather(-1, ids[0, 1:, None])[:, 0]
        scored = batch["mask"][0, a + 1: b] > 0  # the generated tokens
        assert scored.any() and (logp[0, a + 1: b][~scored] == 0).all()
        assert float((logp[0, a + 1: b] - want)[scored].abs().max()) <= TOL
        assert float((entropy[0, a + 1: b] + (dist.exp() * dist).sum(-1))[scored].abs().max()) <= TOL


def _padded_loss(model, seqs):
    """The right-padded computation the learner ran before packing: one row per sequence."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    weights = torch.zeros(len(seqs), width)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s.tokens.astype(np.int64))
        attention[i, : len(s)] = 1
        weights[i, : len(s)] = torch.as_tensor(s.mask * s.advantages)
    logits = model(input_ids=ids, attention_mask=attention).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    return (logp * weights[:, 1:]).sum()


@pytest.mark.parametrize("one_call", [False, True])
def test_the_loss_and_gradient_of_a_packed_micro_batch_equal_the_padded_computation(tiny_model_dir, monkeypatch,
                                                                                     one_call):
    monkeypatch.setattr(packing, "CHUNK_ELEMENTS", 5000)  # chunks recomputed in the backward
    monkeypatch.setattr(packing, "one_call", lambda query: one_call)  # True: the GPU's way, here
    seqs = _sequences(np.random.default_rng(2))
    packed_model, padded_model = _model(tiny_model_dir, packing.attention()), _model(tiny_model_dir)
    batch = packing.collate(seqs)
    logp, _ = packing.token_logprobs(packing.forward(packed_model, batch), batch, 1.0)
    packed = (logp * batch["mask"] * batch["advantages"]).sum()
    padded = _padded_loss(padded_model, seqs)
    packed.backward()
    padded.backward()
    assert float(packed) == pytest.approx(float(padded), abs=TOL)
    grads = [(p.grad, q.grad) for p, q in zip(packed_model.parameters(), padded_model.parameters())]
    scale = max(float(q.abs().max()) for _, q in grads)
    assert max(float((p - q).abs().max()) for p, q in grads) <= TOL * scale


def test_the_block_causal_mask_keeps_each_token_to_its_sequences_past():
    mask = packing.block_causal_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]))[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0, 0],
                    [1, 1, 0, 0, 0, 0],
                    [1, 1, 1, 0, 0, 0],
                    [0, 0, 0, 1, 0, 0],
                    [0, 0, 0, 1, 1, 0],
                    [0, 0, 0, 0, 0, 1]]
    assert not packing.one_call(torch.zeros(1, 2, 8, 4))  # a CPU tensor: a call per length


def test_per_sequence_sums_follow_the_rows_sequences():
    batch = {"bounds": torch.tensor([0, 2, 5, 6]), "sequence": torch.tensor([[0, 0, 1, 1, 1, 2]])}
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    assert packing.per_sequence(values, batch).tolist() == [3.0, 12.0, 6.0]


@pytest.mark.parametrize("one_call", [False, True])
def test_varlen_attention_refuses_a_row_that_does_not_start_a_sequence(tiny_model_dir, monkeypatch, one_call):
    monkeypatch.setattr(packing, "one_call", lambda query: one_call)
    model = _model(tiny_model_dir, packing.attention())
    with pytest.raises(ValueError, match="must start at 0"):
        model(input_ids=torch.tensor([[5, 6, 7]]), position_ids=torch.tensor([[3, 0, 1]]), use_cache=False)
