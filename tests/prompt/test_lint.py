"""The linter: volatile fields before stable content, their cost, JSON-lines differences."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import orjson
import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from prefixrouter.analyze.lint_cli import lint
from prefixrouter.prompt import Linter, LintObserver, LintParams, render_body, scan_volatile
from prefixrouter.prompt.lint import VolatileMatch, _scan_range

DOC = "\n".join(f"Section {i}: the service keeps every promise it makes." for i in range(200))
STAMP = "2024-05-01T10:00:03Z"

runner = CliRunner()
app = typer.Typer()
app.command()(lint)


def _body(system: str, user: str) -> dict:  # type: ignore[type-arg]
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def test_timestamp_before_a_long_document_is_found_with_its_cost() -> None:
    body = _body(f"You answer questions. Report generated {STAMP}.", f"{DOC}\n\nWhat is 3?")
    (f,) = Linter().lint_body(body)
    rendered = render_body(body)
    start = rendered.text.index(STAMP)
    end = start + len(STAMP)
    assert (f.kind, f.position, f.text) == ("timestamp", start, STAMP)
    assert f.location == f"messages[0].content@{len('You answer questions. Report generated ')}"
    # everything up to the question (the last paragraph) is stable: ~ chars / 4 tokens
    assert f.stable_tokens_after == round((rendered.tail_start - end) / 4)
    assert f.stable_tokens_after > 2_000
    assert "move it after the stable block" in f.fix and str(f.stable_tokens_after) in f.fix


def test_timestamp_after_the_document_costs_nothing() -> None:
    body = _body("You answer questions.", f"{DOC}\n\nAsked at {STAMP}: what is 3?")
    assert Linter().lint_body(body) == []
    # and in its own paragraph right before the question it is below the threshold too
    body = _body("You answer questions.", f"{DOC}\n\nTime: {STAMP}\n\nWhat is 3?")
    assert Linter().lint_body(body) == []


def test_history_turns_are_not_linted() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"It is {STAMP}."},
            {"role": "assistant", "content": f"Noted, {STAMP}. " + DOC},
            {"role": "user", "content": "And now?"},
        ]
    }
    assert Linter().lint_body(body) == []


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("request 3f2a1b4c-1111-2222-3333-444455556666", "uuid"),
        ("traceparent 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "trace_id"),
        ("id deadbeef12345678aa", "hex_id"),
        ("session_id=sess-81", "session_id"),
        ('{"user_id": "u-42"}', "user_id"),
        ("X-Request-Id: abc-9", "request_id"),
        ("nonce: Zx81q", "nonce"),
        ("attempt=3", "counter"),
        ("Tue, 01 May 2024 10:00:00 GMT", "timestamp"),
        ("May 1, 2024 at 10:00 AM", "timestamp"),
        ("ts=1714557601", "timestamp"),
        ("at 10:42:07", "timestamp"),
        ("on 2024-05-01", "date"),
        ("date: 2024/5/1", "date"),
        ("on 05/01/2024", "date"),
        ("on 1 May 2024", "date"),
        ("on Wednesday, May 1st, 2024", "date"),
    ],
)
def test_volatile_patterns(text: str, kind: str) -> None:
    assert [m.kind for m in scan_volatile(text)] == [kind]


PIECES = st.sampled_from(
    [" ", "\n", "word", "x" * 70, "Time: ", "2024-05-01T10:00:03Z", "May 1, 2024", "10:42:07",
     "3f2a1b4c-1111-2222-3333-444455556666", "session_id=", "abc", '"user_id": "u-4"', "=",
     "deadbeef12345678aa", "doc-", "1714557601", ":", "7", ".", "nonce: ", "attempt=2"]
)  # fmt: skip


@given(st.lists(PIECES, max_size=40).map("".join), st.integers(0, 5), st.integers(0, 5))
@settings(max_examples=300, deadline=None)
def test_windowed_scan_equals_a_full_scan(text: str, cut_start: int, cut_end: int) -> None:
    start, end = min(cut_start, len(text)), max(len(text) - cut_end, 0)
    full: list[VolatileMatch] = []
    _scan_range(text, start, max(start, end), full)
    assert scan_volatile(text, start, max(start, end)) == full


@pytest.mark.parametrize(
    "text",
    ["time: later", "version 2.1.0", "item 42 of 100", "user: hello", "a doc-0123456789abcdef0"],
)
def test_ordinary_text_is_not_volatile(text: str) -> None:
    assert scan_volatile(text) == []


def test_template_placeholders() -> None:
    template = "{{ now() }} You are a support agent.\n" + DOC + "\n{{ question }}"
    (f,) = Linter().lint_template(template)
    assert (f.kind, f.position, f.text, f.line) == ("timestamp", 0, "{{ now() }}", 1)
    assert f.stable_tokens_after == round((len(template) - len("{{ now() }}{{ question }}")) / 4)
    doc_first = "Static rules.\n{document}\n" + DOC + "\n${question}"
    (g,) = Linter().lint_template(doc_first)
    assert (g.kind, g.text) == ("variable", "{document}")


def test_jsonl_field_that_differs_between_otherwise_identical_requests() -> None:
    names = ["Alice", "Bob", "Carol", "Dave"]
    bodies = [(i + 1, _body(f"You assist {n} today.\n{DOC}", f"Question {i}?")) for i, n in
              enumerate(names)]  # fmt: skip
    (f,) = Linter().lint_bodies(bodies)
    text = render_body(bodies[1][1]).text
    assert f.kind == "varying_field"
    assert f.position == text.index("Bob")
    assert f.text == "Bob"
    assert f.requests == 3 and f.line == 2  # found when comparing requests 2, 3 and 4
    assert f.stable_tokens_after > 2_000


def test_jsonl_different_documents_are_not_fields() -> None:
    other = DOC.replace("service", "vendor").replace("promise", "deadline")
    bodies = [(1, _body("Read this.", f"{DOC}\n\nQ1")), (2, _body("Read this.", f"{other}\n\nQ2"))]
    assert Linter().lint_bodies(bodies) == []


def test_jsonl_merges_the_same_finding_across_requests() -> None:
    bodies = [(i, _body(f"Now: 2024-05-0{i}T10:00:00Z\n{DOC}", f"Q{i}")) for i in range(1, 6)]
    (f,) = Linter().lint_bodies(bodies)
    assert f.kind == "timestamp" and f.requests == 5 and f.line == 1


@pytest.mark.parametrize("shape", ["prompt", "user"])
def test_jsonl_timestamp_ahead_of_a_prompt_with_no_paragraph_break(shape: str) -> None:
    """One request alone is all tail; requests that repeat what follows the stamp show its cost."""
    policy = "Policy text, the same on every call. " * 100

    def body(i: int) -> dict:  # type: ignore[type-arg]
        text = f"Current time: 2024-01-01T10:0{i}:00Z. {policy} Question {i}?"
        if shape == "prompt":
            return {"model": "m", "prompt": text}
        return {"model": "m", "messages": [{"role": "user", "content": text}]}

    assert Linter().lint_body(body(0)) == []  # alone: its own text, nothing to compare
    (f,) = Linter().lint_bodies([(i + 1, body(i)) for i in range(5)])
    assert f.kind == "timestamp" and "2024-01-01T10:01:00Z" in f.text
    assert f.requests == 4 and f.line == 2
    assert f.stable_tokens_after >= len(policy) / 4 - 5


def test_jsonl_differing_questions_after_a_stable_block_are_not_fields() -> None:
    """Long questions that differ word by word have little equal text after them."""
    bodies = [
        (i, _body("Be brief.", f"{DOC}\n\nQuestion {i} about section {i * 7}, asked the long way "
                   f"so that it is longer than the field limit, with {i} more words at its end?"))
        for i in range(1, 6)
    ]  # fmt: skip
    assert Linter().lint_bodies(bodies) == []


def test_observer_counts_by_class_and_never_changes_the_request() -> None:
    obs = LintObserver()
    body = _body(f"Report generated {STAMP}.", f"{DOC}\n\nQ?")
    frozen = copy.deepcopy(body)
    assert obs.observe(render_body(body)) == {"timestamp": 1}
    assert body == frozen
    assert obs.observe(render_body(body), prefix_class="rag") == {"timestamp": 1}
    assert obs.observe(render_body(_body("Be brief.", "hi"))) == {}
    assert obs.observe(render_body({"messages": 5})) == {}  # unreadable shapes are simply clean
    assert obs.observe(None) == {}  # a prompt of token ids: nothing to lint
    assert obs.findings() == {"document": {"timestamp": 1}, "rag": {"timestamp": 1}}
    assert obs.requests() == {"document": 1, "rag": 1, "system": 1, "unknown": 2}
    assert obs.errors == 0
    assert "session" in obs.classes()


def test_observer_survives_a_broken_linter() -> None:
    class Broken(Linter):
        def lint_prompt(self, prompt, line=None):  # type: ignore[no-untyped-def]
            raise RuntimeError("boom")

    obs = LintObserver(Broken())
    assert obs.observe(render_body({"messages": []})) == {}
    assert obs.errors == 1


def test_min_stable_tokens_is_configurable() -> None:
    body = _body(f"Report {STAMP}.", "short rules here.\n\nQ?")
    assert Linter().lint_body(body) == []
    assert len(Linter(LintParams(min_stable_tokens=1)).lint_body(body)) == 1


# ---------------------------------------------------------------------------- CLI


def _write(path: Path, obj: object) -> Path:
    path.write_bytes(orjson.dumps(obj))
    return path


def test_cli_json_output_and_exit_codes(tmp_path: Path) -> None:
    f = _write(tmp_path / "body.json", _body(f"Now {STAMP}, session_id=s-1.", f"{DOC}\n\nQ"))
    res = runner.invoke(app, [str(f), "--json"])
    assert res.exit_code == 1  # 2 findings > 0 allowed
    findings = json.loads(res.stdout)
    assert [x["kind"] for x in findings] == ["timestamp", "session_id"]
    assert set(findings[0]) >= {"kind", "position", "text", "stable_tokens_after", "fix"}
    assert runner.invoke(app, [str(f), "--max-findings", "2"]).exit_code == 0
    assert runner.invoke(app, [str(f), "--max-findings", "1"]).exit_code == 1
    clean = _write(tmp_path / "clean.json", _body("Be brief.", f"{DOC}\n\nQ {STAMP}"))
    res = runner.invoke(app, [str(clean)])
    assert res.exit_code == 0 and "no volatile fields" in res.stdout


def test_cli_jsonl_template_and_errors(tmp_path: Path) -> None:
    lines = [orjson.dumps(_body(f"Hi {n}.\n{DOC}", "Q")).decode() for n in ("Ann", "Ben")]
    jsonl = tmp_path / "reqs.jsonl"
    jsonl.write_text("\n".join([lines[0], "{oops", lines[1]]) + "\n")
    res = runner.invoke(app, [str(jsonl), "--json"])
    assert res.exit_code == 1
    assert [x["kind"] for x in json.loads(res.stdout)] == ["varying_field"]
    assert f"{jsonl}:2: invalid JSON" in res.stderr
    tpl = tmp_path / "prompt.txt"
    tpl.write_text("Today is {{ today }}.\n" + DOC + "\n{{ question }}\n")
    res = runner.invoke(app, [str(tpl), "--json", "--max-findings", "5"])
    assert res.exit_code == 0 and json.loads(res.stdout)[0]["kind"] == "date"
    missing = runner.invoke(app, [str(tmp_path / "nope.json")])
    assert missing.exit_code == 2 and "error:" in missing.stderr
    notbody = _write(tmp_path / "x.json", {"hello": 1})
    assert runner.invoke(app, [str(notbody)]).exit_code == 2


@pytest.mark.parametrize(
    ("head", "kind"),
    [
        ("{{ now }}\n", "timestamp"),  # opens like a JSON object, is a template
        ("{% if tools %}Tools.{% endif %}\nToday is {{ current_date }}.\n", "date"),
        ("{user_id} asks:\n", "user_id"),
    ],
)
def test_cli_lints_a_template_that_opens_with_a_brace(tmp_path: Path, head: str, kind: str) -> None:
    tpl = tmp_path / "prompt.j2"
    tpl.write_text(head + DOC + "\n{{ question }}\n")
    res = runner.invoke(app, [str(tpl), "--json"])
    assert res.exit_code == 1, res.output
    assert [f["kind"] for f in json.loads(res.stdout)] == [kind]
    assert "invalid JSON" not in res.stderr


@pytest.mark.parametrize(
    ("content", "message"),
    [
        # a body cut short: JSON lines, none of them a body
        ('{"messages": [ {"role": "user", "content": "hi"} ', ": no request body in it: 1 line "
         "skipped as malformed; the first, line 1: invalid JSON: unexpected end of data"),
        ('{"a": 1}\n{"b"\n', ": no request body in it: 2 lines skipped as malformed; the first, "
         "line 1: no 'messages' or 'prompt'"),
        ("[1, 2, 3]", ": no request body in it: 3 items skipped as malformed; the first, item 1: "
         "expected a JSON object, got int"),
        ("[]", ": no request body in it: it is empty"),
        ('[{"messages": [', ":1: invalid JSON: unexpected end of data"),
    ],
)  # fmt: skip
def test_cli_a_json_file_with_no_body_is_an_error(
    tmp_path: Path, content: str, message: str
) -> None:
    f = tmp_path / "body.json"
    f.write_text(content)
    res = runner.invoke(app, [str(f)])
    assert res.exit_code == 2, res.output
    assert f"error: {f}{message}" in " ".join(res.stderr.split())
    assert "no volatile fields" not in res.stdout


def test_a_pasted_log_is_data_not_fields() -> None:
    log = "\n".join(f"2024-05-01T10:{i // 60:02d}:{i % 60:02d}Z GET /x/{i}" for i in range(300))
    body = _body("Summarize the log.", f"{log}\n\nWhat failed?")
    assert Linter().lint_body(body) == []
    # a few occurrences are still fields
    few = _body("Summarize.", "\n".join(log.splitlines()[:3]) + f"\n{DOC}\n\nWhat failed?")
    assert len(Linter().lint_body(few)) == 3


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 5)), max_size=8), st.integers(0, 80),
       st.integers(0, 80))  # fmt: skip
def test_stable_chars_counts_outside_the_spans(raw: list, a: int, b: int) -> None:  # type: ignore[type-arg]
    from prefixrouter.prompt.lint import _StableChars

    spans, pos = [], 0
    for gap, width in raw:  # disjoint, sorted
        spans.append((pos + gap, pos + gap + width))
        pos += gap + width
    covered = {i for s, e in spans for i in range(s, e)}
    expected = sum(1 for i in range(a, b) if i not in covered)
    assert _StableChars(spans).between(a, b) == expected
