"""Every command that writes files refuses two outputs in one file, before it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from prefixrouter.cli import app

runner = CliRunner()


def test_bench_refuses_two_outputs_in_one_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--json X --markdown X`` ran, and the markdown replaced the JSON."""

    def no_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the bench ran with two outputs in one file")

    monkeypatch.setattr("prefixrouter.bench.runner.run_bench", no_run)
    out = tmp_path / "bench.out"
    res = runner.invoke(app, ["bench", "--no-overhead", "--json", str(out), "--markdown", str(out)])
    assert res.exit_code == 2, (res.output, res.exception)
    assert res.output.strip() == f"error: --markdown {out}: is the --json output"
    assert not out.exists()


def test_analyze_refuses_its_log_and_two_outputs_in_one_file(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text('{"prompt": "hello"}\n')
    res = runner.invoke(app, ["analyze", str(log), "--json", str(log)])
    assert res.exit_code == 2 and res.output.strip() == f"error: --json {log}: is the log it reads"
    png = tmp_path / "a.png"
    res = runner.invoke(app, ["analyze", str(log), "--json", str(png), "--plot", str(png)])
    assert res.exit_code == 2 and res.output.strip() == f"error: --plot {png}: is the --json output"
