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
streamed); ``latency_ms`` from arrival to the end of the response; ``ts`` is
the wall-clock end time (Unix seconds), ``time`` the decision time on the
gateway's monotonic clock.

The hot path only appends ``(decision, outcome)`` to a bounded deque (and to a
pending list when a file is configured); turning it into JSON happens when
``/admin/decisions`` is read or when the background flusher writes the batch
(every ``flush_interval_s``), so a request pays for neither. Records are
complete only at the end of a request, so the file is in completion order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from prefixrouter.core.router import Decision


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
    """

    model: str
    tenant: str
    status: int
    actual_cached_tokens: int | None
    prompt_tokens: int | None
    ttft_s: float | None
    latency_s: float
    attempts: int
    retried_from: list[str]
    stream: bool
    error: str | None = None
    ts: float = 0.0


def render(decision: Decision, outcome: RequestOutcome) -> dict[str, Any]:
    """One decision-log record."""
    rec = decision.to_dict()
    chosen = decision.chosen
    terms = chosen.terms if chosen is not None else None
    actual = outcome.actual_cached_tokens
    prompt = outcome.prompt_tokens
    rec.update(
        model=outcome.model,
        tenant=outcome.tenant,
        decision={"tier": decision.tier, "reason": decision.reason, "policy": decision.policy},
        actual_cached_tokens=actual,
        queue_wait_ms=round(terms.queue_wait_s * 1e3, 3) if terms is not None else None,
        predicted_ttft_ms=round(terms.ttft_s * 1e3, 3) if terms is not None else None,
        prefill_tokens=(prompt - actual) if prompt is not None and actual is not None else None,
        estimated_prompt_tokens=decision.prompt_tokens,
        prompt_tokens=prompt,
        ttft_ms=round(outcome.ttft_s * 1e3, 3) if outcome.ttft_s is not None else None,
        latency_ms=round(outcome.latency_s * 1e3, 3),
        status=outcome.status,
        attempts=outcome.attempts,
        retried_from=outcome.retried_from,
        stream=outcome.stream,
        error=outcome.error,
        ts=round(outcome.ts, 6),
    )
    return rec


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
        self._ring: deque[tuple[Decision, RequestOutcome]] = deque(maxlen=ring_size)
        self._pending: list[tuple[Decision, RequestOutcome]] = []
        self._file: IO[bytes] | None = None
        self.written = 0

    def record(self, decision: Decision, outcome: RequestOutcome) -> None:
        """Keep one finished request (cheap: no serialization here)."""
        item = (decision, outcome)
        self._ring.append(item)
        if self.path is not None:
            self._pending.append(item)

    def recent(self, limit: int) -> list[dict[str, Any]]:
        """The newest ``limit`` records, oldest first."""
        items = list(self._ring)[-limit:] if limit > 0 else []
        return [render(d, o) for d, o in items]

    def flush(self) -> int:
        """Write pending records to the file; returns how many."""
        if not self._pending or self.path is None:
            return 0
        batch, self._pending = self._pending, []
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("ab")
        self._file.write(b"".join(orjson.dumps(render(d, o)) + b"\n" for d, o in batch))
        self._file.flush()
        self.written += len(batch)
        return len(batch)

    async def run(self) -> None:
        """Flush every ``flush_interval_s`` until cancelled (then flush once more)."""
        try:
            while True:
                await asyncio.sleep(self.flush_interval_s)
                self.flush()
        finally:
            self.close()

    def close(self) -> None:
        """Flush and close the file."""
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
