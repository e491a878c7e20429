"""Speed of `prefixrouter analyze`: synthetic request bodies, requests analyzed per second.

Usage::

    python benchmarks/analyze_speed.py [--requests N] [--tokenizer PATH]
        [--block-size N] [--kv-tokens N] [--keep FILE]

Writes N OpenAI request bodies (JSON lines) to a temporary file: a mix of
shared system templates with short questions (40%), one document with many
questions (25%), growing multi-turn sessions (15%), two-layer RAG (10%) and
unique prompts (10%), built with the stable-assembly builders. It then times
the streaming analysis of that file (generation not included) and prints one
JSON object: requests per second, prompt tokens per second, peak resident
memory and the headline shares.
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

import orjson

from prefixrouter.analyze import AnalyzeParams, analyze_log, load_encoder
from prefixrouter.prompt import Fragment, PinnedSession, StableLayer, doc_qa_request, rag_request

_VOCAB = (
    "cache prefix token block router worker engine prompt document question answer policy "
    "latency memory session retrieval fragment system template queue batch decode prefill"
)
WORDS = _VOCAB.split()


def _text(rng: random.Random, words: int) -> str:
    lines = []
    for _ in range(max(1, words // 12)):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + ".")
    return "\n".join(lines)


def generate(path: Path, n: int, seed: int = 0) -> None:
    """Write ``n`` synthetic request bodies to ``path``."""
    rng = random.Random(seed)
    systems = [_text(rng, 1200) for _ in range(5)]
    docs = [_text(rng, 2500) for _ in range(200)]
    stable = StableLayer(_text(rng, 400), response_policy=_text(rng, 100), rules=_text(rng, 300))
    pool = [Fragment(f"src-{i % 97}", i, 0.0, _text(rng, 120)) for i in range(1000)]
    sessions: list[tuple[PinnedSession, int]] = []
    with path.open("wb") as fh:
        for i in range(n):
            r = rng.random()
            if r < 0.40:
                body = {
                    "model": "m",
                    "messages": [
                        {"role": "system", "content": rng.choice(systems)},
                        {"role": "user", "content": f"{i}: {_text(rng, 30)}"},
                    ],
                }
            elif r < 0.65:
                body = doc_qa_request(
                    model="m",
                    instruction="Answer from the document only.",
                    document=docs[min(int(rng.expovariate(0.05)), len(docs) - 1)],
                    question=_text(rng, 20),
                ).body
            elif r < 0.80:
                if not sessions or rng.random() < 0.2:
                    frags = [
                        Fragment(f.source_id, f.position, rng.random(), f.text)
                        for f in rng.sample(pool, 4)
                    ]
                    sessions.append((PinnedSession(model="m", stable=stable, fragments=frags), 0))
                    sessions = sessions[-50:]
                k = rng.randrange(len(sessions))
                session, turns = sessions[k]
                body = session.ask(_text(rng, 25)).body
                session.answer(_text(rng, 60))
                sessions[k] = (session, turns + 1)
            elif r < 0.90:
                frags = [
                    Fragment(f.source_id, f.position, rng.random(), f.text)
                    for f in rng.sample(pool, 5)
                ]
                body = rag_request(
                    model="m", stable=stable, fragments=frags, question=_text(rng, 20)
                ).body
            else:
                body = {"model": "m", "messages": [{"role": "user", "content": _text(rng, 600)}]}
            fh.write(orjson.dumps(body) + b"\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-tokens", type=int, default=500_000)
    ap.add_argument("--keep", type=Path, default=None, help="Write the log here and keep it.")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "requests.jsonl"
        t0 = time.perf_counter()
        generate(path, args.requests)
        t1 = time.perf_counter()
        encoder = load_encoder(args.tokenizer) if args.tokenizer else None
        params = AnalyzeParams(block_size=args.block_size, kv_tokens=args.kv_tokens)
        report, _ = analyze_log(path, params, encoder)
        t2 = time.perf_counter()
        size = path.stat().st_size
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {
        "requests": report["requests"],
        "mode": report["mode"],
        "log_mb": round(size / 2**20, 1),
        "generate_s": round(t1 - t0, 2),
        "analyze_s": round(t2 - t1, 2),
        "requests_per_s": round(report["requests"] / (t2 - t1), 1),
        "prompt_tokens_per_s": round(report["prompt_tokens"] / (t2 - t1)),
        "peak_rss_mb": round(rss / (2**20 if sys.platform == "darwin" else 2**10), 1),
        "reusable_share_unlimited": report["reusable_share_unlimited"],
        "reusable_share_kv": report["reusable_share_kv"],
        "sampling_rate": report["sampling_rate"],
        "first_class": report["first_class"],
    }
    print(orjson.dumps(out).decode())


if __name__ == "__main__":
    main()
