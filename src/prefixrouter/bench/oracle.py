"""The oracle router: each document pinned to one engine, decided from the workload in advance.

A router that knows the whole workload before it starts can do what no online
router can: place every document once, where the fleet's KV holds it, and
never move it. The bench computes that placement from the workload itself and
runs it as one more router beside the others (``--routers oracle,...``), so
"how far from the best placement" is measured in the same run, on the same
engines, at the same arrival times.

The placement (:func:`pin_documents`) is longest-processing-time-first
greedy: documents by weight ``tokens x questions`` (heaviest first, ties by
name), each to the engine with the least weight so far among those whose
pinned tokens stay within ``capacity_tokens`` with it (ties: the lowest
index); if none has room, the one with the fewest pinned tokens. It is
deterministic, and LPT keeps the heaviest engine within 4/3 of the best
possible balance. It balances work, not arrivals: the oracle does nothing
about bursts, which is why an online router can come close to it but also
beat it on p99.

Which document a request is about (:class:`DocumentKeys`): the workload's
``group``s are mapped to the longest prompt prefix (messages' roles and
contents, concatenated) that all of a group's requests share, cut to the
shortest such prefix over all groups (at most :data:`MAX_KEY_CHARS`); a
request's key is the hash of its own prompt cut to that length. A workload
whose groups share such a prefix cannot be pinned this way and is refused.
Requests whose key is unknown (the bench's warm-up and health probes) go
round robin.

The server (``python -m prefixrouter.bench.oracle --port P --pins FILE
--worker URL ...``) is a plain aiohttp proxy: ``/v1/chat/completions`` and
``/v1/completions`` to the pinned engine, streamed through chunk by chunk;
``/health`` answers itself.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from prefixrouter.errors import ConfigError
from prefixrouter.harness.replay import ReplayRequest

MAX_KEY_CHARS = 4096
"""Longest prompt prefix a key is cut to (enough to tell documents apart)."""
PIN_FILL = 0.85
"""Share of an engine's KV the documents pinned to it may take (the rest: running requests)."""


def prompt_text(body: Mapping[str, Any]) -> str:
    """A chat or completion body's prompt as one string (roles and contents, in order)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(
            f"\x00{m.get('role', '')}\x00{m.get('content', '')}"
            for m in messages
            if isinstance(m, dict)
        )
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def document_key(body: Mapping[str, Any], chars: int) -> str:
    """The hash of the body's prompt cut to ``chars`` characters."""
    return _digest(prompt_text(body)[:chars])


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True, slots=True)
class DocumentKeys:
    """How requests are told apart by document (module doc).

    Attributes:
        chars: A request's key is its prompt's first ``chars`` characters, hashed.
        groups: Key -> group.
        documents: Group -> the prompt prefix all its requests share (the document).
        questions: Group -> how many requests it has.
    """

    chars: int
    groups: dict[str, str]
    documents: dict[str, str]
    questions: dict[str, int]

    @classmethod
    def of(cls, requests: Sequence[ReplayRequest]) -> DocumentKeys:
        """The keys of a workload's groups.

        Raises:
            ConfigError: No requests, or two groups that no prompt prefix tells apart.
        """
        shared: dict[str, str] = {}
        questions: dict[str, int] = {}
        for r in requests:
            text = prompt_text(r.body)
            prev = shared.get(r.group)
            shared[r.group] = text if prev is None else prev[: _common_prefix(prev, text)]
            questions[r.group] = questions.get(r.group, 0) + 1
        if not shared:
            raise ConfigError("oracle: the workload has no requests")
        chars = min(MAX_KEY_CHARS, *(len(t) for t in shared.values()))
        groups: dict[str, str] = {}
        for group, text in shared.items():
            key = _digest(text[:chars])
            other = groups.setdefault(key, group)
            if other != group:
                raise ConfigError(
                    f"oracle: groups {other!r} and {group!r} start with the same "
                    f"{chars} characters; it cannot tell their requests apart"
                )
        return cls(chars, groups, shared, questions)


def pin_documents(
    weights: Mapping[str, tuple[int, int]], engines: int, capacity_tokens: int | None = None
) -> dict[str, int]:
    """Each document's engine: LPT greedy on ``tokens x questions`` within capacity (module doc).

    Args:
        weights: Document -> (its tokens, its questions).
        engines: How many engines (indices ``0 .. engines-1``).
        capacity_tokens: Tokens of KV per engine that pinned documents may take
            (None: no limit).

    Raises:
        ConfigError: ``engines`` < 1.
    """
    if engines < 1:
        raise ConfigError(f"oracle: needs at least one engine, got {engines}")
    load = [0] * engines
    tokens = [0] * engines
    out: dict[str, int] = {}
    order = sorted(weights, key=lambda d: (-weights[d][0] * weights[d][1], d))
    for doc in order:
        size, asked = weights[doc]
        room = [
            e
            for e in range(engines)
            if capacity_tokens is None or tokens[e] + size <= capacity_tokens
        ]
        best = (
            min(room, key=lambda e: (load[e], e))
            if room
            else min(range(engines), key=lambda e: (tokens[e], e))
        )
        out[doc] = best
        load[best] += size * asked
        tokens[best] += size
    return out


def oracle_pins(
    requests: Sequence[ReplayRequest],
    engines: int,
    count_tokens: Callable[[str], int],
    capacity_tokens: int | None = None,
) -> tuple[DocumentKeys, dict[str, int]]:
    """The oracle's keys and each group's engine for a workload.

    ``count_tokens(text) -> int`` measures a document (the tokenizer's count).
    """
    keys = DocumentKeys.of(requests)
    weights = {g: (int(count_tokens(d)), keys.questions[g]) for g, d in keys.documents.items()}
    return keys, pin_documents(weights, engines, capacity_tokens)


def write_pins(path: Path, keys: DocumentKeys, pins: Mapping[str, int]) -> None:
    """The server's pin file: the key length and key -> engine index."""
    table = {key: pins[group] for key, group in keys.groups.items()}
    path.write_bytes(orjson.dumps({"chars": keys.chars, "pins": table}, option=orjson.OPT_INDENT_2))


# --------------------------------------------------------------------- the server


class OracleProxy:
    """Forward each request to its document's engine; unknown documents round robin."""

    def __init__(self, workers: Sequence[str], chars: int, pins: Mapping[str, int]) -> None:
        self.workers = [w.rstrip("/") for w in workers]
        self.chars = chars
        self.pins = dict(pins)
        self._next = itertools.cycle(range(len(self.workers)))
        self.session: aiohttp.ClientSession | None = None

    def engine(self, body: Mapping[str, Any]) -> str:
        index = self.pins.get(document_key(body, self.chars))
        return self.workers[next(self._next) if index is None else index % len(self.workers)]

    async def forward(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return web.json_response(
                {"error": {"message": "body is not JSON", "type": "invalid_request_error"}},
                status=400,
            )
        assert self.session is not None
        url = self.engine(body if isinstance(body, dict) else {}) + request.path
        headers = {"Content-Type": "application/json"}
        try:
            async with self.session.post(url, data=raw, headers=headers) as up:
                out = web.StreamResponse(status=up.status)
                out.content_type = up.content_type
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except aiohttp.ClientError as exc:
            return web.json_response(
                {"error": {"message": f"engine {url}: {exc}", "type": "upstream_error"}},
                status=502,
            )

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def start(self, _app: web.Application) -> None:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None),
            connector=aiohttp.TCPConnector(limit=0),
        )

    async def close(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.forward)
        app.router.add_post("/v1/completions", self.forward)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.close)
        return app


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The bench's oracle router (see the module doc).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--pins", type=Path, required=True, help="pin file (write_pins)")
    p.add_argument("--worker", action="append", required=True, help="engine base URL")
    args = p.parse_args(argv)
    try:
        doc = orjson.loads(args.pins.read_bytes())
        chars, pins = int(doc["chars"]), {str(k): int(v) for k, v in doc["pins"].items()}
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        print(f"error: --pins {args.pins}: {exc}", file=sys.stderr)
        return 2
    proxy = OracleProxy(args.worker, chars, pins)
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
