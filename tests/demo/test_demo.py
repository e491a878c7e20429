"""`prefixrouter demo` end to end: real engine and gateway processes on loopback."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prefixrouter.cli import app
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

    from prefixrouter.demo.cli import served_lines
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
            # --serve prints where the dashboard is: its page, whose data opens to the key.
            (line,) = [x for x in served_lines(gateway.url, "demo-key-1") if "dashboard:" in x]
            page = line.split("dashboard: ", 1)[1]
            assert page == f"{gateway.url}/dashboard#key=demo-key-1"
            assert await status(page.split("#")[0], None) == 200
            snapshot = gateway.url + "/dashboard/snapshot"
            assert await status(snapshot, None) == 401
            assert await status(snapshot, "Bearer demo-key-1") == 200
            fleet.stop(gateway)
            gateway = await serve_forever(fleet, [engine])  # no key: the admin API is off
            assert await status(gateway.url + "/admin/workers", "Bearer demo-key-1") == 403

        asyncio.run(asyncio.wait_for(body(), 40))


@pytest.mark.timeout(120)
def test_demo_envoy_removes_its_temporary_folder_when_it_ends(
    tmp_path: Path, tokenizer_cache: str
) -> None:
    import re
    import signal

    exe = Path(sys.executable).with_name("prefixrouter")
    tmp = tmp_path / "tmp"  # the demo's TMPDIR: whatever it leaves there is seen
    tmp.mkdir()
    env = {**os.environ, "PREFIXROUTER_CACHE": tokenizer_cache, "TMPDIR": str(tmp)}
    proc = subprocess.Popen(
        [str(exe), "demo", "--envoy", "--workers", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        bootstrap = None
        for line in proc.stdout:
            if (found := re.match(r"Envoy's bootstrap.*: (\S+)$", line.strip())) is not None:
                bootstrap = Path(found.group(1))
                break
        assert bootstrap is not None, proc.stderr.read() if proc.stderr else ""
        # Printed to be read while the demo runs: it is there until the end.
        assert bootstrap.stat().st_size > 0
        assert bootstrap.parent.name.startswith("prefixrouter-demo-envoy-")
        proc.send_signal(signal.SIGINT)  # Ctrl-C, as soon as the line is there
        # The handler is in place before the lines are printed: a Ctrl-C that follows
        # them at once is the one way out (it could land between the print and the
        # wait, as a KeyboardInterrupt: an exit of 130). Both pipes are drained
        # meanwhile: a demo blocked writing to a full pipe would never exit.
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not bootstrap.parent.exists()
    assert not list(tmp.glob("prefixrouter-demo-envoy-*"))


def test_a_plot_path_that_cannot_be_written_is_refused_before_the_engines_start(
    tmp_path: Path,
) -> None:
    (tmp_path / "file").write_text("")
    for bad in (tmp_path, tmp_path / "demo.txt", tmp_path / "file" / "demo.png"):
        result = CliRunner().invoke(app, ["demo", "--plot", str(bad)])
        assert result.exit_code == 2, result.output
        assert result.output.strip().splitlines()[-1].startswith(f"error: --plot {bad}: ")
        assert "through" not in result.output  # no router ran
