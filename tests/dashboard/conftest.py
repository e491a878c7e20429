"""A live gateway for the dashboard's tests: two ``prefixrouter engine`` processes behind it.

Real processes on loopback (the harness's :class:`~prefixrouter.harness.processes.Fleet`,
stopped by PID): the simulated engines at 20x speed with the tiny CPU profile and
``python -m prefixrouter.gateway`` with an admin key, started once for the package's tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import orjson
import pytest

from prefixrouter.gateway.cli import ADMIN_KEY_ENV
from prefixrouter.harness.processes import Fleet
from tests.admin_client import ADMIN_KEY


@dataclass
class Live:
    """The running gateway."""

    url: str
    key: str
    workers: list[str]


@pytest.fixture(scope="package")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("dashboard")
    with Fleet() as fleet:
        args = ["--profile", "tiny-cpu", "--time-scale", "20", "--model", "tiny"]
        args += ["--kv-blocks", "8192"]
        engines = [fleet.start(f"e{i}", "prefixrouter.simulated_engine", args) for i in range(2)]
        asyncio.run(fleet.wait_healthy(engines, timeout_s=30.0))
        cfg = tmp / "gateway.yaml"
        cfg.write_bytes(
            orjson.dumps(  # JSON is YAML
                {
                    "workers": [{"url": e.url, "id": e.name} for e in engines],
                    "metrics_poll": {"interval_s": 0.5},
                }
            )
        )
        env = {ADMIN_KEY_ENV: ADMIN_KEY}  # in the environment, as a secret should be
        gw = fleet.start("gateway", "prefixrouter.gateway", ["--config", str(cfg)], env=env)
        asyncio.run(fleet.wait_healthy([gw], timeout_s=30.0))
        yield Live(gw.url, ADMIN_KEY, [e.name for e in engines])
