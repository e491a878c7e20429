"""EngineServerConfig: overrides and validation."""

from __future__ import annotations

import pytest

from prefixrouter.errors import ConfigError
from prefixrouter.simulated_engine import EngineServerConfig


def test_defaults_follow_the_profile() -> None:
    cfg = EngineServerConfig()
    prof = cfg.engine_profile()
    assert (prof.name, prof.block_size, prof.kv_blocks) == ("tiny-cpu", 16, 256)
    assert cfg.effective_max_model_len == 4096


def test_block_size_keeps_kv_memory_and_kv_blocks_override() -> None:
    prof = EngineServerConfig(block_size=32).engine_profile()
    assert (prof.block_size, prof.kv_blocks) == (32, 128)
    prof = EngineServerConfig(block_size=32, kv_blocks=10).engine_profile()
    assert (prof.block_size, prof.kv_blocks) == (32, 10)
    assert EngineServerConfig(block_size=32, kv_blocks=10).effective_max_model_len == 320


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"time_scale": 0}, "time_scale"),
        ({"kv_blocks": 0}, "kv_blocks"),
        ({"profile": "nope"}, "profile"),
        ({"max_model_len": 5000}, "max_model_len"),
        ({"model": ""}, "model"),
        ({"default_max_tokens": 0}, "default_max_tokens"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineServerConfig(**kwargs)  # type: ignore[arg-type]
    assert str(info.value).startswith(field + ":")
