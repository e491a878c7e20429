from __future__ import annotations

import pytest

from prefixrouter.core import Router, WorkerId
from tests.core.conftest import request, send, tokens, with_loads

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
DOC = tokens(1, 1_600)


@pytest.mark.parametrize(
    ("loads", "worker", "tier"),
    [
        ((9, 0), W1, "balance"),  # spread 9 > 8: least loaded, the match ignored
        ((8, 0), W0, "cache_hit"),  # spread 8; 8 <= mean 4 + 1 * std 4
    ],
)
def test_imbalance_beyond_8_restricts_to_least_loaded(
    loads: tuple[int, int], worker: WorkerId, tier: str
) -> None:
    r = Router("aibrix_prefix")
    send(r, request("a", DOC), with_loads(*loads), W0, 0.0)
    d = r.route(request("q", DOC), with_loads(*loads), 1.0)
    assert (d.worker_id, d.tier) == (worker, tier)


def test_match_percent_desc_then_running_asc_within_mean_plus_k_std() -> None:
    r = Router("aibrix_prefix")
    ws = with_loads(5, 1, 0)
    send(r, request("a", DOC), ws, W0, 0.0)
    send(r, request("b", DOC[:800]), ws, W1, 0.0)
    # mean 2, std 2.16: w0 (100%, 5 running) is above the bound, w1 (50%, 1) is not
    d = r.route(request("q", DOC), ws, 1.0)
    assert (d.worker_id, d.tier) == (W1, "cache_hit")
    assert {c.worker_id: c.score for c in d.candidates} == pytest.approx({W0: 100, W1: 50, W2: 0})
    send(r, request("c", DOC), ws, W2, 0.0)
    # now w0 and w2 both match 100%: fewer running first
    assert r.route(request("q", DOC), ws, 1.0).worker_id == W2


def test_least_request_when_no_matching_worker_passes_the_bound() -> None:
    r = Router("aibrix_prefix")
    ws = with_loads(5, 0, 0)
    send(r, request("a", DOC), ws, W0, 0.0)
    d = r.route(request("q", DOC), ws, 1.0)  # bound 1.67 + 2.36 = 4.02 < 5
    assert (d.worker_id, d.tier) == (W1, "cache_miss")
    assert d.predicted_cached_tokens == 0
