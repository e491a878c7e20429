"""Fixtures for the whole suite.

The locally built tokenizer is cached per session in a temporary directory
(``PREFIXROUTER_CACHE``), so no test writes into the user's home directory and
every session proves that the tokenizer builds from scratch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


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
