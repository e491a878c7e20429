"""`analyze` and `lint` on inputs that once read wrong: counts that contradict, gzip by
another name, outputs on the input, non-UTF-8 and empty files, item numbers."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import orjson
import pytest
import typer
from typer.testing import CliRunner

from prefixrouter.analyze import analyze_log, iter_records, parse_record
from prefixrouter.analyze.cli import analyze
from prefixrouter.analyze.lint_cli import lint

runner = CliRunner()
analyze_app = typer.Typer()
analyze_app.command()(analyze)
lint_app = typer.Typer()
lint_app.command()(lint)

STAMP = "2024-05-01T12:00:00Z"
DOC = "You are a helpful assistant. " * 200


def _lines(path: Path, objs: list[object]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in objs))
    return path


def _bodies(n: int = 6) -> list[object]:
    doc = "".join(f"Paragraph {i} of the handbook explains rule {i}.\n" for i in range(60))
    return [{"model": "m", "messages": [{"role": "user", "content": f"{doc}\n\nQ{i}?"}]}
            for i in range(n)]  # fmt: skip


# ---------------------------------------------------------------------------- cached tokens


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"prefix_key": "a", "prompt_tokens": 100, "actual_cached_tokens": 500},
         "cached_tokens 500 > prompt_tokens 100"),
        ({"prefix_key": "a", "estimated_prompt_tokens": 100, "actual_cached_tokens": 101},
         "cached_tokens 101 > estimated_prompt_tokens 100"),
        ({"prompt": "hi", "prompt_tokens": 10, "cached_tokens": 11},
         "cached_tokens 11 > prompt_tokens 10"),
        ({"body": {"prompt": "hi"}, "usage": {"prompt_tokens": 1_000,
          "prompt_tokens_details": {"cached_tokens": 2_000}}},
         "cached_tokens 2,000 > prompt_tokens 1,000"),
    ],
)  # fmt: skip
def test_more_cached_than_prompt_tokens_is_a_malformed_line(
    record: dict[str, object], reason: str
) -> None:
    """It was kept, and the report said "engine-reported cached share 275.0%"."""
    assert parse_record(record, 2) == reason


def test_equal_counts_and_a_missing_one_are_fine() -> None:
    rec = parse_record({"prefix_key": "a", "prompt_tokens": 100, "actual_cached_tokens": 100})
    assert not isinstance(rec, str) and rec.cached_tokens == 100
    rec = parse_record({"prompt": "hi", "cached_tokens": 7})  # no prompt count to compare
    assert not isinstance(rec, str) and rec.cached_tokens == 7


def test_the_tours_log_reports_the_line_and_a_share_within_100_percent(tmp_path: Path) -> None:
    log = _lines(tmp_path / "keys.jsonl", [
        {"prefix_key": "a", "prompt_tokens": 100, "actual_cached_tokens": 0},
        {"prefix_key": "a", "prompt_tokens": 100, "actual_cached_tokens": 500},
        {"prefix_key": "a", "prompt_tokens": 100, "actual_cached_tokens": 50},
    ])  # fmt: skip
    res = runner.invoke(analyze_app, [str(log)])
    assert res.exit_code == 0, res.output
    assert f"{log}:2: cached_tokens 500 > prompt_tokens 100" in res.stderr
    report, _ = analyze_log(log)
    assert report["requests"] == 2 and report["observed_cached_share"] == 0.25


# ---------------------------------------------------------------------------- gzip by content


def test_a_gzip_log_is_read_whatever_its_name(tmp_path: Path) -> None:
    plain = _lines(tmp_path / "log.jsonl", _bodies())
    packed = tmp_path / "loggz.jsonl"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert [r.line for r in iter_records(packed)] == [r.line for r in iter_records(plain)]

    def report(path: Path) -> dict[str, object]:
        return {k: v for k, v in analyze_log(path)[0].items() if k != "log"}

    assert report(packed) == report(plain) and report(plain)["requests"] == 6
    named = tmp_path / "plain.jsonl.gz"  # a plain file with a .gz name reads as plain
    named.write_bytes(plain.read_bytes())
    assert report(named) == report(plain)


def test_lint_reads_gzip_too(tmp_path: Path) -> None:
    body = {"messages": [{"role": "system", "content": f"Now {STAMP}. {DOC}"},
                         {"role": "user", "content": "Q?"}]}  # fmt: skip
    packed = tmp_path / "body.json"
    packed.write_bytes(gzip.compress(orjson.dumps(body)))
    res = runner.invoke(lint_app, [str(packed), "--json"])
    assert res.exit_code == 1, res.output
    assert [f["kind"] for f in json.loads(res.stdout)] == ["timestamp"]
    cut = tmp_path / "cut.json"
    cut.write_bytes(gzip.compress(orjson.dumps(body))[:20])
    res = runner.invoke(lint_app, [str(cut)])
    assert res.exit_code == 2 and f"error: {cut}: not a valid gzip file" in res.stderr


# ---------------------------------------------------------------------------- outputs


def test_analyze_outputs_are_never_the_log_nor_each_other(tmp_path: Path) -> None:
    """--json on the log replaced the log with the report."""
    log = _lines(tmp_path / "log.jsonl", _bodies())
    before = log.read_bytes()
    res = runner.invoke(analyze_app, [str(log), "--json", str(log)])
    assert res.exit_code == 2
    assert f"error: --json {log}: is the log it reads" in res.stderr
    assert log.read_bytes() == before
    png = tmp_path / "same.png"
    res = runner.invoke(analyze_app, [str(log), "--json", str(png), "--plot", str(png)])
    assert res.exit_code == 2
    assert f"error: --plot {png}: is the --json output" in res.stderr
    assert not png.exists()


# ---------------------------------------------------------------------------- lint inputs


def test_lint_names_the_line_of_a_byte_that_is_not_utf8(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_bytes(b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "\xff"}\n')
    res = runner.invoke(lint_app, [str(f)])
    assert res.exit_code == 2
    assert f"error: {f}:3: not UTF-8 text (invalid start byte at byte 44)" in res.stderr


@pytest.mark.parametrize(("content", "why"), [(b"", "it is empty"), (b" \n\n\t", "only blanks")])
def test_lint_refuses_a_file_with_nothing_in_it(tmp_path: Path, content: bytes, why: str) -> None:
    """An empty file was linted as a template: exit 0, "no volatile fields"."""
    f = tmp_path / "empty.jsonl"
    f.write_bytes(content)
    res = runner.invoke(lint_app, [str(f)])
    assert res.exit_code == 2, res.output
    assert f"error: {f}: nothing to lint: {why}" in res.stderr


def test_lint_counts_array_items_from_one_as_lines_are(tmp_path: Path) -> None:
    f = tmp_path / "arr.json"
    good = {"messages": [{"role": "user", "content": "hi"}]}
    f.write_bytes(orjson.dumps([good, {"messages": "x"}, good]))
    res = runner.invoke(lint_app, [str(f)])
    assert res.exit_code == 0, res.output
    assert f"{f}: item 2: 'messages' is not a list" in res.stderr
    f.write_bytes(orjson.dumps([{"messages": "x"}]))
    res = runner.invoke(lint_app, [str(f)])
    assert res.exit_code == 2
    assert f"{f}: item 1: 'messages' is not a list" in res.stderr
    assert "the first, item 1:" in " ".join(res.stderr.split())


def test_lint_help_says_a_system_only_request_is_all_tail(tmp_path: Path) -> None:
    """By design: the last message is the call's own; JSON lines compare calls."""
    res = runner.invoke(lint_app, ["--help"], env={"COLUMNS": "400"})
    assert "a request of one system message is all tail" in " ".join(res.output.split())
    body = {"messages": [{"role": "system", "content": f"Time: {STAMP}. {DOC}"}]}
    one = tmp_path / "one.json"
    one.write_bytes(orjson.dumps(body))
    assert runner.invoke(lint_app, [str(one)]).exit_code == 0
    later = json.loads(json.dumps(body).replace("12:00:00", "12:05:00"))
    many = _lines(tmp_path / "many.jsonl", [body, later])
    res = runner.invoke(lint_app, [str(many), "--json"])
    assert res.exit_code == 1 and json.loads(res.stdout)[0]["kind"] == "timestamp"
