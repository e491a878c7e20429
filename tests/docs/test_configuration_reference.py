"""docs/configuration.md is what the configuration model generates; the model documents each key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from prefixrouter.gateway import config_reference as ref
from prefixrouter.gateway.config import GatewayConfig, _Model

DOC = Path(__file__).parents[2] / "docs" / "configuration.md"


def test_the_reference_is_what_the_model_generates() -> None:
    # On failure: python -m prefixrouter.gateway.config_reference > docs/configuration.md
    assert ref.check(DOC) is None


def test_every_key_of_the_model_is_in_the_reference() -> None:
    text = DOC.read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| `")}

    def keys(model: type[BaseModel]) -> set[str]:
        out = {f"`{name}`" for name in model.model_fields}
        for field in model.model_fields.values():
            held = ref._model_of(field.annotation)
            if held is not None:
                out |= keys(held[0])
        return out

    assert keys(GatewayConfig) <= rows
    assert "| `max_warm_wait_s` | float | `inf` |" in text  # the policy's own knobs too
    assert "| `connect_timeout_s` | float > 0 | `3.0` | TCP connect timeout per attempt. |" in text


def test_the_check_names_a_stale_line_and_the_command(tmp_path: Path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(DOC.read_text().replace("`8080`", "`8081`"))
    problem = ref.check(stale)
    assert problem is not None and ref.COMMAND in problem
    line = int(problem.split(":")[1])
    assert "8081" in stale.read_text().splitlines()[line - 1]
    proc = subprocess.run(
        [sys.executable, "-m", "prefixrouter.gateway.config_reference", "--check", str(stale)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "differs from the model" in proc.stderr


def test_an_undocumented_key_fails_with_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    class Section(_Model):
        """A section with one documented and one undocumented key.

        Attributes:
            known: Documented here.
        """

        known: int = 1
        unknown: int = 2
        described: int = Field(default=3, description="Documented by its field.")

    missing: list[str] = []
    (section,) = ref.model_sections(Section, "extra", missing)
    assert missing == ["extra.unknown"]
    meanings = {r.key: r.meaning for r in section.rows}
    assert meanings["known"] == "Documented here." and meanings["described"].startswith("Doc")


def test_attribute_docs_join_continuation_lines_and_stop_at_the_section_end() -> None:
    class Doc:
        """Summary.

        Attributes:
            a: First line
                and its continuation.
            b: Second.

        Notes:
            c: not an attribute.
        """

    assert ref.attribute_docs(Doc) == {"a": "First line and its continuation.", "b": "Second."}


def test_types_and_defaults_read_as_yaml() -> None:
    from typing import Annotated, Literal

    assert ref.type_name(Annotated[int, Field(gt=0)] | None) == "int > 0 | null"
    assert ref.type_name(Literal["text", "token"]) == '"text" | "token"'
    assert ref.type_name(dict[str, list[int]]) == "map of str to list of int"
    assert [ref.value_text(v) for v in (None, True, "", [429, 502])] == [
        "null",
        "true",
        '""',
        "[429, 502]",
    ]
