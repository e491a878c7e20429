"""A trace's times are counted from its first arrival, wherever its timestamps start."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from prefixrouter.sim.profiles import get_profile
from prefixrouter.sim.runner import plan
from prefixrouter.sim.traces import MAX_SPAN_S, TraceFormatError, load_mooncake

EPOCH_MS = 1_714_000_000_000  # 2024-04-24, in ms: what a production log stamps
ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 1300, "output_length": 3, "hash_ids": [0, 1, 3]},
    {"timestamp": 3000, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
    {"timestamp": 6000, "input_length": 1536, "output_length": 5, "hash_ids": [0, 4, 5]},
]


def _write(path: Path, rows: Sequence[dict[str, object]], shift: float = 0) -> Path:
    shifted = [{**r, "timestamp": r["timestamp"] + shift} for r in rows]  # type: ignore[operator]
    path.write_text("".join(json.dumps(r) + "\n" for r in shifted))
    return path


def _arrivals(path: Path, **kwargs: object) -> list[float]:
    return [r.arrival for r in load_mooncake(path, **kwargs).requests]  # type: ignore[arg-type]


def test_an_epoch_stamped_trace_replays_as_the_same_trace_from_zero(tmp_path: Path) -> None:
    zero = _write(tmp_path / "zero.jsonl", ROWS)
    epoch = _write(tmp_path / "epoch.jsonl", ROWS, EPOCH_MS)
    assert _arrivals(epoch) == _arrivals(zero) == [0.0, 1.5, 3.0, 6.0]
    assert _arrivals(epoch, rate_scale=2) == _arrivals(zero, rate_scale=2)


def test_a_rate_stretches_an_epoch_trace_as_the_trace_from_zero(tmp_path: Path) -> None:
    """The tour's burst: 200 requests within 1e-6 s of each other, titled 5 req/s."""
    prof = get_profile("llama3-8b-h100")
    got = []
    for name, shift in (("zero", 0), ("epoch", EPOCH_MS)):
        wl = load_mooncake(_write(tmp_path / f"{name}.jsonl", ROWS, shift))
        p = plan(wl, prof, ["round_robin"], workers=2, rate=2.0)
        got.append([r.arrival for r in p.workload.requests])
    assert got[0] == got[1]
    assert got[0][-1] == pytest.approx((len(ROWS) - 1) / 2.0 * 4 / 3)  # 4 requests at 2/s


def test_the_stretch_counts_from_the_first_arrival_of_any_workload() -> None:
    """A workload built in code, whose times need not start at 0, is stretched over its span."""
    from dataclasses import replace

    from prefixrouter.sim.scenarios import get_scenario

    wl = get_scenario("gsp").build(0, 20)
    late = replace(
        wl,
        fixed_times=True,
        requests=[replace(r, arrival=r.arrival + 1e6) for r in wl.requests],
    )
    early = replace(late, requests=[replace(r, arrival=r.arrival - 1e6) for r in late.requests])
    prof = get_profile("llama3-8b-h100")
    a = plan(late, prof, ["round_robin"], workers=2, rate=3.0).workload.requests
    b = plan(early, prof, ["round_robin"], workers=2, rate=3.0).workload.requests
    assert a[0].arrival == b[0].arrival == 0.0
    assert [r.arrival for r in a] == pytest.approx([r.arrival for r in b])


def test_a_window_of_an_unsorted_trace_counts_from_its_smallest_timestamp(tmp_path: Path) -> None:
    """``start`` once took the first kept line's time, so an earlier one arrived before 0."""
    rows = [ROWS[0], ROWS[2], ROWS[1], ROWS[3]]  # 0, 3000, 1500, 6000 ms
    arrivals = _arrivals(_write(tmp_path / "t.jsonl", rows), start=1)
    assert arrivals == [0.0, 1.5, 4.5]


def test_a_span_past_microsecond_precision_names_the_line_and_field(tmp_path: Path) -> None:
    """At 1e18 ms a millisecond of prefill added to an arrival vanished: TTFT read 0."""
    rows = [dict(ROWS[0]), {**ROWS[1], "timestamp": 10**18}]
    path = _write(tmp_path / "huge.jsonl", rows)
    with pytest.raises(TraceFormatError, match=r"huge\.jsonl:2: field 'timestamp': "):
        load_mooncake(path)
    # Just inside the limit loads; slowing the replay down can take it past.
    ok_ms = int(MAX_SPAN_S * 1000) - 1
    inside = _write(tmp_path / "inside.jsonl", [dict(ROWS[0]), {**ROWS[1], "timestamp": ok_ms}])
    assert load_mooncake(inside).requests[-1].arrival == pytest.approx(MAX_SPAN_S)
    with pytest.raises(TraceFormatError, match="field 'timestamp'"):
        load_mooncake(inside, rate_scale=0.5)


def test_huge_timestamps_close_together_keep_their_gaps(tmp_path: Path) -> None:
    """Big, but a short span: integer ms are subtracted exactly before becoming floats."""
    base = 10**17 + 1  # past 2**53: as a float, +1 ms would be lost
    path = _write(tmp_path / "t.jsonl", [dict(ROWS[0]), dict(ROWS[1])], base)
    assert _arrivals(path) == [0.0, 1.5]
    one = _write(tmp_path / "one.jsonl", [{**ROWS[0], "timestamp": 1e300}])
    assert _arrivals(one) == [0.0]
