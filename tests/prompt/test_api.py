"""The public surface of prefixrouter.prompt and prefixrouter.analyze is what __all__ claims."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("name", ["prefixrouter.prompt", "prefixrouter.analyze"])
def test_all_names_resolve(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__all__ == sorted(module.__all__, key=lambda n: (not n.isupper(), n))
    for attr in module.__all__:
        assert getattr(module, attr) is not None, attr


def test_cli_functions_are_plain_typer_commands() -> None:
    import inspect

    from prefixrouter.analyze.cli import analyze
    from prefixrouter.analyze.lint_cli import lint

    assert list(inspect.signature(lint).parameters)[:3] == ["file", "json_out", "max_findings"]
    assert list(inspect.signature(analyze).parameters) == [
        "log", "tokenizer", "block_size", "kv_tokens", "json_out", "plot",
    ]  # fmt: skip
