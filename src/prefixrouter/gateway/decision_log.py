"""The decision log: one JSON line per finished request, and a ring for the admin API.

A record holds the router's :class:`~prefixrouter.core.router.Decision` (what
it predicted and why) beside what happened (cached tokens the engine reported,
time to first token, status). Fields, at least::

    request_id, model, tenant, prefix_key, prefix_class, selected_worker,
    candidate_workers, predicted_cached_tokens, actual_cached_tokens,
    queue_wait_ms, prefill_tokens, ttft_ms, decision {tier, reason, policy}

``queue_wait_ms`` and ``predicted_ttft_ms`` are the cost model's prediction
for the chosen worker (an engine does not report a request's queue time);
``actual_cached_tokens`` and ``prompt_tokens`` are the engine's ``usage``
(null when it reported none); ``prefill_tokens`` = prompt - cached;
``ttft_ms`` is measured to the first upstream byte of a stream (null when not
streamed); ``expected_output_tokens`` is what the router expected the answer to
decode (the client's ``max_tokens`` at the fill earlier answers showed, or
without a cap what such answers decoded, :mod:`prefixrouter.core.output`);
``latency_ms`` from arrival to the end of the response; ``ts`` is the
wall-clock end time (Unix seconds), ``time`` the decision time on the
gateway's monotonic clock. ``namespace`` is the cache namespace key: a
client's own ``cache_salt`` appears in it only as a keyed digest (see
:mod:`prefixrouter.gateway.tenancy`), so the log never holds the salt, and
``tenant`` is the tenant the API key named. ``client_request_id`` (present
only then) is the client's own ``X-Request-Id``, which the response echoes
and the access log writes; ``request_id`` stays the gateway's, unique per
request. The records are read through
``/admin/decisions``, which needs the admin key.

The hot path only appends a small :class:`LogEntry` to a bounded deque (and to
a pending list when a file is configured); turning it into JSON happens when
``/admin/decisions`` is read or when the background flusher writes the batch
(every ``flush_interval_s``), so a request pays for neither. The entry copies
the decision's logged fields instead of keeping the
:class:`~prefixrouter.core.router.Decision`: the decision's routing context
holds the request's rendered prompt and block hashes (about 12 KB for an 8 KB
chat body), and keeping a thousand of those alive for the ring made every
request allocate cold memory and made the cyclic collector rescan them.
Records are complete only at the end of a request, so the file is in
completion order.

The file is a :class:`~prefixrouter.gateway.log_file.LogFile`, opened for
append when the gateway starts (:meth:`DecisionLog.open`): a path that cannot
be written (a folder, no permission) stops the start with one line naming it.
A write that fails later (a full disk, a file removed from under it) never
stops the flusher: the batch is dropped and counted in
:attr:`DecisionLog.dropped`, one warning says so per outage, and the next
batches try again (reopening the file).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import orjson

from prefixrouter.core.router import Decision
from prefixrouter.gateway.log_file import LogFile

log = logging.getLogger("prefixrouter.gateway")

MAX_PENDING = 100_000
"""Records waiting for the file at most; past it new ones are dropped (and counted).

The flusher empties the list every ``flush_interval_s``, so only a flusher
that is not running fills it: the bound keeps that from growing the process."""


@dataclass(slots=True)
class RequestOutcome:
    """What happened to a routed request (the gateway's side of the record).

    Attributes:
        model: Requested model.
        tenant: Resolved tenant.
        status: HTTP status the client got (499: the client went away).
        actual_cached_tokens: Engine-reported reuse (None: not reported).
        prompt_tokens: Engine-reported prompt length (None: not reported).
        ttft_s: Time to first upstream byte of a stream (None: not streamed).
        latency_s: Time from arrival to the end of the response.
        attempts: Workers tried.
        retried_from: Workers that refused or failed before the first byte.
        stream: The client asked for a stream.
        error: What went wrong, if anything.
        ts: Wall-clock time at the end (Unix seconds).
        client_request_id: The client's own ``X-Request-Id`` (None: it sent
            none, or none the gateway keeps): the id the access log and the
            client have, where ``request_id`` is the router's.
    """

    model: str
    tenant: str
    status: int
    actual_cached_tokens: int | None
    prompt_tokens: int | None
    ttft_s: float | None
    latency_s: float
    attempts: int
    retried_from: tuple[str, ...]
    stream: bool
    error: str | None = None
    ts: float = 0.0
    client_request_id: str | None = None


class LogEntry:
    """What the log keeps of one finished request until it is rendered.

    The decision's fields that :func:`render` writes (those of
    :meth:`Decision.to_dict <prefixrouter.core.router.Decision.to_dict>` and
    the chosen worker's cost terms), without its routing context.
    """

    __slots__ = (
        "affinity",
        "candidates",
        "expected_output_tokens",
        "filtered",
        "namespace",
        "now",
        "outcome",
        "policy",
        "predicted_cached_tokens",
        "prefix_class",
        "prefix_key",
        "prompt_tokens",
        "reason",
        "request_id",
        "tier",
        "warm_abandoned",
        "worker_id",
    )

    def __init__(self, d: Decision, outcome: RequestOutcome) -> None:
        self.request_id = d.request_id
        self.namespace = d.namespace
        self.prefix_key = d.prefix_key
        self.prefix_class = d.prefix_class
        self.policy = d.policy
        self.worker_id = d.worker_id
        self.tier = d.tier
        self.reason = d.reason
        self.predicted_cached_tokens = d.predicted_cached_tokens
        self.prompt_tokens = d.prompt_tokens
        self.expected_output_tokens = d.context.output_tokens
        self.candidates = d.candidates
        self.filtered = d.filtered
        self.warm_abandoned = d.warm_abandoned
        self.now = d.now
        self.affinity = d.affinity
        self.outcome = outcome


def render(entry: LogEntry) -> dict[str, Any]:
    """One decision-log record."""
    terms = None
    for c in entry.candidates:
        if c.worker_id == entry.worker_id:
            terms = c.terms
            break
    outcome = entry.outcome
    actual = outcome.actual_cached_tokens
    prompt = outcome.prompt_tokens
    out: dict[str, Any] = {
        # Decision.to_dict's fields, in its order.
        "request_id": entry.request_id,
        "namespace": entry.namespace,
        "prefix_key": entry.prefix_key,
        "prefix_class": entry.prefix_class,
        "policy": entry.policy,
        "selected_worker": entry.worker_id,
        "tier": entry.tier,
        "reason": entry.reason,
        "predicted_cached_tokens": entry.predicted_cached_tokens,
        "prompt_tokens": prompt,
        "expected_output_tokens": entry.expected_output_tokens,
        "candidate_workers": [c.to_dict() for c in entry.candidates],
        "filtered": dict(entry.filtered),
        "warm_abandoned": entry.warm_abandoned,
        "time": entry.now,
        # What happened.
        "model": outcome.model,
        "tenant": outcome.tenant,
        "decision": {"tier": entry.tier, "reason": entry.reason, "policy": entry.policy},
        "actual_cached_tokens": actual,
        "queue_wait_ms": round(terms.queue_wait_s * 1e3, 3) if terms is not None else None,
        "predicted_ttft_ms": round(terms.ttft_s * 1e3, 3) if terms is not None else None,
        "prefill_tokens": (prompt - actual) if prompt is not None and actual is not None else None,
        "estimated_prompt_tokens": entry.prompt_tokens,
        "ttft_ms": round(outcome.ttft_s * 1e3, 3) if outcome.ttft_s is not None else None,
        "latency_ms": round(outcome.latency_s * 1e3, 3),
        "status": outcome.status,
        "attempts": outcome.attempts,
        "retried_from": list(outcome.retried_from),
        "stream": outcome.stream,
        "error": outcome.error,
        "ts": round(outcome.ts, 6),
    }
    if entry.affinity:  # a session pin held ("hit") or why it broke
        out["affinity"] = entry.affinity
    if outcome.client_request_id is not None:  # the id the client and the access log have
        out["client_request_id"] = outcome.client_request_id
    return out


class DecisionLog:
    """Bounded in-memory ring plus an optional JSON-lines file.

    Args:
        path: File to append to (None: memory only).
        ring_size: Records kept for ``/admin/decisions``.
        flush_interval_s: How often the flusher writes pending records.
    """

    def __init__(self, path: Path | None, ring_size: int = 1000, flush_interval_s: float = 1.0):
        self.path = path
        self.flush_interval_s = flush_interval_s
        self._ring: deque[LogEntry] = deque(maxlen=ring_size)
        self._pending: list[LogEntry] = []
        self._file = (
            LogFile(path, "decision log", "decision_log.path", "records")
            if path is not None
            else None
        )
        self.recorded = 0
        """Records kept since start (the dashboard's count of decisions made)."""

    @property
    def written(self) -> int:
        """Records written to the file."""
        return self._file.written if self._file is not None else 0

    @property
    def dropped(self) -> int:
        """Records that could not be written to the file (module docstring)."""
        return self._file.dropped if self._file is not None else 0

    def open(self) -> None:
        """Open the file for append now (the gateway's startup); nothing without a path.

        Raises:
            ConfigError: It cannot be opened for append; the message names
                ``decision_log.path``, the path and why.
        """
        if self._file is not None:
            self._file.open()

    def record(self, decision: Decision, outcome: RequestOutcome) -> None:
        """Keep one finished request (cheap: no serialization here)."""
        entry = LogEntry(decision, outcome)
        self._ring.append(entry)
        self.recorded += 1
        if self._file is not None:
            if len(self._pending) < MAX_PENDING:
                self._pending.append(entry)
            else:
                self._file.dropped += 1

    def recent(self, limit: int) -> list[dict[str, Any]]:
        """The newest ``limit`` records, oldest first."""
        items = list(self._ring)[-limit:] if limit > 0 else []
        return [render(e) for e in items]

    def newest(self, count: int) -> list[LogEntry]:
        """The newest ``count`` entries the ring still holds, oldest first, unrendered."""
        ring = self._ring
        count = min(count, len(ring))
        if count <= 0:
            return []
        # islice over the reversed deque: O(count), not O(ring).
        out = list(islice(reversed(ring), count))
        out.reverse()
        return out

    def flush(self) -> int:
        """Write pending records to the file; returns how many.

        Never raises :class:`OSError`: a batch that cannot be written is
        dropped and counted (module docstring).
        """
        if not self._pending or self._file is None:
            return 0
        batch, self._pending = self._pending, []
        lines = []
        for e in batch:
            try:
                lines.append(orjson.dumps(render(e)) + b"\n")
            except (TypeError, orjson.JSONEncodeError):
                # One record that cannot be written (a string that is not
                # UTF-8) must not cost the others, nor stop the flusher.
                log.warning("decision log: dropped a record that is not JSON-serializable")
        return self._file.write(lines)

    async def run(self) -> None:
        """Flush every ``flush_interval_s`` until cancelled (then flush once more)."""
        try:
            while True:
                await asyncio.sleep(self.flush_interval_s)
                try:
                    self.flush()
                except Exception:  # a bug in one batch must not stop the flusher for good
                    log.exception("decision log: flush failed")
        finally:
            self.close()

    def close(self) -> None:
        """Flush and close the file; never raises (it runs on the shutdown path)."""
        try:
            self.flush()
        except Exception:  # the cleanup after it must run
            log.exception("decision log: flush failed")
        if self._file is not None:
            self._file.close()
