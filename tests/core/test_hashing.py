from __future__ import annotations

from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixrouter.core import (
    BlockHasher,
    CacheNamespace,
    TokenEstimator,
    hash_text_blocks,
    hash_token_blocks,
)

SEED = CacheNamespace("m").seed


def test_whole_blocks_only() -> None:
    assert len(hash_token_blocks(SEED, list(range(47)), 16)) == 2
    assert len(hash_token_blocks(SEED, list(range(48)), 16)) == 3
    assert hash_token_blocks(SEED, list(range(15)), 16) == ()


def test_chain_equal_prefix_equal_hashes_then_diverge() -> None:
    a = list(range(64))
    b = [*range(40), 999, *range(41, 64)]
    ha, hb = hash_token_blocks(SEED, a, 16), hash_token_blocks(SEED, b, 16)
    assert ha[:2] == hb[:2]
    # block 2 differs, and so does every later block, even though block 3's tokens agree
    assert ha[2] != hb[2] and ha[3] != hb[3]


def test_list_and_array_inputs_agree() -> None:
    toks = list(range(100, 200))
    assert hash_token_blocks(SEED, toks, 16) == hash_token_blocks(SEED, array("I", toks), 16)


def test_namespace_separates_everything() -> None:
    toks = list(range(64))
    seeds = {
        CacheNamespace("m").seed,
        CacheNamespace("m", tenant="t1").seed,
        CacheNamespace("m", tenant="t2").seed,
        CacheNamespace("m", adapter_id="lora").seed,
        CacheNamespace("m", template_version="v2").seed,
        CacheNamespace("m", tokenizer_revision="r2").seed,
        CacheNamespace("m2").seed,
    }
    assert len(seeds) == 7
    chains = {hash_token_blocks(s, toks, 16)[0] for s in seeds}
    assert len(chains) == 7


def test_namespace_seed_is_stable_across_processes() -> None:
    # xxh3 of the key: a fixed value, not Python's randomized hash()
    assert CacheNamespace("m").seed == CacheNamespace("m").seed
    import subprocess
    import sys

    code = "from prefixrouter.core import CacheNamespace; print(CacheNamespace('m').seed)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == SEED


def test_namespace_key_and_seed_are_derived_from_the_fields() -> None:
    from dataclasses import replace

    ns = CacheNamespace("m", tenant="t")
    assert ns.key == "m||||t"
    assert ns.seed == 5522790739424383187  # engines and routers must agree on it
    other = replace(ns, tenant="u")
    assert other.key == "m||||u" and other.seed == CacheNamespace("m", tenant="u").seed
    assert ns == CacheNamespace("m", tenant="t") and ns != other
    assert "seed" not in repr(ns)


def test_hashes_are_plain_ints() -> None:
    hashes = hash_text_blocks(SEED, "x" * 1000, 256) + hash_token_blocks(SEED, range(64), 16)
    assert hashes and all(type(h) is int for h in hashes)


def test_text_mode_chunks_and_unicode() -> None:
    text = "abcd" * 100  # 400 chars
    assert len(hash_text_blocks(SEED, text, 128)) == 3
    uni = "é" * 300
    hu = hash_text_blocks(SEED, uni, 128)
    assert len(hu) == 2
    assert hash_text_blocks(SEED, uni + "x" * 10, 128) == hu


def test_bad_sizes_raise() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_token_blocks(SEED, [1, 2], 0)
    with pytest.raises(ValueError, match="chunk_chars"):
        hash_text_blocks(SEED, "ab", 0)


def test_estimator_learns_chars_per_token() -> None:
    est = TokenEstimator(chars_per_token=4.0, alpha=0.2)
    for _ in range(60):
        est.observe(3000, 1000)  # the engine says 3 chars per token
    assert est.chars_per_token == pytest.approx(3.0, abs=0.01)
    assert est.estimate(3000) == 1000
    est.observe(0, 10)  # ignored
    assert est.chars_per_token == pytest.approx(3.0, abs=0.01)


def test_text_blocks_use_estimated_tokens() -> None:
    hasher = BlockHasher(chunk_chars=256, estimator=TokenEstimator(chars_per_token=4.0))
    pb = hasher.text_blocks(SEED, "x" * 1000)
    assert pb.block_tokens == 64.0 and pb.prompt_tokens == 250 and len(pb.hashes) == 3
    assert pb.tokens_for(2) == 128


@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=200),
    st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=200),
    st.sampled_from([1, 4, 16]),
)
def test_common_blocks_iff_common_token_prefix(a: list[int], b: list[int], bs: int) -> None:
    ha, hb = hash_token_blocks(SEED, a, bs), hash_token_blocks(SEED, b, bs)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    shared_blocks = 0
    while shared_blocks < min(len(ha), len(hb)) and ha[shared_blocks] == hb[shared_blocks]:
        shared_blocks += 1
    assert shared_blocks == min(common // bs, len(ha), len(hb))


def test_only_the_first_max_prompt_tokens_are_hashed_but_the_length_counts_in_full() -> None:
    tokens = list(range(10_000))
    capped = BlockHasher(block_size=16, max_prompt_tokens=1_000).token_blocks(SEED, tokens)
    full = BlockHasher(block_size=16).token_blocks(SEED, tokens)
    assert capped.hashes == full.hashes[: 1_000 // 16]
    assert capped.prompt_tokens == full.prompt_tokens == 10_000

    text = "abcdefgh" * 10_000
    est = TokenEstimator(4.0)
    capped_t = BlockHasher(chunk_chars=256, estimator=est, max_prompt_tokens=1_000).text_blocks(
        SEED, text
    )
    full_t = BlockHasher(chunk_chars=256, estimator=est).text_blocks(SEED, text)
    assert capped_t.hashes == full_t.hashes[: 4_000 // 256]  # 1,000 tokens of 4 characters
    assert capped_t.prompt_tokens == full_t.prompt_tokens == 20_000
