"""`prefixrouter demo` end to end: real engine and gateway processes on loopback."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefixrouter.demo.workload import build_workload


def test_workload_is_deterministic_and_mixes_both_kinds() -> None:
    a, b = build_workload(40, seed=3), build_workload(40, seed=3)
    assert a == b
    assert {r.kind for r in a} == {"doc-qa", "system-prompt"}
    assert all(x.offset_s < y.offset_s for x, y in itertools.pairwise(a))
    assert build_workload(40, seed=4) != a


@pytest.mark.timeout(180)
def test_demo_runs_both_routers_and_writes_a_plot(tmp_path: Path, tokenizer_cache: str) -> None:
    exe = Path(sys.executable).with_name("prefixrouter")
    png = tmp_path / "demo.png"
    env = {**os.environ, "PREFIXROUTER_CACHE": tokenizer_cache}
    out = subprocess.run(
        [str(exe), "demo", "--workers", "2", "--requests", "24", "--rate", "12",
         "--plot", str(png)],
        capture_output=True, text=True, timeout=170, check=False, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    rows = {ln.split()[1]: ln for ln in lines if "round_robin" in ln or "prefixrouter" in ln}
    assert set(rows) == {"round_robin", "prefixrouter"}
    for row in rows.values():
        assert "24/24" in row  # every request answered through each router
    assert png.read_bytes()[:4] == b"\x89PNG"
