"""Workload types and arrival processes (prefixrouter.sim.workload)."""

from __future__ import annotations

import math
from array import array

import numpy as np
import pytest

from prefixrouter.core.types import PrefixClass
from prefixrouter.sim.scenarios import get_scenario
from prefixrouter.sim.workload import (
    DEFAULT_GAMMA_CV,
    MAX_GAMMA_CV,
    MIN_GAMMA_CV,
    SimRequest,
    Workload,
    arrival_cv,
    gamma_arrivals,
    make_arrivals,
    poisson_arrivals,
    random_tokens,
    rate_ladder,
)
from tests.sim.helpers import sim_request


def _gaps(times: np.ndarray) -> np.ndarray:
    return np.diff(times, prepend=0.0)


def _request(i: int, arrival: float, *segments: array[int]) -> SimRequest:
    return sim_request(
        i, arrival, *segments, output_tokens=10, prefix_class=PrefixClass.SYSTEM,
        first_user_offset=len(segments[0]),
    )  # fmt: skip


# --------------------------------------------------------------------------- tokens


def test_random_tokens_are_uint32_in_vocab_and_seeded() -> None:
    a = random_tokens(np.random.default_rng(7), 10_000, vocab=1000)
    b = random_tokens(np.random.default_rng(7), 10_000, vocab=1000)
    c = random_tokens(np.random.default_rng(8), 10_000, vocab=1000)
    assert a.typecode == "I" and a.itemsize == 4
    assert len(a) == 10_000
    assert min(a) >= 0 and max(a) < 1000
    assert a.tobytes() == b.tobytes()
    assert a.tobytes() != c.tobytes()
    assert len(random_tokens(np.random.default_rng(0), 0)) == 0


def test_random_tokens_rejects_bad_arguments() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError):
        random_tokens(rng, -1)
    with pytest.raises(ValueError):
        random_tokens(rng, 5, vocab=0)


# --------------------------------------------------------------------------- SimRequest


def test_sim_request_tokens_concatenate_segments_on_demand() -> None:
    shared = array("I", [1, 2, 3])
    r = _request(0, 0.0, shared, array("I", [4, 5]))
    assert r.prompt_tokens == 5
    flat = r.tokens()
    assert flat.typecode == "I"
    assert list(flat) == [1, 2, 3, 4, 5]
    assert flat is not r.tokens()  # built each time, never cached on the request
    assert list(shared) == [1, 2, 3]  # the shared segment is not modified


# --------------------------------------------------------------------------- Workload


def test_workload_scaled_divides_unit_rate_arrivals_and_shares_segments() -> None:
    seg = array("I", range(32))
    wl = Workload("w", "d", [_request(i, float(i), seg) for i in range(5)])
    fast = wl.scaled(10.0)
    assert [r.arrival for r in fast.requests] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert all(r.segments[0] is seg for r in fast.requests)
    assert [r.arrival for r in wl.requests] == [0.0, 1.0, 2.0, 3.0, 4.0]  # original untouched
    assert fast.name == wl.name and fast.default_workers == wl.default_workers


def test_workload_scaled_keeps_fixed_times() -> None:
    seg = array("I", [1])
    wl = Workload("t", "d", [_request(i, float(i), seg) for i in range(3)], fixed_times=True)
    same = wl.scaled(50.0)
    assert [r.arrival for r in same.requests] == [0.0, 1.0, 2.0]
    assert same.requests is not wl.requests


def test_workload_stretched_keeps_the_gaps_proportions_from_the_first_arrival() -> None:
    seg = array("I", [1])
    times = [1000.0, 1001.0, 1003.0, 1007.0]  # a late start: epoch times
    wl = Workload("t", "d", [_request(i, t, seg) for i, t in enumerate(times)], fixed_times=True)
    at2 = wl.stretched(2.0)  # 4 requests over 7 s, made 2 per second: 2 s
    assert [r.arrival for r in at2.requests] == pytest.approx([0.0, 2 / 7, 6 / 7, 2.0])
    assert [r.arrival for r in wl.requests] == times  # original untouched
    burst = Workload("b", "d", [_request(i, 5.0, seg) for i in range(3)], fixed_times=True)
    assert [r.arrival for r in burst.stretched(10.0).requests] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("rate", [0.0, -1.0, float("inf"), float("nan")])
def test_workload_scaled_rejects_bad_rates(rate: float) -> None:
    wl = Workload("w", "d", [])
    with pytest.raises(ValueError):
        wl.scaled(rate)
    with pytest.raises(ValueError):
        wl.stretched(rate)


def test_workload_limited_and_validation() -> None:
    seg = array("I", [1])
    wl = Workload("w", "d", [_request(i, float(i), seg) for i in range(10)])
    assert [r.request_id for r in wl.limited(3).requests] == ["r0", "r1", "r2"]
    assert len(wl.limited(100)) == 10
    assert wl.span == 9.0 and wl.limited(3).span == 2.0 and Workload("w", "d", []).span == 0.0
    with pytest.raises(ValueError):
        wl.limited(-1)
    with pytest.raises(ValueError, match="not sorted"):
        Workload("w", "d", [_request(0, 2.0, seg), _request(1, 1.0, seg)])
    with pytest.raises(ValueError):
        Workload("w", "d", [], default_workers=0)


def test_lengths_scaled_cuts_each_shared_segment_once_and_the_kv_with_it() -> None:
    system, doc = array("I", range(100)), array("I", range(1000))
    reqs = [_request(i, float(i), system, doc, array("I", range(40 + i))) for i in range(3)]
    wl = Workload("w", "d", reqs, default_kv_blocks=6000)
    half = wl.lengths_scaled(0.5)
    assert half.default_kv_blocks == 3000 and wl.default_kv_blocks == 6000
    first = half.requests[0]
    assert [len(s) for s in first.segments] == [50, 500, 20]
    # The requests that shared a segment share its cut; each question is its own.
    assert all(r.segments[0] is first.segments[0] for r in half.requests)
    assert all(r.segments[1] is first.segments[1] for r in half.requests)
    assert [len(r.segments[2]) for r in half.requests] == [20, 20, 21]
    assert first.output_tokens == 5 and first.first_user_offset == 50
    assert wl.requests[0].prompt_tokens == 1140  # the original is untouched
    assert wl.lengths_scaled(1.0) is wl
    tiny = Workload("w", "d", [_request(0, 0.0, array("I", [7]), array("I", [8]))])
    cut = tiny.lengths_scaled(0.01).requests[0]
    assert [len(s) for s in cut.segments] == [1, 1] and cut.output_tokens == 1


@pytest.mark.parametrize("scale", [0.0, -0.5, 1.5])
def test_lengths_scaled_rejects_a_scale_outside_zero_to_one(scale: float) -> None:
    with pytest.raises(ValueError, match="scale"):
        Workload("w", "d", []).lengths_scaled(scale)


def test_system_segments_count_the_segments_before_the_first_user_offset() -> None:
    a, b, c = array("I", [1] * 10), array("I", [2] * 20), array("I", [3] * 5)
    req = _request(0, 0.0, a, b, c)
    assert req.system_segments == 1
    req.first_user_offset = 30
    assert req.system_segments == 2
    req.first_user_offset = 35  # the last segment is always the user's
    assert req.system_segments == 2
    req.first_user_offset = 0
    assert req.system_segments == 0


# --------------------------------------------------------------------------- arrivals


def test_poisson_arrivals_have_unit_rate_and_cv_one() -> None:
    t = poisson_arrivals(100_000, np.random.default_rng(1))
    gaps = _gaps(t)
    assert np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(1.0, abs=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("cv", [0.5, 2.0, 3.0])
def test_gamma_arrivals_have_unit_mean_and_requested_cv(cv: float) -> None:
    gaps = _gaps(gamma_arrivals(200_000, np.random.default_rng(2), cv))
    assert gaps.mean() == pytest.approx(1.0, abs=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_gamma_arrivals_reject_bad_cv() -> None:
    with pytest.raises(ValueError):
        gamma_arrivals(10, np.random.default_rng(0), 0.0)


def test_arrivals_are_deterministic_per_seed() -> None:
    a = poisson_arrivals(100, np.random.default_rng(3))
    b = poisson_arrivals(100, np.random.default_rng(3))
    c = poisson_arrivals(100, np.random.default_rng(4))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_rate_ladder_has_unit_mean_rate_and_the_stage_shape() -> None:
    rates = [1.0, 2.0, 4.0, 8.0]
    t = rate_ladder(5_000, rates, np.random.default_rng(5))
    assert len(t) == 20_000
    assert np.all(np.diff(t) >= 0)
    assert len(t) / t[-1] == pytest.approx(1.0, rel=0.03)  # unit mean rate overall
    gaps = _gaps(t).reshape(4, 5_000).mean(axis=1)
    # Each stage is twice as fast as the previous one.
    assert gaps[0] / gaps[1] == pytest.approx(2.0, rel=0.08)
    assert gaps[0] / gaps[3] == pytest.approx(8.0, rel=0.08)


def test_rate_ladder_uneven_stages_and_gamma() -> None:
    t = rate_ladder([100, 3_000, 6_000], [3.0, 30.0, 60.0], np.random.default_rng(6), cv=2.0)
    assert len(t) == 9_100
    assert len(t) / t[-1] == pytest.approx(1.0, rel=0.1)
    with pytest.raises(ValueError):
        rate_ladder([1, 2], [1.0], np.random.default_rng(0))
    with pytest.raises(ValueError):
        rate_ladder(5, [1.0, 0.0], np.random.default_rng(0))
    assert len(rate_ladder(0, [1.0], np.random.default_rng(0))) == 0


def test_make_arrivals_parses_process_names() -> None:
    rng = np.random.default_rng(0)
    assert len(make_arrivals("poisson", 10, rng)) == 10
    assert len(make_arrivals("gamma", 10, rng)) == 10
    assert len(make_arrivals("gamma:3.5", 10, rng)) == 10
    assert arrival_cv("poisson") == 1.0
    assert arrival_cv("gamma") == DEFAULT_GAMMA_CV
    assert arrival_cv("gamma:3") == 3.0
    for bad in ("uniform", "gamma:x", "gamma:-1", "poisson:2", ""):
        with pytest.raises(ValueError, match="arrival process"):
            make_arrivals(bad, 10, rng)


# --------------------------------------------------------------------------- arrival bounds
# Arrival processes refuse what would give no usable times; workloads refuse such times.


@pytest.mark.parametrize(
    "cv", ["1e-300", "1e-160", "0.009", "100.5", "1e160", "1e300", "0", "-1", "inf", "nan"]
)
def test_a_gamma_cv_out_of_range_is_refused(cv: str) -> None:
    """1e-300 divided by zero, 1e160 hung the event loop, 1e-160 gave a table of NaN;
    every number out of range gets the range's message (0, -1 and inf were "unknown")."""
    with pytest.raises(ValueError, match=r"cv must be between 0\.01 and 100"):
        make_arrivals(f"gamma:{cv}", 10, np.random.default_rng(0))
    with pytest.raises(ValueError, match=rf"^arrival process 'gamma:{cv}': cv must be between"):
        arrival_cv(f"gamma:{cv}")
    with pytest.raises(ValueError, match="arrival process"):
        get_scenario("rag").build(0, 10, f"gamma:{cv}")
    with pytest.raises(ValueError, match="cv must be between"):
        gamma_arrivals(10, np.random.default_rng(0), float(cv))
    with pytest.raises(ValueError, match="cv must be between"):
        rate_ladder(5, [1.0, 2.0], np.random.default_rng(0), cv=float(cv))


@pytest.mark.parametrize("cv", [MIN_GAMMA_CV, 1.0, MAX_GAMMA_CV])
def test_the_bounds_themselves_give_finite_increasing_times(cv: float) -> None:
    times = make_arrivals(f"gamma:{cv:g}", 2000, np.random.default_rng(1))
    assert np.isfinite(times).all() and (np.diff(times) >= 0).all()


@pytest.mark.parametrize(
    "process", ["poisson:", "gamma:", "poisson:1", "gamma: ", ":", "gamma:x", "gamma:1e"]
)
def test_a_colon_promises_a_number(process: str) -> None:
    """``poisson:`` ran as poisson and the report recorded ``"arrival": "poisson:"``."""
    with pytest.raises(ValueError, match=r"^unknown arrival process"):
        arrival_cv(process)
    with pytest.raises(ValueError, match=r"^unknown arrival process"):
        make_arrivals(process, 3, np.random.default_rng(0))


def test_the_known_names_keep_their_draws() -> None:
    """The default processes draw what they drew: published figures stay."""
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    assert list(make_arrivals("poisson", 5, rng_a)) == list(np.cumsum(rng_b.exponential(1.0, 5)))
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    assert list(make_arrivals("gamma", 5, rng_a)) == list(np.cumsum(rng_b.gamma(0.25, 4.0, 5)))
    assert arrival_cv("poisson") == 1.0 and arrival_cv("gamma") == 2.0
    assert arrival_cv("gamma:3") == 3.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_workload_refuses_a_time_that_is_not_finite(bad: float) -> None:
    """NaN passed the order test (``nan < prev`` is False)."""
    tokens = array("I", [1, 2, 3])
    with pytest.raises(ValueError, match=r"r1 arrives at .* not a finite time"):
        Workload("w", "", [sim_request(i, t, tokens) for i, t in enumerate((0.0, bad, 5.0))])
    with pytest.raises(ValueError, match="not a finite time"):
        Workload("w", "", [sim_request(0, bad, tokens)])
