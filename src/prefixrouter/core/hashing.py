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
  ``prompt_tokens``, globally and per prefix (a prompt's chunks are converted
  at its own prefix's estimate where one was learned).

Token ids are packed as little-endian uint32 once per prompt (``array``), then
sliced per block: hashing 32,768 tokens costs one pass over 128 KiB plus one
C call per block.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import xxhash

from prefixrouter.core.running_mean import fold
from prefixrouter.core.types import BlockHash

_xxh3 = xxhash.xxh3_64_intdigest

DEFAULT_BLOCK_SIZE = 16
DEFAULT_CHUNK_CHARS = 256
DEFAULT_CHARS_PER_TOKEN = 4.0
DEFAULT_MAX_PROMPT_TOKENS = 131_072
"""The gateway's bound on the tokens of a prompt that are hashed (``routing.max_prompt_tokens``)."""
DEFAULT_MAX_PREFIX_ESTIMATES = 16_384
"""Prefix anchors with a characters-per-token estimate of their own (about 3 MB)."""


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


def anchor_depths(blocks: int) -> range:
    """Exponents ``k`` of the anchor depths ``2**k`` (in blocks) a chain of ``blocks`` has.

    Depths 1, 2, 4, ... up to ``blocks``: a handful per prompt (12 for 2,048
    chunks), and the deepest covers at least half of the chain.
    """
    return range(blocks.bit_length())


class TokenEstimator:
    """Characters per token, learned from the engine's answers, globally and per prefix.

    **Globally**: the running mean of ``chars / prompt_tokens`` over observed
    requests, each weighted ``max(alpha, 1/n)`` (``n``: observations so far,
    counting this one; :func:`~prefixrouter.core.running_mean.fold`, the
    router's one running mean). The first answer therefore *replaces* the prior (an
    engine's count beats a guess; a prior crept from by ``alpha`` per request
    under-valued warm workers for many requests), the first ``1/alpha`` are an
    equal-weight mean, and later ones move it by ``alpha`` at most, so one odd
    prompt cannot swing every prediction.

    **Per prefix**: documents differ (source code has fewer characters per token
    than prose, numbers and CJK fewer still), so one global figure predicted
    6,252 to 10,102 cached tokens for four 8,000-token documents on a real
    engine. Each observation with the prompt's chained block hashes is also
    folded, the same way, into an entry per *anchor* of its chain: the hash at
    depth 1, 2, 4, ... blocks (:func:`anchor_depths`). A prompt's estimate is
    that of its deepest anchor with an entry, else the global one
    (:meth:`for_prefix`): the second question about a document finds the
    document's anchor (equal hashes, equal prefix) and converts its matched
    chunks at that document's own ratio; a conversation's next turn finds the
    anchors its previous turn left. The ratio is the whole prompt's (the
    engine's ``prompt_tokens``), so a prefix's estimate carries its suffixes'
    share: small where the prefix is most of the prompt, which is where the
    cached tokens matter. The engine's cached tokens are not used for it: they
    also fall when the engine evicted, which is no fact about characters.

    Entries are kept least recently *observed* first out past ``max_prefixes``
    (bounded memory; deterministic). Reads (:meth:`for_prefix`,
    :meth:`estimate`) change nothing, so hashing may run on another thread
    than the one that observes: an entry is a tuple replaced whole.

    Attributes:
        prior: The starting estimate, fixed (the text-mode prefix key's depth
            in characters is computed from it, never from the moving estimate).
        chars_per_token: The global estimate.
        alpha: The least weight of a new observation.
        max_prefixes: Anchors kept.
    """

    __slots__ = ("_count", "_prefixes", "alpha", "chars_per_token", "max_prefixes", "prior")

    def __init__(
        self,
        chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
        alpha: float = 0.1,
        max_prefixes: int = DEFAULT_MAX_PREFIX_ESTIMATES,
    ):
        if chars_per_token <= 0:
            raise ValueError("chars_per_token must be positive")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if max_prefixes < 0:
            raise ValueError(f"max_prefixes must be >= 0, got {max_prefixes}")
        self.prior = chars_per_token
        self.chars_per_token = chars_per_token
        self.alpha = alpha
        self.max_prefixes = max_prefixes
        self._count = 0
        # anchor hash -> (chars per token, observations, capped at 1/alpha)
        self._prefixes: OrderedDict[BlockHash, tuple[float, int]] = OrderedDict()

    def estimate(self, chars: int) -> int:
        """Estimated tokens of ``chars`` characters (the global estimate)."""
        return max(1, round(chars / self.chars_per_token)) if chars else 0

    def for_prefix(self, hashes: Sequence[BlockHash]) -> float:
        """Characters per token for a prompt with these chained hashes.

        The entry of the deepest anchor of ``hashes`` that has one, else the
        global estimate. Changes nothing.
        """
        depth, cpt = self._deepest(hashes)
        return cpt if depth else self.chars_per_token

    def learned_depth(self, hashes: Sequence[BlockHash]) -> int:
        """Chunks covered by the deepest anchor of ``hashes`` with an estimate (0: none).

        ``for_prefix`` converts at that anchor's estimate; the deeper it is,
        the more of the prompt the estimate was learned on. Changes nothing.
        """
        return self._deepest(hashes)[0]

    def _deepest(self, hashes: Sequence[BlockHash]) -> tuple[int, float]:
        """(depth in chunks, estimate) of the deepest anchor with an entry; (0, 0.0) if none."""
        prefixes = self._prefixes
        if prefixes:
            get = prefixes.get
            for k in reversed(anchor_depths(len(hashes))):
                depth = 1 << k
                hit = get(hashes[depth - 1])
                if hit is not None:
                    return depth, hit[0]
        return 0, 0.0

    def prefixes(self) -> int:
        """Anchors with an estimate of their own."""
        return len(self._prefixes)

    def observe(self, chars: int, prompt_tokens: int, hashes: Sequence[BlockHash] = ()) -> None:
        """Fold in one (characters, engine-reported prompt tokens) pair.

        ``hashes``: the prompt's chained block hashes (text mode's chunks), to
        learn its prefixes' estimates too.
        """
        if chars <= 0 or prompt_tokens <= 0:
            return
        ratio = chars / prompt_tokens
        cap = max(1, round(1.0 / self.alpha))
        self.chars_per_token, self._count = fold(self.chars_per_token, self._count, ratio, cap)
        if not hashes or self.max_prefixes == 0:
            return
        prefixes = self._prefixes
        for k in anchor_depths(len(hashes)):
            anchor = hashes[(1 << k) - 1]
            old = prefixes.get(anchor)
            if old is None:
                prefixes[anchor] = (ratio, 1)
            else:
                prefixes[anchor] = fold(old[0], old[1], ratio, cap)
                prefixes.move_to_end(anchor)
        while len(prefixes) > self.max_prefixes:
            prefixes.popitem(last=False)


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
        # The prompt's own prefix's estimate where one was learned (see
        # TokenEstimator): its chunks, matched or not, are converted at it.
        cpt = self.estimator.for_prefix(hashes)
        total = prompt_tokens or (max(1, round(len(text) / cpt)) if text else 0)
        return PromptBlocks(hashes, self.chunk_chars / cpt, total)

    def text_key_blocks(self, prefix_key_tokens: int) -> int:
        """Text mode: chunks the prefix key covers, from a fixed number of characters.

        ``prefix_key_tokens`` at the estimator's *prior* (never the moving
        estimate), so a document keeps one key however the estimate learns.
        """
        return max(1, int(prefix_key_tokens * self.estimator.prior) // self.chunk_chars)
