#!/usr/bin/env bash
# Install the peer routers that `prefixrouter bench` compares against, each from
# PyPI into its own virtual environment under the repository root:
#
#   .venvs/sglang-router   sglang-router==0.3.2
#   .venvs/vllm-router     vllm-router==0.1.17
#
# A venv that already holds the right version is left alone, so the script is
# safe to run again. Options: PYTHON=python3.12 picks the interpreter;
# PREFIXROUTER_PEERS_DIR=DIR installs under DIR instead of .venvs (the bench
# reads the same variable). Usage: scripts/install_peers.sh [sglang] [vllm]
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
peers="${PREFIXROUTER_PEERS_DIR:-$root/.venvs}"
python="${PYTHON:-python3}"

install() {  # install NAME PACKAGE VERSION
    local venv="$peers/$1" package="$2" version="$3" have=""
    if [[ -x "$venv/bin/python" ]]; then
        have="$("$venv/bin/python" -c \
            "import importlib.metadata as m; print(m.version('$package'))" 2>/dev/null || true)"
    fi
    if [[ "$have" == "$version" && -e "$venv/bin/$package" ]]; then
        echo "$package $version: already installed in $venv"
        return
    fi
    echo "$package $version: installing into $venv"
    [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$package==$version"
    "$venv/bin/python" -c "import importlib.metadata as m; print('$package', m.version('$package'), 'ok')"
}

targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(sglang vllm)
mkdir -p "$peers"
for t in "${targets[@]}"; do
    case "$t" in
        sglang) install sglang-router sglang-router 0.3.2 ;;
        vllm) install vllm-router vllm-router 0.1.17 ;;
        *) echo "unknown peer '$t' (known: sglang, vllm)" >&2; exit 2 ;;
    esac
done
