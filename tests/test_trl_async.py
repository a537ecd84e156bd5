"""The stand-in for flash-attn's variable-length kernel that TRL's AsyncGRPOTrainer runs on here
(benchmarks/trl_async.py, patch 1): each segment's attention equals a plain causal attention over its own keys."""

import pytest
import torch
import torch.nn.functional as F

from benchmarks.trl_async import varlen_attention


def _plain(q, k, v):
    """One segment, queries at the end of the keys' positions: scores masked past each query's own position."""
    lq, lk = q.shape[0], k.shape[0]
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    seen = torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("lengths", [[(5, 5), (3, 3)], [(2, 6), (4, 4), (1, 9)]])  # (queries, keys): a prefix's tail
def test_varlen_attention_equals_each_segments_own_causal_attention(lengths):
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    q = torch.randn(sum(a for a, _ in lengths), heads, dim)
    k, v = (torch.randn(sum(b for _, b in lengths), kv_heads, dim) for _ in range(2))
    cu_q = torch.tensor([0, *torch.tensor([a for a, _ in lengths]).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor([b for _, b in lengths]).cumsum(0).tolist()], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    want = torch.cat([_plain(q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]])
                      for i in range(len(lengths))])
    assert out.shape == q.shape and torch.allclose(out, want, atol=1e-5)
    with pytest.raises(NotImplementedError, match="sliding window"):
        varlen_attention(q, k, v, cu_q, cu_k, window_size=(4, 0))


def test_a_full_causal_segment_is_sdpas_causal_attention():
    torch.manual_seed(1)
    q, k, v = (torch.randn(6, 2, 8) for _ in range(3))
    cu = torch.tensor([0, 6], dtype=torch.int32)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    assert torch.allclose(varlen_attention(q, k, v, cu, cu), want.transpose(0, 1), atol=1e-6)


def test_the_reward_crosses_into_a_spawned_process_and_scores_as_the_env_does():
    import json
    import pickle

    from benchmarks.trl_async import EnvReward
    from streamrl.config import load_config

    reward = pickle.loads(pickle.dumps(EnvReward(load_config("configs/smollm2.yaml"))))  # as TRL's spawn sends it
    row = json.dumps({"question": "What is 12 + 30?", "answer": 42})  # a row of the recipe's train.jsonl
    # right: 1 and the answer-format bonus 0.1; wrong but well formed: the bonus alone
    assert reward([[{"content": "42"}], [{"content": "41"}]], [row, row]) == pytest.approx([1.1, 0.1])


def test_trl_settings_override_the_defaults_and_a_wrong_one_names_itself():
    from benchmarks.trl_async import TUNABLE, tuning

    assert tuning() == TUNABLE
    assert tuning(("server_threads=2", "max_inflight_tasks=128")) == {**TUNABLE, "server_threads": 2,
                                                                      "max_inflight_tasks": 128}
    for bad, named in (("threads=2", "'threads' is not one of"), ("server_threads=two", "'two' is not an integer"),
                       ("trainer_threads=0", "at least 1 thread")):
        with pytest.raises(SystemExit, match=named):
            tuning((bad,))


def test_trl_settings_apply_only_to_the_async_trainer(monkeypatch):
    from benchmarks import against_trl

    monkeypatch.setattr(against_trl, "require_trl", lambda: None)  # CI's test install has no TRL
    monkeypatch.setattr(against_trl, "run", lambda *a, **k: pytest.fail("ran with a setting it would ignore"))
    with pytest.raises(SystemExit, match="--trl-set runs with --trl-trainer async"):
        against_trl.main(quick=True, trl_set=("server_threads=2",))


def _tried(name: str, samples_per_s: float, steps: int = 6) -> dict:
    from benchmarks.trl_tune import CANDIDATES

    staleness, pairs = CANDIDATES[name]
    return {"candidate": name, "max_staleness": staleness, "trl_set": list(pairs), "steps": steps, "steps_made": steps,
            "samples_per_s": samples_per_s, "wall_s": 1.0, "dropped_stale": 0, "staleness_mean": 0.5,
            "weight_sync_s": 0.1, "train_rewards": [0.1, 0.3]}


def test_trl_tuning_joins_earlier_candidates_by_name_and_names_the_fastest(tmp_path, monkeypatch):
    import json

    from benchmarks import trl_tune

    monkeypatch.setattr(trl_tune, "require_trl_version", lambda: None)
    (tmp_path / "trl_tune.json").write_text(json.dumps({"runs": [
        _tried("defaults", 1.0), _tried("staleness-4", 9.0), _tried("threads-2", 5.0, steps=2)]}))
    monkeypatch.setattr(trl_tune, "run_candidate", lambda name, steps: _tried(name, 1.5, steps))
    data = trl_tune.main(out=tmp_path, study="staleness-4")
    assert [r["candidate"] for r in data["runs"]] == ["defaults", "staleness-4"]  # a shorter run is not joined
    assert data["runs"][1]["samples_per_s"] == 1.5  # its new run replaced the old
    assert data["best"] == "staleness-4" and data["best_max_staleness"] == 4
    assert (tmp_path / "trl_tune.png").is_file()
    with pytest.raises(SystemExit, match="'fast' is not one of defaults"):
        trl_tune.main(out=tmp_path, study="fast")
