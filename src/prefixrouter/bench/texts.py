"""Deterministic prose of a given token length, for live benchmarks and real-engine tests.

Documents must have a known length in the engine's tokens (so that a KV pool
of N tokens holds a known number of them) and be unrelated to each other
(distinct from the first token, so they share no cached prefix). Words are
drawn, seeded, from a small legal and medical vocabulary, and the text is cut
to about ``tokens`` tokens of the project's tokenizer (the tiny vLLM model's).
"""

from __future__ import annotations

import random

from prefixrouter.tokenization import load_tokenizer

VOCABULARY = (
    "the contract party shall provide notice within thirty days of any change to the terms "
    "including payment schedule delivery obligations warranty claims liability limits "
    "termination rights governing law and dispute resolution patient history medication "
    "dosage allergy report laboratory result imaging follow up visit referral diagnosis "
    "treatment plan consent record"
)


def record_text(seed: int, tokens: int) -> str:
    """About ``tokens`` tokens of prose, starting with ``Record <seed>.``."""
    rng = random.Random(seed)
    words = VOCABULARY.split()
    tok = load_tokenizer(None)
    out = [f"Record {seed}."]
    while True:
        out.extend(rng.choice(words) for _ in range(200))
        text = " ".join(out)
        n = len(tok.encode(text))
        if n >= tokens:
            return text[: int(len(text) * tokens / n)]
