"""Value types shared by every part of the routing core.

Ids are ``NewType`` wrappers so that a worker id cannot be passed where a
request id is expected. Hot-path records are ``slots`` dataclasses: the router
creates several per request and attribute access on slots is the cheapest
Python offers.

Nothing here does I/O or reads a clock; times are plain ``float`` seconds on
whatever clock the driver (gateway or simulator) uses.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import xxhash

WorkerId = NewType("WorkerId", str)
RequestId = NewType("RequestId", str)
BlockHash = NewType("BlockHash", int)
"""A 64-bit chained block hash (see :mod:`prefixrouter.core.hashing`)."""


class PrefixClass(enum.StrEnum):
    """What kind of reusable prefix a request carries; used to break down metrics."""

    SYSTEM = "system"
    DOCUMENT = "document"
    SESSION = "session"
    RAG = "rag"
    UNKNOWN = "unknown"


class EntrySource(enum.IntEnum):
    """Where the router learned that a worker holds a block, weakest first."""

    SPECULATIVE = 0  # we sent a request there; the engine has probably cached it
    CONFIRMED = 1  # the engine reported reusing it (usage.cached_tokens)
    EVENT = 2  # the engine said so in a KV event: exact until a BlockRemoved


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    """Everything that must be equal for two requests to share KV cache.

    The namespace seeds the block-hash chain, so blocks of different namespaces
    never collide: two tenants, two adapters or two template versions with the
    same text get unrelated hashes.
    """

    model_revision: str
    tokenizer_revision: str = ""
    adapter_id: str = ""
    template_version: str = ""
    tenant: str = ""
    key: str = field(init=False, repr=False, compare=False)
    """A readable, stable identifier of the namespace."""
    seed: int = field(init=False, repr=False, compare=False)
    """The hash of the namespace: ``h[-1]`` of every block-hash chain in it."""

    def __post_init__(self) -> None:
        # Derived once: drivers share one namespace object among many requests
        # and the router reads both on every request.
        key = "|".join(
            (
                self.model_revision,
                self.tokenizer_revision,
                self.adapter_id,
                self.template_version,
                self.tenant,
            )
        )
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "seed", int(xxhash.xxh3_64_intdigest(key.encode("utf-8"))))


@dataclass(slots=True)
class RoutingRequest:
    """What the router needs to know about one request.

    Exactly one of ``tokens`` (token mode) and ``text`` (text mode) drives the
    block hashes. ``prompt_tokens`` is the true or estimated prompt length;
    ``text`` and ``first_user_text`` are kept for policies that work on
    characters (the peers' baselines).

    Attributes:
        request_id: Unique id, echoed in the decision.
        namespace: The cache namespace (model, tokenizer, adapter, template, tenant).
        tokens: Prompt token ids, in token mode.
        text: The prompt text as the engine would see it (normalized), in text mode.
        prompt_tokens: Prompt length in tokens (estimated in text mode); 0 = derive.
        max_tokens: The request's ``max_tokens``: a cap on its output (what it is
            expected to decode is ``RoutingContext.output_tokens``, learned).
        prefix_class: What kind of prefix this is, for reporting.
        model: Model name the request asks for (filters on it).
        adapter: LoRA adapter the request asks for, if any.
        pool: Restrict to workers of this pool, if set.
        first_user_text: Text of the first user message (KubeAI keys on it).
        first_user_offset: Token offset of the first user message, in token mode.
        tenant: The tenant asking ("" = anonymous): the workers' ``tenants``
            lists admit it. Not the namespace's tenant field, which is empty
            for every tenant that shares its cache.
    """

    request_id: RequestId
    namespace: CacheNamespace
    tokens: Sequence[int] | None = None
    text: str | None = None
    prompt_tokens: int = 0
    max_tokens: int = 256
    prefix_class: PrefixClass = PrefixClass.UNKNOWN
    model: str = ""
    adapter: str = ""
    pool: str | None = None
    first_user_text: str | None = None
    first_user_offset: int = 0
    tenant: str = ""

    def __post_init__(self) -> None:
        if self.tokens is None and self.text is None:
            raise ValueError(f"request {self.request_id}: needs tokens or text")
        if self.prompt_tokens <= 0 and self.tokens is not None:
            self.prompt_tokens = len(self.tokens)


@dataclass(frozen=True, slots=True)
class SpeedProfile:
    """How fast one worker prefills and decodes.

    ``prefill_time(n, c)`` is the time to compute ``n`` new tokens that attend
    to ``c`` tokens already in cache: a fixed overhead, a linear term (the
    weights' FLOPs per token) and an attention term that grows with the tokens
    each new token attends to (``c + n/2`` on average). ``decode_step_time(b, k)``
    is one decode step for a batch of ``b`` sequences holding ``k`` context
    tokens in total: reading the weights once, plus per-sequence and
    per-context-token costs (KV reads).

    Attributes:
        prefill_overhead_s: Fixed cost of one prefill (scheduling, kernel launch).
        prefill_s_per_token: Seconds per new token from the weights' FLOPs.
        prefill_s_per_token_context: Seconds per (new token x attended token).
        decode_step_s: Fixed cost of a decode step (weights read once).
        decode_s_per_seq: Additional seconds per sequence in the batch.
        decode_s_per_context_token: Additional seconds per cached token read.
        chunk_tokens: Chunked-prefill token budget per engine step.
    """

    prefill_overhead_s: float = 0.004
    prefill_s_per_token: float = 5.0e-5
    prefill_s_per_token_context: float = 1.0e-10
    decode_step_s: float = 0.008
    decode_s_per_seq: float = 5.0e-5
    decode_s_per_context_token: float = 1.0e-8
    chunk_tokens: int = 8192

    def prefill_time(self, new_tokens: float, context_tokens: float = 0.0) -> float:
        """Seconds to prefill ``new_tokens`` after ``context_tokens`` already cached."""
        if new_tokens <= 0:
            return 0.0
        attended = context_tokens + new_tokens / 2.0
        return (
            self.prefill_overhead_s
            + self.prefill_s_per_token * new_tokens
            + self.prefill_s_per_token_context * new_tokens * attended
        )

    def decode_step_time(self, batch: int, context_tokens: float) -> float:
        """Seconds for one decode step of ``batch`` sequences with ``context_tokens`` in total."""
        if batch <= 0:
            return 0.0
        return (
            self.decode_step_s
            + self.decode_s_per_seq * batch
            + self.decode_s_per_context_token * context_tokens
        )


@dataclass(slots=True)
class WorkerView:
    """A snapshot of one worker, as the driver sees it at decision time.

    The router never mutates it. Load fields come from the driver's in-flight
    ledger (see :class:`prefixrouter.core.load.InflightLedger`) and, live, from
    the engine's metrics.

    Attributes:
        worker_id: Stable id.
        healthy: False removes it from every decision.
        pool: Pool name ("default"; a configured cold pool is e.g. "cold").
        models: Models it serves (empty = any).
        adapters: LoRA adapters it serves.
        tenants: Tenants allowed on it (None = all).
        in_flight: Requests sent and not completed.
        pending_prefill_tokens: Uncached prompt tokens still to prefill (queued + running).
        prefill_elapsed_s: Seconds the engine has been on the head of that
            queue (0 when nothing is pending; see :mod:`prefixrouter.core.load`).
        since_routed_s: Seconds since the router last sent it a request
            (infinite when it never has; the ledger's, as ``in_flight``).
        decoding: Requests past their first token.
        decode_tokens_remaining: Expected output tokens still to generate, all requests.
        context_tokens: KV tokens held by running requests (attended by each decode step).
        queued_prompt_tokens: Prompt tokens of requests sent and not yet decoding:
            they join the decode batch as soon as their prefill ends.
        decoding_own_tokens: KV tokens the decoding requests hold for
            themselves alone (output, and the uncached tail of a prompt mostly
            reused; a prefix they share is not counted, nor a prompt a request
            prefilled mostly itself, which its readers may share): what the
            engine frees as they finish.
        kv_capacity_blocks: Engine KV cache size in blocks.
        kv_used_blocks: Blocks in use by running requests (not reclaimable).
        block_size: Engine tokens per block.
        max_slots: Concurrent sequences the engine runs (max_num_seqs).
        profile: Speed profile (calibrated online by the cost model).
    """

    worker_id: WorkerId
    healthy: bool = True
    pool: str = "default"
    models: frozenset[str] = field(default_factory=frozenset)
    adapters: frozenset[str] = field(default_factory=frozenset)
    tenants: frozenset[str] | None = None
    in_flight: int = 0
    pending_prefill_tokens: int = 0
    prefill_elapsed_s: float = 0.0
    since_routed_s: float = math.inf
    decoding: int = 0
    decode_tokens_remaining: int = 0
    context_tokens: int = 0
    queued_prompt_tokens: int = 0
    decoding_own_tokens: int = 0
    kv_capacity_blocks: int = 100_000
    kv_used_blocks: int = 0
    block_size: int = 16
    max_slots: int = 256
    profile: SpeedProfile = field(default_factory=SpeedProfile)

    @property
    def waiting(self) -> int:
        """Requests sent and not past their first token yet (queued or prefilling)."""
        n = self.in_flight - self.decoding
        return n if n > 0 else 0

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks held by running requests."""
        return self.kv_used_blocks / self.kv_capacity_blocks if self.kv_capacity_blocks else 1.0
