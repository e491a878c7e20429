"""A live gateway for the dashboard's tests: two ``prefixrouter engine`` processes behind it.

Real processes on loopback (the harness's :class:`~prefixrouter.harness.processes.Fleet`,
stopped by PID): the simulated engines at 20x speed with the tiny CPU profile and
``python -m prefixrouter.gateway`` with an admin key, started once for the package's tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from prefixrouter.gateway.cli import ADMIN_KEY_ENV
from prefixrouter.harness.processes import Fleet
from tests.admin_client import ADMIN_KEY
from tests.gateway.served import engines_behind_gateway


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
        settings = {"metrics_poll": {"interval_s": 0.5}}
        env = {ADMIN_KEY_ENV: ADMIN_KEY}  # in the environment, as a secret should be
        engines, gw = engines_behind_gateway(fleet, tmp / "gateway.yaml", settings, env=env)
        yield Live(gw.url, ADMIN_KEY, [e.name for e in engines])
