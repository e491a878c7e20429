"""Our rendering of a model's own Jinja chat template gives transformers' (vLLM's) token ids.

vLLM renders chat requests with ``transformers``' ``apply_chat_template``; the
vLLM venv has it, so the comparison runs there, on a model folder with a
Llama-3-shaped template (BOS, headers, tools through ``tojson``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, TypedDict

import pytest

from prefixrouter.real_engines.vllm_fleet import ensure_vllm
from prefixrouter.tokenization import load_tokenizer
from tests.tokenization.test_chat_template import LLAMA3_LIKE, model_dir

pytestmark = pytest.mark.vllm

CASES: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "  Policy: be exact.\n"},
        {"role": "user", "content": "Résumé of clause 4?"},
        {"role": "assistant", "content": "Clause 4 says..."},
        {"role": "user", "content": "And 5?"},
    ],
]
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
]


class _Case(TypedDict):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


SCRIPT = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
out = []
for case in json.loads(sys.argv[2]):
    ids = tok.apply_chat_template(
        case["messages"], tools=case["tools"], tokenize=True, add_generation_prompt=True
    )
    out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
print(json.dumps(out))
"""


def test_model_template_token_ids_match_transformers(tmp_path: Path) -> None:
    setup = ensure_vllm()
    folder = model_dir(tmp_path, {"chat_template": LLAMA3_LIKE, "bos_token": "<|endoftext|>"})
    cases: list[_Case] = [{"messages": m, "tools": t} for m in CASES for t in (None, TOOLS)]
    proc = subprocess.run(
        [str(setup.python), "-c", SCRIPT, str(folder), json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    tok = load_tokenizer(folder)
    assert tok.template is not None
    ours = [tok.encode_chat(c["messages"], c["tools"]) for c in cases]
    assert ours == theirs
