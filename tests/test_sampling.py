import math

import torch

from streamrl.generation import SamplingParams
from streamrl.inference.engines.sampling import sample_batch, truncate


def test_truncate_top_k_and_top_p_by_hand():
    x = torch.tensor([1.0, 3.0, 2.0, 0.0])
    assert truncate(x, 2, 1.0).tolist() == [-math.inf, 3.0, 2.0, -math.inf]
    # softmax([3, 2, 1, 0]) = [.644, .237, .087, .032]: 0.5 keeps one token, 0.85 keeps two
    assert truncate(x, -1, 0.5).tolist() == [-math.inf, 3.0, -math.inf, -math.inf]
    assert truncate(x, -1, 0.85).tolist() == [-math.inf, 3.0, 2.0, -math.inf]
    assert torch.equal(truncate(x, -1, 1.0), x)
    # a top_p too small for float32 (it rounds to 0) still keeps the likeliest token: found by the fuzz test
    assert truncate(x, -1, 2e-284).tolist() == [-math.inf, 3.0, -math.inf, -math.inf]
    assert truncate(x, 27, 2e-284).tolist() == [-math.inf, 3.0, -math.inf, -math.inf]


def test_logprob_is_under_the_tempered_untruncated_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.1, 3.0, 0.2]])
    params = [SamplingParams(temperature=0.5, top_k=1), SamplingParams(temperature=0)]
    tokens, logprobs = sample_batch(logits, params, [None, None])
    assert tokens == [0, 2]  # top_k=1 leaves one choice; greedy takes the argmax
    assert abs(logprobs[0] - float(torch.log_softmax(logits[0] / 0.5, -1)[0])) < 1e-6
    assert abs(logprobs[1] - float(torch.log_softmax(logits[1], -1)[2])) < 1e-6  # greedy: temperature 1


def test_seeded_rows_are_reproducible_and_unseeded_rows_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens, _ = sample_batch(logits, params, [None] * 4000)
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)

    def draw():
        return sample_batch(logits[:5], params[:5], [torch.Generator().manual_seed(3) for _ in range(5)])[0]

    assert draw() == draw()
