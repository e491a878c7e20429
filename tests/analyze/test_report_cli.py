"""Report, verdict and the `analyze` command."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
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
    log.write_text("x\n" * (MAX_ERRORS_SHOWN + 5))
    res = runner.invoke(app, [str(log)])
    assert res.exit_code == 0
    assert res.stderr.count("invalid JSON") == MAX_ERRORS_SHOWN
    assert "5 more malformed lines skipped" in res.stderr
    assert "No requests to analyze." in res.stdout


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
