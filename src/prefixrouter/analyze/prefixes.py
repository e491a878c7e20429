"""Streaming prefix analysis of a request log, in bounded memory.

Every request is rendered to one prompt (:func:`~prefixrouter.prompt.render.render_body`)
and classified (:func:`~prefixrouter.prompt.classify.classify`, as the gateway
classifies it) unless its record states a class, then cut into
chained block hashes with the routing core's own hashing
(:mod:`prefixrouter.core.hashing`): token mode with a tokenizer (blocks of
``block_size`` token ids), text mode without one (chunks of
``block_size * chars_per_token`` characters, each counted as ``block_size``
estimated tokens). Because ``h[i]`` folds in ``h[i-1]``, a block hash names a
whole prefix, so "how much of this prompt was sent before" is "how many of
its leading block hashes were seen before". Four streaming structures read the
hashes; each has a fixed memory bound, so a log of any length (1,000,000
requests and more) is analyzed in bounded memory.

* :class:`SampledReuse`: the prefill an **unlimited** cache would save (a
  block is reused when it was seen before) and the prefill an **LRU cache of
  kv_tokens** would save (``kv_tokens / block_size`` blocks; a request touches
  its blocks deepest first, so a prefix's first blocks are the most recent and
  the cached set stays prefix-closed, as in vLLM, which evicts the tail of a
  chain first). Memory: at most ``max_sampled_blocks`` hashes. Beyond that it
  samples the hash space (SHARDS, Waldspurger et al., FAST 2015): only blocks
  with ``hash < threshold`` are simulated, the LRU capacity is scaled by the
  rate, hits are scaled back by ``1 / rate``; the threshold halves each time
  the sample outgrows the bound. Exact while the rate is 1.
* :class:`PrefixCounter`: how many requests sent each prefix (block-chain
  node), for the top repeated prefixes and the shared-prefix length of each
  request. Memory: at most ``max_prefix_nodes`` nodes; when full, the nodes
  seen least often (count 1 first) are pruned until half remain. Counts are
  then lower bounds, short by at most :attr:`PrefixCounter.error_bound`.
  The top list is built from the *branch points*: for each request, the
  deepest node it shares with an earlier request (at most ``max_prefix_ends``
  kept, the most sent first).
* :class:`DivergenceDetector`: near-identical requests (equal once every hex
  digit is deleted, and before their per-call tail) are compared with
  the last such request; where they first differ, if they agree again right
  after the differing word for ``min_reconverge_tokens`` or more, the word is
  a hidden volatile field (a timestamp, a trace id) and its token position is
  reported. Memory: ``max_exemplars`` texts of at most ``exemplar_chars``
  characters, ``max_divergences`` aggregated findings.
* per-class totals (:class:`ClassStats`) and a histogram of shared-prefix
  lengths (one counter per distinct length).

With the defaults (2^18 sampled blocks, 2^18 prefix nodes, 256 exemplars of
32 KiB) the process stays under about 100 MB whatever the log's length
(measured: 400,000 requests, 86 MB peak resident memory, sampling rate 1/32
at the end). Tokenized text is never kept beyond its batch.

Records whose status says no engine served them (:attr:`LogRecord.served
<prefixrouter.analyze.reader.LogRecord.served>`: a 400 for a prompt too
long, a 502) are counted apart (:attr:`Analysis.unserved_requests`) and
left out of everything else: their prompts were never prefilled, so they
neither cost prefill nor warm a cache.

Gateway decision records logged without a body carry only a ``prefix_key``
(the id of the first ``prefix_key_tokens`` tokens): such a record becomes a
chain of that many tokens' blocks derived from the key, so the same
structures measure reuse up to that depth (a lower bound; no divergences).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Protocol

import xxhash

from prefixrouter.analyze.reader import LogRecord
from prefixrouter.core.hashing import TokenEstimator, hash_text_blocks, hash_token_blocks
from prefixrouter.core.types import PrefixClass
from prefixrouter.prompt.classify import DEFAULT_PARAMS, ClassifierParams, classify
from prefixrouter.prompt.lint import common_prefix_len
from prefixrouter.prompt.render import IM_END, IM_START, RenderedPrompt, render_body

_FULL = 1 << 64
_STEP = 1 << 32  # PrefixCounter packs (count << 32) | depth into one int
_HEX_DIGITS = b"0123456789abcdefABCDEF"
_EMPTY = RenderedPrompt("", (), 0)


@dataclass(frozen=True, slots=True)
class AnalyzeParams:
    """Analysis parameters and memory bounds.

    Attributes:
        block_size: Engine block size in tokens (text mode: estimated tokens per chunk).
        kv_tokens: KV cache capacity in tokens for the LRU estimate (0: none).
        chars_per_token: Text mode: characters per estimated token.
        max_sampled_blocks: Bound of :class:`SampledReuse` (hashes held).
        max_prefix_nodes: Bound of :class:`PrefixCounter` (nodes held).
        max_prefix_ends: Branch points kept for the top-prefix list.
        top_n: Repeated prefixes and divergences to report.
        max_exemplars: Near-identical request groups remembered.
        exemplar_chars: Characters of each remembered request compared.
        min_reconverge_tokens: Equal tokens needed after a difference to call it a field.
        max_divergences: Divergence points aggregated.
        batch: Requests tokenized per batch (token mode).
        prefix_key_tokens: Decision records without a body: tokens their
            ``prefix_key`` stands for (the gateway's ``prefix_key_tokens``).
        classifier: Thresholds and markers of the inferred prefix class (the
            gateway's defaults; its ``routing.document_chars`` is ``document_chars``).
    """

    block_size: int = 16
    kv_tokens: int = 500_000
    chars_per_token: float = 4.0
    max_sampled_blocks: int = 1 << 18
    max_prefix_nodes: int = 1 << 18
    max_prefix_ends: int = 1 << 13
    top_n: int = 10
    max_exemplars: int = 256
    exemplar_chars: int = 32_768
    min_reconverge_tokens: int = 64
    max_divergences: int = 1024
    batch: int = 64
    prefix_key_tokens: int = 1024
    classifier: ClassifierParams = DEFAULT_PARAMS

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kv_tokens < 0:
            raise ValueError(f"kv_tokens must be >= 0, got {self.kv_tokens}")
        if self.chars_per_token <= 0:
            raise ValueError("chars_per_token must be positive")
        if min(self.max_sampled_blocks, self.max_prefix_nodes, self.max_prefix_ends) < 2:
            raise ValueError("memory bounds must be >= 2")

    @property
    def chunk_chars(self) -> int:
        """Text mode: characters per block."""
        return max(1, round(self.block_size * self.chars_per_token))


def _leading(hashes: Sequence[int], present: Any) -> int:
    """How many leading hashes are in ``present`` (prefix-closed: binary search)."""
    lo, hi = 0, len(hashes)
    while lo < hi:
        mid = (lo + hi) // 2
        if hashes[mid] in present:
            lo = mid + 1
        else:
            hi = mid
    return lo


class SampledReuse:
    """Blocks an unlimited cache and an LRU cache would reuse, in bounded memory.

    Invariants: ``_lru`` keys are a subset of ``_seen``; both hold only hashes
    below ``threshold``; ``len(_seen) <= max_samples`` after every access; the
    LRU holds at most ``capacity`` sampled blocks, oldest first.
    """

    __slots__ = ("_lru", "_seen", "capacity_blocks", "max_samples", "resamples", "threshold")

    def __init__(self, capacity_blocks: int, max_samples: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.max_samples = max_samples
        self.threshold = _FULL
        self.resamples = 0
        self._seen: set[int] = set()
        self._lru: OrderedDict[int, None] = OrderedDict()

    @property
    def rate(self) -> float:
        """Fraction of the hash space simulated (1.0: exact)."""
        return self.threshold / _FULL

    @property
    def capacity(self) -> int:
        """LRU capacity in sampled blocks."""
        return int(self.capacity_blocks * self.rate + 0.5) if self.capacity_blocks else 0

    def __len__(self) -> int:
        return len(self._seen)

    def access(self, hashes: Sequence[int]) -> tuple[float, float]:
        """Record one request's blocks.

        Returns:
            (estimated blocks an unlimited cache reuses, estimated blocks the LRU reuses).
        """
        t = self.threshold
        sample = hashes if t == _FULL else [h for h in hashes if h < t]
        scale = _FULL / t
        seen = self._seen
        hit_u = _leading(sample, seen)
        if hit_u < len(sample):
            seen.update(sample[hit_u:])
        cap = self.capacity
        hit_k = 0
        if cap:
            lru = self._lru
            hit_k = _leading(sample, lru)
            move = lru.move_to_end
            # Deepest block first, the prefix's first block last (most recent).
            for i in range(len(sample) - 1, hit_k - 1, -1):
                lru[sample[i]] = None
            for i in range(hit_k - 1, -1, -1):
                move(sample[i])
            while len(lru) > cap:
                lru.popitem(last=False)
        if len(seen) > self.max_samples:
            self._resample()
        return hit_u * scale, hit_k * scale

    def _resample(self) -> None:
        while len(self._seen) > self.max_samples:
            t = self.threshold = self.threshold // 2
            self._seen = {h for h in self._seen if h < t}
            for h in [h for h in self._lru if h >= t]:
                del self._lru[h]
            self.resamples += 1
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)


class PrefixCounter:
    """How many requests sent each prefix (block-chain node), in bounded memory.

    Each node maps to ``count << 32 | depth``. Invariant: at most ``cap``
    nodes after every :meth:`add`. Pruning removes the nodes of the smallest
    counts until half remain; a removed node that comes back restarts at 1, so
    counts are lower bounds and :attr:`error_bound` (the sum of the pruned
    counts' thresholds) bounds how far below the truth any count can be.
    """

    __slots__ = ("_counts", "cap", "error_bound", "prunes")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.error_bound = 0
        self.prunes = 0
        self._counts: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._counts)

    def __contains__(self, node: object) -> bool:
        return node in self._counts

    def add(self, hashes: Sequence[int]) -> int:
        """Count one request's nodes; return how many leading nodes were known before."""
        counts = self._counts
        get = counts.get
        known = -1
        for i, h in enumerate(hashes):
            v = get(h)
            if v is None:
                if known < 0:
                    known = i
                counts[h] = _STEP + i
            else:
                counts[h] = v + _STEP
        if len(counts) > self.cap:
            self._prune()
        return len(hashes) if known < 0 else known

    def count(self, node: int) -> int:
        """Requests that sent this prefix (0 if unknown)."""
        return self._counts.get(node, 0) >> 32

    def depth(self, node: int) -> int:
        """Block index of the node (its prefix has ``depth + 1`` blocks)."""
        return self._counts.get(node, 0) & (_STEP - 1)

    def _prune(self) -> None:
        keep = self.cap // 2
        k = 0
        while len(self._counts) > keep:
            k += 1
            limit = (k + 1) * _STEP  # drop counts <= k
            self._counts = {h: v for h, v in self._counts.items() if v >= limit}
        self.error_bound += k
        self.prunes += 1


@dataclass(slots=True)
class Divergence:
    """Where near-identical requests first differ.

    Attributes:
        token_position: Token offset of the differing word.
        text: The differing word in one of the requests (at most 80 characters).
        requests: Requests involved.
        stable_tokens_after: Equal tokens right after it (what it costs per call).
        char_position: Character offset of the differing word in the rendered prompt.
    """

    token_position: int
    text: str
    requests: int
    stable_tokens_after: int
    char_position: int


class DivergenceDetector:
    """Finds hidden volatile fields by comparing near-identical requests.

    Requests are grouped by a *skeleton*: the stable part of the rendered
    prompt (before its per-call tail, at most ``exemplar_chars``) with every
    hex digit deleted (``bytes.translate``, one C pass), so requests
    differing only in timestamps, counters or ids share a group. Each group keeps its last
    request; a new one is compared with it (:meth:`observe`).
    """

    __slots__ = ("_exemplars", "_found", "exemplar_chars", "max_exemplars", "max_found")

    def __init__(self, max_exemplars: int, exemplar_chars: int, max_found: int) -> None:
        self.max_exemplars = max_exemplars
        self.exemplar_chars = exemplar_chars
        self.max_found = max_found
        self._exemplars: OrderedDict[int, str] = OrderedDict()
        self._found: dict[tuple[int, int, int], Divergence] = {}

    def observe(
        self,
        text: str,
        stable_end: int,
        seed: int,
        min_equal_chars: int,
        to_tokens: Callable[[int], int],
    ) -> Divergence | None:
        """Compare one request with the last of its group; remember it.

        Args:
            text: The rendered prompt.
            stable_end: Where its per-call tail begins.
            seed: The namespace seed (groups never mix namespaces).
            min_equal_chars: Equal characters needed after the differing word.
            to_tokens: Maps a character offset of ``text`` to a token offset.

        Returns:
            The aggregated divergence this request contributed to, if any.
        """
        s = text[: min(stable_end, self.exemplar_chars)]
        if not s:
            return None
        masked = s.encode("utf-8", "surrogatepass").translate(None, _HEX_DIGITS)
        key = xxhash.xxh3_64_intdigest(masked, seed)
        prev = self._exemplars.get(key)
        self._exemplars[key] = s
        self._exemplars.move_to_end(key)
        if len(self._exemplars) > self.max_exemplars:
            self._exemplars.popitem(last=False)
        if prev is None or prev == s:
            return None
        p = common_prefix_len(prev, s)
        if p >= min(len(prev), len(s)):
            return None
        start = p
        while start > 0 and p - start < 64 and not s[start - 1].isspace():
            start -= 1
        end_s, end_p = _word_end(s, p), _word_end(prev, p)
        equal = common_prefix_len(s[end_s:], prev[end_p:])
        if equal < min_equal_chars:
            return None
        word = s[start:end_s]
        dkey = (
            seed,
            start,
            xxhash.xxh3_64_intdigest(
                s[max(0, start - 32) : start].encode("utf-8", "surrogatepass")
            ),
        )
        found = self._found.get(dkey)
        if found is None:
            if len(self._found) >= self.max_found:
                smallest = min(self._found, key=lambda k: self._found[k].requests)
                del self._found[smallest]
            tokens_after = to_tokens(end_s + equal) - to_tokens(end_s)
            found = Divergence(to_tokens(start), word[:80], 1, tokens_after, start)
            self._found[dkey] = found
        found.requests += 1
        return found

    def top(self, n: int) -> list[Divergence]:
        """The ``n`` divergences seen in the most requests."""
        ranked = sorted(
            self._found.values(),
            key=lambda d: (-d.requests, -d.stable_tokens_after, d.token_position),
        )
        return ranked[:n]


def _word_end(text: str, pos: int, limit: int = 128) -> int:
    end = pos
    while end < len(text) and end - pos < limit and not text[end].isspace():
        end += 1
    return end


@dataclass(slots=True)
class ClassStats:
    """Totals of one prefix class (reusable tokens are estimates under sampling)."""

    requests: int = 0
    prompt_tokens: int = 0
    reusable_unlimited: float = 0.0
    reusable_kv: float = 0.0


@dataclass(frozen=True, slots=True)
class TopPrefix:
    """A prefix sent again and again.

    Attributes:
        tokens: Its length in tokens.
        count: Requests that sent it (a lower bound if the counter pruned).
        text_start: The start of its text (markup stripped, whitespace collapsed).
        text_end: The last characters of the prefix.
    """

    tokens: int
    count: int
    text_start: str
    text_end: str


@dataclass(frozen=True, slots=True)
class Analysis:
    """Everything :class:`PrefixAnalyzer` measured; :mod:`.report` turns it into a verdict."""

    params: AnalyzeParams
    mode: str
    requests: int
    prompt_tokens: int
    reusable_unlimited: float
    reusable_kv: float
    by_class: dict[str, ClassStats]
    top_prefixes: list[TopPrefix]
    divergences: list[Divergence]
    shared_prefix_hist: dict[int, int]
    sampling_rate: float
    count_error_bound: int
    observed_prompt_tokens: int
    observed_cached_tokens: int
    key_only_requests: int = 0
    key_only_unseen_tokens: int = 0
    """Prompt tokens of prefix-key records beyond the key's depth: whether they
    repeat, the log cannot show, so reuse is a lower bound while this is > 0."""
    memory: dict[str, int] = field(default_factory=dict)
    unserved_requests: int = 0
    """Records left out because their status says no engine served them."""


class Tokenized(Protocol):
    """What a tokenizer returns for one text (``tokenizers.Encoding`` fits)."""

    @property
    def ids(self) -> list[int]: ...

    @property
    def offsets(self) -> list[tuple[int, int]]: ...


class Encoder(Protocol):
    """Tokenizes texts in batches (``tokenizers.Tokenizer`` fits)."""

    def encode_batch(self, texts: list[str]) -> Sequence[Tokenized]: ...


def load_encoder(path: Path) -> Encoder:
    """A ``tokenizers`` tokenizer from ``tokenizer.json`` (or a folder holding one).

    Raises:
        OSError: No such file.
        ValueError: The file is not a tokenizer.
    """
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise OSError(f"no tokenizer file at {file}")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises plain Exception
        raise ValueError(f"{file}: not a tokenizers file ({exc})") from None

    class _HF:
        def encode_batch(self, texts: list[str]) -> Sequence[Tokenized]:
            return tok.encode_batch(texts, add_special_tokens=False)

    return _HF()


def _display(text: str, width: int = 80, *, tail: bool = False) -> str:
    text = text.replace(IM_START, "").replace(IM_END + "\n", " | ").replace(IM_END, " |")
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    return "…" + text[-(width - 1) :] if tail else text[: width - 1] + "…"


class PrefixAnalyzer:
    """Feeds log records through the streaming structures (see the module docstring)."""

    def __init__(self, params: AnalyzeParams | None = None, encoder: Encoder | None = None):
        self.params = p = params or AnalyzeParams()
        self.encoder = encoder
        self.estimator = TokenEstimator(p.chars_per_token)
        self.reuse = SampledReuse(p.kv_tokens // p.block_size, p.max_sampled_blocks)
        self.counter = PrefixCounter(p.max_prefix_nodes)
        self.divergences = DivergenceDetector(p.max_exemplars, p.exemplar_chars, p.max_divergences)
        self._ends: dict[int, tuple[str, str]] = {}
        self._classes: dict[str, ClassStats] = {}
        self._hist: dict[int, int] = {}
        self._seeds: dict[str, int] = {}
        self.requests = 0
        self.prompt_tokens = 0
        self.reusable_unlimited = 0.0
        self.reusable_kv = 0.0
        self.observed_prompt_tokens = 0
        self.observed_cached_tokens = 0
        self.key_only = 0
        self.key_only_unseen = 0
        self.unserved = 0

    def _served(self, records: Iterable[LogRecord]) -> Iterator[LogRecord]:
        """The records an engine served; the others are only counted (module doc)."""
        for rec in records:
            if rec.served:
                yield rec
            else:
                self.unserved += 1

    def feed(self, records: Iterable[LogRecord]) -> None:
        """Analyze the served records in order (tokenized in batches in token mode)."""
        it: Iterator[LogRecord] = self._served(records)
        if self.encoder is None:
            for rec in it:
                self._one(rec, render_body(rec.body), None)
            return
        while batch := list(islice(it, self.params.batch)):
            rendered = [_EMPTY if r.prefix_key else render_body(r.body) for r in batch]
            encoded = self.encoder.encode_batch([r.text for r in rendered])
            for rec, prompt, enc in zip(batch, rendered, encoded, strict=True):
                self._one(rec, prompt, enc)

    def _seed(self, namespace: str) -> int:
        seed = self._seeds.get(namespace)
        if seed is None:
            seed = self._seeds[namespace] = xxhash.xxh3_64_intdigest(namespace.encode("utf-8"))
        return seed

    def _one(self, rec: LogRecord, prompt: RenderedPrompt, enc: Tokenized | None) -> None:
        if rec.prefix_key is not None:
            self._key_only(rec)
            return
        p = self.params
        text = prompt.text
        seed = self._seed(rec.namespace)
        ends: list[int] | None = None
        if enc is None:
            hashes = hash_text_blocks(seed, text, p.chunk_chars)
            prompt_tokens = self.estimator.estimate(len(text))
        else:
            ids = enc.ids  # a fresh list on every access: read it once
            hashes = hash_token_blocks(seed, ids, p.block_size)
            prompt_tokens = len(ids)

        def to_tokens(pos: int) -> int:
            nonlocal ends
            if enc is None:
                return self.estimator.estimate(pos)
            if ends is None:
                ends = [e for _, e in enc.offsets]
            return bisect_right(ends, pos)

        cls = rec.prefix_class or classify(prompt, p.classifier)
        known = self._account(rec, cls, hashes, prompt_tokens)
        if known and hashes[known - 1] not in self._ends:
            cut = known * p.chunk_chars if enc is None else enc.offsets[known * p.block_size - 1][1]
            self._add_end(hashes[known - 1], text[:cut])
        min_chars = round(p.min_reconverge_tokens * p.chars_per_token)
        self.divergences.observe(text, prompt.tail_start, seed, min_chars, to_tokens)

    def _key_only(self, rec: LogRecord) -> None:
        """A decision record without a body: its prefix key stands for its first tokens.

        The key names the first ``prefix_key_tokens`` tokens (or the whole
        prompt if shorter), so it becomes a chain of that many tokens' blocks,
        derived from the key; the rest of the prompt counts as unique. Reuse
        is then a lower bound, exact up to that depth.
        """
        p = self.params
        tokens = rec.prompt_tokens or 0
        key = rec.prefix_key or ""
        h = xxhash.xxh3_64_intdigest(key.encode("utf-8"), self._seed(rec.namespace))
        chain: list[int] = []
        for j in range(min(tokens, p.prefix_key_tokens) // p.block_size):
            h = xxhash.xxh3_64_intdigest(j.to_bytes(4, "little"), h)
            chain.append(h)
        self.key_only += 1
        # The key names the whole of a shorter prompt: only what lies beyond it is unseen.
        self.key_only_unseen += max(0, tokens - p.prefix_key_tokens)
        known = self._account(rec, rec.prefix_class or PrefixClass.UNKNOWN, chain, tokens)
        if known and chain[known - 1] not in self._ends:
            self._add_end(chain[known - 1], f"prefix_key {key}")

    def _account(
        self, rec: LogRecord, cls: PrefixClass, hashes: Sequence[int], prompt_tokens: int
    ) -> int:
        """Feed one request's blocks to every structure; return its known leading blocks."""
        bs = self.params.block_size
        hit_u, hit_k = self.reuse.access(hashes)
        reuse_u = min(float(prompt_tokens), hit_u * bs)
        reuse_k = min(float(prompt_tokens), hit_k * bs)
        known = self.counter.add(hashes)
        self._hist[known] = self._hist.get(known, 0) + 1
        stats = self._classes.get(cls.value)
        if stats is None:
            stats = self._classes[cls.value] = ClassStats()
        stats.requests += 1
        stats.prompt_tokens += prompt_tokens
        stats.reusable_unlimited += reuse_u
        stats.reusable_kv += reuse_k
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.reusable_unlimited += reuse_u
        self.reusable_kv += reuse_k
        if rec.cached_tokens is not None:
            self.observed_cached_tokens += rec.cached_tokens
            self.observed_prompt_tokens += rec.prompt_tokens or prompt_tokens
        return known

    def _add_end(self, node: int, prefix_text: str) -> None:
        ends = self._ends
        ends[node] = (_display(prefix_text), _display(prefix_text[-200:], tail=True))
        if len(ends) > self.params.max_prefix_ends:
            ranked = sorted(ends, key=lambda h: self.counter.count(h), reverse=True)
            for h in ranked[len(ranked) // 2 :]:
                del ends[h]

    def top_prefixes(self) -> list[TopPrefix]:
        """The prefixes whose caching saves the most prefill: ``(count - 1) * tokens``."""
        bs = self.params.block_size
        rows: list[tuple[int, int, int, TopPrefix]] = []
        for node, (start, end) in self._ends.items():
            count = self.counter.count(node)
            if count < 2:
                continue
            tokens = (self.counter.depth(node) + 1) * bs
            rows.append(((count - 1) * tokens, tokens, node, TopPrefix(tokens, count, start, end)))
        rows.sort(key=lambda r: (-r[0], -r[1], r[2]))
        return [r[3] for r in rows[: self.params.top_n]]

    def result(self) -> Analysis:
        """A snapshot of everything measured so far."""
        return Analysis(
            params=self.params,
            mode=(
                "prefix-key"
                if self.requests and self.key_only == self.requests
                else "text"
                if self.encoder is None
                else "token"
            ),
            requests=self.requests,
            prompt_tokens=self.prompt_tokens,
            reusable_unlimited=self.reusable_unlimited,
            reusable_kv=self.reusable_kv,
            by_class=dict(sorted(self._classes.items())),
            top_prefixes=self.top_prefixes(),
            divergences=self.divergences.top(self.params.top_n),
            shared_prefix_hist=dict(sorted(self._hist.items())),
            sampling_rate=self.reuse.rate,
            count_error_bound=self.counter.error_bound,
            observed_prompt_tokens=self.observed_prompt_tokens,
            observed_cached_tokens=self.observed_cached_tokens,
            key_only_requests=self.key_only,
            key_only_unseen_tokens=self.key_only_unseen,
            memory={
                "sampled_blocks": len(self.reuse),
                "prefix_nodes": len(self.counter),
                "prefix_ends": len(self._ends),
            },
            unserved_requests=self.unserved,
        )


def analyze_records(
    records: Iterable[LogRecord],
    params: AnalyzeParams | None = None,
    encoder: Encoder | None = None,
) -> Analysis:
    """Analyze a stream of records in one pass.

    Args:
        records: Log records (see :func:`prefixrouter.analyze.reader.iter_records`).
        params: Parameters and memory bounds.
        encoder: A tokenizer for token mode; None for text mode.
    """
    analyzer = PrefixAnalyzer(params, encoder)
    analyzer.feed(records)
    return analyzer.result()


def class_names() -> tuple[str, ...]:
    """The prefix classes, in report order."""
    return tuple(c.value for c in PrefixClass)
