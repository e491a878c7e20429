"""The outlier-ejection state machine (prefixrouter.core.outlier), with the time passed in."""

from __future__ import annotations

import math

import pytest

from prefixrouter.core.outlier import Change, OutlierDetector, OutlierPolicy, Transition
from prefixrouter.core.types import WorkerId

A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")
POLICY = OutlierPolicy(consecutive_failures=3, base_ejection_s=5.0, max_ejection_s=12.0)


def fail(
    det: OutlierDetector, w: WorkerId, now: float, n: int = 1, others: int = 2
) -> Transition | None:
    """``n`` failures of ``w`` at ``now`` (a fleet of 3); the last one's transition."""
    out = None
    for _ in range(n):
        out = det.failure(w, now, fleet=3, others_routable=others)
    return out


def test_consecutive_failures_eject_and_a_success_resets_the_run() -> None:
    det = OutlierDetector(POLICY)
    assert fail(det, A, 0.0, 2) is None
    det.success(A, 0.1)
    assert fail(det, A, 0.2, 2) is None  # the run started again
    t = fail(det, A, 0.3)
    assert t is not None and t.change is Change.EJECTED
    assert t.until == pytest.approx(5.3) and t.ejections == 1 and t.failures == 3
    assert det.ejected(A) and det.ejected_count() == 1 and det.next_release == pytest.approx(5.3)


def test_the_worker_returns_when_its_time_is_up_and_not_before() -> None:
    det = OutlierDetector(POLICY)
    fail(det, A, 0.0, 3)
    assert det.release(4.99) == [] and det.ejected(A)
    back = det.release(5.0)
    assert [(t.worker_id, t.change) for t in back] == [(A, Change.RETURNED)]
    assert not det.ejected(A) and det.next_release == math.inf


def test_answers_of_requests_sent_before_the_ejection_change_nothing() -> None:
    det = OutlierDetector(POLICY)
    fail(det, A, 0.0, 3)
    assert fail(det, A, 1.0, 10) is None
    det.success(A, 1.0)
    assert det.ejected_until(A) == pytest.approx(5.0)


def test_a_returned_worker_that_fails_again_is_ejected_at_once_for_longer_capped() -> None:
    det = OutlierDetector(POLICY)
    fail(det, A, 0.0, 3)
    det.release(5.0)
    t = fail(det, A, 5.1)  # probation: one failure is enough
    assert t is not None and t.ejections == 2 and t.until == pytest.approx(15.1)
    det.release(15.1)
    t = fail(det, A, 15.2)
    assert t is not None and t.ejections == 3 and t.until == pytest.approx(15.2 + 12.0)  # cap


def test_a_success_after_returning_ends_the_probation() -> None:
    det = OutlierDetector(POLICY)
    fail(det, A, 0.0, 3)
    det.release(5.0)
    det.success(A, 5.1)
    assert fail(det, A, 5.2, 2) is None  # a full run is needed again
    assert fail(det, A, 5.3) is not None


def test_the_ejection_count_is_forgiven_after_a_long_clean_stretch() -> None:
    det = OutlierDetector(POLICY)
    fail(det, A, 0.0, 3)
    det.release(5.0)
    det.success(A, 5.1)
    t = fail(det, A, 5.0 + 12.0 + 1.0, 3)  # back longer than max_ejection_s: one forgiven
    assert t is not None and t.ejections == 1 and t.until - t.at == pytest.approx(5.0)
    assert det.ejections(A) == 2  # the lifetime count, for the metric


def test_never_more_than_the_share_nor_the_last_routable_worker() -> None:
    det = OutlierDetector(OutlierPolicy(consecutive_failures=1, max_ejected_share=0.5))
    # 3 workers, half of them: one ejected at most.
    assert fail(det, A, 0.0, others=2) is not None
    assert fail(det, B, 0.0, others=1) is None
    assert fail(det, C, 0.0, others=1) is None
    assert det.ejected_count() == 1
    # A failure that could not eject still counts: B goes once A is back.
    det.release(10.0)
    assert fail(det, B, 10.1, others=2) is not None


def test_a_lone_worker_or_one_whose_peers_are_down_is_never_ejected() -> None:
    det = OutlierDetector(OutlierPolicy(consecutive_failures=1, max_ejected_share=1.0))
    assert det.failure(A, 0.0, fleet=1, others_routable=0) is None
    assert det.failure(A, 0.0, fleet=3, others_routable=0) is None  # b, c down by health
    assert not det.ejected(A)


def test_at_least_one_worker_may_be_ejected_whatever_the_share() -> None:
    assert OutlierPolicy(max_ejected_share=0.1).max_ejected(3) == 1
    assert OutlierPolicy(max_ejected_share=0.5).max_ejected(10) == 5


def test_a_restarted_engine_ends_its_ejection_and_starts_afresh() -> None:
    det = OutlierDetector(POLICY)
    fail(det, A, 0.0, 3)
    det.release(5.0)
    fail(det, A, 5.1)  # ejected a second time, until 15.1
    assert fail(det, B, 6.0, 3) is None  # the fleet guard: one of three at a time
    assert det.restarted(A, 7.0) is True
    assert not det.ejected(A) and det.next_release == math.inf
    assert det.ejections(A) == 2  # the history is kept...
    assert fail(det, A, 7.1) is None  # ...but no probation: one failure ejects nothing
    t = fail(det, B, 7.5)  # the guard's place is free again
    assert t is not None and det.ejected(B) and det.next_release == pytest.approx(12.5)
    assert det.restarted(C, 8.0) is False  # never seen: nothing to end
    assert det.restarted(B, 8.0) is True and det.ejected_count() == 0
    t = fail(det, A, 8.1, 2)  # A's run: 1 + 2 failures, its first ejection since the restart
    assert t is not None and t.ejections == 1 and t.until == pytest.approx(13.1)


def test_forgetting_an_ejected_worker_frees_its_place() -> None:
    det = OutlierDetector(OutlierPolicy(consecutive_failures=1))
    fail(det, A, 0.0)
    fail(det, B, 1.0, others=2)  # refused: 3 * 0.5 = 1 ejected at most
    det.forget(A)
    assert det.ejected_count() == 0 and det.next_release == math.inf
    assert fail(det, B, 2.0) is not None and det.next_release == pytest.approx(7.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"consecutive_failures": 0},
        {"base_ejection_s": 0.0},
        {"base_ejection_s": 10.0, "max_ejection_s": 5.0},
        {"max_ejected_share": 0.0},
        {"max_ejected_share": 1.5},
    ],
)
def test_a_policy_that_cannot_work_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        OutlierPolicy(**kwargs)  # type: ignore[arg-type]
