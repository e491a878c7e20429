"""`prefixrouter simulate` on inputs that once ran wrong: one-line errors, honest reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from prefixrouter.cli import MAX_WORKERS, app

runner = CliRunner()
TINY = ["simulate", "--scenario", "gsp", "--requests", "20", "--workers", "2"]
EPOCH_MS = 1_714_000_000_000


def _trace(path: Path, shift: int = 0, n: int = 12) -> Path:
    rows = [
        {"timestamp": shift + 400 * i, "input_length": 600 + 10 * i, "output_length": 5,
         "hash_ids": [0, 100 + i]}
        for i in range(n)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _error(args: list[str]) -> str:
    """The error line of a refused run (exit 2, no traceback): one, the last on stderr
    (after a progress bar, if the error needed the prompts scanned)."""
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and res.stderr.strip().splitlines()[-1] == errors[0], res.stderr
    return errors[0]


def _report(args: list[str], out: Path) -> dict[str, Any]:
    if out.is_dir():
        out = out / "report.json"
    res = runner.invoke(app, [*args, "--json", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def test_an_epoch_trace_at_a_rate_is_the_trace_from_zero(tmp_path: Path) -> None:
    """It arrived as one burst and reported 48 req/s under a title of 5."""
    args = ["simulate", "--workers", "2", "--policies", "prefix_aware,round_robin"]
    reports = []
    for name, shift in (("zero", 0), ("epoch", EPOCH_MS)):
        (tmp_path / name).mkdir()
        trace = _trace(tmp_path / name / "t.jsonl", shift)  # one name: the report's scenario
        reports.append(_report([*args, "--trace", str(trace), "--rate", "5"], tmp_path / name))
    zero, epoch = ({k: v for k, v in r.items() if k != "trace"} for r in reports)
    assert zero == epoch
    for r in zero["results"]:
        assert r["throughput_rps"] < 6  # asked for 5; the burst gave about 10 times that


def test_a_trace_span_past_float_precision_is_refused(tmp_path: Path) -> None:
    trace = tmp_path / "huge.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}\n'
        '{"timestamp": 1e18, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}\n'
    )
    line = _error(["simulate", "--trace", str(trace), "--policies", "prefix_aware"])
    assert line.startswith(f"error: {trace}:2: field 'timestamp': ")


@pytest.mark.parametrize("cv", ["1e-300", "1e-160", "1e160"])
def test_an_arrival_cv_out_of_range_is_refused(cv: str, no_run: None) -> None:
    """A traceback, a table of NaN, a hang."""
    line = _error([*TINY, "--policies", "round_robin", "--arrival", f"gamma:{cv}"])
    assert line.startswith(f"error: --arrival: arrival process 'gamma:{cv}': cv must be between")


def test_an_arrival_name_with_an_empty_argument_is_refused(no_run: None) -> None:
    for process in ("poisson:", "gamma:"):
        line = _error([*TINY, "--arrival", process])
        assert line.startswith(f"error: --arrival: unknown arrival process '{process}'")


def test_an_output_is_never_the_input_nor_the_other_output(tmp_path: Path, no_run: None) -> None:
    """--json on the trace replaced the trace with the report."""
    trace = _trace(tmp_path / "t.jsonl")
    before = trace.read_bytes()
    args = ["simulate", "--trace", str(trace), "--policies", "round_robin"]
    line = _error([*args, "--json", str(trace)])
    assert line == f"error: --json {trace}: is the trace it reads"
    link = tmp_path / "link.jsonl"
    link.symlink_to(trace)
    assert "is the trace it reads" in _error([*args, "--json", str(link)])
    spelled = tmp_path / "sub" / ".." / "t.jsonl"
    assert "is the trace it reads" in _error([*args, "--json", str(spelled)])
    assert trace.read_bytes() == before
    png = tmp_path / "same.png"
    line = _error([*TINY, "--json", str(png), "--plot", str(png)])
    assert line == f"error: --plot {png}: is the --json output"


def test_the_bundled_trace_is_reported_as_the_scenario_named(tmp_path: Path) -> None:
    args = ["simulate", "--scenario", "mooncake-conversation", "--requests", "30"]
    res = runner.invoke(app, [*args, "--policies", "round_robin", "--json",
                              str(tmp_path / "m.json")], env={"COLUMNS": "200"})  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "m.json").read_text())["scenario"] == "mooncake-conversation"
    assert "mooncake-conversation · 16 workers" in res.stdout


def test_no_sync_drops_the_lag_with_a_note(tmp_path: Path) -> None:
    args = [*TINY, "--policies", "round_robin", "--replicas", "2", "--no-sync"]
    res = runner.invoke(app, [*args, "--sync-lag-ms", "50", "--json", str(tmp_path / "a.json")])
    assert res.exit_code == 0, res.output
    assert "note: --sync-lag-ms has no effect with --no-sync" in res.stderr
    with_lag = json.loads((tmp_path / "a.json").read_text())
    assert with_lag["replicas"] == {"routers": 2, "sync": False, "sync_lag_ms": 0.0}
    without = _report(args, tmp_path / "b.json")
    assert with_lag == without


def test_an_infinite_lag_is_refused(no_run: None) -> None:
    """It ran, and the JSON said ``"sync_lag_ms": null`` (typer's range lets inf through):
    refused naming the option (the fleet's configuration refuses it for the API)."""
    line = _error([*TINY, "--replicas", "3", "--sync-lag-ms", "inf"])
    assert line == "error: --sync-lag-ms inf: must be a finite number of milliseconds"


def test_a_load_or_rate_that_overflows_names_the_option(no_run: None) -> None:
    line = _error([*TINY, "--load", "1e308"])
    assert line.startswith("error: --load 1e+308: the arrival rate it gives (inf req/s)")
    line = _error([*TINY, "--rate", "inf"])
    assert line.startswith("error: --rate inf: expected a positive finite number")


def test_a_huge_rate_has_a_readable_title() -> None:
    res = runner.invoke(app, [*TINY, "--policies", "round_robin", "--rate", "1e308"],
                        env={"COLUMNS": "200"})  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "gsp · 2 workers · 1e+308 req/s" in res.stdout


def test_workers_are_bounded(no_run: None) -> None:
    """100,000 workers ran for minutes with no output (each arrival scores every worker)."""
    res = runner.invoke(app, [*TINY, "--workers", str(MAX_WORKERS + 1)], env={"COLUMNS": "200"})
    assert res.exit_code == 2 and "Traceback" not in res.output
    flat = " ".join(res.stderr.split())
    assert "Invalid value for '--workers'" in flat and f"{MAX_WORKERS}" in flat, res.stderr
    res = runner.invoke(app, ["simulate", "--help"], env={"COLUMNS": "400"})
    help_text = " ".join(res.output.split())
    assert "at most 4,096" in help_text and "15 s" not in help_text


def test_the_prompts_are_scanned_once_with_a_progress_bar(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The bound, the floor and the load's capacity each hashed every prompt, silently."""
    from prefixrouter.sim import report

    calls: list[int] = []
    scan = report.first_seen

    def counted(workload: Any, on_progress: Any = None) -> report.FirstSeen:
        calls.append(len(workload.requests))
        return scan(workload, on_progress)

    monkeypatch.setattr(report, "first_seen", counted)
    res = runner.invoke(app, [*TINY, "--policies", "round_robin", "--load", "0.5"])
    assert res.exit_code == 0, res.output
    assert calls == [20] and "prefix bound" in res.stderr
    res = runner.invoke(app, [*TINY, "--policies", "round_robin", "--rate", "1"])
    assert res.exit_code == 0, res.output
    assert calls == [20, 20] and "prefix bound" in res.stderr


def test_a_policy_named_twice_runs_once(tmp_path: Path) -> None:
    args = [*TINY, "--policies", "prefix_aware,round_robin,prefix_aware"]
    res = runner.invoke(app, [*args, "--json", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    assert "note: --policies: prefix_aware is named twice; it runs once" in res.stderr
    report = json.loads((tmp_path / "p.json").read_text())
    assert [r["policy"] for r in report["results"]] == ["prefix_aware", "round_robin"]
