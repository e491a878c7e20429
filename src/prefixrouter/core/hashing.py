"""Chained block hashes: the routing key of a prompt.

A prompt is cut into whole blocks; block ``i`` gets
``h[i] = xxh3_64(bytes of block i, seed=h[i-1])`` with ``h[-1] = namespace.seed``.
Because each hash folds in its parent, equal ``h[i]`` means the whole prefix up
to and including block ``i`` is equal (up to a 2^-64 collision), inside one
namespace. A trailing partial block is never hashed: engines cache whole blocks
only, so a partial block can never be reused.

Two modes:

* **token mode** (precise): token ids in blocks of the engine's block size
  (vLLM's default is 16; its CPU build needs 32). Block boundaries then match
  the engine's, and with KV events the index is exact.
* **text mode** (approximate, no tokenizer): fixed-size chunks of normalized
  text. Each chunk stands for ``chunk_chars / chars_per_token`` tokens;
  :class:`TokenEstimator` learns ``chars_per_token`` from the engine's reported
  ``prompt_tokens``.

Token ids are packed as little-endian uint32 once per prompt (``array``), then
sliced per block: hashing 32,768 tokens costs one pass over 128 KiB plus one
C call per block.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import xxhash

from prefixrouter.core.types import BlockHash

_xxh3 = xxhash.xxh3_64_intdigest

DEFAULT_BLOCK_SIZE = 16
DEFAULT_CHUNK_CHARS = 256
DEFAULT_CHARS_PER_TOKEN = 4.0
DEFAULT_MAX_PROMPT_TOKENS = 131_072
"""The gateway's bound on the tokens of a prompt that are hashed (``routing.max_prompt_tokens``)."""


@dataclass(slots=True)
class PromptBlocks:
    """A prompt's chained block hashes and how many tokens each stands for.

    Attributes:
        hashes: ``h[0..n-1]`` for the whole blocks of the prompt.
        block_tokens: Tokens per block (exact in token mode, estimated in text mode).
        prompt_tokens: Tokens of the whole prompt, partial tail included.
    """

    hashes: tuple[BlockHash, ...]
    block_tokens: float
    prompt_tokens: int

    def tokens_for(self, blocks: int) -> int:
        """Tokens covered by the first ``blocks`` blocks."""
        return int(blocks * self.block_tokens)


def _chain(seed: int, data: bytes, step: int, whole_blocks: int) -> tuple[BlockHash, ...]:
    parent = seed
    out: list[int] = []
    append = out.append
    for start in range(0, whole_blocks * step, step):
        parent = _xxh3(data[start : start + step], parent)
        append(parent)
    # ``BlockHash`` is a NewType: calling it per block is a Python-level call
    # that returns its argument unchanged (a third of this loop's time).
    return cast("tuple[BlockHash, ...]", tuple(out))


def hash_token_blocks(seed: int, tokens: Sequence[int], block_size: int) -> tuple[BlockHash, ...]:
    """Chained hashes of the whole ``block_size``-token blocks of ``tokens``.

    Args:
        seed: The namespace seed (``CacheNamespace.seed``).
        tokens: Prompt token ids (each < 2^32).
        block_size: The engine's block size in tokens.

    Returns:
        One hash per whole block, in prompt order.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    packed = tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        packed = array("I", packed)
        packed.byteswap()
    return _chain(seed, packed.tobytes(), block_size * 4, len(tokens) // block_size)


def hash_text_blocks(seed: int, text: str, chunk_chars: int) -> tuple[BlockHash, ...]:
    """Chained hashes of the whole ``chunk_chars``-character chunks of ``text``.

    Chunks are cut on characters, not bytes, so a multi-byte character never
    straddles two chunks; ASCII text (the common case) is encoded once.
    """
    if chunk_chars <= 0:
        raise ValueError(f"chunk_chars must be positive, got {chunk_chars}")
    whole = len(text) // chunk_chars
    if text.isascii():
        return _chain(seed, text.encode("ascii"), chunk_chars, whole)
    parent = seed
    out: list[int] = []
    for start in range(0, whole * chunk_chars, chunk_chars):
        parent = _xxh3(text[start : start + chunk_chars].encode("utf-8"), parent)
        out.append(parent)
    return cast("tuple[BlockHash, ...]", tuple(out))


class TokenEstimator:
    """Characters per token, learned from the engine's reported prompt lengths.

    An exponentially weighted mean of ``chars / prompt_tokens`` over observed
    requests; ``alpha`` is the weight of the newest observation.
    """

    __slots__ = ("alpha", "chars_per_token")

    def __init__(self, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN, alpha: float = 0.1):
        if chars_per_token <= 0:
            raise ValueError("chars_per_token must be positive")
        self.chars_per_token = chars_per_token
        self.alpha = alpha

    def estimate(self, chars: int) -> int:
        """Estimated tokens of ``chars`` characters."""
        return max(1, round(chars / self.chars_per_token)) if chars else 0

    def observe(self, chars: int, prompt_tokens: int) -> None:
        """Fold in one (characters, engine-reported prompt tokens) pair."""
        if chars <= 0 or prompt_tokens <= 0:
            return
        ratio = chars / prompt_tokens
        self.chars_per_token += self.alpha * (ratio - self.chars_per_token)


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Turns a request's prompt into :class:`PromptBlocks` in one of the two modes.

    Attributes:
        block_size: Engine block size (token mode).
        chunk_chars: Characters per chunk (text mode).
        estimator: Chars-per-token estimator (text mode).
        max_prompt_tokens: Only the first this many tokens of a prompt are
            hashed (text mode: as many characters as they take at the current
            estimate); None = all. The prompt's length still counts in full,
            so only a prefix match deeper than this goes unseen. It bounds
            the routing work of one request (hashing, matching, the index's
            updates) whatever a client sends: a prompt of a million token ids
            is otherwise a million ids of work on the router's thread.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    chunk_chars: int = DEFAULT_CHUNK_CHARS
    estimator: TokenEstimator = field(default_factory=TokenEstimator)
    max_prompt_tokens: int | None = None

    def token_blocks(self, seed: int, tokens: Sequence[int]) -> PromptBlocks:
        """Token mode: exact block boundaries."""
        limit = self.max_prompt_tokens
        hashed = tokens if limit is None or len(tokens) <= limit else tokens[:limit]
        hashes = hash_token_blocks(seed, hashed, self.block_size)
        return PromptBlocks(hashes, float(self.block_size), len(tokens))

    def text_blocks(self, seed: int, text: str, prompt_tokens: int = 0) -> PromptBlocks:
        """Text mode: character chunks, token counts estimated."""
        limit = self.max_prompt_tokens
        if limit is not None:
            chars = int(limit * self.estimator.chars_per_token)
            hashed = text if len(text) <= chars else text[:chars]
        else:
            hashed = text
        hashes = hash_text_blocks(seed, hashed, self.chunk_chars)
        total = prompt_tokens or self.estimator.estimate(len(text))
        per_block = self.chunk_chars / self.estimator.chars_per_token
        return PromptBlocks(hashes, per_block, total)
