"""Open-loop streamed load, and its accounting from the engines' own records.

The fault suite (``tests/faults/``), ``benchmarks/faults_table.py`` and
``benchmarks/soak.py`` all measure a fault the same way:

* :class:`OpenLoad` sends streamed chat requests at Poisson arrival times
  (seeded), whether or not earlier ones have finished (*open loop*: a stuck
  gateway cannot slow the load down and hide itself). A share of them asks
  about one of a few long documents (repeated prefixes, which prefix routing
  sends to the engine that holds them), the rest are unique prompts. Every
  request carries a tag of its own in the OpenAI ``user`` field, which the
  gateway forwards untouched. Each request has a client deadline; a gateway
  URL that refuses the connection is skipped for the next one (what a load
  balancer in front of replicas does: nothing was sent).
* Each outcome (:class:`Outcome`) is classified by what the client saw:
  ``complete`` (``data: [DONE]``), ``clean_error`` (an OpenAI-shaped error
  status, or an SSE ``error`` event), ``refused`` (no gateway took the
  connection), ``cut`` (the connection broke: the gateway process died), or
  ``silent`` (the body ended without ``[DONE]`` and without an error, or the
  deadline passed): a silent request is a lost one.
* The engines' served logs (``prefixrouter engine --served-log``, one JSON line
  per event: :mod:`prefixrouter.simulated_engine.faults`) say which engine
  received each tag and when. :func:`account` counts, from them:

  - **lost**: silent requests, plus completes whose engine response id is in
    no engine's log as a finished answer to that tag (an answer from nowhere);
  - **duplicated**: requests an engine received *after* the client had its
    first byte (a retry after bytes reached the client; for an engine that
    was frozen, see :func:`account`), or whose stream carried the response
    ids of two engine requests (two answers spliced).

  Both are 0 when the gateway keeps its promise: retry only before the first
  byte, and end every stream either complete or with an error event.
* :func:`leave_s` and :func:`return_s` time how long traffic takes to leave a
  failed engine (from the gateway's decision records: the last request sent
  after the fault that was routed to it, or retried away from it) and to
  return to a restarted one (from its served log: the first request sent
  after it was ready that it received).

All clocks are ``time.monotonic()``: one clock for every process on the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
import orjson

Kind = Literal["complete", "clean_error", "refused", "cut", "silent"]


def document(seed: int, sections: int = 40) -> str:
    """A long document of its own per seed (a repeated prefix)."""
    return " ".join(
        f"Doc {seed} part {i}: the committee approved item {i * 13 + seed} as drafted."
        for i in range(sections)
    )


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it.

    Attributes:
        tag: Its ``user`` field (unique per request).
        t_send: When it was sent (monotonic seconds).
        t_first: When its first body byte came (None: none did).
        t_end: When it ended.
        kind: How it ended (module doc).
        status: HTTP status (0: no response).
        worker: The gateway's ``X-Prefixrouter-Worker`` header.
        request_id: The gateway's ``X-Request-Id`` header.
        url: The gateway that took it.
        engine_ids: The ``id`` of every chunk (the engine's response id).
        error: What went wrong, if anything.
    """

    tag: str
    t_send: float
    t_first: float | None = None
    t_end: float = 0.0
    kind: Kind = "silent"
    status: int = 0
    worker: str = ""
    request_id: str = ""
    url: str = ""
    engine_ids: set[str] = field(default_factory=set)
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_send


def _is_error_body(raw: bytes) -> bool:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return isinstance(data, dict) and isinstance(data.get("error"), dict)


def _read_events(out: Outcome, buf: bytes) -> tuple[bytes, bool]:
    """Take the complete events off ``buf``; True once ``[DONE]`` or an error event came."""
    while b"\n\n" in buf:
        event, buf = buf.split(b"\n\n", 1)
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                out.kind = "complete"
                return buf, True
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue  # a malformed event: passed on, not an ending
            if not isinstance(obj, dict):
                continue
            if isinstance(obj.get("error"), dict):
                out.kind, out.error = "clean_error", str(obj["error"].get("message", ""))
                return buf, True
            if isinstance(obj.get("id"), str):
                out.engine_ids.add(obj["id"])
    return buf, False


async def stream_request(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    body: dict[str, Any],
    deadline_s: float,
    start: int = 0,
) -> Outcome:
    """Send one streamed chat request (``body["user"]`` is its tag) and classify how it ended.

    ``urls`` are tried from ``start`` on while they refuse the connection.
    """
    out = Outcome(str(body["user"]), time.monotonic())
    try:
        async with asyncio.timeout(deadline_s):
            await _send(session, urls, body, out, start)
    except TimeoutError:
        out.kind, out.error = "silent", f"no end within {deadline_s:g} s"
    out.t_end = time.monotonic()
    return out


async def _send(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    body: dict[str, Any],
    out: Outcome,
    start: int,
) -> None:
    for k in range(len(urls)):
        url = urls[(start + k) % len(urls)]
        try:
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                out.url = url
                out.status = resp.status
                out.worker = resp.headers.get("X-Prefixrouter-Worker", "")
                out.request_id = resp.headers.get("X-Request-Id", "")
                if resp.status != 200:
                    raw = await resp.read()
                    out.t_first = time.monotonic()
                    out.kind = "clean_error" if _is_error_body(raw) else "silent"
                    out.error = raw[:200].decode(errors="replace")
                    return
                buf = b""
                ended = False
                async for chunk in resp.content.iter_any():
                    if out.t_first is None:
                        out.t_first = time.monotonic()
                    buf, ended = _read_events(out, buf + chunk)
                    if ended:
                        break
                if not ended:
                    out.kind, out.error = "silent", "the stream ended without [DONE] or an error"
                return
        except aiohttp.ClientConnectorError as exc:
            out.kind, out.error = "refused", str(exc)
            continue  # nothing was sent: the next gateway
        except (aiohttp.ClientError, ConnectionError) as exc:
            out.kind, out.error = "cut", f"{type(exc).__name__}: {exc}"
            return


@dataclass
class LoadMix:
    """What :class:`OpenLoad` sends.

    Attributes:
        rate: Requests per second (Poisson arrivals).
        repeat_share: Share of requests about one of the ``documents``.
        documents: How many distinct long documents.
        max_tokens: Output tokens per request.
        deadline_s: A request still open after this is ``silent``.
        seed: Seed of arrivals and choices.
    """

    rate: float = 15.0
    repeat_share: float = 0.6
    documents: int = 6
    max_tokens: int = 8
    deadline_s: float = 30.0
    seed: int = 0


class OpenLoad:
    """Open-loop streamed load on one or more gateway URLs (module doc).

    Args:
        urls: Gateway base URLs; requests go round-robin, skipping refusers.
        mix: What to send.
        name: Prefix of every tag (tells runs apart in the engines' logs).
    """

    def __init__(self, urls: Sequence[str], mix: LoadMix, name: str = "load") -> None:
        self.urls = list(urls)
        self.mix = mix
        self.name = name
        self.outcomes: list[Outcome] = []
        self._rng = random.Random(mix.seed)
        self._docs = [document(mix.seed * 1000 + i) for i in range(mix.documents)]
        self._n = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def body(self) -> dict[str, Any]:
        """The next request's body (and tag)."""
        self._n += 1
        tag = f"{self.name}-{self._n}"
        if self._rng.random() < self.mix.repeat_share:
            text = f"{self._rng.choice(self._docs)}\nQuestion {self._n}: what was approved?"
        else:
            text = f"Unique prompt {tag} {self._rng.random():.9f}: summarise nothing in particular."
        return {
            "model": "tiny",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": self.mix.max_tokens,
            "stream": True,
            "user": tag,
        }

    async def start(self) -> None:
        """Start sending (returns at once)."""
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        self._session = aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=None)
        )
        self._runner = asyncio.create_task(self._run())

    async def _one(self, body: dict[str, Any], start: int) -> None:
        assert self._session is not None
        out = await stream_request(self._session, self.urls, body, self.mix.deadline_s, start)
        self.outcomes.append(out)

    async def _run(self) -> None:
        next_at = time.monotonic()
        i = 0
        while not self._stop.is_set():
            next_at += self._rng.expovariate(self.mix.rate)
            delay = next_at - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
                if self._stop.is_set():
                    break
            task = asyncio.create_task(self._one(self.body(), i % len(self.urls)))
            i += 1
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def stop(self) -> list[Outcome]:
        """Stop sending, wait for every request to end (each is bounded), return all outcomes."""
        self._stop.set()
        if self._runner is not None:
            await self._runner
        if self._tasks:
            await asyncio.gather(*list(self._tasks))
        if self._session is not None:
            await self._session.close()
        return sorted(self.outcomes, key=lambda o: o.t_send)

    def sent_since(self, t: float) -> int:
        """Requests sent (and ended) since ``t``: to wait for traffic, not for time."""
        return sum(1 for o in self.outcomes if o.t_send >= t)


# ---------------------------------------------------------------- engines' records


@dataclass(frozen=True, slots=True)
class Served:
    """One request an engine received, from its served log."""

    engine: str
    rid: str
    tag: str | None
    t_recv: float
    t_first: float | None  # when it wrote the first byte (None: never)
    how: str | None  # None: no end line (the engine died first)


def read_served(paths: Mapping[str, Path]) -> list[Served]:
    """Every request in the engines' served logs (``{engine name: file}``).

    A last line cut by a ``SIGKILL`` is skipped.
    """
    out: list[Served] = []
    for engine, path in paths.items():
        recv: dict[str, dict[str, Any]] = {}
        firsts: dict[str, float] = {}
        ends: dict[str, str] = {}
        with contextlib.suppress(FileNotFoundError):
            for line in path.read_bytes().splitlines():
                try:
                    ev = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                if not isinstance(ev, dict):
                    continue
                if ev.get("ev") == "recv":
                    recv[ev["rid"]] = ev
                elif ev.get("ev") == "first":
                    firsts[ev["rid"]] = float(ev["t"])
                elif ev.get("ev") == "end":
                    ends[ev["rid"]] = str(ev.get("how"))
        for rid, ev in recv.items():
            tag, t = ev.get("tag"), float(ev["t"])
            out.append(Served(engine, rid, tag, t, firsts.get(rid), ends.get(rid)))
    return out


@dataclass
class Tally:
    """A run's requests by how they ended, and its lost and duplicated counts."""

    requests: int = 0
    complete: int = 0
    clean_errors: int = 0
    refused: int = 0
    cut: int = 0
    lost: int = 0
    duplicated: int = 0
    examples: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "complete": self.complete,
            "clean_errors": self.clean_errors,
            "refused": self.refused,
            "cut": self.cut,
            "lost": self.lost,
            "duplicated": self.duplicated,
            "examples": self.examples[:5],
        }


FREEZE_READ_S = 1.0
"""How long after a thaw a frozen engine may still be reading what the kernel buffered."""


def account(
    outcomes: Iterable[Outcome],
    served: Sequence[Served],
    frozen: Mapping[str, Sequence[tuple[float, float]]] | None = None,
) -> Tally:
    """Count lost and duplicated requests (module doc) from the engines' records.

    ``frozen``: engines that were stopped (``SIGSTOP``), each with its
    ``(t0, t1)`` windows.
    Such an engine reads, once thawed, requests the kernel took in while it was
    stopped, so its receive stamps up to just after ``t1`` are later than
    their arrival: one of them counts as late only if the engine then wrote a byte
    for it (an answer the client might have seen twice).
    """
    frozen = frozen or {}

    def late(s: Served, t_first: float) -> bool:
        if s.t_recv <= t_first:
            return False
        # Stamped on waking (the thaw races the caller's own stamp of it).
        buffered = any(t0 <= s.t_recv <= t1 + FREEZE_READ_S for t0, t1 in frozen.get(s.engine, ()))
        return not buffered or s.t_first is not None

    by_tag: dict[str, list[Served]] = {}
    for s in served:
        if s.tag is not None:
            by_tag.setdefault(s.tag, []).append(s)
    tally = Tally()
    kinds: Counter[str] = Counter()
    for o in outcomes:
        tally.requests += 1
        kinds[o.kind] += 1
        seen = by_tag.get(o.tag, [])
        if o.kind == "silent":
            tally.lost += 1
            tally.examples.append(f"lost {o.tag}: {o.error}")
        elif o.kind == "complete":
            finished = {s.rid for s in seen if s.how == "done"}
            if not o.engine_ids or not o.engine_ids <= finished:
                tally.lost += 1
                tally.examples.append(f"unserved {o.tag}: {sorted(o.engine_ids)}")
        t_first = o.t_first
        again = t_first is not None and any(late(s, t_first) for s in seen)
        if again or len(o.engine_ids) > 1:
            tally.duplicated += 1
            got = [(s.engine, s.t_recv, s.t_first, s.how) for s in seen]
            tally.examples.append(f"duplicated {o.tag} (first byte {t_first}): {got}")
    tally.complete = kinds["complete"]
    tally.clean_errors = kinds["clean_error"]
    tally.refused = kinds["refused"]
    tally.cut = kinds["cut"]
    return tally


def leave_s(
    outcomes: Sequence[Outcome],
    decisions: Sequence[Mapping[str, Any]],
    worker: str,
    t_fault: float,
    t_until: float,
) -> float | None:
    """Seconds from ``t_fault`` to the send time of the last request routed to ``worker``
    (or retried away from it) among those sent before ``t_until``; 0 when none was.

    None: requests sent in the last second before ``t_until`` still went there
    (traffic did not leave).
    """
    touched = {
        str(d["request_id"])
        for d in decisions
        if d.get("selected_worker") == worker or worker in (d.get("retried_from") or ())
    }
    sends = [
        o.t_send
        for o in outcomes
        if t_fault <= o.t_send < t_until and o.request_id and o.request_id in touched
    ]
    if not sends:
        return 0.0
    last = max(sends)
    return None if last > t_until - 1.0 else last - t_fault


def return_s(
    outcomes: Sequence[Outcome], served: Sequence[Served], engine: str, t_ready: float
) -> float | None:
    """Seconds from ``t_ready`` until ``engine`` received a request sent after it (None: never)."""
    sent = {o.tag: o.t_send for o in outcomes if o.t_send >= t_ready}
    got = [s.t_recv for s in served if s.engine == engine and s.tag in sent]
    return min(got) - t_ready if got else None


async def until(probe: Any, what: str, timeout_s: float, interval_s: float = 0.05) -> Any:
    """Poll the coroutine function ``probe`` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(interval_s)
