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
    rows = {ln.split()[1]: ln for ln in lines if "round_robin" in ln or "prefix_aware" in ln}
    assert set(rows) == {"round_robin", "prefix_aware"}
    for row in rows.values():
        assert "24/24" in row  # every request answered through each router
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(60)
def test_the_served_gateway_opens_its_admin_api_to_the_generated_key_only() -> None:
    import asyncio

    import aiohttp

    from prefixrouter.demo.run import serve_forever
    from prefixrouter.harness.processes import Fleet

    async def status(url: str, auth: str | None) -> int:
        headers = {"Authorization": auth} if auth else None
        async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
            return r.status

    with Fleet() as fleet:
        toy = ["--profile", "tiny-cpu", "--time-scale", "50"]
        engine = fleet.start("engine", "prefixrouter.simulated_engine", toy)
        asyncio.run(fleet.wait_healthy([engine]))

        async def body() -> None:
            gateway = await serve_forever(fleet, [engine], "demo-key-1")
            url = gateway.url + "/admin/workers"
            assert await status(url, None) == 401
            assert await status(url, "Bearer nope") == 401
            assert await status(url, "Bearer demo-key-1") == 200
            fleet.stop(gateway)
            gateway = await serve_forever(fleet, [engine])  # no key: the admin API is off
            assert await status(gateway.url + "/admin/workers", "Bearer demo-key-1") == 403

        asyncio.run(asyncio.wait_for(body(), 40))
