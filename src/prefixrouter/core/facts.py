"""Routing facts: what one dispatcher records, so that other replicas can apply it.

Several gateway replicas in front of one pool of engines each route a share of
the traffic. Each must know what the others placed where, or every replica
learns placement from its own share only and scatters each prefix over the
workers. A :class:`~prefixrouter.core.dispatch.Dispatcher` that records facts
appends one to its outbox for every change a peer needs to mirror:

* :class:`RoutedFact`: a request was sent to a worker (its block hashes, the
  tokens it will prefill, the output it may decode);
* :class:`FirstTokenFact`: its prefill is done (it decodes now);
* :class:`CountedFact`: text mode: the engine counted its prompt's tokens
  before answering (the gateway's ``POST /tokenize`` of a new prefix), from
  which every replica learns the prefix's characters per token at once;
* :class:`SettledFact`: its answer (cached tokens reported, or a rejection,
  which takes the routing back; the observed TTFT, and in text mode the
  prompt's characters and the engine's token count, from which every replica
  calibrates the worker's speed and learns characters per token as one router
  would from all the answers);
* :class:`WorkerFact`: a worker stopped answering or restarted empty.

A peer applies them with :meth:`Dispatcher.apply_peer
<prefixrouter.core.dispatch.Dispatcher.apply_peer>`, through the same index,
policy and in-flight calls as its own requests: a peer's routing is
speculative until the peer's completion confirms it, exactly like one's own.

Facts are plain values with no time in them: clocks differ between
machines, so a receiver applies a fact at its own ``now`` (the transport
stamps what it sends, to measure the propagation lag). Engine KV events
are not facts: every replica hears the engines itself. Block hashes are
namespace-seeded, so a fact never makes another tenant's or model's prefix
look warm.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from prefixrouter.core.types import BlockHash, RequestId, WorkerId


class Settlement(enum.IntEnum):
    """How the origin settled a routing."""

    COMPLETED = 0  # the engine answered and reported its reuse
    UNREPORTED = 1  # answered (or failed after it may have prefilled), no reuse reported
    REJECTED = 2  # the engine did no prefill: the routing is taken back


class WorkerChange(enum.IntEnum):
    """A change of a worker's state that one replica saw first."""

    DOWN = 0  # stopped answering: its entries are kept, demoted to speculative
    RESTARTED = 1  # a new engine process: its cache is empty


@dataclass(frozen=True, slots=True)
class NamespaceFields:
    """The fields of a :class:`~prefixrouter.core.types.CacheNamespace`, as sent."""

    model_revision: str
    tokenizer_revision: str = ""
    adapter_id: str = ""
    template_version: str = ""
    tenant: str = ""


@dataclass(frozen=True, slots=True)
class RoutedFact:
    """A request was sent to ``worker``.

    Attributes:
        request_id: The origin's request id (unique per origin).
        worker: The worker it went to.
        namespace: Its cache namespace (the hashes are seeded by it).
        model: The model it asked for.
        prefix_key: The router's id of its leading prefix.
        hashes: Its chained block hashes.
        block_tokens: Tokens per block (estimated in text mode).
        prompt_tokens: Prompt length in tokens.
        predicted_cached_tokens: What the origin expected the worker to reuse.
        max_tokens: Output tokens it may decode.
        predicted_ttft_s: The cost model's TTFT for the worker with the
            calibration divided out (0: the policy does not use the cost
            model). With the answer's TTFT it is the calibration sample a
            peer folds in, as the origin does.
        speculative: The origin's prediction rested on an entry that only a
            routing had placed there (no answer or engine event had confirmed
            it): a shortfall at settlement is then a prefill still running,
            not the worker's cache, and no replica may count it against the
            worker's trust (:meth:`~prefixrouter.core.index.PrefixIndex.on_completed`).
    """

    request_id: RequestId
    worker: WorkerId
    namespace: NamespaceFields
    model: str
    prefix_key: str
    hashes: tuple[BlockHash, ...]
    block_tokens: float
    prompt_tokens: int
    predicted_cached_tokens: int
    max_tokens: int
    predicted_ttft_s: float = 0.0
    speculative: bool = False


@dataclass(frozen=True, slots=True)
class FirstTokenFact:
    """The engine sent the request's first token: its prefill is done."""

    request_id: RequestId


@dataclass(frozen=True, slots=True)
class SettledFact:
    """The origin settled a routing.

    Attributes:
        request_id: The routed request's id.
        settlement: Completed (reuse reported), unreported, or rejected.
        actual_cached_tokens: The engine's reported reuse (``COMPLETED`` only).
        prompt_chars: Text mode: the prompt's characters (0: no observation).
        prompt_tokens: Text mode: the engine's count of the prompt's tokens.
        ttft_s: The observed time to first token (-1: not measured).
        output_tokens: The engine's ``completion_tokens`` (0: not reported);
            peers learn the expected output from it, as the origin does.
    """

    request_id: RequestId
    settlement: Settlement
    actual_cached_tokens: int
    prompt_chars: int = 0
    prompt_tokens: int = 0
    ttft_s: float = -1.0
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class CountedFact:
    """Text mode: the engine counted the routed prompt's tokens (before its answer).

    Attributes:
        request_id: The routed request's id.
        prompt_chars: The prompt's characters.
        prompt_tokens: The engine's count of its tokens.
    """

    request_id: RequestId
    prompt_chars: int
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class WorkerFact:
    """A worker went down or restarted, as the origin's health checks saw it."""

    worker: WorkerId
    change: WorkerChange


Fact = RoutedFact | FirstTokenFact | SettledFact | CountedFact | WorkerFact
"""Anything a dispatcher records for its peers."""
