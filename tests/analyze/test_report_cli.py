"""Report, verdict and the `analyze` command."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
import typer
from typer.testing import CliRunner

from prefixrouter.analyze import analyze_log
from prefixrouter.analyze.cli import MAX_ERRORS_SHOWN, analyze
from prefixrouter.prompt import doc_qa_request

runner = CliRunner()
app = typer.Typer()
app.command()(analyze)

REQUIRED = {
    "requests", "prompt_tokens", "reusable_tokens_unlimited", "reusable_share_unlimited",
    "reusable_share_kv", "top_prefixes", "divergences", "verdict",
}  # fmt: skip


def _write(path: Path, bodies: list[dict]) -> Path:  # type: ignore[type-arg]
    path.write_bytes(b"".join(orjson.dumps(b) + b"\n" for b in bodies))
    return path


def _unique_log(path: Path, n: int = 30) -> Path:
    return _write(path, [{"prompt": f"{i:04d} " + f"unique words {i} " * 80} for i in range(n)])


def _doc_log(path: Path) -> Path:
    doc = "".join(f"Paragraph {i} of the handbook explains rule {i}.\n" for i in range(150))
    bodies = [
        doc_qa_request(model="m", instruction="Answer.", document=doc, question=f"Q{i}?").body
        for i in range(20)
    ]
    bodies += [{"prompt": f"{i} other " * 20} for i in range(5)]
    return _write(path, bodies)


def test_verdict_no_reuse(tmp_path: Path) -> None:
    report, _ = analyze_log(_unique_log(tmp_path / "u.jsonl"))
    assert report["reusable_share_unlimited"] < 0.01
    assert report["pays"] is False and report["first_class"] is None
    assert report["verdict"].startswith("Prefix-aware routing does not pay for this traffic")
    assert "least loaded" in report["verdict"]


def test_verdict_high_reuse_names_the_class(tmp_path: Path) -> None:
    report, _ = analyze_log(_doc_log(tmp_path / "d.jsonl"))
    assert report["reusable_share_unlimited"] > 0.8
    assert report["pays"] is True and report["first_class"] == "document"
    assert report["verdict"].startswith("Prefix-aware routing pays for this traffic")
    assert "Roll it out first on document traffic" in report["verdict"]


def test_verdict_when_prefixes_do_not_fit_the_cache(tmp_path: Path) -> None:
    from prefixrouter.analyze import AnalyzeParams

    docs = ["".join(f"{d}-{i} text here. " for i in range(500)) for d in range(10)]
    bodies = [{"prompt": f"{docs[d]}\n\nQ{r}"} for r in range(3) for d in range(10)]
    report, _ = analyze_log(_write(tmp_path / "c.jsonl", bodies), AnalyzeParams(kv_tokens=2_000))
    assert report["reusable_share_unlimited"] > 0.5 > report["reusable_share_kv"]
    assert report["pays"] is False and report["first_class"] is not None
    assert report["verdict"].startswith("Prefix-aware routing pays only if the fleet's KV")


def test_cli_json_plot_and_hidden_field_verdict(tmp_path: Path) -> None:
    rules = "\n".join(f"Rule {i}: answer about topic {i} precisely." for i in range(100))
    bodies = [
        {"model": "m", "messages": [
            {"role": "system", "content": f"trace_id=a{i:015x}b\n{rules}"},
            {"role": "user", "content": f"Q{i}"},
        ]}
        for i in range(8)
    ]  # fmt: skip
    log = tmp_path / "log.jsonl"
    log.write_bytes(b"".join(orjson.dumps(b) + b"\n" for b in bodies) + b"garbage\n")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    res = runner.invoke(app, [str(log), "--json", str(out), "--plot", str(png), "--block-size",
                              "32", "--kv-tokens", "100000"])  # fmt: skip
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert set(report) >= REQUIRED
    assert report["requests"] == 8 and report["malformed_lines"] == 1
    assert report["block_size"] == 32 and report["kv_tokens"] == 100_000
    assert f"{log}:9: invalid JSON" in res.stderr
    (d,) = report["divergences"]
    assert d["text"].startswith("trace_id=a") and d["requests"] == 8
    assert set(d) >= {"token_position", "text", "requests"}
    assert "near-identical requests diverge at token" in report["verdict"]
    assert "verdict:" in res.stdout
    assert png.stat().st_size > 10_000


def test_cli_caps_the_error_lines_shown(tmp_path: Path) -> None:
    log = tmp_path / "bad.jsonl"
    log.write_text("x\n" * (MAX_ERRORS_SHOWN + 5) + '{"prompt": "one usable line"}\n')
    res = runner.invoke(app, [str(log)])
    assert res.exit_code == 0
    assert res.stderr.count("invalid JSON") == MAX_ERRORS_SHOWN
    assert "5 more malformed lines skipped" in res.stderr
    assert "requests" in res.stdout


def test_cli_a_log_with_no_usable_line_is_an_error_that_says_why(tmp_path: Path) -> None:
    log = tmp_path / "bad.jsonl"
    log.write_text("x\n[1]\n" + '{"status": 200}\n')
    res = runner.invoke(app, [str(log)])
    assert res.exit_code == 2
    assert f"error: {log}: no request in it: 3 lines skipped" in res.stderr
    assert "the first, line 1: invalid JSON" in res.stderr
    assert "verdict" not in res.stdout
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    res = runner.invoke(app, [str(empty)])
    assert res.exit_code == 2 and "it is empty" in res.stderr


def test_cli_a_damaged_gzip_names_the_file(tmp_path: Path) -> None:
    import gzip

    data = gzip.compress(
        b"".join(orjson.dumps({"prompt": f"p{i} " * 200}) + b"\n" for i in range(50))
    )
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    flipped = bytearray(data)
    flipped[20:60] = bytes(b ^ 0xFF for b in flipped[20:60])
    corrupt = tmp_path / "corrupt.jsonl.gz"
    corrupt.write_bytes(bytes(flipped))
    for log in (cut, corrupt):
        res = runner.invoke(app, [str(log)])
        assert res.exit_code == 2, res.output
        assert f"error: {log}: cannot read: not a valid gzip file: " in res.stderr
        assert res.exception is None or isinstance(res.exception, SystemExit)


def test_cli_refuses_output_paths_it_cannot_write_before_reading_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import prefixrouter.analyze.cli as analyze_cli

    log = _unique_log(tmp_path / "u.jsonl", 3)
    a_file = tmp_path / "a.json"
    a_file.write_text("{}")

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the log was read before the output paths were checked")

    monkeypatch.setattr(analyze_cli, "analyze_log", must_not_run)
    cases = [
        (
            ["--json", str(a_file / "x.json")],
            f"--json {a_file / 'x.json'}: {a_file} is not a folder",
        ),
        (["--json", str(tmp_path)], f"--json {tmp_path}: is a directory"),
        (["--plot", str(tmp_path / "out.txt")], "expected a file name ending in .png"),
        (["--plot", str(tmp_path)], f"--plot {tmp_path}: is a directory"),
        (["--plot", str(tmp_path / "noext")], "expected a file name ending in .png"),
    ]
    for args, message in cases:
        res = runner.invoke(app, [str(log), *args])
        assert res.exit_code == 2, res.output
        assert message in res.stderr
    res = runner.invoke(app, [str(tmp_path)])
    assert res.exit_code == 2 and f"{tmp_path}: is a directory" in res.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_cli_a_failed_write_is_one_line(tmp_path: Path) -> None:
    res = runner.invoke(app, [str(_unique_log(tmp_path / "u.jsonl", 3)), "--json", "/dev/full"])
    assert res.exit_code == 2
    assert "error: --json /dev/full: cannot write: No space left on device" in res.stderr


def test_kv_tokens_0_means_no_limit_in_help_table_and_verdict(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    res = runner.invoke(app, [str(_doc_log(tmp_path / "d.jsonl")), "--kv-tokens", "0",
                              "--json", str(out)], env={"COLUMNS": "200"})  # fmt: skip
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["reusable_tokens_kv"] is None and report["reusable_share_kv"] is None
    assert all(c["reusable_share_kv"] is None for c in report["by_class"].values())
    assert "no KV limit (--kv-tokens 0)" in res.stdout
    assert "LRU 0 KV tokens" not in res.stdout
    assert "(no KV limit given)" in report["verdict"] and report["pays"] is True
    help_text = " ".join(runner.invoke(app, ["--help"], env={"COLUMNS": "200"}).stdout.split())
    assert "0: no limit" in help_text


def _decisions(path: Path, prompt_tokens: int, cached: int | None) -> Path:
    """A gateway decision log (no bodies): 12 requests about one document, then 3 others."""
    records = [
        {
            "request_id": f"r{i}", "namespace": "m||||",
            "prefix_key": "k-doc" if i < 12 else f"k{i}",
            "prefix_class": "document", "prompt_tokens": prompt_tokens,
            **({"actual_cached_tokens": cached if 0 < i < 12 else 0} if cached is not None else {}),
        }
        for i in range(15)
    ]  # fmt: skip
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def test_prefix_key_records_give_a_lower_bound_never_a_does_not_pay(tmp_path: Path) -> None:
    # 30,000-token prompts: the keys see only their first 1,024 tokens (3% of each).
    report, _ = analyze_log(_decisions(tmp_path / "big.jsonl", 30_000, 29_900))
    assert report["key_only_unseen_tokens"] == 15 * (30_000 - 1024)
    assert report["reusable_share_unlimited"] < 0.10 < report["reusable_share_unlimited_max"]
    # The engines' counts decide: 11 of 15 requests served 29,900 tokens from cache.
    assert report["observed_cached_share"] > 0.7
    assert report["pays"] is True
    assert "the engines report 73% of prompt tokens served from their cache" in report["verdict"]
    assert "does not pay" not in report["verdict"]
    # Without engine counts the log cannot tell, and says so with the range.
    report, _ = analyze_log(_decisions(tmp_path / "nocounts.jsonl", 30_000, None))
    assert report["pays"] is None and report["first_class"] is None
    assert report["verdict"].startswith("This log cannot tell whether prefix-aware routing pays")
    assert "at least 2.5%" in report["verdict"] and "up to 99.1% may" in report["verdict"]
    assert "does not pay" not in report["verdict"]
    # A lower bound that clears the bar says "at least".
    report, _ = analyze_log(_decisions(tmp_path / "mid.jsonl", 3_000, None))
    assert report["pays"] is True
    assert report["verdict"].startswith("Prefix-aware routing pays for this traffic: at least")
    # Prompts within the key's depth are measured exactly: no bound, the plain verdict.
    report, _ = analyze_log(_decisions(tmp_path / "short.jsonl", 800, None))
    assert report["key_only_unseen_tokens"] == 0
    assert report["reusable_share_unlimited"] == report["reusable_share_unlimited_max"]
    assert "at least" not in report["verdict"]


def test_cli_table_marks_a_lower_bound(tmp_path: Path) -> None:
    res = runner.invoke(app, [str(_decisions(tmp_path / "big.jsonl", 30_000, 29_900))],
                        env={"COLUMNS": "200"})  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "at least 11,264 (2.5%)" in res.stdout
    assert "tokens beyond the keys' first 1,024 (reuse unknown)" in res.stdout


def test_cli_user_errors_exit_2(tmp_path: Path) -> None:
    res = runner.invoke(app, [str(tmp_path / "missing.jsonl")])
    assert res.exit_code == 2 and "no such file" in res.stderr
    log = _unique_log(tmp_path / "u.jsonl", 2)
    bad_tok = tmp_path / "tok.json"
    bad_tok.write_text("{}")
    res = runner.invoke(app, [str(log), "--tokenizer", str(bad_tok)])
    assert res.exit_code == 2 and "--tokenizer" in res.stderr
    res = runner.invoke(app, [str(log), "--tokenizer", str(tmp_path / "none")])
    assert res.exit_code == 2
    assert runner.invoke(app, [str(log), "--block-size", "0"]).exit_code == 2


def test_speed_benchmark_runs(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "analyze_speed.py"), "--requests", "150"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    result = json.loads(out.stdout)
    assert result["requests"] == 150 and result["requests_per_s"] > 0
