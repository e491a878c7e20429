"""`analyze` counts only the requests engines served, and says when its tokens are estimates.

* A decision log holds requests the engines refused (a 400 for a prompt too
  long): they were never prefilled, so they are counted apart and left out
  of the request count, the prompt tokens and the reusable share.
* Without ``--tokenizer`` the token counts are 4 characters per token: the
  table writes them ``~N`` and says how they were estimated, and so does the
  verdict; with a tokenizer they are plain counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import typer
from tokenizers import Tokenizer, models, pre_tokenizers
from typer.testing import CliRunner

from prefixrouter.analyze import analyze_log, load_encoder
from prefixrouter.analyze.cli import analyze

runner = CliRunner()
app = typer.Typer()
app.command()(analyze)


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    return path


def _decision(i: int, key: str, tokens: int, status: int, cached: int | None) -> dict[str, Any]:
    """A body-less gateway decision record, as ``--decision-log`` writes it."""
    refused = status >= 400
    return {
        "request_id": f"r{i}", "namespace": "tiny||||", "prefix_key": key,
        "prefix_class": "document",
        "prompt_tokens": None if refused else tokens,  # the engine's usage: none when refused
        "estimated_prompt_tokens": tokens, "actual_cached_tokens": cached, "status": status,
        "error": "This model's maximum context length is 2000 tokens." if refused else None,
    }  # fmt: skip


def _served_then_refused(path: Path) -> Path:
    """4 requests of 1,517 tokens on one document (served), then 4 of 7,517 (all 400s)."""
    served = [_decision(i, "doc-a", 1517, 200, 0 if i == 0 else 1504) for i in range(4)]
    refused = [_decision(4 + i, "doc-b", 7517, 400, None) for i in range(4)]
    return _write(path, served + refused)


def test_requests_the_engines_refused_are_left_out_and_counted_apart(tmp_path: Path) -> None:
    report, _ = analyze_log(_served_then_refused(tmp_path / "dl.jsonl"))
    assert report["requests"] == 4 and report["unserved_requests"] == 4
    assert report["prompt_tokens"] == 4 * 1517  # what the engines were asked to prefill
    # 3 of the 4 served requests find the document's first 1,024 tokens (64 blocks).
    assert report["reusable_tokens_unlimited"] == 3 * 1024
    assert report["by_class"]["document"]["requests"] == 4
    assert "4 records no engine served (an error status) are left out" in report["verdict"]
    res = runner.invoke(app, [str(tmp_path / "dl.jsonl")], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "records not served (error status), left out" in res.stdout
    # A client that went away (499) was still sent to an engine: it counts.
    report, _ = analyze_log(_write(tmp_path / "gone.jsonl", [_decision(0, "doc-a", 1517, 499, 0)]))
    assert report["requests"] == 1 and report["unserved_requests"] == 0


def test_a_log_whose_requests_were_all_refused_says_so(tmp_path: Path) -> None:
    log = _write(tmp_path / "refused.jsonl", [_decision(i, "d", 7517, 400, None) for i in range(3)])
    res = runner.invoke(app, [str(log)], env={"COLUMNS": "200"})
    assert res.exit_code == 2
    assert "no served request in it: its 3 records all have an error status" in res.stderr


def test_bodies_with_a_status_are_left_out_too_but_a_bare_body_has_none(tmp_path: Path) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 200}]}
    lines: list[dict[str, Any]] = [
        {"request": body, "status": 200}, {"request": body, "status": 400}, body
    ]  # fmt: skip
    report, _ = analyze_log(_write(tmp_path / "wrapped.jsonl", lines))
    assert report["requests"] == 2 and report["unserved_requests"] == 1


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer that knows every word of the test's prompts."""
    vocab = {w: i for i, w in enumerate(["[UNK]", "shared", *(f"w{i}" for i in range(20))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_text_mode_token_counts_are_labelled_estimates(
    tmp_path: Path, word_tokenizer: Path
) -> None:
    log = _write(
        tmp_path / "bodies.jsonl",
        [{"model": "m", "prompt": "shared " * 400 + f"w{i}"} for i in range(10)],
    )
    report, _ = analyze_log(log)
    assert report["tokens_estimated"] is True and report["chars_per_token"] == 4.0
    assert "Token counts are estimates at 4 characters per token" in report["verdict"]
    assert "(~" in report["verdict"]  # the amount named in the verdict
    res = runner.invoke(app, [str(log), "--kv-tokens", "0"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    row = next(ln for ln in res.stdout.splitlines() if "prompt tokens (" in ln)
    est = report["prompt_tokens"]
    assert "prompt tokens (estimated at 4 chars/token; --tokenizer for exact)" in row
    assert f"~{est:,}" in row
    # With a tokenizer the counts are exact, and written plainly.
    report, _ = analyze_log(log, encoder=load_encoder(word_tokenizer))
    assert report["tokens_estimated"] is False and report["prompt_tokens"] == 10 * 401
    assert "estimate" not in report["verdict"]
    res = runner.invoke(
        app, [str(log), "--kv-tokens", "0", "--tokenizer", str(word_tokenizer)],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "estimated" not in res.stdout and "~" not in res.stdout
    assert f"{10 * 401:,}" in res.stdout
