"""The cost model: predicted time to first token of a request on a worker.

For a request of ``T`` prompt tokens of which worker ``w`` holds the first
``M`` (with confidence ``c``) and ``O`` expected output tokens::

    predicted_ttft(w) = queue_wait(w) + prefill(w) + decode_impact(w) + memory_risk(w)

* ``queue_wait``: the prefill already queued on ``w`` (tokens the router sent
  and the engine has not prefilled), half a decode step on average for the
  step in flight, plus, when every sequence slot is taken, the time until
  enough running requests finish to free one.
* ``prefill``: ``c * P(T - M, context=M) + (1 - c) * P(T, 0)``; ``P`` is the
  worker's speed profile. The expectation over confidence is what makes a
  doubtful cache entry worth less than a certain one.
* ``decode_impact``: chunked prefill shares each engine step with the running
  decodes, so every prefill step of the queued work and of this request also
  pays one decode step of the running batch.
* ``memory_risk``: when the blocks that the work queued ahead and this
  request need (uncached prompts plus outputs) exceed the free KV blocks, the
  queue waits for running requests to release memory (engines admit in
  order, so one request that does not fit blocks those behind it): the
  shortfall's share of the used blocks times the time the running batch takes
  to drain.

Three further terms are not part of this request's TTFT; policies may weigh them:

* ``decode_s``: the expected time to generate ``O`` tokens on ``w`` with the
  batch it would join;
* ``eviction_s``: the prefill time of the cached blocks that storing this
  prompt would evict from ``w``'s full cache (``evicted_tokens``, given by the
  caller from the prefix index). It is the price of copying a prefix: another
  request will likely have to recompute what was evicted.
* ``memory_risk_freed_s``: the same head-of-line wait as ``memory_risk``,
  with the shortfall counted against the blocks the running requests free as
  they finish (``WorkerView.decoding_own_tokens``: their outputs and the
  uncached tails of prompts they mostly reused) instead of all used
  blocks. A prefix the readers share stays held until the last of them
  ends, so on a worker whose KV holds documents pinned by their readers the
  used blocks overstate what finishing frees many times over
  (``memory_risk`` predicted waits of 2-10 s as 0.1-1.6 s in the
  simulator). It is the better prediction of that wait, but used for every
  choice it made the router leave a document's busy holder for a cold worker
  more often, and each such copy evicts a context that is asked for again
  (``benchmarks/tried/kv_admission_own_blocks.patch``); ``prefix_aware``
  reads it only to rank the holders of one prefix among themselves, where
  nothing is copied. Without the ledger's count (a view no ledger filled)
  the used blocks stand in, as in ``memory_risk``.

Calibration: each worker has a scale factor (start 1) applied to every time
term. After each request the driver reports the observed TTFT; the factor
moves toward ``observed / predicted`` by ``calibration_alpha`` (clipped to
``[1/max_scale, max_scale]``), so a slower GPU or a busier engine than its
profile says is learned within tens of requests.

A worker learns only from the requests it is sent, so a factor that is too
high starves its worker of the traffic that would correct it. A restarted
engine is where that bites: its factor described the old process under its
old load, while identical engines that kept serving learned a lower one as
they warmed (seen live, 40% apart: past the tie band, so the new process got
no cold traffic for seconds). So a restarted worker that has shown nothing
since (:meth:`CostModel.restarted`) is predicted a millionth below the
lowest factor of the workers observed, read live: optimism about the
unknown, so it gets the next request that any idle worker would (the
tie-break among equals goes its way) and learns its own factor from the
traffic (within tens of requests; a slower one learns its way up). A factor
copied once at the restart was tried: the others kept learning and drifted
a few percent below it within seconds, and at a load that leaves nothing in
flight every cold request went to the lowest of them (up to 6.6 s before the
new process got one). The fleet's mean was tried before that: with
identical engines 20% apart it left the new process outside the tie band of
the best. A worker back from an outage (frozen, cut off: its health checks
failed, and it is the same process with its cache) is in the same place, its
factor as old as the outage, and gets the same optimism
(:meth:`CostModel.restarted` through ``Router.worker_up``). Seen live: an
engine SIGSTOPped for 10 s got no request for 22 s after SIGCONT, and in a
rerun that polled the factors, a frozen engine's stayed put while the
others' moved between 0.42 and 0.65 within seconds, so it came back above
the lowest by whatever they had drifted (past the tie band, it loses every
cold tie). A
worker never observed (a new one) starts from the profile's own
speed (factor 1): the same optimism for every worker at a fleet's start
reshuffled the first placements and moved whole simulated runs (llm-d's
customer benchmark at load 0.6, text mode: 529 to 978 ms mean). Pure: no
clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixrouter.core.types import WorkerId, WorkerView


@dataclass(slots=True)
class CostTerms:
    """The predicted terms of one candidate, in seconds.

    A plain slots record, not frozen: several are built per request, and a
    frozen dataclass sets each field through ``object.__setattr__`` (about
    twice as slow). Treat it as read-only. ``step_s`` is not a term of the
    first token but its grain: one engine step of the batch the request
    would join (a first token comes at the end of a step, and where in the
    step in flight a request lands is unknown), scaled like the terms.
    """

    queue_wait_s: float
    prefill_s: float
    decode_impact_s: float
    memory_risk_s: float
    decode_s: float
    eviction_s: float = 0.0
    scale: float = 1.0
    memory_risk_freed_s: float = 0.0
    step_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        """Predicted time to first token."""
        return self.queue_wait_s + self.prefill_s + self.decode_impact_s + self.memory_risk_s


@dataclass(frozen=True, slots=True)
class CostParams:
    """Calibration settings.

    Attributes:
        calibration_alpha: Weight of the newest observation in the scale factor.
        max_scale: Bound on the scale factor (and its inverse).
        min_observed_s: Observations shorter than this are ignored (noise).
    """

    calibration_alpha: float = 0.05
    max_scale: float = 4.0
    min_observed_s: float = 1e-4


RESTARTED_EDGE = 1e-6
"""How far below the lowest observed factor a restarted worker is predicted
(relative): enough to win an exact tie against that worker, nothing else."""


class CostModel:
    """Predicts TTFT terms per worker and calibrates them from observations."""

    def __init__(self, params: CostParams | None = None) -> None:
        self.params = params or CostParams()
        # Observed workers; a restarted one is in `_restarted` (and not in
        # `_scale`) until observed again; a worker in neither is at 1.
        self._scale: dict[WorkerId, float] = {}
        self._restarted: set[WorkerId] = set()

    def _unobserved_scale(self, worker: WorkerId) -> float:
        """A worker with no factor of its own: a restarted one a hair below the
        lowest observed factor, read now (module doc); any other the profile's 1."""
        if worker in self._restarted and self._scale:
            return min(self._scale.values()) * (1.0 - RESTARTED_EDGE)
        return 1.0

    def scale(self, worker: WorkerId) -> float:
        """The worker's calibration factor (1 = the profile is right)."""
        s = self._scale.get(worker)
        return self._unobserved_scale(worker) if s is None else s

    def predict(
        self,
        w: WorkerView,
        prompt_tokens: int,
        cached_tokens: int,
        confidence: float,
        output_tokens: int,
        evicted_tokens: int = 0,
    ) -> CostTerms:
        """Predicted terms for a request on worker ``w``.

        Args:
            w: The worker's snapshot.
            prompt_tokens: ``T``.
            cached_tokens: ``M``, the matched prefix in tokens.
            confidence: ``c`` in [0, 1], how sure we are ``M`` is still cached.
            output_tokens: ``O``.
            evicted_tokens: Cached tokens that storing the prompt would evict.
        """
        # Called for every candidate of every request. On the common path,
        # two-argument min/max are written out (`b if b > a else a` is exactly
        # max(a, b)) and the worker's fields are read once: a builtin call or
        # an attribute read costs more here than the arithmetic.
        prof = w.profile
        in_flight, decoding, max_slots = w.in_flight, w.decoding, w.max_slots
        # The batch this request's prefill steps share: the running decodes and
        # every request queued ahead of it, which decode by the time it does.
        batch = in_flight if in_flight > decoding else decoding
        batch = max_slots if max_slots < batch else batch
        batch_context = w.context_tokens + w.queued_prompt_tokens
        decode_step = prof.decode_step_time(batch, batch_context)
        pending = w.pending_prefill_tokens

        queue = prof.prefill_time(pending, 0.0) if pending > 0 else 0.0
        if in_flight > 0:
            # A new request waits, on average, for half of the step in flight.
            queue += 0.5 * decode_step
        excess = in_flight - max_slots + 1
        if excess > 0:
            # Slots free up as running requests finish: `running` sequences with
            # `mean_left` tokens left each, one token per decode step. Before any
            # of them decodes, this request's own output length stands in.
            running = min(in_flight, max_slots)
            if decoding > 0:
                mean_left = w.decode_tokens_remaining / decoding
            else:
                mean_left = float(output_tokens)
            step = prof.decode_step_time(running, w.context_tokens)
            queue += excess * mean_left * step / running

        new_tokens = prompt_tokens - cached_tokens
        warm = prof.prefill_time(new_tokens, cached_tokens)
        if confidence >= 1.0 or cached_tokens <= 0:
            prefill = warm
        else:
            prefill = confidence * warm + (1.0 - confidence) * prof.prefill_time(prompt_tokens, 0.0)

        expected_new = new_tokens + (1.0 - confidence) * cached_tokens
        if expected_new > 0:
            chunk = prof.chunk_tokens
            chunk = chunk if chunk > 1 else 1
            steps = math.ceil((pending + expected_new) / chunk)
        else:
            steps = 1
        impact = steps * decode_step

        risk = freed_risk = 0.0
        block = w.block_size
        block = block if block > 1 else 1
        # Engines admit first come, first served and a request that does not
        # fit blocks the queue behind it, so what counts is the memory of all
        # the work queued ahead plus this request's (each queued request is
        # assumed to reserve as much output as this one).
        queued = in_flight - decoding
        queued = queued if queued > 0 else 0
        needed = math.ceil((pending + expected_new + (queued + 1) * output_tokens) / block)
        free = w.kv_capacity_blocks - w.kv_used_blocks
        if needed > free and decoding > 0:
            shortfall = min(1.0, (needed - free) / max(1, w.kv_used_blocks))
            drain = (w.decode_tokens_remaining / decoding) * decode_step
            risk = shortfall * drain
            # What a finishing request frees is its own blocks; a prefix the
            # running requests share is held until the last of them ends.
            own = w.decoding_own_tokens // block
            freed = own if own > 0 else w.kv_used_blocks
            freed_risk = min(1.0, (needed - free) / max(1, freed)) * drain

        own_step = prof.decode_step_time(batch + 1, batch_context + prompt_tokens)
        decode = output_tokens * own_step

        s = self._scale.get(w.worker_id)  # self.scale(), without the call if known
        if s is None:
            s = self._unobserved_scale(w.worker_id)
        eviction = prof.prefill_time(evicted_tokens, 0.0) if evicted_tokens > 0 else 0.0
        # By keyword: `scale` passed positionally once landed in a term slot,
        # which left calibration converging to the square root of the error.
        return CostTerms(
            queue * s, prefill * s, impact * s, risk * s, decode * s, eviction * s, scale=s,
            memory_risk_freed_s=freed_risk * s, step_s=decode_step * s,
        )  # fmt: skip

    def observe(self, worker: WorkerId, predicted: CostTerms, observed_ttft_s: float) -> None:
        """Move the worker's scale toward what one request's TTFT showed.

        Args:
            worker: The worker that served the request.
            predicted: The terms predicted at decision time (with the scale then in force).
            observed_ttft_s: The measured time to first token.
        """
        p = self.params
        predicted_ttft = predicted.ttft_s
        if observed_ttft_s < p.min_observed_s or predicted_ttft <= 0:
            return
        scale = self.scale(worker)
        unscaled = predicted_ttft / predicted.scale
        ratio = min(p.max_scale, max(1.0 / p.max_scale, observed_ttft_s / unscaled))
        scale += p.calibration_alpha * (ratio - scale)
        self._scale[worker] = min(p.max_scale, max(1.0 / p.max_scale, scale))
        self._restarted.discard(worker)

    def forget(self, worker: WorkerId) -> None:
        """Drop a removed worker's calibration."""
        self._restarted.discard(worker)
        self._scale.pop(worker, None)

    def restarted(self, worker: WorkerId) -> None:
        """The worker's factor is stale (a new engine process, or back from an outage):
        until observed again it is predicted a hair below the lowest factor of the
        others, whatever they learn meanwhile (module doc); the profile's own (1)
        when none has one."""
        self._restarted.add(worker)
        self._scale.pop(worker, None)
