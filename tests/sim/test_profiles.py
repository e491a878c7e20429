"""The built-in engine profiles: figures follow from the stated derivation and are sane."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prefixrouter.core.types import SpeedProfile
from prefixrouter.sim.profiles import (
    H100_SXM_BF16_FLOPS,
    H100_SXM_HBM_BYTES_PER_S,
    LLAMA3_8B,
    LLAMA3_70B,
    PROFILES,
    EngineProfile,
    attention_flops_per_pair,
    flops_per_token,
    get_profile,
    kv_bytes_per_token,
)


def test_required_profiles_exist() -> None:
    assert {"llama3-8b-h100", "llama3-70b-8xh100", "tiny-cpu"} <= set(PROFILES)
    for name, p in PROFILES.items():
        assert get_profile(name) is p and p.name == name
        assert p.speed.chunk_tokens == p.max_batched_tokens
        assert p.block_size == 16


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="llama3-8b-h100") as err:
        get_profile("gpt-9")
    assert "gpt-9" in str(err.value) and "tiny-cpu" in str(err.value)


def test_model_figures() -> None:
    assert kv_bytes_per_token(LLAMA3_8B) == 131_072  # 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_token(LLAMA3_70B) == 327_680  # 2 * 80 * 8 * 128 * 2
    assert flops_per_token(LLAMA3_8B) == pytest.approx(16.06e9)
    assert attention_flops_per_pair(LLAMA3_8B) == 4 * 32 * 4096


def test_8b_figures_follow_the_derivation() -> None:
    s = get_profile("llama3-8b-h100").speed
    assert s.prefill_s_per_token == pytest.approx(16.06e9 / (H100_SXM_BF16_FLOPS * 0.5))
    bw = H100_SXM_HBM_BYTES_PER_S * 0.7
    assert s.decode_s_per_context_token == pytest.approx(131_072 / bw)
    assert s.decode_step_s == pytest.approx(16.06e9 / bw + 0.002)


@pytest.mark.parametrize(
    ("name", "prefill_10k", "decode_32x2k"),
    [
        ("llama3-8b-h100", (0.2, 0.5), (0.010, 0.030)),
        ("llama3-70b-8xh100", (0.3, 0.8), (0.010, 0.040)),
    ],
)
def test_speed_is_in_a_sane_range(
    name: str, prefill_10k: tuple[float, float], decode_32x2k: tuple[float, float]
) -> None:
    s = get_profile(name).speed
    lo, hi = prefill_10k
    assert lo <= s.prefill_time(10_000, 0) <= hi
    lo, hi = decode_32x2k
    assert lo <= s.decode_step_time(32, 32 * 2048) <= hi


def test_kv_capacity_is_what_is_left_after_weights() -> None:
    p8 = get_profile("llama3-8b-h100")
    # (80 GiB * 0.9 - 16.06 GB - 4 GB) / 128 KiB / 16 tokens
    assert p8.kv_blocks == int((80 * 2**30 * 0.9 - 16.06e9 - 4e9) / 131_072 / 16)
    assert 20_000 < p8.kv_blocks < 35_000
    p70 = get_profile("llama3-70b-8xh100")
    assert 60_000 < p70.kv_blocks < 100_000


def test_tiny_profile_is_fast_and_small() -> None:
    p = get_profile("tiny-cpu")
    assert p.speed.prefill_time(1000, 0) < 0.5
    assert p.speed.decode_step_time(4, 2000) < 0.05
    assert p.kv_blocks == 16 * 2**20 // 4096 // 16
    assert p.max_num_seqs <= p.max_batched_tokens


def test_profile_validates_scheduler_limits() -> None:
    base = EngineProfile("x", "", SpeedProfile(), kv_blocks=10)
    with pytest.raises(ValueError):
        replace(base, max_num_seqs=10, max_batched_tokens=5)
    with pytest.raises(ValueError):
        replace(base, kv_blocks=0)
