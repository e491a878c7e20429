"""The real-time driver of one :class:`~prefixrouter.sim.engine.EngineModel`.

The engine model reads no clock: it is told ``now`` and says when it next needs
to be advanced. This module runs it on the wall clock of an asyncio loop.

Time mapping: simulated seconds = wall seconds since start x ``time_scale``.
With ``time_scale = 10`` a prefill the profile prices at 0.5 s takes 50 ms.

Driving: instead of a task that loops, one loop timer (``call_later``) is armed
for the engine's :meth:`~EngineModel.next_wakeup`. When it fires the driver
calls :meth:`~EngineModel.advance` with the current simulated time (so a late
timer still processes every step that ended meanwhile, at its own simulated
time), resolves the requests' futures, and re-arms. A :meth:`EngineRuntime.submit`
first advances the engine to now (the model's protocol), submits, and re-arms
only if the engine's ``epoch`` changed, i.e. its planned wakeup moved.

Per request, a :class:`RequestHandle` carries two futures: ``first`` (the
engine's :class:`FirstToken`: cached tokens, queue wait) and ``done`` (its
:class:`Completed`). The engine coalesces decode steps, so it has no event per
output token; streaming handlers pace the tokens between the two with
:meth:`EngineRuntime.token_interval` (see ``app.py``).

Cancellation: :meth:`EngineRuntime.cancel` (the HTTP handler calls it when its
client disconnects) forgets the handle and aborts the request in the engine
model, as vLLM aborts a disconnected client's request: it advances the engine
to now (outputs that came due are delivered first), calls
:meth:`~EngineModel.abort` and re-arms the timer, like :meth:`EngineRuntime.submit`.
A waiting request leaves the queue at once; a running one leaves the batch at
the end of the engine step in flight, freeing its slot and its KV (its computed
prompt blocks stay cached), so ``vllm:num_requests_running`` and the KV usage
drop within one step. The aborted request gets no further outputs: metrics
count the prefill it finished before the abort (the engine did that work), not
its partial generation, nor a success. Cancelling a request that already
completed does nothing (its handle is gone).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prefixrouter.core.events import KvEvent
from prefixrouter.core.types import BlockHash
from prefixrouter.sim.engine import (
    Completed,
    EngineModel,
    EngineOutput,
    EngineRequest,
    FirstToken,
    KvEventOut,
)


@dataclass(slots=True, eq=False)
class RequestHandle:
    """One request in flight on the engine.

    Attributes:
        request_id: Engine request id.
        prompt_tokens: Prompt length.
        output_tokens: Tokens to generate.
        submitted: Wall time (runtime clock) of the submit.
        arrival: Simulated time of the submit (the engine's clock).
        first: Resolves to the engine's :class:`FirstToken`.
        done: Resolves to the engine's :class:`Completed`.
        first_at: Wall time the first token was delivered (0 before).
    """

    request_id: str
    prompt_tokens: int
    output_tokens: int
    submitted: float
    arrival: float
    first: asyncio.Future[FirstToken] = field(repr=False)
    done: asyncio.Future[Completed] = field(repr=False)
    first_at: float = 0.0


class RuntimeObserver(Protocol):
    """Told about every engine output (metrics); ``handle`` is None if cancelled."""

    def first_token(self, out: FirstToken, handle: RequestHandle | None, wall: float) -> None:
        """A request's first token came out at wall time ``wall``."""

    def completed(self, out: Completed, handle: RequestHandle | None, wall: float) -> None:
        """A request finished at wall time ``wall``."""


class EngineRuntime:
    """Runs an :class:`EngineModel` in real time on the running asyncio loop.

    Args:
        engine: The engine model (fresh: its clock starts at 0 with the runtime).
        time_scale: Simulated seconds per wall second.
        observer: Gets every first token and completion (e.g. metrics).
        clock: Wall clock in seconds (monotonic); injectable for tests.
    """

    def __init__(
        self,
        engine: EngineModel,
        time_scale: float = 1.0,
        observer: RuntimeObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        self.engine = engine
        self.time_scale = time_scale
        self.observer = observer
        self._clock = clock
        self._t0 = clock()
        self._handles: dict[str, RequestHandle] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._armed_epoch = -1
        self._ids = itertools.count()
        self._closed = False
        self.on_kv_events: Callable[[list[KvEvent]], None] | None = None
        """Gets each step's KV events (the engine model must emit them)."""

    # ---------------------------------------------------------------- clock

    def wall(self) -> float:
        """The runtime's wall clock (seconds, monotonic)."""
        return self._clock()

    def sim_now(self) -> float:
        """The engine's current simulated time."""
        return (self._clock() - self._t0) * self.time_scale

    def set_time_scale(self, time_scale: float) -> None:
        """Run at ``time_scale`` from now on (a slowed engine, fault injection).

        Simulated time stays continuous: the origin moves so that ``sim_now``
        is the same just before and after, and the timer is re-armed for the
        engine's next wakeup at the new speed.
        """
        if not time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        now = self.sim_now()
        self.time_scale = time_scale
        self._t0 = self._clock() - now / time_scale
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._closed:
            self._arm()

    # ---------------------------------------------------------------- queries

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet completed or cancelled."""
        return len(self._handles)

    def token_interval(self) -> float:
        """Wall seconds one decode step takes now (an estimate for pacing streams).

        The profile's decode step time for the current batch and context; a
        step that also prefills is longer, so streams may run ahead of the
        engine, which is why a stream's last token waits for the completion.
        """
        eng = self.engine
        step = eng.profile.speed.decode_step_time(
            max(1, eng.num_decoding), eng.decode_context_tokens
        )
        return float(step) / self.time_scale

    # ---------------------------------------------------------------- driving

    def submit(
        self, block_hashes: Sequence[BlockHash], prompt_tokens: int, output_tokens: int
    ) -> RequestHandle:
        """Enqueue a request now.

        Args:
            block_hashes: Chained hashes of the prompt's whole blocks.
            prompt_tokens: Prompt length in tokens.
            output_tokens: Tokens to generate (at least 1).

        Returns:
            The handle whose futures resolve at first token and at completion.

        Raises:
            ValueError: If the engine rejects the request (too long for the KV cache).
            RuntimeError: If the runtime was stopped.
        """
        if self._closed:
            raise RuntimeError("the engine runtime is stopped")
        loop = asyncio.get_running_loop()
        wall = self._clock()
        now = (wall - self._t0) * self.time_scale
        self._advance(now)
        rid = f"r{next(self._ids)}"
        self.engine.submit(
            EngineRequest(rid, tuple(block_hashes), prompt_tokens, output_tokens, now), now
        )
        handle = RequestHandle(
            rid,
            prompt_tokens,
            output_tokens,
            wall,
            now,
            loop.create_future(),
            loop.create_future(),
        )
        self._handles[rid] = handle
        self._arm()
        return handle

    def cancel(self, request_id: str) -> None:
        """Forget a request and abort it in the engine (see the module docstring).

        A no-op for a request that completed (or was cancelled) already. Its
        futures are left pending: the only waiter, the handler, is leaving.
        """
        if self._handles.pop(request_id, None) is None or self._closed:
            return
        now = self.sim_now()
        # Advance first (the model's protocol): a step that ended before now
        # still delivers its outputs, and the abort lands in the step in flight.
        self._advance(now)
        self.engine.abort(request_id, now)
        self._arm()

    def reset_cache(self) -> None:
        """Drop the engine's prefix cache (vLLM's ``/reset_prefix_cache``)."""
        now = self.sim_now()
        self._advance(now)
        self._emit(self.engine.reset_cache(now))
        self._arm()

    def stop(self) -> None:
        """Stop the timer and cancel every pending future (server shutdown)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for handle in self._handles.values():
            handle.first.cancel()
            handle.done.cancel()
        self._handles.clear()

    # --------------------------------------------------------------- internals

    def _arm(self) -> None:
        """(Re)arm the loop timer for the engine's next wakeup if it moved."""
        eng = self.engine
        if self._timer is not None:
            if self._armed_epoch == eng.epoch:
                return
            self._timer.cancel()
            self._timer = None
        wake = eng.next_wakeup()
        if wake is None or self._closed:
            return
        self._armed_epoch = eng.epoch
        delay = self._t0 + wake / self.time_scale - self._clock()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(max(0.0, delay), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._advance(self.sim_now())
        self._arm()

    def _advance(self, now: float) -> None:
        outputs = self.engine.advance(now)
        if not outputs:
            return
        wall = self._clock()
        handles = self._handles
        observer = self.observer
        for out in outputs:
            if isinstance(out, FirstToken):
                handle = handles.get(out.request_id)
                if observer is not None:
                    observer.first_token(out, handle, wall)
                if handle is not None and not handle.first.done():
                    handle.first_at = wall
                    handle.first.set_result(out)
            elif isinstance(out, Completed):
                handle = handles.pop(out.request_id, None)
                if observer is not None:
                    observer.completed(out, handle, wall)
                if handle is not None and not handle.done.done():
                    handle.done.set_result(out)
        self._emit(outputs)

    def _emit(self, outputs: Sequence[EngineOutput]) -> None:
        """Hand the outputs' KV events, if any, to :attr:`on_kv_events` as one batch."""
        if self.on_kv_events is None:
            return
        events = [out.event for out in outputs if isinstance(out, KvEventOut)]
        if events:
            self.on_kv_events(events)
