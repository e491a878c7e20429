"""Simulated requests, workloads and the arrival processes that time them.

A :class:`Workload` is a list of :class:`SimRequest` sorted by arrival time plus
what the simulator needs to run it (default worker count, KV size, block size).
Generated workloads (:mod:`prefixrouter.sim.scenarios`) are produced in
*unit-rate time*: their arrivals have a mean rate of one request per second,
and the runner calls :meth:`Workload.scaled` to reach the rate under test, so
one generated workload serves a whole rate sweep and the request mix stays
identical between rates. Trace replays (:mod:`prefixrouter.sim.traces`) carry
real arrival times (``fixed_times``): :meth:`Workload.scaled` keeps them, and
only :meth:`Workload.stretched` (a load or rate asked of a trace) changes
their clock, keeping their burstiness.

Prompts are token-id arrays (``array('I')``, 4 bytes per token) split into
*segments*. A shared prefix - a system prompt, a document, a session's history -
is one array object referenced by every request that carries it, so a
workload of 600 questions about a 40,000-token document stores the document
once (160 KB), not 600 times. :meth:`SimRequest.tokens` concatenates on demand
for the one consumer that needs a flat prompt (block hashing).

Arrival processes take a seeded :class:`numpy.random.Generator` and return
absolute arrival times (``float64``, seconds, increasing) for a unit mean rate:

* :func:`poisson_arrivals`: exponential gaps, coefficient of variation 1.
* :func:`gamma_arrivals`: gamma gaps with a chosen coefficient of variation;
  ``cv > 1`` gives the bursts production traces show (ServeGen, Azure).
* :func:`rate_ladder`: piecewise Poisson (or gamma) stages at different
  relative rates, normalized so the whole run averages one request per second;
  used for load ramps such as llm-d's 3 -> 60 req/s benchmark.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from prefixrouter.core.types import CacheNamespace, PrefixClass, RequestId

# array('I') must be 4 bytes (uint32) so token buffers can be filled straight
# from numpy bytes and hashed as little-endian uint32 (see core.hashing).
if array("I").itemsize != 4:  # pragma: no cover - true on every supported platform
    raise ImportError("prefixrouter.sim needs array('I') to be 4 bytes wide")

DEFAULT_VOCAB = 32_000
"""Token ids are drawn from ``[0, DEFAULT_VOCAB)`` (a Llama-2-sized vocabulary)."""

DEFAULT_BLOCK_SIZE = 16
"""Engine KV block size of generated workloads (vLLM's default)."""

DEFAULT_GAMMA_CV = 2.0
"""Coefficient of variation of ``"gamma"`` arrivals when none is given."""

MIN_GAMMA_CV = 0.01
"""The smallest gamma ``cv``: gaps equal to within 1% are a clock already, and far below it
``cv * cv`` underflows (a shape of ``1 / 0``)."""

MAX_GAMMA_CV = 100.0
"""The largest gamma ``cv``. At 100, 93% of the gaps are 0 s and a run needs about
``cv**2`` = 10,000 requests before its mean rate nears the one asked for; past it the
rate is fiction (at 1,000, 100,000 requests average 1e-10 s apart), and far past it
``cv * cv`` overflows into infinite or NaN arrivals."""

SIM_NAMESPACE = CacheNamespace(model_revision="sim-model")
"""The cache namespace of every simulated request that has no tenant of its own."""

FloatArray = npt.NDArray[np.float64]


@dataclass(slots=True)
class SimRequest:
    """One simulated request.

    Attributes:
        request_id: Unique id (stable across runs with the same seed).
        arrival: Arrival time in seconds (unit-rate time unless the workload is fixed-time).
        namespace: Cache namespace; requests of different namespaces never share KV.
        segments: The prompt as consecutive token-id arrays (typecode ``"I"``).
            Shared prefixes are the same array objects across requests.
        output_tokens: Tokens the engine generates (always at least 1).
        prefix_class: What kind of reusable prefix the request carries (for reporting).
        group: What it is about: a document, session, template or customer id.
        first_user_offset: Token offset where the first user message starts
            (KubeAI keys on its first characters); 0 when the prompt has no system part.
    """

    request_id: RequestId
    arrival: float
    namespace: CacheNamespace
    segments: tuple[array[int], ...]
    output_tokens: int
    prefix_class: PrefixClass
    group: str
    first_user_offset: int = 0

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in tokens (sum of the segment lengths)."""
        return sum(len(s) for s in self.segments)

    def tokens(self) -> array[int]:
        """The whole prompt as one new array (built on demand, never stored)."""
        out: array[int] = array("I")
        for seg in self.segments:
            out.extend(seg)  # same typecode: a memcpy
        return out

    @property
    def system_segments(self) -> int:
        """How many leading segments are the system part (before ``first_user_offset``;
        at least the last segment is the user's)."""
        pos = count = 0
        for s in self.segments:
            if pos >= self.first_user_offset:
                break
            pos += len(s)
            count += 1
        return min(count, len(self.segments) - 1)


@dataclass(slots=True)
class Workload:
    """A named list of requests, sorted by arrival, plus simulator defaults.

    Attributes:
        name: Scenario or trace name.
        description: What the workload models and with which parameters.
        requests: Requests sorted by arrival time.
        fixed_times: True when arrivals are real times (trace replay); False when
            they are unit-rate times that :meth:`scaled` rescales.
        default_workers: Replicas to simulate unless the caller says otherwise.
        default_kv_blocks: Per-worker KV cache size in blocks the scenario is
            designed for (None: the engine model's default).
        block_size: Engine KV block size in tokens.
    """

    name: str
    description: str
    requests: list[SimRequest]
    fixed_times: bool = False
    default_workers: int = 8
    default_kv_blocks: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.default_workers < 1:
            raise ValueError(f"workload {self.name}: default_workers must be >= 1")
        if self.default_kv_blocks is not None and self.default_kv_blocks < 1:
            raise ValueError(f"workload {self.name}: default_kv_blocks must be >= 1")
        if self.block_size < 1:
            raise ValueError(f"workload {self.name}: block_size must be >= 1")
        prev = -math.inf
        for req in self.requests:
            # NaN passes the order test (``nan < prev`` is False) and an infinite time
            # never comes: either would stall the event loop or fill the report with NaN.
            if not math.isfinite(req.arrival):
                raise ValueError(
                    f"workload {self.name}: request {req.request_id} arrives at "
                    f"{req.arrival}, not a finite time"
                )
            if req.arrival < prev:
                raise ValueError(
                    f"workload {self.name}: requests not sorted by arrival at {req.request_id}"
                )
            prev = req.arrival

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def span(self) -> float:
        """Time from the first arrival to the last (seconds; 0 for an empty workload):
        what a stretched clock stretches, wherever the times start."""
        return self.requests[-1].arrival - self.requests[0].arrival if self.requests else 0.0

    def scaled(self, rate: float) -> Workload:
        """A copy whose arrivals have mean rate ``rate`` requests per second.

        Unit-rate arrivals are divided by ``rate``; a fixed-time workload (a trace)
        is returned unchanged, as a copy (:meth:`stretched` changes its clock).
        Segments are shared, not copied.

        Raises:
            ValueError: ``rate`` is not positive and finite, or the times it
                gives are not finite.
        """
        _check_rate(rate)
        if self.fixed_times:
            return replace(self, requests=list(self.requests))
        inv = 1.0 / rate
        return replace(self, requests=[replace(r, arrival=r.arrival * inv) for r in self.requests])

    def stretched(self, rate: float) -> Workload:
        """A copy whose clock is stretched so that its mean rate is ``rate`` requests/s.

        For real times (a trace): the gaps keep their proportions, so the trace
        keeps its burstiness. Times count from the first arrival, not from 0 (a
        trace that starts late, at epoch times, is the same trace), and the
        mean rate is the requests over :attr:`span` (one second for a span of
        0: all at once stays all at once). Segments are shared, not copied.

        Raises:
            ValueError: ``rate`` is not positive and finite, or the times it
                gives are not finite (a tiny rate).
        """
        _check_rate(rate)
        first = self.requests[0].arrival if self.requests else 0.0
        factor = (len(self.requests) / (self.span or 1.0)) / rate
        return replace(
            self, requests=[replace(r, arrival=(r.arrival - first) * factor) for r in self.requests]
        )

    def limited(self, n: int) -> Workload:
        """A copy with only the first ``n`` requests (by arrival)."""
        if n < 0:
            raise ValueError(f"limit must be >= 0, got {n}")
        return replace(self, requests=self.requests[:n])

    def lengths_scaled(self, scale: float) -> Workload:
        """A copy with every segment, output and the KV size ``scale`` times as large.

        A shared segment is cut once, so the requests that shared it still
        share one (shorter) array; each output is at least one token. The
        scenario's KV per worker is scaled too, so caches stay under the
        pressure the scenario was designed for: 0.5 gives doc-qa the live
        benchmark's workload and KV size (:mod:`prefixrouter.bench.workload`
        cuts it with this method).

        Raises:
            ValueError: ``scale`` outside (0, 1].
        """
        if not 0 < scale <= 1:
            raise ValueError(f"scale: must be in (0, 1], got {scale}")
        if scale == 1:
            return self
        cut: dict[int, array[int]] = {}

        def seg(s: array[int]) -> array[int]:
            out = cut.get(id(s))
            if out is None:
                out = cut[id(s)] = s[: max(1, round(len(s) * scale))]
            return out

        reqs = [
            replace(
                r,
                segments=tuple(seg(s) for s in r.segments),
                output_tokens=max(1, round(r.output_tokens * scale)),
                first_user_offset=sum(len(seg(s)) for s in r.segments[: r.system_segments]),
            )
            for r in self.requests
        ]
        blocks = self.default_kv_blocks
        return replace(
            self,
            requests=reqs,
            default_kv_blocks=math.ceil(blocks * scale) if blocks is not None else None,
        )

    def prompt_token_total(self) -> int:
        """Prompt tokens of all requests (what a cache-blind cluster prefills)."""
        return sum(r.prompt_tokens for r in self.requests)


def _check_rate(rate: float) -> None:
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a positive finite number, got {rate}")


def random_tokens(rng: np.random.Generator, n: int, vocab: int = DEFAULT_VOCAB) -> array[int]:
    """``n`` uniformly random token ids in ``[0, vocab)`` as ``array('I')``.

    Drawn with numpy and copied as raw bytes: about 100x faster than a Python loop,
    which matters for 40,000-token documents and whole traces.
    """
    if n < 0:
        raise ValueError(f"token count must be >= 0, got {n}")
    if not 0 < vocab <= 2**32:
        raise ValueError(f"vocab must be in [1, 2**32], got {vocab}")
    return array("I", rng.integers(0, vocab, size=n, dtype=np.uint32).tobytes())


def poisson_arrivals(n: int, rng: np.random.Generator) -> FloatArray:
    """``n`` arrival times of a Poisson process with rate 1 (exponential gaps)."""
    _check_count(n)
    return np.cumsum(rng.exponential(1.0, size=n))


def gamma_arrivals(n: int, rng: np.random.Generator, cv: float) -> FloatArray:
    """``n`` arrival times with gamma gaps of mean 1 and coefficient of variation ``cv``.

    Shape ``k = 1/cv^2`` and scale ``cv^2`` give mean ``k * scale = 1`` and standard
    deviation ``sqrt(k) * scale = cv``. ``cv > 1`` is burstier than Poisson:
    many short gaps, a few long silences.
    """
    _check_count(n)
    return np.cumsum(_gamma_gaps(n, rng, cv))


def rate_ladder(
    n_per_stage: int | Sequence[int],
    relative_rates: Sequence[float],
    rng: np.random.Generator,
    cv: float = 1.0,
) -> FloatArray:
    """Arrival times of consecutive stages at different rates, unit mean rate overall.

    Stage ``i`` sends ``n_per_stage[i]`` requests (an int: the same for every
    stage) at a rate proportional to ``relative_rates[i]``. Rates are normalized
    so the *expected* duration of the whole run equals the request count: the
    run averages one request per second and :meth:`Workload.scaled` sets the
    mean rate while keeping the ladder's shape. Gaps are exponential
    (``cv == 1``) or gamma with that coefficient of variation.
    """
    rates = [float(r) for r in relative_rates]
    counts = [n_per_stage] * len(rates) if isinstance(n_per_stage, int) else list(n_per_stage)
    if not rates or len(counts) != len(rates):
        raise ValueError("rate_ladder needs one request count per stage and at least one stage")
    if any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise ValueError(f"relative rates must be positive and finite, got {rates}")
    if any(c < 0 for c in counts):
        raise ValueError(f"stage request counts must be >= 0, got {counts}")
    total = sum(counts)
    if total == 0:
        return np.zeros(0, dtype=np.float64)
    # Expected run time at the given rates, then the factor that makes it `total` seconds.
    norm = sum(c / r for c, r in zip(counts, rates, strict=True)) / total
    gaps: list[FloatArray] = []
    for count, rate in zip(counts, rates, strict=True):
        unit = rng.exponential(1.0, size=count) if cv == 1.0 else _gamma_gaps(count, rng, cv)
        gaps.append(unit / (rate * norm))
    return np.cumsum(np.concatenate(gaps))


def make_arrivals(process: str, n: int, rng: np.random.Generator) -> FloatArray:
    """Unit-rate arrival times for a process named on the command line.

    ``"poisson"``, ``"gamma"`` (coefficient of variation :data:`DEFAULT_GAMMA_CV`)
    or ``"gamma:<cv>"`` (e.g. ``"gamma:3"``), ``cv`` from :data:`MIN_GAMMA_CV` to
    :data:`MAX_GAMMA_CV`.

    Raises:
        ValueError: Another name (``"poisson:"`` and ``"gamma:"`` included: a
            colon promises a number), or a cv out of range.
    """
    cv = arrival_cv(process)  # validates the name first, whatever n is
    if process == "poisson":
        return poisson_arrivals(n, rng)
    return gamma_arrivals(n, rng, cv)


def arrival_cv(process: str) -> float:
    """The gap coefficient of variation that :func:`make_arrivals` uses for ``process``
    (1 for ``"poisson"``).

    Raises:
        ValueError: Not a process :func:`make_arrivals` knows (the message
            starts ``unknown arrival process``): another name, or ``gamma:``
            with no number after it; or a gamma cv out of range, whatever
            number it is (``gamma:0``, ``gamma:-1``, ``gamma:inf`` included).
    """
    if process == "poisson":
        return 1.0
    if process == "gamma":
        return DEFAULT_GAMMA_CV
    kind, _, arg = process.partition(":")
    try:
        cv = float(arg) if kind == "gamma" else None
    except ValueError:
        cv = None
    if cv is None:
        raise ValueError(
            f"unknown arrival process {process!r}: expected 'poisson', 'gamma' or "
            f"'gamma:<cv>' with {MIN_GAMMA_CV:g} <= cv <= {MAX_GAMMA_CV:g}"
        )
    if (why := _cv_problem(cv)) is not None:
        raise ValueError(f"arrival process {process!r}: {why}")
    return cv


def _cv_problem(cv: float) -> str | None:
    """Why ``cv`` is no gamma coefficient of variation to draw gaps with, or None."""
    if not MIN_GAMMA_CV <= cv <= MAX_GAMMA_CV:  # NaN fails it too
        return (
            f"cv must be between {MIN_GAMMA_CV:g} and {MAX_GAMMA_CV:g}, got {cv:g} "
            f"(below, the gaps are constant; above, the run's rate is not the one asked for)"
        )
    return None


def _gamma_gaps(n: int, rng: np.random.Generator, cv: float) -> FloatArray:
    if (why := _cv_problem(cv)) is not None:
        raise ValueError(why)
    var = cv * cv
    return rng.gamma(1.0 / var, var, size=n)


def _check_count(n: int) -> None:
    if n < 0:
        raise ValueError(f"request count must be >= 0, got {n}")
