import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.generation import SamplingParams
from streamrl.inference.engines.hf import HFEngine


@pytest.mark.slow
def test_smollm2_converts_to_a_plain_directory_our_engine_serves(smollm2_dir):
    path = smollm2_dir  # convert_smollm2's output, made once for the session
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    engine = HFEngine(model, tokenizer=tokenizer)
    try:
        out = engine.submit("q", prompt, SamplingParams(max_new_tokens=12, temperature=0)).result(120)
    finally:
        engine.shutdown()
    assert "5" in tokenizer.decode(out.output_ids)  # a real instruct model answers
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    assert out.output_ids == ref[: len(out.output_ids)]


def test_a_generic_fast_tokenizer_loads_as_autotokenizer_would_without_importing_torch(tiny_model_dir):
    import subprocess
    import sys

    from streamrl.models import load_tokenizer

    ours, auto = load_tokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = [{"role": "user", "content": "reverse: stream"}]
    assert type(ours) is type(auto)
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"] \
        == auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert (ours.eos_token_id, ours.pad_token_id) == (auto.eos_token_id, auto.pad_token_id)
    probe = ("import sys; from streamrl.models import load_tokenizer; "
             f"load_tokenizer({str(tiny_model_dir)!r}); print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"
