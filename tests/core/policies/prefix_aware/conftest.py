"""Helpers of the ``prefix_aware`` tests: workers, hand-built candidates, a full cache.

Each test module covers one step of :mod:`prefixrouter.core.policies.prefix_aware`:
first the step function on hand-built figures (the rule itself), then the
router on the default profile (the rule inside a real decision).
"""

from __future__ import annotations

from typing import NoReturn

from prefixrouter.core import (
    Router,
    WorkerId,
)
from prefixrouter.core.cost import CostTerms
from prefixrouter.core.policies.prefix_aware import (
    OutputClassParams,
)
from prefixrouter.core.policy import CandidateScore
from tests.core.conftest import tokens, warm

W0, W1, W2, W3 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2"), WorkerId("w3")
SHORT = OutputClassParams(warm_margin_rel=0.25, warm_margin_abs_s=0.05, max_warm_wait_s=4.0)


def fill_cache(router: Router, worker: WorkerId, blocks: int = 2_000, now: float = 0.0) -> None:
    """Make ``worker``'s cache full of other prefixes (a copy would evict them)."""
    router.index.set_capacity(worker, blocks)
    warm(router, worker, tokens(10_000 + int(worker[1:]), blocks * 16), now)


def candidate(decision: object, worker: WorkerId) -> object:
    return next(c for c in decision.candidates if c.worker_id == worker)  # type: ignore[attr-defined]


def calibrate(router: Router, worker: WorkerId, factor: float) -> None:
    """Teach the cost model that ``worker`` runs ``factor`` times its profile."""
    for _ in range(300):
        router.cost.observe(worker, CostTerms(0.0, 1.0, 0.0, 0.0, 0.0), factor)


def scored(
    worker: str,
    ttft: float,
    *,
    queue: float = 0.0,
    decode: float = 0.0,
    eviction: float = 0.0,
    scale: float = 1.0,
    matched: int = 0,
    score: float | None = None,
    step: float = 0.0,
) -> CandidateScore:
    """A hand-built candidate: TTFT ``ttft`` of which ``queue`` is queue wait; score = TTFT;
    ``step`` its engine step (``CostTerms.step_s``)."""
    terms = CostTerms(queue, ttft - queue, 0.0, 0.0, decode, eviction, scale, step_s=step)
    return CandidateScore(WorkerId(worker), matched, 1.0, terms, ttft if score is None else score)


def never(*_: object) -> NoReturn:
    raise AssertionError("demand must not be computed")
