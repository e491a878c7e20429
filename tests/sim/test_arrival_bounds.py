"""Arrival processes refuse what would give no usable times; workloads refuse such times."""

from __future__ import annotations

import math
from array import array

import numpy as np
import pytest

from prefixrouter.core.types import PrefixClass, RequestId
from prefixrouter.sim.scenarios import get_scenario
from prefixrouter.sim.workload import (
    MAX_GAMMA_CV,
    MIN_GAMMA_CV,
    SIM_NAMESPACE,
    SimRequest,
    Workload,
    arrival_cv,
    gamma_arrivals,
    make_arrivals,
    rate_ladder,
)


@pytest.mark.parametrize("cv", ["1e-300", "1e-160", "0.009", "100.5", "1e160", "1e300"])
def test_a_gamma_cv_out_of_range_is_refused(cv: str) -> None:
    """1e-300 divided by zero, 1e160 hung the event loop, 1e-160 gave a table of NaN."""
    with pytest.raises(ValueError, match=r"cv must be between 0\.01 and 100"):
        make_arrivals(f"gamma:{cv}", 10, np.random.default_rng(0))
    with pytest.raises(ValueError, match="arrival process"):
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


@pytest.mark.parametrize("process", ["poisson:", "gamma:", "poisson:1", "gamma: ", ":"])
def test_a_colon_promises_a_number(process: str) -> None:
    """``poisson:`` ran as poisson and the report recorded ``"arrival": "poisson:"``."""
    with pytest.raises(ValueError, match="unknown arrival process"):
        arrival_cv(process)
    with pytest.raises(ValueError, match="unknown arrival process"):
        make_arrivals(process, 3, np.random.default_rng(0))


def test_the_known_names_keep_their_draws() -> None:
    """The default processes draw what they drew: published figures stay."""
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    assert list(make_arrivals("poisson", 5, rng_a)) == list(np.cumsum(rng_b.exponential(1.0, 5)))
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    assert list(make_arrivals("gamma", 5, rng_a)) == list(np.cumsum(rng_b.gamma(0.25, 4.0, 5)))
    assert arrival_cv("poisson") == 1.0 and arrival_cv("gamma") == 2.0
    assert arrival_cv("gamma:3") == 3.0


def _request(i: int, arrival: float) -> SimRequest:
    return SimRequest(
        RequestId(f"r{i}"), arrival, SIM_NAMESPACE, (array("I", [1, 2, 3]),), 1,
        PrefixClass.SESSION, "g",
    )  # fmt: skip


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_workload_refuses_a_time_that_is_not_finite(bad: float) -> None:
    """NaN passed the order test (``nan < prev`` is False)."""
    with pytest.raises(ValueError, match=r"r1 arrives at .* not a finite time"):
        Workload("w", "", [_request(0, 0.0), _request(1, bad), _request(2, 5.0)])
    with pytest.raises(ValueError, match="not a finite time"):
        Workload("w", "", [_request(0, bad)])
