"""`prefixrouter simulate` from the outside: listing, reports, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from prefixrouter.cli import app
from prefixrouter.sim.scenarios import SCENARIOS, get_scenario

runner = CliRunner()

RESULT_KEYS = {
    "policy", "requests", "completed", "ttft_ms", "e2e_ms", "queue_wait_ms", "throughput_rps",
    "output_tokens_per_s", "prompt_tokens", "cached_tokens", "prefill_tokens", "evictions",
    "load_imbalance", "warm_abandoned",
}  # fmt: skip


def test_list_names_every_scenario_on_one_line_each() -> None:
    res = runner.invoke(app, ["simulate", "--list"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == len(SCENARIOS) >= 11
    assert {ln.split()[0] for ln in lines} == set(SCENARIOS)


def _simulate(tmp_path: Path, name: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    args = ["simulate", "--scenario", "gsp", "--requests", "120", "--workers", "4"]
    args += ["--load", "0.7", "--policies", "prefix_aware,round_robin", "--seed", "5"]
    args += ["--json", str(out)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def test_json_report_schema_and_byte_identical_reruns(tmp_path: Path) -> None:
    a = _simulate(tmp_path, "a")
    assert {"scenario", "workers", "seed", "lower_bound_prefill_tokens", "results"} <= set(a)
    assert [r["policy"] for r in a["results"]] == ["prefix_aware", "round_robin"]
    for r in a["results"]:
        assert set(r) >= RESULT_KEYS
        assert set(r["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
        assert r["completed"] == 120 and r["requests"] == 120
        assert r["prefill_tokens"] >= a["lower_bound_prefill_tokens"]
        for q in ("mean", "p50", "p90", "p99"):  # no policy beats the floor
            assert 0 < a["ttft_floor_ms"][q] <= r["ttft_ms"][q]
    _simulate(tmp_path, "b")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_scale_simulates_the_live_benchs_fleet(tmp_path: Path) -> None:
    # --scale cuts lengths and the scenario's KV as `prefixrouter bench --scale`
    # does, so the simulator runs the live cell's workload.
    from prefixrouter.bench.workload import build_bench_workload
    from prefixrouter.sim.profiles import get_profile
    from prefixrouter.tokenization import load_tokenizer

    out = tmp_path / "half.json"
    args = ["simulate", "--scenario", "doc-qa", "--requests", "40", "--workers", "4"]
    args += ["--load", "0.8", "--scale", "0.5", "--policies", "round_robin", "--json", str(out)]
    res = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "lengths x0.5, 3000 KV blocks" in res.output
    report = json.loads(out.read_text())
    live = build_bench_workload(
        "doc-qa", requests=40, rate=8.0, scale=0.5, workers=4,
        profile=get_profile("llama3-8b-h100"), tokenizer=load_tokenizer(), load=0.8,
    )  # fmt: skip
    assert report["scale"] == 0.5 and report["kv_blocks"] == live.kv_blocks == 3000
    # The bench's cut of the scenario, prompt for prompt; about half the whole one.
    cut = get_scenario("doc-qa").build(0, 40).lengths_scaled(0.5)
    assert report["results"][0]["prompt_tokens"] == cut.prompt_token_total()
    whole = get_scenario("doc-qa").build(0, 40).prompt_token_total()
    assert cut.prompt_token_total() == pytest.approx(whole / 2, rel=0.01)
    res = runner.invoke(app, ["simulate", "--scale", "1.5"])
    assert res.exit_code != 0 and "--scale" in res.output


def test_plot_is_written(tmp_path: Path) -> None:
    png = tmp_path / "out.png"
    res = runner.invoke(
        app,
        ["simulate", "--scenario", "unique", "--requests", "60", "--policies", "round_robin",
         "--plot", str(png)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_deprecated_policy_name_runs_the_policy_under_its_name(tmp_path: Path) -> None:
    out = tmp_path / "old.json"
    args = ["simulate", "--scenario", "gsp", "--requests", "30", "--workers", "2"]
    res = runner.invoke(app, [*args, "--policies", "prefixrouter", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "'prefixrouter' is deprecated, use 'prefix_aware'" in res.output
    assert [r["policy"] for r in json.loads(out.read_text())["results"]] == ["prefix_aware"]


def test_unknown_names_give_one_line_errors() -> None:
    for args, needle in (
        (["--scenario", "nope"], "unknown scenario 'nope'"),
        (["--policies", "prefix_aware,bogus"], "unknown policy 'bogus'"),
        (["--profile", "h9000"], "unknown engine profile 'h9000'"),
    ):
        res = runner.invoke(app, ["simulate", *args])
        assert res.exit_code == 2, res.output
        assert needle in res.output and "Traceback" not in res.output


def test_malformed_trace_names_file_line_and_field(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'
    trace.write_text(good + "\n" + '{"timestamp": 5, "input_length": 600, "output_length": 5}\n')
    res = runner.invoke(app, ["simulate", "--trace", str(trace), "--policies", "round_robin"])
    assert res.exit_code == 2
    assert "t.jsonl:2" in res.output and "hash_ids" in res.output
    assert "Traceback" not in res.output


def test_a_trace_that_cannot_be_read_is_named_with_the_reason(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    res = runner.invoke(app, ["simulate", "--trace", str(missing), "--policies", "round_robin"])
    assert res.exit_code == 2
    # One line, as for a configuration file: the path, then why (no errno).
    flat = " ".join(res.output.split())
    assert f"{missing}: cannot read: No such file or directory" in flat, res.output
    assert "Errno" not in flat and "Traceback" not in flat


TINY = ["simulate", "--scenario", "doc-qa", "--requests", "20", "--policies", "round_robin"]


def _trace_line(input_length: int, output_length: int, timestamp: int = 0) -> str:
    ids = list(range(-(-input_length // 512)))
    return json.dumps({"timestamp": timestamp, "input_length": input_length,
                       "output_length": output_length, "hash_ids": ids})  # fmt: skip


def test_a_request_that_does_not_fit_the_kv_cache_is_refused_before_the_run(
    tmp_path: Path, no_run: None
) -> None:
    res = runner.invoke(app, [*TINY, "--kv-blocks", "10"])
    assert res.exit_code == 2, res.output
    assert (
        "error: --kv-blocks 10: request doc-qa-00000 needs 40,434 tokens (40,308 prompt + 126 "
        "output), the KV cache holds 160 (10 blocks of 16)" in res.stderr
    )
    res = runner.invoke(app, ["simulate", "--scenario", "system-prompt", "--requests", "20",
                              "--profile", "tiny-cpu", "--policies", "round_robin"])  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "error: --profile tiny-cpu: request system-prompt-00000 needs" in res.stderr
    assert "the KV cache holds 4,096 (256 blocks of 16); give more with --kv-blocks" in res.stderr
    trace = tmp_path / "huge.jsonl"
    trace.write_text(_trace_line(600, 5) + "\n" + _trace_line(600, 10**11) + "\n")
    res = runner.invoke(app, ["simulate", "--trace", str(trace), "--policies", "round_robin"])
    assert res.exit_code == 2, res.output
    assert f"error: {trace}:2: input_length 600 + output_length 100,000,000,000 = " in res.stderr
    assert "more than the KV cache holds" in res.stderr


def test_plan_refuses_a_request_that_does_not_fit() -> None:
    from prefixrouter.sim.profiles import get_profile
    from prefixrouter.sim.runner import RequestTooLarge, plan

    workload = get_scenario("doc-qa").build(0, 5)
    with pytest.raises(RequestTooLarge) as err:
        plan(workload, get_profile("llama3-8b-h100"), ["round_robin"], kv_blocks=10)
    assert err.value.request.request_id == "doc-qa-00000" and err.value.source == "kv_blocks"
    assert err.value.capacity_tokens == 160 < err.value.needed_tokens


def test_output_paths_are_checked_before_the_run(tmp_path: Path, no_run: None) -> None:
    a_file = tmp_path / "a1.json"
    a_file.write_text("{}")
    cases = [
        (["--json", f"{a_file}/x.json"], f"--json {a_file}/x.json: {a_file} is not a folder"),
        (["--json", str(tmp_path)], f"--json {tmp_path}: is a directory"),
        (["--plot", str(tmp_path / "out.txt")], "expected a file name ending in .png"),
        (["--plot", "."], "--plot .: is a directory"),
        (["--plot", str(tmp_path / "plotnoext")], "expected a file name ending in .png"),
    ]  # fmt: skip
    for args, message in cases:
        res = runner.invoke(app, [*TINY, *args])
        assert res.exit_code == 2, res.output
        assert message in res.stderr
    res = runner.invoke(app, [*TINY, "--seed", str(2**64)])
    assert res.exit_code == 2 and "--seed" in res.output


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_failed_write_is_one_line() -> None:
    res = runner.invoke(app, [*TINY, "--json", "/dev/full"])
    assert res.exit_code == 2
    assert "error: --json /dev/full: cannot write: No space left on device" in res.stderr


def test_a_rate_overrides_the_load_and_the_report_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.figure

    titles: list[str] = []

    def savefig(fig: matplotlib.figure.Figure, path: object, **kwargs: object) -> None:
        titles.append(fig.get_suptitle())

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    out, png = tmp_path / "rl.json", tmp_path / "rl.png"
    res = runner.invoke(app, [*TINY, "--rate", "2", "--load", "0.9", "--json", str(out),
                              "--plot", str(png)], env={"COLUMNS": "200"})  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "note: --rate 2 overrides --load 0.9" in res.stderr
    report = json.loads(out.read_text())
    assert report["load"] is None and report["rate_rps"] == 2.0
    assert "doc-qa · 4 workers · 2.00 req/s" in res.stdout and "load 0.90" not in res.stdout
    assert titles == ["doc-qa: 4 workers, 2.00 req/s"]
    # The same run as --rate alone: nothing simulated changes.
    alone = tmp_path / "r.json"
    assert runner.invoke(app, [*TINY, "--rate", "2", "--json", str(alone)]).exit_code == 0
    assert json.loads(alone.read_text()) == report


def test_options_the_workload_would_ignore_are_refused_or_noted(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(_trace_line(600, 5) + "\n")
    for args, message in (
        (["--trace", str(trace), "--scenario", "hot-prefix"], "give --trace or --scenario"),
        (["--rate-scale", "5"], "--rate-scale speeds up a trace replay"),
        (["--trace", str(trace), "--rate-scale", "2", "--load", "1"], "--rate-scale has no effect"),
        (["--trace", str(trace), "--arrival", "gamma:2"], "a trace replays its own arrival times"),
        (["--trace-format", "foo"], "--trace-format applies to --trace FILE"),
    ):  # fmt: skip
        res = runner.invoke(
            app, ["simulate", "--requests", "20", "--policies", "round_robin", *args]
        )
        assert res.exit_code == 2, (args, res.output)
        assert message in res.stderr, (args, res.stderr)
    # One router has no peers to sync with: the run is the plain one, with a note.
    for args in (["--no-sync"], ["--sync-lag-ms", "50"]):
        res = runner.invoke(app, [*TINY, *args])
        assert res.exit_code == 0, res.output
        assert "note: --no-sync and --sync-lag-ms have no effect on one router" in res.stderr
    assert "note:" not in runner.invoke(app, TINY).stderr


def test_the_report_records_every_option_that_changes_the_results(tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    args = [*TINY, "--arrival", "gamma:3", "--no-token-count", "--limit", "15", "--json", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    report = json.loads(out.read_text())
    assert report["arrival"] == "gamma:3" and report["token_count"] is False
    assert report["requests"] == 20 and report["limit"] == 15
    trace = tmp_path / "t.jsonl"
    trace.write_text(_trace_line(600, 5) + "\n" + _trace_line(700, 5, timestamp=9) + "\n")
    args = ["simulate", "--trace", str(trace), "--rate-scale", "2", "--policies", "round_robin"]
    assert runner.invoke(app, [*args, "--json", str(out)]).exit_code == 0
    report = json.loads(out.read_text())
    assert report["trace"] == str(trace) and report["rate_scale"] == 2.0
    # A default run's report keeps the keys it had.
    args = ["simulate", "--policies", "round_robin", "--requests", "5", "--json", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    added = {"trace", "arrival", "rate_scale", "token_count", "limit"}
    assert not added & set(json.loads(out.read_text()))


def test_console_script_runs(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("prefixrouter")
    out = subprocess.run(
        [str(exe), "simulate", "--scenario", "templates-bad", "--requests", "40",
         "--policies", "round_robin"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "round_robin" in out.stdout
