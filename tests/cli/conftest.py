"""Fixtures for the command-line tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any simulation run fail the test: the error must come before the run."""
    import prefixrouter.sim.runner as sim_runner

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the simulation ran before the error")

    monkeypatch.setattr(sim_runner, "run_plan", must_not_run)
