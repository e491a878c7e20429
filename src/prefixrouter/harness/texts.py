"""Text for live workloads: pronounceable filler and prose of a known token length.

Live traffic goes through real HTTP to real servers that tokenize it, so
workloads are text, derived from a seed (the same seed sends the same bytes):

* :func:`syllable_words`: words from a fixed syllable grammar, pronounceable
  so that a BPE tokenizer splits them like text (about 1.5 to 2 tokens per
  word), a full stop every 14 words. The demo's documents and prompts and
  the bench's scenario segments are made of them.
* :func:`record_text`: prose of about a given number of tokens of the
  project's tokenizer (the tiny vLLM model's), from a small legal and
  medical vocabulary, each seed starting differently (``Record <seed>.``), so
  documents have a known length and share no cached prefix. Real-engine
  tests and the real-vLLM benchmark use it.
"""

from __future__ import annotations

import random

from prefixrouter.tokenization import load_tokenizer

ONSETS = ("b", "c", "d", "f", "g", "l", "m", "n", "p", "r", "s", "t", "v", "st", "tr", "pl")
VOWELS = ("a", "e", "i", "o", "u", "ea", "io", "ou")
CODAS = ("", "n", "r", "s", "t", "l", "nd", "st", "m")

VOCABULARY = (
    "the contract party shall provide notice within thirty days of any change to the terms "
    "including payment schedule delivery obligations warranty claims liability limits "
    "termination rights governing law and dispute resolution patient history medication "
    "dosage allergy report laboratory result imaging follow up visit referral diagnosis "
    "treatment plan consent record"
)


def syllable_words(rng: random.Random, n: int) -> str:
    """``n`` words of the syllable grammar (module doc), drawn from ``rng``."""
    out = []
    for i in range(n):
        syllables = rng.choice((1, 2, 2, 3))
        word = "".join(
            rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables)
        )
        out.append(word)
        if i % 14 == 13:
            out[-1] += "."
    return " ".join(out)


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
