"""``benchmarks/soak.py`` for 2 minutes: faults on a schedule, nothing lost, RSS bounded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]
MINUTES = 2


def test_a_two_minute_soak_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", str(MINUTES),
           "--gap-s", "8", "--json", str(out), "--plot", str(png)]  # fmt: skip
    # The run's own 120 s, the fleet's start and stop, and room for a loaded machine.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = orjson.loads(out.read_bytes())
    for key in ("requests", "errors", "lost", "duplicated", "faults", "per_minute"):
        assert key in report
    assert report["requests"] > 0.5 * report["rate"] * 60 * MINUTES
    assert report["lost"] == 0 and report["duplicated"] == 0, report["examples"]
    assert report["stuck_in_flight"] == 0 and report["gateway_tracebacks"] == 0
    assert report["complete"] + sum(report["errors"].values()) == report["requests"]
    assert len(report["faults"]) >= 3  # kill and restart, freeze, slow at least
    rows = report["per_minute"]
    assert [r["minute"] for r in rows] == list(range(1, MINUTES + 1))
    assert all(r["p99_ttft_s"] is not None and r["p99_ttft_s"] > 0 for r in rows)
    rss = [r["gateway_rss_mb"] for r in rows]
    # Bounded: no minute past 1 GiB, and no growth worth the name in 2 minutes
    # (measured 64.5 then 66.8 MiB).
    assert all(0 < m < 1024 for m in rss) and rss[-1] < 1.5 * rss[0], rss
    assert png.stat().st_size > 10_000
