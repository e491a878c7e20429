"""Fixtures for the whole suite.

The locally built tokenizer is cached per session in a temporary directory
(``PREFIXROUTER_CACHE``), so no test writes into the user's home directory and
every session proves that the tokenizer builds from scratch.

``async def`` tests run on a fresh event loop each, with a 30 s bound (a tiny
runner below: the project has no pytest-asyncio).
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Iterator

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(asyncio.wait_for(pyfuncitem.obj(**args), timeout=30))
    return True


@pytest.fixture(scope="session", autouse=True)
def tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Point the tokenizer cache at a session temp dir (built once, on first use)."""
    path = str(tmp_path_factory.mktemp("prefixrouter-cache"))
    old = os.environ.get("PREFIXROUTER_CACHE")
    os.environ["PREFIXROUTER_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("PREFIXROUTER_CACHE", None)
    else:
        os.environ["PREFIXROUTER_CACHE"] = old
