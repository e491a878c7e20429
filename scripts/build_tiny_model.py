"""Write random weights for the tiny local model that real vLLM CPU engines serve.

No weights can be downloaded where this project runs, and the real-engine tests
only look at usage, metrics, KV events and timing, never at generated text. So
the model is a random-weight ``LlamaForCausalLM`` small enough to prefill 16k
tokens in seconds on one CPU core, with a vocabulary that matches the project's
own tokenizer (:mod:`prefixrouter.tokenization`, 8,192 entries), which
``scripts/setup_vllm.sh`` writes into the same folder beforehand.

Run with the vLLM venv's python (it needs torch and transformers)::

    .venvs/vllm/bin/python scripts/build_tiny_model.py .venvs/tiny-model

Deterministic: ``torch.manual_seed(0)``; bf16; about 17 MB.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HIDDEN = 256
LAYERS = 4
HEADS = 4
INTERMEDIATE = 512
MAX_POSITIONS = 32768
VOCAB = 8192
# Ids of the project's tokenizer's special tokens (prefixrouter.tokenization.SPECIAL_TOKENS).
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="model folder (already holds the tokenizer)")
    args = parser.parse_args()
    out: Path = args.out

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok_json = out / "tokenizer.json"
    if tok_json.is_file():
        tok = json.loads(tok_json.read_text(encoding="utf-8"))
        vocab, added = tok["model"]["vocab"], tok.get("added_tokens", [])
        size = max([*vocab.values(), *(t["id"] for t in added)]) + 1
        if size != VOCAB:
            raise SystemExit(f"{tok_json}: vocabulary of {size} entries, the model expects {VOCAB}")

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=None, eos_token_id=IM_END_ID, pad_token_id=ENDOFTEXT_ID
    ).save_pretrained(out)
    print(f"wrote {out} ({sum(p.numel() for p in model.parameters()):,} parameters)")


if __name__ == "__main__":
    main()
