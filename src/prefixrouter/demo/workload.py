"""The demo's built-in traffic: questions about long documents plus chats under one system prompt.

Text, not token ids: the requests go through real HTTP to real servers that
tokenize them. Everything is derived from a seed, so two runs send the same
bytes in the same order at the same offsets:

* **doc-QA**: ``documents`` policy documents of about ``doc_words`` words each;
  each request is a fixed system instruction, one document, then a new
  question (the document is the long reusable prefix);
* **system-prompt**: one long system prompt (``system_words``) shared by
  every chat, then a short user message.

The two kinds are interleaved; arrivals are Poisson at ``rate`` requests per
second. Words come from the harness's syllable grammar
(:func:`prefixrouter.harness.texts.syllable_words`: pronounceable, so the BPE
tokenizer splits them like text, about 1.5 to 2 tokens per word).
"""

from __future__ import annotations

import random

from prefixrouter.harness.replay import ReplayRequest
from prefixrouter.harness.texts import syllable_words


def build_workload(
    requests: int,
    *,
    rate: float = 8.0,
    documents: int = 3,
    doc_words: int = 1_800,
    system_words: int = 700,
    max_tokens: int = 64,
    model: str = "tiny",
    seed: int = 0,
) -> list[ReplayRequest]:
    """The demo's requests, sorted by send offset (seconds from the start)."""
    rng = random.Random(seed)
    docs = [
        f"Policy document {d + 1}.\n\n" + syllable_words(rng, doc_words) for d in range(documents)
    ]
    system_prompt = "You are the support assistant of a small company. " + syllable_words(
        rng, system_words
    )
    instruction = "Answer questions about the document below, briefly and accurately."
    out: list[ReplayRequest] = []
    t = 0.0
    for i in range(requests):
        t += rng.expovariate(rate)
        if i % 2 == 0:
            d = rng.randrange(documents)
            messages = [
                {"role": "system", "content": instruction},
                {
                    "role": "user",
                    "content": docs[d] + "\n\nQuestion: " + syllable_words(rng, 25) + "?",
                },
            ]
            kind, group = "doc-qa", f"doc{d + 1}"
        else:
            messages = [
                {"role": "system", "content": system_prompt},
                {"role": "user", "content": syllable_words(rng, 40) + "?"},
            ]
            kind, group = "system-prompt", "system"
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        out.append(ReplayRequest(t, kind, group, body))
    return out
