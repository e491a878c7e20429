"""The configuration reference (``docs/configuration.md``), generated from the configuration model.

Every key of :class:`~prefixrouter.gateway.config.GatewayConfig`, with its type,
its default and its meaning, one Markdown table per section, then the
parameters of the default policy (``policy.params`` of ``prefix_aware``).
Nothing is written by hand, so the reference cannot drift from the model::

    python -m prefixrouter.gateway.config_reference > docs/configuration.md
    python -m prefixrouter.gateway.config_reference --check docs/configuration.md

``--check`` exits 1 (naming the first line that differs) when the file is not
what the model generates; ``tests/docs/test_configuration_reference.py`` runs it.

Where the meaning comes from, first found wins:

1. the field's ``description`` (``Field(description=...)``);
2. the ``Attributes:`` section of its class's docstring (the project's
   Google-style docstrings, one ``name: text`` entry per field, continuation
   lines indented deeper);
3. for a field that is a section of its own, the first line of that
   section's class docstring.

A field with none of them is an error (:class:`MissingDescriptionError` names
every one), so a new option cannot ship undocumented.

Types are written as a reader of YAML needs them: ``float > 0``, ``int >= 0``,
``"text" | "token"``, ``list of int``, ``map of str to str``, ``null`` for None.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from prefixrouter.core.policies.prefix_aware import PrefixAwareParams
from prefixrouter.core.policy import DEFAULT_POLICY
from prefixrouter.errors import unreadable
from prefixrouter.gateway.config import GatewayConfig

COMMAND = "python -m prefixrouter.gateway.config_reference > docs/configuration.md"


class MissingDescriptionError(ValueError):
    """Fields that have no description anywhere (``section.key`` names, one per line)."""


@dataclass(frozen=True, slots=True)
class Row:
    """One key of a section: its name, type, default and meaning."""

    key: str
    type: str
    default: str
    meaning: str


@dataclass(frozen=True, slots=True)
class Section:
    """One table: a heading (the dotted path of its keys), a summary and its rows."""

    path: str
    summary: str
    rows: tuple[Row, ...]


def attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` entries of ``cls``'s docstring: name -> text (lines joined).

    An entry starts at the section's first indentation (``name: text``); deeper
    lines continue it; the section ends at a line indented no deeper than its
    ``Attributes:`` header (or at the docstring's end).
    """
    doc = inspect.cleandoc(cls.__doc__ or "")
    out: dict[str, str] = {}
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return out
    header_indent = len(lines[start]) - len(lines[start].lstrip())
    entry_indent: int | None = None
    current: str | None = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= header_indent:
            break
        if entry_indent is None:
            entry_indent = indent
        text = line.strip()
        if indent == entry_indent and ":" in text:
            name, _, rest = text.partition(":")
            current = name.strip()
            out[current] = rest.strip()
        elif current is not None:
            out[current] = f"{out[current]} {text}".strip()
    return out


def summary(cls: type) -> str:
    """The first paragraph of ``cls``'s docstring, on one line."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    return " ".join(doc.split("\n\n", 1)[0].split())


_ROLE = re.compile(r":(?:mod|class|func|meth|attr|data):`~?\.?([^`]+)`")


def markdown(text: str) -> str:
    """Docstring markup (reST literals and roles) as Markdown code spans."""
    return _ROLE.sub(r"`\1`", text).replace("``", "`")


def type_name(tp: Any) -> str:
    """How a YAML reader should write a value of annotation ``tp``."""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *meta = get_args(tp)
        return _constrained(type_name(base), _constraints(meta))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in get_args(tp))
    if origin is Literal:
        return " | ".join(f'"{a}"' for a in get_args(tp))
    if origin is list:
        return f"list of {type_name(get_args(tp)[0])}"
    if origin is dict:
        key, value = get_args(tp)
        return f"map of {type_name(key)} to {type_name(value)}"
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "section"
    if tp is Path:
        return "path"
    return getattr(tp, "__name__", str(tp))


def _constraints(meta: list[Any]) -> list[str]:
    out: list[str] = []
    for m in meta:
        if isinstance(m, FieldInfo):
            out += _constraints(list(m.metadata))
        elif isinstance(m, annotated_types.Gt):
            out.append(f"> {m.gt}")
        elif isinstance(m, annotated_types.Ge):
            out.append(f">= {m.ge}")
        elif isinstance(m, annotated_types.Lt):
            out.append(f"< {m.lt}")
        elif isinstance(m, annotated_types.Le):
            out.append(f"<= {m.le}")
    return out


def _constrained(name: str, limits: list[str]) -> str:
    return f"{name} {', '.join(limits)}" if limits else name


def _field_type(field: FieldInfo) -> str:
    return _constrained(type_name(field.annotation), _constraints(list(field.metadata)))


def value_text(value: Any) -> str:
    """A default as it would be written in YAML (``null``, ``true``, ``"x"``, ``[429, 502]``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, Path):
        return f'"{value}"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _default(field: FieldInfo) -> Any:
    if field.default is not PydanticUndefined:
        return field.default
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return PydanticUndefined


def _model_of(tp: Any) -> tuple[type[BaseModel], str] | None:
    """The section class a field holds, and the suffix of its entries' path."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp, ""
    origin, args = get_origin(tp), get_args(tp)
    if origin is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], "[]"
    if origin is dict and len(args) == 2:
        value = args[1]
        if isinstance(value, type) and issubclass(value, BaseModel):
            return value, ".NAME"
    return None


_HOLDS = {"": "section", "[]": "list of entries", ".NAME": "map of name to entry"}


def model_sections(
    model: type[BaseModel], path: str = "", missing: list[str] | None = None
) -> Iterator[Section]:
    """The sections of ``model`` (its own keys first, then each nested section, in field order).

    Fields without a description are appended to ``missing`` as dotted paths.
    """
    missing = missing if missing is not None else []
    docs = attribute_docs(model)
    rows: list[Row] = []
    nested: list[tuple[type[BaseModel], str]] = []
    for name, field in model.model_fields.items():
        held = _model_of(field.annotation)
        meaning = field.description or docs.get(name, "")
        key = f"{path}.{name}" if path else name
        if held is not None:
            cls, suffix = held
            meaning = meaning or summary(cls)
            nested.append((cls, key + suffix))
            link = _anchor(key + suffix)
            see = f"See [`{key}{suffix}`](#{link})."
            rows.append(Row(name, _HOLDS[suffix], "", f"{meaning} {see}"))
            continue
        if not meaning:
            missing.append(key)
        default = _default(field)
        shown = "(required)" if default is PydanticUndefined else value_text(default)
        rows.append(Row(name, _field_type(field), shown, meaning))
    yield Section(path, summary(model), tuple(rows))
    for cls, sub in nested:
        yield from model_sections(cls, sub, missing)


def params_sections(params_cls: type[Any], path: str, missing: list[str]) -> Iterator[Section]:
    """The sections of a policy's params dataclass (nested dataclasses as their own tables)."""
    docs = attribute_docs(params_cls)
    defaults = params_cls()
    rows: list[Row] = []
    nested: list[tuple[Any, str]] = []
    for f in dataclasses.fields(params_cls):
        meaning = docs.get(f.name, "")
        key = f"{path}.{f.name}"
        if not meaning:
            missing.append(key)
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            nested.append((value, key))
            see = f"See [`{key}`](#{_anchor(key)})."
            rows.append(Row(f.name, "section", "", f"{meaning} {see}"))
            continue
        rows.append(Row(f.name, type(value).__name__, value_text(value), meaning))
    head = summary(params_cls).rstrip(".")
    yield Section(path, f"{head} (`policy.name: {DEFAULT_POLICY}`, the default).", tuple(rows))
    for value, key in nested:
        yield _defaults_section(value, key, missing)


def _defaults_section(value: Any, path: str, missing: list[str]) -> Section:
    """A nested params instance: its own defaults (``short`` and ``long`` differ)."""
    docs = attribute_docs(type(value))
    rows = []
    for f in dataclasses.fields(value):
        meaning = docs.get(f.name, "")
        if not meaning:
            missing.append(f"{path}.{f.name}")
        v = getattr(value, f.name)
        rows.append(Row(f.name, type(v).__name__, value_text(v), meaning))
    return Section(path, summary(type(value)), tuple(rows))


def _anchor(path: str) -> str:
    """GitHub's anchor of a heading ``## `path` ``: lower case, punctuation dropped."""
    kept = "".join(c for c in path.lower() if c.isalnum() or c in "-_ ")
    return kept.replace(" ", "-")


def _link(path: str) -> str:
    return f"[`{path}`](#{_anchor(path)})" if path else "[top level](#top-level)"


def _cell(text: str) -> str:
    return markdown(text).replace("|", "\\|")


def render() -> str:
    """The whole reference as Markdown.

    Raises:
        MissingDescriptionError: Some field has no description; the message names each.
    """
    missing: list[str] = []
    sections = list(model_sections(GatewayConfig, "", missing))
    sections += list(params_sections(PrefixAwareParams, "policy.params", missing))
    if missing:
        raise MissingDescriptionError(
            "configuration fields without a description (give each a Field(description=...) "
            "or an Attributes: entry in its class docstring):\n" + "\n".join(missing)
        )
    out = [
        "# Configuration reference",
        "",
        f"Generated from the configuration model by `{COMMAND}`;",
        "do not edit by hand (`tests/docs/test_configuration_reference.py` fails when this file",
        "and `src/prefixrouter/gateway/config.py` disagree).",
        "",
        "`prefixrouter serve --config FILE` reads one YAML file. Every key is optional: an",
        "empty file is a gateway on 127.0.0.1:8080 with the `prefix_aware` policy, text-mode",
        "hashing and no workers. An invalid file stops the gateway with one line per problem,",
        "`FILE:LINE: dotted.field: what is wrong`. Command-line options (`--worker`, `--port`,",
        "`--policy`, `--decision-log`, `--admin-api-key`, `--cluster`, `--replica-id`) override",
        "the file. Durations are in seconds (`_s`), sizes in bytes unless the key says otherwise.",
        "",
        "Examples: `examples/` (vLLM, SGLang, generic OpenAI fleets, KV events, replicas).",
        "",
        "Sections: " + ", ".join(_link(s.path) for s in sections),
        "",
    ]
    for s in sections:
        out += [f"## `{s.path}`" if s.path else "## top level", "", markdown(s.summary), ""]
        out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for r in s.rows:
            default = f"`{r.default}`" if r.default and r.default[0] != "(" else r.default
            out.append(f"| `{r.key}` | {_cell(r.type)} | {_cell(default)} | {_cell(r.meaning)} |")
        out.append("")
    return "\n".join(out)


def check(path: Path) -> str | None:
    """None when ``path`` holds what :func:`render` gives; else what differs, in one line."""
    want = render()
    try:
        have = path.read_text(encoding="utf-8")
    except OSError as exc:
        return unreadable(path, exc)
    if have == want:
        return None
    for i, (a, b) in enumerate(zip(have.splitlines(), want.splitlines(), strict=False), 1):
        if a != b:
            return f"{path}:{i}: differs from the model; regenerate it: {COMMAND}"
    return f"{path}: differs from the model in length; regenerate it: {COMMAND}"


def main(argv: list[str] | None = None) -> int:
    """Print the reference, or ``--check FILE`` it (exit 1 when stale)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        if args[:1] == ["--check"] and len(args) == 2:
            problem = check(Path(args[1]))
            if problem is not None:
                print(problem, file=sys.stderr)
                return 1
            return 0
        if args:
            print(f"usage: {COMMAND.split(' >')[0]} [--check FILE]", file=sys.stderr)
            return 2
        sys.stdout.write(render())
    except MissingDescriptionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
