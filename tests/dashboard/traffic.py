"""Traffic for the dashboard's tests: questions about a few documents, plus unique prompts.

Seeded, so every run sends the same bytes. Streamed, so the gateway measures
time to first token; the documents carry ``X-Prefix-Class: document`` (warm
after their first question); the unique prompts share a short system
instruction (a partial hit, a fifth of the prompt) and carry no class header
(the gateway classifies them).
"""

from __future__ import annotations

import asyncio
import random

import aiohttp

from prefixrouter.harness.texts import syllable_words

DOCUMENTS = 3


def documents(seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [f"Document {d}.\n\n" + syllable_words(rng, 500) for d in range(DOCUMENTS)]


async def send(url: str, rounds: int, unique: int, seed: int = 0) -> int:
    """Ask every document ``rounds`` questions and send ``unique`` one-off prompts.

    Returns:
        How many requests got a 200.
    """
    rng = random.Random(seed)
    docs = documents()
    system = "Answer in one line. " + syllable_words(random.Random(1000), 60)
    bodies: list[tuple[list[dict[str, str]], str | None]] = []
    for _ in range(rounds):
        for doc in docs:
            question = doc + "\n\nQuestion: " + syllable_words(rng, 12) + "?"
            bodies.append(([{"role": "user", "content": question}], "document"))
    for _ in range(unique):
        chat = [
            {"role": "system", "content": system},
            {"role": "user", "content": syllable_words(rng, 200)},
        ]
        bodies.append((chat, None))
    rng.shuffle(bodies)
    limit = asyncio.Semaphore(4)
    ok = 0

    async def one(
        session: aiohttp.ClientSession, messages: list[dict[str, str]], cls: str | None
    ) -> None:
        nonlocal ok
        body = {
            "model": "tiny",
            "messages": messages,
            "max_tokens": 8,
            "stream": True,
        }
        headers = {"X-Prefix-Class": cls} if cls else {}
        async with (
            limit,
            session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r,
        ):
            await r.read()
            ok += r.status == 200

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, c, k) for c, k in bodies))
    return ok
