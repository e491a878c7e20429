"""EngineServerConfig: overrides and validation."""

from __future__ import annotations

import pytest

from prefixrouter.errors import ConfigError
from prefixrouter.simulated_engine import EngineServerConfig
from prefixrouter.simulated_engine.config import DEFAULT_MAX_MODEL_LEN, DEFAULT_PROFILE


def test_defaults_follow_the_profile() -> None:
    cfg = EngineServerConfig(profile="tiny-cpu")
    prof = cfg.engine_profile()
    assert (prof.name, prof.block_size, prof.kv_blocks) == ("tiny-cpu", 16, 256)
    assert cfg.effective_max_model_len == 4096


def test_the_newcomer_default_takes_long_documents() -> None:
    # No profile: a long-context model whose KV holds the seed's 30,000-token
    # documents many times over, not the 4,096-token toy.
    cfg = EngineServerConfig()
    prof = cfg.engine_profile()
    assert prof.name == DEFAULT_PROFILE == "llama3-8b-h100"
    assert cfg.effective_max_model_len == DEFAULT_MAX_MODEL_LEN == 131_072
    assert prof.kv_blocks * prof.block_size >= 10 * 30_000
    # An explicit length may go up to the KV cache.
    assert EngineServerConfig(max_model_len=400_000).effective_max_model_len == 400_000


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"profile": "tiny-cpu"}, "--kv-blocks, or without --profile (llama3-8b-h100: 131,072"),
        ({}, "--max-model-len up to 436,"),
        ({"profile": "tiny-cpu", "max_model_len": 1024}, "--max-model-len up to 4,096"),
        ({"kv_blocks": 100}, "start it with more --kv-blocks and --max-model-len"),
    ],
)
def test_length_hint_names_the_flag_that_admits_the_request(
    kwargs: dict[str, object], names: str
) -> None:
    hint = EngineServerConfig(**kwargs).length_hint()  # type: ignore[arg-type]
    assert hint.startswith("This simulated engine (profile ") and names in hint, hint


def test_block_size_keeps_kv_memory_and_kv_blocks_override() -> None:
    toy = "tiny-cpu"
    prof = EngineServerConfig(profile=toy, block_size=32).engine_profile()
    assert (prof.block_size, prof.kv_blocks) == (32, 128)
    prof = EngineServerConfig(profile=toy, block_size=32, kv_blocks=10).engine_profile()
    assert (prof.block_size, prof.kv_blocks) == (32, 10)
    assert EngineServerConfig(block_size=32, kv_blocks=10).effective_max_model_len == 320


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"time_scale": 0}, "time_scale"),
        ({"kv_blocks": 0}, "kv_blocks"),
        ({"profile": "nope"}, "profile"),
        ({"max_model_len": 5000, "profile": "tiny-cpu"}, "max_model_len"),
        ({"max_model_len": 500_000}, "max_model_len"),
        ({"model": ""}, "model"),
        ({"default_max_tokens": 0}, "default_max_tokens"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineServerConfig(**kwargs)  # type: ignore[arg-type]
    assert str(info.value).startswith(field + ":")
