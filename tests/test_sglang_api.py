"""SGLang's prompt scoring and text post-processing on /generate, and SGLang's own frontend client against
``streamrl serve``.

Scores are checked against a teacher-forced fp32 forward of the same weights (1e-5 on the hf engine, 1e-4
on vllm). The model is the tiny Llama with its end-of-turn row of the output head steered so that greedy
decoding of ``PROMPT`` ends with that special token after a few ordinary ones: the text SGLang returns
must leave it out, and keep it only when asked.
"""

from __future__ import annotations

import importlib.util
import math
import signal
import subprocess
import sys
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.buffer.redis_server import free_port
from streamrl.inference.engines.hf import HFEngine
from streamrl.inference.engines.vllm_outputs import prompt_scores
from streamrl.inference.server import create_app
from streamrl.models import make_tiny_model
from streamrl.rollout.client import wait_healthy

PROMPT = "the quick brown fox jumps over the"
CHOICES = [" lazy dog", " answer is 19", " model answers", " number between"]
EOT = "<|im_end|>"
HAS_VLLM = importlib.util.find_spec("vllm") is not None


# ---------------------------------------------------------------------- the model and its reference


def make_eot_model(path, **kw) -> str:
    """``make_tiny_model``, then the end-of-turn row of the output head set to 1.05 x the row of the token
    greedy decoding of ``PROMPT`` reaches at step k: greedy output is k - 1 ordinary tokens and EOT (checked)."""
    make_tiny_model(path, **kw)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = tokenizer(PROMPT, add_special_tokens=False).input_ids
    eot = tokenizer.convert_tokens_to_ids(EOT)
    plain = greedy(model, prompt, 8)
    head = model.get_output_embeddings().weight
    original = head[eot].clone()
    for k in range(3, 8):
        with torch.no_grad():
            head[eot] = 1.05 * head[plain[k - 1]]
        if greedy(model, prompt, k) == plain[: k - 1] + [eot]:
            model.save_pretrained(path)
            return str(path)
        with torch.no_grad():
            head[eot] = original
    raise AssertionError("no step of greedy decoding could be steered to end with the end-of-turn token")


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def reference(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[j] | ids[:j]) for j >= 1, row j - 1: a teacher-forced fp32 forward at temperature 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)


def chosen(ref: torch.Tensor, ids: list[int]) -> list[float]:
    return ref.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_eot_model(tmp_path_factory.mktemp("eot-model"))


@pytest.fixture(scope="module")
def served(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = HFEngine(model, max_batch_size=8, tokenizer=tokenizer)
    with TestClient(create_app(engine, model_path=model_dir, tokenizer=tokenizer)) as client:
        yield client, model, tokenizer
    engine.shutdown()


def _score(client, ids, **body):
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                       "return_logprob": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


IDS = [12, 40, 7, 99, 3, 250, 18, 64, 5]


# ---------------------------------------------------------------------- prompt scoring, hf engine


def test_prompt_scores_equal_a_teacher_forced_forward_and_nothing_is_generated(served):
    client, model, _ = served
    body = _score(client, IDS, logprob_start_len=0)
    meta = body["meta_info"]
    assert body["output_ids"] == [] and body["text"] == ""
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["output_token_logprobs"]) == (len(IDS), 0, [])
    assert meta["weight_version"] == 0 and meta["weight_versions"] == []
    entries = meta["input_token_logprobs"]
    assert [t for _, t, _ in entries] == IDS and all(x is None for *_, x in entries)
    assert entries[0][0] is None  # SGLang has no logprob for the first token
    want = chosen(reference(model, IDS), IDS)
    assert max(abs(lp - w) for (lp, _, _), w in zip(entries[1:], want)) <= 1e-5


@pytest.mark.parametrize("start", [-1, 1, 4, len(IDS) - 1, len(IDS)])
def test_logprob_start_len_picks_where_input_logprobs_begin_with_a_null_first_entry(served, start):
    client, model, _ = served
    entries = _score(client, IDS, logprob_start_len=start)["meta_info"]["input_token_logprobs"]
    if start in (-1, len(IDS)):  # -1, SGLang's default: no input logprobs; len: none left
        assert entries == []
        return
    assert [t for _, t, _ in entries] == IDS[start:]
    assert entries[0][0] is None  # SGLang computes none for the first entry, whatever the start
    want = chosen(reference(model, IDS), IDS)[start:]
    assert max((abs(lp - w) for (lp, _, _), w in zip(entries[1:], want)), default=0) <= 1e-5


def test_top_logprobs_num_gives_the_k_likeliest_tokens_sorted(served):
    client, model, _ = served
    k = 5
    meta = _score(client, IDS, logprob_start_len=2, top_logprobs_num=k)["meta_info"]
    tops = meta["input_top_logprobs"]
    assert meta["output_top_logprobs"] == [] and tops[0] is None and len(tops) == len(IDS) - 2
    values, indices = reference(model, IDS)[2:].topk(k, -1)
    for top, want_values, want_ids in zip(tops[1:], values, indices):
        assert len(top) == k and [t for _, t, _ in top] == want_ids.tolist()
        lps = [lp for lp, _, _ in top]
        assert lps == sorted(lps, reverse=True)
        assert max(abs(a - b) for a, b in zip(lps, want_values.tolist())) <= 1e-5
    # the prompt's own token is in the top list exactly when its logprob is high enough
    for (lp, t, _), top in zip(meta["input_token_logprobs"][1:], tops[1:]):
        assert (t in [i for _, i, _ in top]) == (lp >= top[-1][0])


def test_return_text_in_logprobs_gives_each_tokens_text(served):
    client, _, tokenizer = served
    meta = _score(client, IDS, logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True)["meta_info"]
    assert [x for _, _, x in meta["input_token_logprobs"]] == [tokenizer.decode([t]) for t in IDS]
    assert all(x == tokenizer.decode([t]) for top in meta["input_top_logprobs"][1:] for _, t, x in top)


def test_scoring_without_return_logprob_checks_the_prompt_and_returns_its_length(served):
    client, _, tokenizer = served
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["prompt_tokens"] == len(tokenizer(PROMPT, add_special_tokens=False).input_ids)
    assert "input_token_logprobs" not in meta and r.json()["output_ids"] == []
    bad = client.post("/generate", json={"input_ids": [10_000], "sampling_params": {"max_new_tokens": 0}})
    assert bad.status_code == 400 and "input_ids must be in" in bad.json()["error"]["message"]


def test_a_batch_of_texts_is_scored_prompt_by_prompt_in_order(served):
    client, model, tokenizer = served
    texts = [PROMPT + c for c in CHOICES[:3]]
    r = client.post("/generate", json={"text": texts, "rid": "pick", "return_logprob": True, "logprob_start_len": 0,
                                       "sampling_params": {"max_new_tokens": 0, "temperature": 0}})
    assert r.status_code == 200, r.text
    bodies = r.json()
    assert [b["meta_info"]["id"] for b in bodies] == ["pick_0", "pick_1", "pick_2"]
    for text, body in zip(texts, bodies):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        entries = body["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in entries] == ids
        want = chosen(reference(model, ids), ids)  # temperature 0 does not touch the scores
        assert max(abs(lp - w) for (lp, _, _), w in zip(entries[1:], want)) <= 1e-5
    one = client.post("/generate", json={"input_ids": [IDS], "sampling_params": {"max_new_tokens": 0}}).json()
    assert isinstance(one, list) and len(one) == 1  # a batch of one is still a batch


def test_input_logprobs_come_with_a_generation_too(served):
    client, model, _ = served
    r = client.post("/generate", json={"input_ids": IDS, "return_logprob": True, "logprob_start_len": 3,
                                       "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == 4
    entries = meta["input_token_logprobs"]
    assert [t for _, t, _ in entries] == IDS[3:] and entries[0][0] is None
    want = chosen(reference(model, IDS), IDS)[3:]
    assert max(abs(lp - w) for (lp, _, _), w in zip(entries[1:], want)) <= 1e-5


@pytest.mark.parametrize(
    "body, message",
    [
        ({"logprob_start_len": len(IDS) + 1}, "logprob_start_len 10 is past the end of a 9-token prompt"),
        ({"logprob_start_len": -2}, "logprob_start_len"),
        ({"top_logprobs_num": -1}, "top_logprobs_num"),
        ({"top_logprobs_num": 10**6}, "top_logprobs_num must be in [0, "),
        ({"top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 3}}, "top_logprobs_num needs max_new_tokens 0"),
        ({"sampling_params": {"max_new_tokens": 0, "top_k": 0}}, "top_k"),
        ({"input_ids": [IDS, []]}, "input_ids is empty"),
        ({"input_ids": None, "text": []}, "text is an empty batch"),
        ({"rid": ["a", "b"]}, "rid: a list of rids needs a batch"),
        ({"sampling_params": {"max_new_tokens": 0, "skip_special_tokens": "perhaps"}}, "skip_special_tokens"),
    ],
)
def test_bad_scoring_requests_get_400_naming_the_field(served, body, message):
    request = {"input_ids": IDS, "return_logprob": True, "sampling_params": {"max_new_tokens": 0}, **body}
    r = served[0].post("/generate", json=request)
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]


def test_logprob_fields_are_ignored_without_return_logprob_as_in_sglang(served):
    r = served[0].post("/generate", json={"input_ids": IDS, "logprob_start_len": 99, "top_logprobs_num": 3,
                                          "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert r.status_code == 200 and "input_token_logprobs" not in r.json()["meta_info"]


# ---------------------------------------------------------------------- text post-processing


def _greedy_text(client, tokenizer, **sampling):
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                          **sampling}})
    assert r.status_code == 200, r.text
    return r.json()


def test_text_leaves_out_the_end_of_turn_token_by_default(served):
    client, model, tokenizer = served
    body = _greedy_text(client, tokenizer)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    ids = body["output_ids"]
    assert ids[-1] == eot and body["meta_info"]["finish_reason"] == {"type": "stop", "matched": eot}
    assert ids == greedy(model, tokenizer(PROMPT, add_special_tokens=False).input_ids, len(ids))  # ids untouched
    assert EOT not in body["text"] and body["text"] == tokenizer.decode(ids[:-1])
    # SGLang trims the matched stop token whatever skip_special_tokens says; no_stop_trim keeps it
    assert _greedy_text(client, tokenizer, skip_special_tokens=False)["text"] == body["text"]
    kept = _greedy_text(client, tokenizer, skip_special_tokens=False, no_stop_trim=True)["text"]
    assert kept == body["text"] + EOT
    assert _greedy_text(client, tokenizer, no_stop_trim=True)["text"] == body["text"]  # skipped as special


def test_special_tokens_inside_the_output_show_only_with_skip_special_tokens_false(served):
    client, _, tokenizer = served
    skipped = _greedy_text(client, tokenizer, ignore_eos=True)
    ids = skipped["output_ids"]
    assert tokenizer.convert_tokens_to_ids(EOT) in ids[:-1]  # generated, and generation went on past it
    assert EOT not in skipped["text"] and skipped["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    shown = _greedy_text(client, tokenizer, ignore_eos=True, skip_special_tokens=False)
    assert shown["output_ids"] == ids and EOT in shown["text"]
    assert shown["text"] == tokenizer.decode(ids, skip_special_tokens=False)


def test_spaces_between_special_tokens_is_taken_and_left_to_the_tokenizer(served):
    # transformers 5's tokenizers accept the flag and ignore it, as they do under SGLang's own server
    client, _, tokenizer = served
    texts = {flag: _greedy_text(client, tokenizer, ignore_eos=True, skip_special_tokens=False,
                                spaces_between_special_tokens=flag)["text"] for flag in (True, False)}
    ids = _greedy_text(client, tokenizer, ignore_eos=True)["output_ids"]
    assert texts[True] == texts[False] == tokenizer.decode(ids, skip_special_tokens=False,
                                                           spaces_between_special_tokens=False)


# ---------------------------------------------------------------------- vLLM's prompt logprobs, without vLLM


def test_vllm_prompt_logprobs_become_scores_with_the_top_k_in_rank_order():
    def position(*entries):  # (token, logprob, rank), as vLLM's Logprob dict holds them
        return {t: SimpleNamespace(logprob=lp, rank=rank) for t, lp, rank in entries}

    prompt_logprobs = [None,
                       position((7, -3.0, 9), (1, -0.5, 1), (2, -1.0, 2)),  # the prompt's token 7, outside the top 2
                       position((2, -0.2, 1), (5, -2.5, 2))]  # the prompt's token 2 is the likeliest
    scores = prompt_scores([4, 7, 2], prompt_logprobs, 2, version=3)
    assert scores.logprobs == [-3.0, -0.2] and scores.version == 3
    assert scores.top == [[(-0.5, 1), (-1.0, 2)], [(-0.2, 2), (-2.5, 5)]]
    assert prompt_scores([4, 7, 2], prompt_logprobs, 0, version=0).top == [[], []]


# ---------------------------------------------------------------------- SGLang's own client, real servers


@pytest.fixture(scope="module")
def sgl():
    return pytest.importorskip(
        "sglang", reason="SGLang's frontend is not installed: scripts/setup.sh installs it "
                         "(pip install --no-deps sglang==0.5.10.post1, with ipython)")


@contextmanager
def serving(model_dir: str, log_path, *overrides: str):
    """``streamrl serve`` on a free port, stopped on exit."""
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "streamrl", "serve", f"model.path={model_dir}", *overrides,
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, proc, timeout_s=180)
        except (RuntimeError, TimeoutError) as e:
            raise AssertionError(f"{e}; its log:\n{log_path.read_text()[-3000:]}") from None
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def expected_choice(model, tokenizer) -> tuple[str, list[float]]:
    """What ``sgl.gen(choices=...)`` must pick, from a transformers forward: SGLang's client scores each
    ``PROMPT + choice`` from two tokens before the prompt's end and takes the largest mean logprob (the
    first entry, null, left out)."""
    prefix = tokenizer(PROMPT, add_special_tokens=False).input_ids
    start = max(len(prefix) - 2, 0)
    # the client's token healing would subtract the null first logprob when the prompt ends with its text
    assert not PROMPT.endswith(tokenizer.decode([prefix[start]]))
    means = []
    for choice in CHOICES:
        ids = tokenizer(PROMPT + choice, add_special_tokens=False).input_ids
        assert ids[: len(prefix)] == prefix
        values = chosen(reference(model, ids), ids)[start:]
        means.append(sum(values) / len(values))
    ranked = sorted(means, reverse=True)
    assert ranked[0] - ranked[1] > 1e-3, "two choices score too close to tell apart"
    return CHOICES[means.index(ranked[0])], means


def check_sglang_client(sgl, url: str, model_dir: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))

    @sgl.function
    def complete(s, prompt):
        s += prompt
        s += sgl.gen("completion", max_tokens=12, temperature=0)

    @sgl.function
    def pick(s, prompt, choices):
        s += prompt
        s += sgl.gen("choice", choices=choices)

    state = complete.run(prompt=PROMPT)
    ids = greedy(model, tokenizer(PROMPT, add_special_tokens=False).input_ids, 12)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    assert eot in ids
    assert state["completion"] == tokenizer.decode(ids[: ids.index(eot)]) and EOT not in state["completion"]
    assert state.get_meta_info("completion")["finish_reason"] == {"type": "stop", "matched": eot}

    want, means = expected_choice(model, tokenizer)
    for choices in (CHOICES, CHOICES[::-1]):  # the pick follows the scores, not the order
        state = pick.run(prompt=PROMPT, choices=choices)
        assert state["choice"] == want
        got = dict(zip(choices, state.get_meta_info("choice")["normalized_prompt_logprobs"]))
        assert all(math.isclose(got[c], m, abs_tol=1e-4) for c, m in zip(CHOICES, means))


def test_sglang_client_on_the_hf_engine(sgl, model_dir, tmp_path):
    with serving(model_dir, tmp_path / "serve.log") as url:
        check_sglang_client(sgl, url, model_dir)


# ---------------------------------------------------------------------- the vllm engine, through its server


@pytest.fixture(scope="module")
def vllm_served(tmp_path_factory):
    """A ``streamrl serve`` with the vllm engine in fp32 (hidden 256: head size 64, which vLLM's CPU backend takes)."""
    if not HAS_VLLM:
        pytest.skip("needs vLLM: scripts/test.sh installs its CPU build")
    path = tmp_path_factory.mktemp("vllm-eot-model")
    model_dir = make_eot_model(path, hidden=256)
    with serving(model_dir, path / "serve.log", "server.engine=vllm", "model.dtype=float32",
                 "server.kv_cache_gb=0.5", "server.max_batch_size=4") as url:
        yield url, model_dir


@pytest.mark.slow  # a vLLM engine start
def test_vllm_prompt_scores_equal_a_teacher_forced_forward(vllm_served):
    import httpx

    url, model_dir = vllm_served
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    k = 4
    r = httpx.post(url + "/generate", timeout=120, json={
        "input_ids": IDS, "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": k,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.3}})  # temperature does not touch scores
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["meta_info"]
    assert body["output_ids"] == [] and meta["completion_tokens"] == 0 and meta["weight_version"] == 0
    entries, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert [t for _, t, _ in entries] == IDS[1:] and entries[0][0] is None and tops[0] is None
    ref = reference(model, IDS)
    want = chosen(ref, IDS)[1:]
    assert max(abs(lp - w) for (lp, _, _), w in zip(entries[1:], want)) <= 1e-4
    values, indices = ref[1:].topk(k, -1)
    for top, want_values, want_ids in zip(tops[1:], values, indices):
        assert [t for _, t, _ in top] == want_ids.tolist()
        assert max(abs(lp - w) for (lp, _, _), w in zip(top, want_values.tolist())) <= 1e-4
    big = httpx.post(url + "/generate", timeout=60, json={"input_ids": IDS, "return_logprob": True,
                                                         "top_logprobs_num": 21,
                                                         "sampling_params": {"max_new_tokens": 0}})
    assert big.status_code == 400 and "max_logprobs" in big.json()["error"]["message"]


@pytest.mark.slow
def test_sglang_client_on_the_vllm_engine(sgl, vllm_served):
    url, model_dir = vllm_served
    check_sglang_client(sgl, url, model_dir)
