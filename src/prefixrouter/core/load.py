"""The in-flight ledger: what the router has sent each worker and not seen finish.

Engines report queue length and KV usage only every few seconds (metric
polls), and each router replica sees only its own traffic, so the router keeps
its own count of the work it sent: prefill tokens still to compute, requests
decoding, expected decode tokens and context held. The gateway and the
simulator update it with the same three calls (routed, first token,
completed) and copy its figures into :class:`~prefixrouter.core.types.WorkerView`.

A prefill in progress: the pending tokens fall only when a request's first
token comes, though the engine has been working on the head of its prefill
queue since it got there. The ledger keeps when that head started (the
routing that found nothing pending, or the first token that ended the
prefill ahead of it) and reports the time since as ``prefill_elapsed_s``
(read by ``prefix_aware``'s prefill-in-progress rule). It also keeps when
it last sent each worker a request and reports the time since as
``since_routed_s`` (read by ``prefix_aware``'s picker for one-off requests).
Times are the caller's clock, passed in.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prefixrouter.core.types import RequestId, WorkerId, WorkerView


@dataclass(slots=True)
class _InFlight:
    worker: WorkerId
    uncached_tokens: int
    prompt_tokens: int
    output_tokens: int
    decoding: bool = False

    @property
    def own_tokens(self) -> int:
        """The KV this request's end frees (``WorkerLoad.decoding_own_tokens``)."""
        if 2 * self.uncached_tokens > self.prompt_tokens:
            return self.output_tokens  # it brought its prompt: readers may share it
        return self.uncached_tokens + self.output_tokens


@dataclass(slots=True)
class WorkerLoad:
    """Aggregates of one worker's in-flight requests."""

    in_flight: int = 0
    pending_prefill_tokens: int = 0
    decoding: int = 0
    decode_tokens_remaining: int = 0
    context_tokens: int = 0
    queued_prompt_tokens: int = 0
    # The decoding requests' own KV: what their ends free; a prefix they
    # share stays held until the last of them ends. A request that reused
    # most of its prompt owns its uncached tail and its output. One that
    # prefilled most of its prompt itself owns only its output: it is how a
    # shared prefix (a document, a session's history) enters the cache, and
    # while the prefix's readers run its end frees none of it. The ledger
    # cannot see which prompts will be reused, so every such prompt counts
    # as shared. Counting it whole, the first question of each 40,000-token
    # document made 2,500 of a worker's 3,450 "own" blocks (simulated doc-qa
    # past capacity), and the wait it predicted for memory was 1.7 s where
    # the queue waited 4-8 s.
    decoding_own_tokens: int = 0
    # When the engine started on the head of the pending prefill (module
    # doc); meaningful only while pending_prefill_tokens > 0.
    prefill_since: float = 0.0
    # When the router last sent this worker a request (-inf: never).
    last_routed: float = -math.inf
    requests: set[RequestId] = field(default_factory=set)


class InflightLedger:
    """Per-worker load from the router's own bookkeeping."""

    def __init__(self) -> None:
        self._requests: dict[RequestId, _InFlight] = {}
        self._loads: dict[WorkerId, WorkerLoad] = {}

    def load(self, worker: WorkerId) -> WorkerLoad:
        """The worker's current aggregates (a live object; do not mutate)."""
        load = self._loads.get(worker)
        if load is None:
            load = self._loads[worker] = WorkerLoad()
        return load

    def worker_of(self, request_id: RequestId) -> WorkerId | None:
        """Where an in-flight request was sent, if it is in flight."""
        item = self._requests.get(request_id)
        return item.worker if item is not None else None

    def on_routed(
        self,
        request_id: RequestId,
        worker: WorkerId,
        uncached_tokens: int,
        prompt_tokens: int,
        output_tokens: int,
        now: float,
    ) -> None:
        """The request was sent to ``worker`` at ``now``; its uncached prefill is queued there."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already in flight")
        item = _InFlight(worker, uncached_tokens, prompt_tokens, output_tokens)
        self._requests[request_id] = item
        load = self.load(worker)
        if load.pending_prefill_tokens <= 0:
            load.prefill_since = now  # nothing ahead of it: the engine starts on it now
        load.last_routed = now
        load.in_flight += 1
        load.pending_prefill_tokens += uncached_tokens
        load.queued_prompt_tokens += prompt_tokens
        load.requests.add(request_id)

    def first_token_seen(self, request_id: RequestId) -> bool:
        """Whether the in-flight request has had its first token (its prefill is done)."""
        item = self._requests.get(request_id)
        return item is not None and item.decoding

    def on_first_token(self, request_id: RequestId, now: float) -> None:
        """Prefill is done at ``now``; the request now decodes and holds its context."""
        item = self._requests.get(request_id)
        if item is None or item.decoding:
            return
        item.decoding = True
        load = self.load(item.worker)
        if item.uncached_tokens > 0:
            # A prefill ended: the engine moves on to the next in line (a
            # fully cached request's first token says nothing of the queue).
            load.prefill_since = now
        load.pending_prefill_tokens -= item.uncached_tokens
        load.queued_prompt_tokens -= item.prompt_tokens
        load.decoding += 1
        load.decode_tokens_remaining += item.output_tokens
        load.context_tokens += item.prompt_tokens
        load.decoding_own_tokens += item.own_tokens

    def on_completed(self, request_id: RequestId) -> None:
        """The request finished, failed or was cancelled: it no longer loads its worker."""
        item = self._requests.pop(request_id, None)
        if item is None:
            return
        load = self.load(item.worker)
        load.in_flight -= 1
        load.requests.discard(request_id)
        if item.decoding:
            load.decoding -= 1
            load.decode_tokens_remaining -= item.output_tokens
            load.context_tokens -= item.prompt_tokens
            load.decoding_own_tokens -= item.own_tokens
        else:
            load.pending_prefill_tokens -= item.uncached_tokens
            load.queued_prompt_tokens -= item.prompt_tokens

    def fill(self, view: WorkerView, now: float) -> WorkerView:
        """Copy this worker's aggregates at ``now`` into ``view`` (in place) and return it."""
        load = self.load(view.worker_id)
        view.in_flight = load.in_flight
        pending = load.pending_prefill_tokens
        view.pending_prefill_tokens = pending
        elapsed = now - load.prefill_since
        view.prefill_elapsed_s = elapsed if pending > 0 and elapsed > 0.0 else 0.0
        since = now - load.last_routed
        view.since_routed_s = since if since > 0.0 else 0.0  # a clock behind: not negative
        view.decoding = load.decoding
        view.decode_tokens_remaining = load.decode_tokens_remaining
        view.context_tokens = load.context_tokens
        view.queued_prompt_tokens = load.queued_prompt_tokens
        view.decoding_own_tokens = load.decoding_own_tokens
        return view

    def drop_worker(self, worker: WorkerId) -> list[RequestId]:
        """Forget a worker's in-flight requests (it died); returns their ids."""
        load = self._loads.pop(worker, None)
        if load is None:
            return []
        for rid in load.requests:
            self._requests.pop(rid, None)
        return sorted(load.requests)
