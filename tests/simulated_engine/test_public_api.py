"""The public surface is what ``__all__`` claims, and importing it is cheap and safe."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("module", ["prefixrouter.simulated_engine", "prefixrouter.tokenization"])
def test_all_names_exist(module: str) -> None:
    mod = importlib.import_module(module)
    missing = [name for name in mod.__all__ if not hasattr(mod, name)]
    assert not missing


def test_engine_command_signature() -> None:
    import inspect

    from prefixrouter.simulated_engine import engine

    params = inspect.signature(engine).parameters
    assert list(params)[:8] == [
        "port", "host", "profile", "kv_blocks", "time_scale", "model", "block_size",
        "max_model_len",
    ]  # fmt: skip
    assert params["host"].default == "127.0.0.1" and params["profile"].default == "llama3-8b-h100"
    assert params["time_scale"].default == 1.0 and params["model"].default == "tiny"
