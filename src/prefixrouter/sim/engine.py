"""A model of one inference engine: continuous batching with chunked prefill.

:class:`EngineModel` reproduces what a vLLM v1 engine does with a stream of
requests, closely enough that a router's decisions have the same consequences:
which prompt tokens are served from the prefix cache, how long a request queues,
when its first token and its last token come, what gets evicted.

It has no event loop and reads no clock: the driver passes ``now`` to every
call. The discrete-event simulator jumps from wakeup to wakeup; a live engine
server sleeps until :meth:`EngineModel.next_wakeup` on the wall clock. Protocol::

    engine.submit(request, now)       # any time; then re-read next_wakeup()
    engine.abort(request_id, now)     # any time (a client left); then re-read next_wakeup()
    t = engine.next_wakeup()          # None: idle
    outputs = engine.advance(t)       # at (or after) t; then re-read next_wakeup()

``epoch`` increases whenever the planned wakeup changes, so a driver that keeps
wakeups in a heap can drop stale ones.

Scheduling, once per engine step (vLLM v1 order):

1. every running decode takes one token of the step's budget
   (``max_batched_tokens``);
2. running requests still prefilling take chunks of the remaining budget, in
   admission order;
3. waiting requests are admitted first come, first served while the budget is
   not spent, ``max_num_seqs`` allows and the KV cache can reserve their blocks;
   an admitted request's uncached prompt starts with a chunk of what is left.
   A request that does not fit in KV blocks the queue (head of line).

KV policy: admission reserves blocks for ``prompt + output_tokens`` tokens, so a
running request never runs out of memory and nothing is ever preempted. vLLM
allocates decode blocks lazily and preempts under pressure; reserving is the
conservative choice (fewer requests run at once when memory is short) and keeps
the model simple and exact. Full prompt blocks are registered in the prefix
cache as their chunk is scheduled (vLLM does the same), so a later request
reuses only computed blocks; the ``BlockStored`` events go out when that step
ends, one per chunk.

Step time, from the profile's :class:`~prefixrouter.core.types.SpeedProfile`::

    sum(prefill_time(chunk, context_before_chunk)) - (chunks - 1) * prefill_overhead_s
    + decode_step_time(decodes, context of the decodes)      # if any decodes

A request whose prefill ends in a step gets its first token (output token 1)
at the step's end; each later step adds one token; when it has
``output_tokens`` tokens it completes and its KV is freed (cached prompt blocks
stay in the prefix cache, evictable).

Decode coalescing: simulating every decode step as a Python event would cost
thousands of events per request. When every running request is decoding and
nothing waiting can be admitted, nothing changes until the next completion, so
the engine plans one *segment* of ``k`` steps up to it. Each step grows every
sequence by one token, so step ``i`` (from 0) lasts ``A + B i`` with
``A = decode_step_time(b, C0)`` and ``B = decode_s_per_context_token x b``, and
the segment ends after ``k A + B k (k - 1) / 2``. A :meth:`EngineModel.submit`
during a segment that could be admitted truncates it at the first step boundary
at or after ``now`` (solving the quadratic for that boundary): exactly where
the step-by-step engine would have admitted it. ``coalesce_decodes=False`` turns
this off (the reference the tests compare with).

Token accounting is O(1) per step: every decoding sequence gains one token per
step, so a sequence stores the engine's step counter when it started decoding,
and completions come out of a heap keyed by the step count at which they finish.

Aborts (vLLM aborts a request whose client disconnected): the engine core takes
aborts between steps, so :meth:`EngineModel.abort` acts at the boundary a
step-by-step engine would. A waiting request has no step and simply leaves the
queue at once. An admitted one (prefilling or decoding) is part of the step in
flight, which runs as planned (its duration already counts that request); at the
step's end the request leaves the batch with no further output (no
``FirstToken``, no ``Completed``, even if that step would have produced one) and
its KV is freed as a finished request's is: its computed prompt blocks stay in
the prefix cache, evictable, and that step's ``BlockStored`` events still go
out. A decode segment in flight is truncated at the first step boundary after
the abort, the way a submit truncates it, because the stepping engine would
plan the next step there with one sequence fewer; aborting the queue's head
does the same, since its successor may be admitted (or the KV wait end) at that
boundary. Nothing of this runs unless something is aborted.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from prefixrouter.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from prefixrouter.core.types import BlockHash, WorkerId
from prefixrouter.sim.kv_cache import EvictionStats, KvCache
from prefixrouter.sim.profiles import EngineProfile


@dataclass(slots=True)
class EngineRequest:
    """One request as the engine sees it.

    Attributes:
        request_id: Unique id.
        block_hashes: Chained hashes of the prompt's full blocks (engine block size).
        prompt_tokens: Prompt length in tokens.
        output_tokens: Tokens to generate (at least 1).
        arrival: When the request arrived (queue wait is measured from it).
    """

    request_id: str
    block_hashes: tuple[BlockHash, ...]
    prompt_tokens: int
    output_tokens: int
    arrival: float


@dataclass(frozen=True, slots=True)
class FirstToken:
    """A request's first output token.

    Attributes:
        request_id: The request.
        time: When the token came out.
        cached_tokens: Prompt tokens served from the prefix cache.
        prompt_tokens: Prompt length.
        queue_wait_s: From arrival to admission (KV reserved, first chunk scheduled).
        kv_wait_s: The part of ``queue_wait_s`` during which admission was blocked
            because the KV cache could not hold the head of the queue.
    """

    request_id: str
    time: float
    cached_tokens: int
    prompt_tokens: int
    queue_wait_s: float
    kv_wait_s: float


@dataclass(frozen=True, slots=True)
class Completed:
    """A request finished generating."""

    request_id: str
    time: float
    output_tokens: int


@dataclass(frozen=True, slots=True)
class KvEventOut:
    """A KV cache event of this worker (only with ``emit_events``)."""

    time: float
    event: KvEvent


EngineOutput = FirstToken | Completed | KvEventOut


@dataclass(slots=True)
class _Seq:
    req: EngineRequest
    seqno: int  # admission tie-breaker in the completion heap
    kv_clock_at_submit: float
    computed: int = 0  # prompt tokens whose KV exists (cached ones included)
    cached: int = 0
    kv_wait: float = 0.0
    queue_wait: float = 0.0
    aborted: bool = False  # leaves the batch at the end of the step in flight


@dataclass(slots=True)
class _Step:
    """The step (or coalesced decode segment) in flight."""

    start: float
    end: float
    k: int  # engine steps it stands for (> 1 only for a decode segment)
    chunks: list[tuple[_Seq, int]]
    first_step_s: float = 0.0  # A: first decode step of a segment
    growth_s: float = 0.0  # B: each later step is this much longer
    stored: list[BlockStored] = field(default_factory=list)

    def offset(self, j: int) -> float:
        """Seconds from the start to the end of decode step ``j`` (1-based)."""
        return j * self.first_step_s + self.growth_s * j * (j - 1) / 2.0


class EngineModel:
    """A simulated engine for one worker (see the module docstring).

    Args:
        worker_id: Id used in KV events.
        profile: Speed, KV size and scheduler limits.
        kv_blocks: Override the profile's KV capacity (blocks).
        emit_events: Emit :class:`KvEventOut` outputs.
        coalesce_decodes: Plan pure-decode stretches as one segment (default);
            False simulates every step (reference behaviour, slow).
    """

    def __init__(
        self,
        worker_id: WorkerId,
        profile: EngineProfile,
        kv_blocks: int | None = None,
        emit_events: bool = False,
        *,
        coalesce_decodes: bool = True,
    ) -> None:
        self.worker_id = worker_id
        self.profile = profile
        self.emit_events = emit_events
        self.coalesce_decodes = coalesce_decodes
        self.kv = KvCache(
            kv_blocks if kv_blocks is not None else profile.kv_blocks, profile.block_size
        )
        self._speed = profile.speed
        self._block_size = profile.block_size
        self._max_seqs = profile.max_num_seqs
        self._budget = profile.max_batched_tokens

        self._waiting: deque[_Seq] = deque()
        self._waiting_prompt_tokens = 0
        self._prefilling: list[_Seq] = []
        # Decoding sequences: (finish step count, seqno, seq). A sequence that got
        # its first token when the step counter was S finishes at S + output - 1.
        self._finish_heap: list[tuple[int, int, _Seq]] = []
        self._n_dec = 0
        # sum over decoding seqs of (prompt + 1 - S): context = this + n_dec * steps.
        self._dec_base = 0
        self._steps = 0
        self._seqno = 0

        # Admitted sequences aborted during the step in flight (removed at its end).
        self._aborting: list[_Seq] = []

        self._step: _Step | None = None
        self._wakeup: float | None = None
        self.epoch = 0
        """Increases whenever :meth:`next_wakeup` changes."""

        # KV-blocked clock: advances only while admission is blocked by KV.
        self._kv_acc = 0.0
        self._kv_since: float | None = None

        self.busy_time = 0.0
        """Sum of step durations (seconds the engine computed)."""
        self.step_count = 0
        """Engine steps simulated (a coalesced segment counts its steps)."""
        self.segments = 0
        """Steps and segments planned: the model's own cost, in events."""
        self.prefill_tokens_computed = 0
        self.cached_tokens_total = 0
        self.kv_wait_total = 0.0
        self.completed = 0
        self.aborted = 0
        """Requests removed by :meth:`abort` (waiting ones at once, admitted ones at
        the end of the step in flight)."""

    # ---------------------------------------------------------------- queries

    def next_wakeup(self) -> float | None:
        """When :meth:`advance` must next be called; None when idle."""
        return self._wakeup

    @property
    def num_running(self) -> int:
        """Admitted requests (prefilling or decoding)."""
        return len(self._prefilling) + self._n_dec

    @property
    def num_waiting(self) -> int:
        """Requests not admitted yet."""
        return len(self._waiting)

    @property
    def num_decoding(self) -> int:
        """Requests past their first token."""
        return self._n_dec

    @property
    def waiting_prompt_tokens(self) -> int:
        """Prompt tokens of the waiting requests (cache hits not known yet)."""
        return self._waiting_prompt_tokens

    @property
    def prefill_tokens_remaining(self) -> int:
        """Uncomputed prompt tokens of admitted requests."""
        return sum(s.req.prompt_tokens - s.computed for s in self._prefilling)

    @property
    def decode_context_tokens(self) -> int:
        """Context tokens the running decodes attend to."""
        return self._dec_base + self._n_dec * self._steps

    @property
    def kv_used_blocks(self) -> int:
        """KV blocks held by running requests."""
        return self.kv.used_blocks

    @property
    def kv_capacity_blocks(self) -> int:
        """KV cache size in blocks."""
        return self.kv.num_blocks

    @property
    def evictions(self) -> int:
        """Blocks evicted from the prefix cache."""
        return self.kv.evictions

    @property
    def eviction_ages(self) -> EvictionStats:
        """Ages of evicted blocks (count, mean, max, log2 histogram)."""
        return self.kv.eviction_stats

    # ---------------------------------------------------------------- driving

    def submit(self, request: EngineRequest, now: float) -> None:
        """Enqueue a request at ``now``; re-read :meth:`next_wakeup` afterwards.

        Call :meth:`advance` up to ``now`` first: a submit at a step boundary that
        was not yet processed joins that boundary's scheduling.

        Raises:
            ValueError: If the request is malformed or could never fit in the KV
                cache (vLLM rejects such requests at its API, via max_model_len).
        """
        prompt = request.prompt_tokens
        if request.output_tokens < 1 or prompt < 1:
            raise ValueError(f"request {request.request_id}: needs prompt and output tokens")
        if len(request.block_hashes) * self._block_size > prompt:
            raise ValueError(f"request {request.request_id}: more block hashes than prompt")
        if self.kv.blocks_needed(prompt + request.output_tokens) > self.kv.num_blocks:
            raise ValueError(
                f"request {request.request_id}: {prompt}+{request.output_tokens} tokens "
                f"exceed the KV cache ({self.kv.num_blocks} blocks)"
            )
        seq = _Seq(request, self._seqno, self._kv_clock(now))
        self._seqno += 1
        queue_was_empty = not self._waiting
        self._waiting.append(seq)
        self._waiting_prompt_tokens += prompt

        step = self._step
        if step is None:
            if self._wakeup is None:  # idle: schedule right away
                self._set_wakeup(now)
            return
        if not queue_was_empty or step.k == 1:
            # A single step ends at the next scheduling point anyway; behind a
            # blocked head, FCFS keeps this request waiting too.
            return
        # A decode segment is in flight: its step boundaries are where a
        # step-by-step engine would try to admit the request.
        j = self._first_boundary_at_or_after(step, now)
        if self.num_running >= self._max_seqs:
            return  # no slot until a completion, which ends the segment anyway
        if not self.kv.can_allocate(request.block_hashes, prompt, prompt + request.output_tokens):
            # The stepping engine would find the head KV-blocked from boundary j;
            # nothing frees memory before the segment ends, so don't split it.
            if self._kv_since is None:
                self._kv_since = step.start + step.offset(j)
            return
        if j < step.k:
            step.k = j
            step.end = step.start + step.offset(j)
            self._set_wakeup(step.end)

    def abort(self, request_id: str, now: float) -> bool:
        """Abort a request at ``now``, as vLLM does when its client disconnects.

        Call :meth:`advance` up to ``now`` first (as for :meth:`submit`), so that
        the step in flight is the one running at ``now``; re-read
        :meth:`next_wakeup` afterwards.

        A waiting request leaves the queue at once. An admitted one (prefilling or
        decoding) leaves the batch at the end of the step in flight: it gets no
        more outputs, its KV is freed as a finished request's (computed prompt
        blocks stay cached, evictable) and the running counts drop then. A
        coalesced decode segment is cut at the first step boundary after ``now``
        so that it ends where the step-by-step engine's step would (see the
        module docstring).

        Looking a request up is linear in the queue and the batch: aborts are
        rare, and an index would cost every request a dict entry.

        Returns:
            True if the request was waiting or running and is aborted now; False
            for an unknown, finished or already aborted id (nothing changes).
        """
        waiting = self._waiting
        for i, seq in enumerate(waiting):
            if seq.req.request_id == request_id:
                del waiting[i]
                self._waiting_prompt_tokens -= seq.req.prompt_tokens
                seq.aborted = True
                self.aborted += 1
                step = self._step
                if i == 0 and step is not None and step.k > 1:
                    # The head was held back (no slot, or KV): at the next boundary
                    # the stepping engine tries its successor, or ends the KV wait.
                    self._truncate_after(step, now)
                return True

        found: _Seq | None = None
        for seq in self._prefilling:
            if seq.req.request_id == request_id:
                found = seq
                break
        else:
            for _, _, seq in self._finish_heap:
                if seq.req.request_id == request_id:
                    found = seq
                    break
        if found is None or found.aborted:
            return False
        found.aborted = True
        self._aborting.append(found)
        step = self._step
        assert step is not None, "an admitted request runs in the step in flight"
        if step.k > 1:
            self._truncate_after(step, now)
        return True

    def advance(self, now: float) -> list[EngineOutput]:
        """Finish every step ending at or before ``now`` and start the next ones.

        Returns:
            The outputs, in time order.
        """
        out: list[EngineOutput] = []
        while self._wakeup is not None and self._wakeup <= now:
            t = self._wakeup
            if self._step is not None:
                self._finish(self._step, out)
            self._plan(t, out)
        return out

    def reset_cache(self, now: float) -> list[EngineOutput]:
        """Drop the whole prefix cache (vLLM's ``/reset_prefix_cache``).

        Running requests keep their memory; nothing cached can be reused.

        Returns:
            ``AllBlocksCleared`` if events are on.
        """
        self.kv.clear()
        if self._step is not None:
            self._step.stored = []  # those blocks are no longer cached
        if not self.emit_events:
            return []
        return [KvEventOut(now, AllBlocksCleared(self.worker_id))]

    # --------------------------------------------------------------- internals

    def _set_wakeup(self, t: float | None) -> None:
        if t != self._wakeup:
            self._wakeup = t
            self.epoch += 1

    def _kv_clock(self, t: float) -> float:
        since = self._kv_since
        if since is None or t <= since:
            return self._kv_acc
        return self._kv_acc + (t - since)

    @staticmethod
    def _first_boundary_at_or_after(step: _Step, now: float) -> int:
        """Smallest ``j`` in ``[1, k]`` whose step ends at or after ``now``."""
        d = now - step.start
        k = step.k
        a, b = step.first_step_s, step.growth_s
        if d <= a:
            return 1
        if b > 0.0:
            lin = a - b / 2.0
            j = math.ceil((-lin + math.sqrt(lin * lin + 2.0 * b * d)) / b)
        elif a > 0.0:
            j = math.ceil(d / a)
        else:  # zero-cost steps (a degenerate profile): the segment ends at its start
            return k
        j = min(max(j, 1), k)
        # The closed form can be off by one in floating point; settle it exactly.
        while j > 1 and step.offset(j - 1) >= d:
            j -= 1
        while j < k and step.offset(j) < d:
            j += 1
        return j

    def _truncate_after(self, step: _Step, now: float) -> None:
        """End a decode segment at the first step boundary after ``now``.

        A boundary exactly at ``now`` is past: the stepping engine, advanced to
        ``now``, has already planned the step after it.
        """
        j = self._first_boundary_at_or_after(step, now)
        if j < step.k and step.offset(j) <= now - step.start:
            j += 1
        if j < step.k:
            step.k = j
            step.end = step.start + step.offset(j)
            self._set_wakeup(step.end)

    def _detach_aborted(self) -> None:
        """Take the aborted sequences out of the batch, correcting the decode sums.

        Runs at the end of the step in flight, after its prefill chunks are
        accounted (an aborted sequence whose prefill ended there was neither
        given a first token nor entered in the decode heap).
        """
        self._prefilling = [s for s in self._prefilling if not s.aborted]
        heap = self._finish_heap
        kept: list[tuple[int, int, _Seq]] = []
        for entry in heap:
            finish, _, seq = entry
            if not seq.aborted:
                kept.append(entry)
                continue
            req = seq.req
            self._n_dec -= 1
            # It started decoding at step count finish - output + 1 (see _finish).
            self._dec_base -= req.prompt_tokens + 1 - (finish - req.output_tokens + 1)
        if len(kept) < len(heap):
            heapq.heapify(kept)
            self._finish_heap = kept

    def _finish(self, step: _Step, out: list[EngineOutput]) -> None:
        t = step.end
        self.busy_time += t - step.start
        self._steps += step.k
        self.step_count += step.k
        steps = self._steps
        kv = self.kv

        if step.stored:
            out.extend(KvEventOut(t, ev) for ev in step.stored)

        if step.chunks:
            heap = self._finish_heap
            for seq, n in step.chunks:
                self.prefill_tokens_computed += n
                seq.computed += n
                req = seq.req
                if seq.computed < req.prompt_tokens or seq.aborted:
                    continue
                out.append(
                    FirstToken(
                        req.request_id,
                        t,
                        seq.cached,
                        req.prompt_tokens,
                        seq.queue_wait,
                        seq.kv_wait,
                    )
                )
                if req.output_tokens == 1:
                    out.append(Completed(req.request_id, t, 1))
                    kv.free(req.request_id, t)
                    self.completed += 1
                else:
                    # It decodes from the next step on: token g+1 at step count S + g.
                    heapq.heappush(heap, (steps + req.output_tokens - 1, seq.seqno, seq))
                    self._n_dec += 1
                    self._dec_base += req.prompt_tokens + 1 - steps
            self._prefilling = [s for s in self._prefilling if s.computed < s.req.prompt_tokens]

        aborting = self._aborting
        if aborting:
            self._detach_aborted()

        heap = self._finish_heap
        while heap and heap[0][0] <= steps:
            finish, _, seq = heapq.heappop(heap)
            req = seq.req
            self._n_dec -= 1
            self._dec_base -= req.prompt_tokens + 1 - (finish - req.output_tokens + 1)
            out.append(Completed(req.request_id, t, req.output_tokens))
            kv.free(req.request_id, t)
            self.completed += 1

        if aborting:
            # Freed after the finished ones, as vLLM frees a step's finished
            # requests before it handles the aborts that came in meanwhile.
            for seq in aborting:
                kv.free(seq.req.request_id, t)
            self.aborted += len(aborting)
            self._aborting = []

    def _plan(self, t: float, out: list[EngineOutput]) -> None:
        speed = self._speed
        n_dec = self._n_dec
        budget = self._budget - n_dec
        chunks: list[tuple[_Seq, int]] = []
        for seq in self._prefilling:
            if budget <= 0:
                break
            n = min(seq.req.prompt_tokens - seq.computed, budget)
            chunks.append((seq, n))
            budget -= n

        waiting = self._waiting
        kv = self.kv
        blocked = False
        while waiting and budget > 0 and len(self._prefilling) + n_dec < self._max_seqs:
            seq = waiting[0]
            req = seq.req
            alloc = kv.allocate(
                req.request_id,
                req.block_hashes,
                req.prompt_tokens,
                req.prompt_tokens + req.output_tokens,
                t,
                register=False,
            )
            if alloc is None:
                blocked = True
                break
            waiting.popleft()
            self._waiting_prompt_tokens -= req.prompt_tokens
            seq.cached = seq.computed = alloc.cached_blocks * self._block_size
            seq.queue_wait = t - req.arrival
            seq.kv_wait = self._kv_clock(t) - seq.kv_clock_at_submit
            self.cached_tokens_total += seq.cached
            self.kv_wait_total += seq.kv_wait
            if alloc.evicted and self.emit_events:
                removed = BlockRemoved(self.worker_id, tuple(h for h, _ in alloc.evicted))
                out.append(KvEventOut(t, removed))
            n = min(req.prompt_tokens - seq.computed, budget)
            chunks.append((seq, n))
            budget -= n
            self._prefilling.append(seq)
        if blocked:
            if self._kv_since is None:
                self._kv_since = t
        elif self._kv_since is not None:
            self._kv_acc = self._kv_clock(t)
            self._kv_since = None

        self.segments += 1
        if chunks:
            dur = 0.0
            stored: list[BlockStored] = []
            for seq, n in chunks:
                dur += speed.prefill_time(n, seq.computed)
                # Register the blocks this chunk computes (vLLM caches at scheduling).
                runs = kv.commit(seq.req.request_id, seq.computed + n, t)
                if runs and self.emit_events:
                    stored.extend(
                        BlockStored(self.worker_id, tuple(r.hashes), r.parent) for r in runs
                    )
            # One step pays the fixed overhead once, however many chunks it holds.
            dur -= (len(chunks) - 1) * speed.prefill_overhead_s
            if n_dec:
                dur += speed.decode_step_time(n_dec, self.decode_context_tokens)
            self._step = _Step(t, t + dur, 1, chunks, stored=stored)
        elif n_dec:
            # Pure decode: nothing can be admitted before the next completion.
            a = speed.decode_step_time(n_dec, self.decode_context_tokens)
            b = speed.decode_s_per_context_token * n_dec
            k = self._finish_heap[0][0] - self._steps if self.coalesce_decodes else 1
            step = _Step(t, t, k, [], a, b)
            step.end = t + step.offset(k)
            self._step = step
        else:
            assert not waiting, "an idle engine must be able to admit its queue head"
            self.segments -= 1
            self._step = None
            self._set_wakeup(None)
            return
        self._set_wakeup(self._step.end)
