"""The dispatcher: the one driver of the routing core's state.

A :class:`~prefixrouter.core.router.Router` decides; its index, cost model,
policy state and the :class:`~prefixrouter.core.load.InflightLedger` remember.
Every caller that changes what they remember goes through one
:class:`Dispatcher`, so the protocol (route, record the routing, count it in
flight; then take it back or feed the engine's answer) is written once and no
driver can forget half of it. The live gateway, the KV-event subscriber and the
simulator all drive the core through it; nothing outside ``core`` touches
``router.index`` or ``router.hasher`` (``tests/core/test_layering_router_access.py``
holds that).

**A request's life.** :meth:`Dispatcher.admit` routes it, places the routing in
the index (speculative entries) and counts it in flight, and returns an
:class:`Admission`: the decision and the request's block hashes. The request is
hashed once: a retry on another worker (:meth:`Dispatcher.retry`) routes the
same hashes among the workers not tried yet. Each admission is settled once,
by :meth:`Dispatcher.reject` (the engine did no prefill: a refusal, a failure
before the first byte, a client that left before it) or by
:meth:`Dispatcher.complete` (the engine's answer: cached tokens, time to first
token); :meth:`Dispatcher.first_token` notes a first token when the driver sees
one. A second settlement, or one after its worker was removed, changes nothing.

**Facts about workers and engines.** A worker down, restarted or removed, a
KV-event batch or a gap in a worker's event sequence, a characters-per-token
observation (text mode: global and per prefix) and the engine's block size
(token mode) each have one method, and the KV room each worker has for cached
prefixes is mirrored by one formula (:func:`prefix_room_blocks`, see there for
why prompts not decoding yet count as prefix blocks).

**The seam for more callers.** Methods take plain facts (worker ids, times on
the caller's clock, token counts, :class:`~prefixrouter.core.events.KvEvent`,
:class:`~prefixrouter.core.types.WorkerView` snapshots,
:class:`~prefixrouter.core.policy.Outcome`) and return plain values, never a
gateway's or simulator's objects, so a new input (routings and events heard
from other gateway replicas, an Envoy endpoint picker's requests) is one more
method here, called from its own adapter. The dispatcher is not thread-safe:
every state-changing call comes from one thread (the gateway's event loop);
only :meth:`Dispatcher.hash` may run elsewhere (it reads, never writes).

**Peers.** With ``record_facts=True`` every change another gateway replica
must mirror is appended, as a :mod:`~prefixrouter.core.facts` value, to an
outbox the driver drains (:meth:`Dispatcher.drain_facts`) and publishes. A
replica applies what it hears with :meth:`Dispatcher.apply_peer`, which drives
the same router calls as its own requests: a peer's routing places speculative
entries, feeds the policy's demand and counts in flight on its worker; the
peer's rejection withdraws it; its completion confirms the chain (or corrects a
miss), calibrates the worker's speed (the routing carries the uncalibrated
prediction, the answer the observed TTFT) and, in text mode, teaches the
characters-per-token estimate (a completion given the prompt's characters and
token count carries them), so each replica learns from every answer, not from
its share of them.
:meth:`Dispatcher.peer_gone` settles, without feedback, everything a peer that
stopped (or restarted under a new epoch) still had in flight, so no worker
looks busy forever.

Pure like the rest of ``core``: no I/O, no clock reads (times are arguments),
no asyncio.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

from prefixrouter.core.cost import CostTerms
from prefixrouter.core.events import KvEvent
from prefixrouter.core.facts import (
    CountedFact,
    Fact,
    FirstTokenFact,
    NamespaceFields,
    RoutedFact,
    SettledFact,
    Settlement,
    WorkerChange,
    WorkerFact,
)
from prefixrouter.core.hashing import PromptBlocks
from prefixrouter.core.index import WorkerMatch
from prefixrouter.core.load import InflightLedger, WorkerLoad
from prefixrouter.core.policy import CandidateScore, Outcome, Policy, RoutingContext
from prefixrouter.core.router import Decision, Router, Steering
from prefixrouter.core.types import (
    BlockHash,
    CacheNamespace,
    EntrySource,
    RequestId,
    RoutingRequest,
    WorkerId,
    WorkerView,
)
from prefixrouter.core.unseen import MAX_REROUTES, UnseenPeers
from prefixrouter.errors import NoWorkerAvailable

RoutingMode = Literal["text", "token"]
"""How prompts are hashed: ``token`` (engine blocks of token ids) or ``text``
(character chunks, tokens estimated)."""

ROUTING_MODES: tuple[RoutingMode, ...] = get_args(RoutingMode)


def routing_mode(name: str) -> RoutingMode:
    """``name`` as a :data:`RoutingMode` (a command line's or a file's string).

    Raises:
        ValueError: ``name`` is not a mode; the message names it and the modes.
    """
    for mode in ROUTING_MODES:
        if name == mode:
            return mode
    known = " or ".join(repr(mode) for mode in ROUTING_MODES)
    raise ValueError(f"unknown routing mode {name!r}: expected {known}")


_PEER = "peer:"
"""Prefix of the ledger ids of peers' routings (never recorded again)."""
_MAX_NAMESPACES = 4096
"""Namespaces of peers' facts kept built (tenants x models x adapters)."""


def _routed_fact(decision: Decision) -> RoutedFact:
    ctx = decision.context
    request, blocks = ctx.request, ctx.blocks
    ns = request.namespace
    chosen = decision.chosen
    terms = chosen.terms if chosen is not None else None
    # The prediction without this replica's calibration: a peer calibrates
    # the worker from (this, the observed TTFT) as this replica does.
    unscaled = terms.ttft_s / terms.scale if terms is not None and terms.scale > 0 else 0.0
    return RoutedFact(
        request_id=request.request_id,
        worker=decision.worker_id,
        namespace=NamespaceFields(
            ns.model_revision, ns.tokenizer_revision, ns.adapter_id, ns.template_version, ns.tenant
        ),
        model=request.model,
        prefix_key=ctx.prefix_key,
        hashes=blocks.hashes,
        block_tokens=blocks.block_tokens,
        prompt_tokens=decision.prompt_tokens,
        predicted_cached_tokens=decision.predicted_cached_tokens,
        max_tokens=request.max_tokens,
        predicted_ttft_s=unscaled,
        speculative=decision.rests_on_speculative,
    )


def prefix_room_blocks(view: WorkerView, index_block_tokens: float) -> int:
    """The KV room ``view``'s engine has for cached prefixes, in index blocks.

    The index mirrors the engine's KV blocks that can hold cached prefixes:
    all of them but those pinned by something else (running requests' output
    and partial blocks), which the engine cannot evict to keep a prefix. The
    engine reports how many blocks are in use (``kv_used_blocks``: the blocks
    of the requests it runs); the prompts among them are cached prefixes, so
    the non-prefix part is the used blocks less the prompts of every request
    in flight, **those not decoding yet included**::

        other = max(0, kv_used_blocks - (context_tokens + queued_prompt_tokens) // block)
        room  = max(1, kv_capacity_blocks - other) * block      (tokens)

    Why included: a driver cannot tell a request the engine is prefilling from
    one that waits in its queue (both are "sent, no first token"), and a
    prefilling prompt holds its blocks from the moment it is scheduled. On long
    prompts prefill is most of a request's time in flight, so leaving these
    prompts out counted them as non-prefix blocks: the mirror shrank by the
    documents being prefilled, the index forgot prefixes the engine held, and
    the policy replicated documents it did not need to. On real vLLM
    (``tests/real_vllm``, doc-QA: four 8,000-token documents on two engines)
    the cached share fell from 87 % to 74.7 %, 81.0 % and one run below 80 %,
    in three runs of four. The error this formula keeps is the other way:
    prompts that truly wait hold no block, so under a long queue the mirror is
    larger than the engine's room and a prefix the engine evicted can be
    predicted warm once (the miss is then seen on completion and corrects the
    index). In the simulator, leaving them out was 5 % better on
    ``llmd-customers``'s mean TTFT (a queue-heavy rate ladder) and otherwise
    alike; the real engine decides.

    Args:
        view: The worker, with the engine's KV figures and the ledger's.
        index_block_tokens: Tokens one index block stands for (the engine's
            block size in token mode; ``chunk_chars / chars_per_token`` in text
            mode).
    """
    block = max(1, view.block_size)
    # Every prompt in flight holds (or is about to hold) cached prefix blocks.
    prompt_blocks = (view.context_tokens + view.queued_prompt_tokens) // block
    other = max(0, view.kv_used_blocks - prompt_blocks)
    room_tokens = max(1, view.kv_capacity_blocks - other) * block
    return max(1, math.floor(room_tokens / index_block_tokens))


@dataclass(eq=False, slots=True)
class Admission:
    """One attempt of one request on one worker, as :meth:`Dispatcher.admit` made it.

    Attributes:
        decision: The routing decision (its context holds the request and its hashes).
        tried: Workers of this request's earlier attempts (a retry avoids them).
        first_token: The engine's first token was noted (:meth:`Dispatcher.first_token`).
        settled: Rejected or completed; nothing more is fed back for it.
        origin: The peer whose routing this is (``""``: this replica's own).
    """

    decision: Decision
    tried: tuple[WorkerId, ...] = ()
    first_token: bool = False
    settled: bool = False
    origin: str = ""

    @property
    def request(self) -> RoutingRequest:
        """The routed request."""
        return self.decision.context.request

    @property
    def blocks(self) -> PromptBlocks:
        """The request's block hashes (computed once per request, reused by retries)."""
        return self.decision.context.blocks

    @property
    def worker(self) -> WorkerId:
        """The worker this attempt was sent to."""
        return self.decision.worker_id


class Dispatcher:
    """The only caller of the Router's state-changing methods and of the in-flight ledger.

    Args:
        router: The routing core (policy, hasher, index, cost model).
        mode: How the driver's requests are hashed; it sets the unit of the
            capacity mirror (see :meth:`index_block_tokens`).
        record_facts: Append a fact for peers to the outbox on every change
            they must mirror (see the module docstring).
    """

    def __init__(
        self, router: Router, mode: RoutingMode = "token", *, record_facts: bool = False
    ) -> None:
        self._router = router
        self._ledger = InflightLedger()
        self.mode: RoutingMode = mode
        self._outbox: list[Fact] | None = [] if record_facts else None
        self._on_first_fact: Callable[[], None] | None = None
        # origin -> its routings applied here and not settled yet, by its request id.
        self._peer_open: dict[str, dict[RequestId, Admission]] = {}
        self._namespaces: dict[NamespaceFields, CacheNamespace] = {}
        self._held: Callable[[], None] | None = None  # see hold_peer_facts
        self._unseen = UnseenPeers()  # peers' routings ours do not see (core.unseen)

    # ------------------------------------------------------------- read-only views

    @property
    def router(self) -> Router:
        """The router (for core and tests; outside core use the views below)."""
        if self._held is not None:
            self._apply_held()
        return self._router

    @property
    def policy_name(self) -> str:
        """The routing policy's registered name."""
        return self._router.policy.name

    @property
    def block_size(self) -> int:
        """Tokens per block of token-mode hashing."""
        return self._router.hasher.block_size

    @property
    def chars_per_token(self) -> float:
        """Text mode's learned characters per token."""
        return self._router.hasher.estimator.chars_per_token

    @property
    def evicted_entries(self) -> int:
        """Index entries evicted for room so far (a counter)."""
        if self._held is not None:
            self._apply_held()
        return self._router.index.evicted_entries

    def speed_scale(self, worker: WorkerId) -> float:
        """The cost model's calibration factor for ``worker`` (1 = its speed profile is right)."""
        return self._router.cost.scale(worker)

    def index_blocks(self, worker: WorkerId) -> int:
        """Blocks the index holds for ``worker``."""
        if self._held is not None:
            self._apply_held()
        return self._router.index.blocks_of(worker)

    def index_capacity(self, worker: WorkerId) -> int:
        """The index's capacity for ``worker``, in index blocks (the mirrored KV room)."""
        if self._held is not None:
            self._apply_held()
        return self._router.index.capacity(worker)

    def holds_prefix(self, worker: WorkerId, prefix_key: str) -> bool:
        """Whether the index holds, for ``worker``, the block a decision's prefix key names.

        A prefix key is the hex hash of the block at the prefix-key depth (see
        :class:`~prefixrouter.core.router.Router`); the dashboard asks this to
        list only the prefixes a worker still holds.
        """
        try:
            block = BlockHash(int(prefix_key, 16))
        except ValueError:
            return False
        return self._router.index.entry(worker, block) is not None

    def index_block_tokens(self) -> float:
        """Tokens one index block stands for in this dispatcher's mode."""
        hasher = self._router.hasher
        if self.mode == "token":
            return float(hasher.block_size)
        return hasher.chunk_chars / hasher.estimator.chars_per_token

    def load(self, worker: WorkerId) -> WorkerLoad:
        """The ledger's aggregates for ``worker`` (a live object; do not mutate)."""
        if self._held is not None:
            self._apply_held()
        return self._ledger.load(worker)

    def fill(self, view: WorkerView, now: float) -> WorkerView:
        """Copy the ledger's figures at ``now`` for ``view``'s worker into it (in place)."""
        if self._held is not None:
            self._apply_held()
        return self._ledger.fill(view, now)

    # ------------------------------------------------------------- requests

    def hash(self, request: RoutingRequest) -> PromptBlocks:
        """The request's chained block hashes. Changes no state (safe on another thread).

        Text mode reads the learned characters per token (the global float and
        the per-prefix entries, each of which :meth:`observe_prompt_tokens`
        replaces whole): a read racing an update sees one side of it, a
        difference of one observation's weight.
        """
        return self._router.blocks_for(request)

    def add_policy(self, policy: Policy) -> None:
        """Make ``policy`` available to steered requests (``Router.add_policy``)."""
        self._router.add_policy(policy)

    def prefix_key(self, request: RoutingRequest, blocks: PromptBlocks) -> str:
        """The prefix key ``request``'s decision will carry. Changes no state."""
        return self._router.prefix_key(request, blocks)

    def admit(
        self,
        request: RoutingRequest,
        views: Sequence[WorkerView],
        now: float,
        blocks: PromptBlocks | None = None,
        steering: Steering | None = None,
    ) -> Admission:
        """Route ``request``, record the routing and count it in flight.

        Args:
            request: The request.
            views: Every candidate worker's snapshot (in-flight figures filled).
            now: Decision time on the caller's clock.
            blocks: The request's hashes if the caller has them (else hashed here).
            steering: Another policy or a session pin for it (``Router.route``).

        Raises:
            NoWorkerAvailable: No worker passed the filters (nothing changed).
            ValueError: The request id is already in flight (nothing changed).
        """
        if self._held is not None:
            self._apply_held()
        return self._admit(request, views, now, blocks, (), steering)

    def warm_up(
        self, admission: Admission, views: Sequence[WorkerView], now: float
    ) -> Admission | None:
        """Admit the prefill-only copy that ``admission``'s decision asks for, if any.

        The policy's hot-prefix rule may decide that a prefix needs another
        replica while the request itself is better served where the prefix
        is (``Decision.warm_up``): the router then warms the copy itself, so
        that no user request pays its cold prefill. The warm-up is the same
        prompt (the same hashes) with ``max_tokens`` 1 and the request id
        ``<id>:warm-up``, routed to the named worker alone and counted in
        flight there like any request; the caller sends it, feeds its first
        token and answer back as for any admission, and keeps it out of what
        it reports as user traffic. None when the decision asks for none, the
        worker is not among ``views`` (gone, or filtered since) or the policy's
        copy budget has nothing left for it (``Router.admit_warm_up``: the next
        request that calls for the copy asks again).
        """
        target = admission.decision.warm_up
        if target is None:
            return None
        view = next((v for v in views if v.worker_id == target), None)
        if view is None:
            return None
        if not self._router.admit_warm_up(admission.decision, now):
            return None
        request = admission.request
        warm = replace(request, request_id=RequestId(f"{request.request_id}:warm-up"), max_tokens=1)
        if self._held is not None:
            self._apply_held()
        try:
            return self._admit(warm, [view], now, admission.blocks, ())
        except NoWorkerAvailable:  # unhealthy since: no copy now
            return None

    def retry(self, previous: Admission, views: Sequence[WorkerView], now: float) -> Admission:
        """Admit ``previous``'s request again, on a worker no attempt has tried.

        Reuses ``previous``'s hashes (a request is hashed once, however many
        attempts it takes) and its policy (a steered request stays in its
        rollout group; a session pin is not kept: its worker was tried).
        ``previous`` must be settled first (rejected, as an attempt the engine
        did no prefill for).

        Raises:
            NoWorkerAvailable: No untried worker passed the filters.
            ValueError: ``previous`` is not settled.
        """
        if self._held is not None:
            self._apply_held()
        if not previous.settled:
            raise ValueError(f"request {previous.request.request_id}: settle the attempt first")
        tried = (*previous.tried, previous.worker)
        left = [v for v in views if v.worker_id not in tried]
        policy = previous.decision.policy
        steering = Steering(policy) if policy != self._router.policy.name else None
        return self._admit(previous.request, left, now, previous.blocks, tried, steering)

    def _admit(
        self,
        request: RoutingRequest,
        views: Sequence[WorkerView],
        now: float,
        blocks: PromptBlocks | None,
        tried: tuple[WorkerId, ...],
        steering: Steering | None = None,
    ) -> Admission:
        router = self._router
        decision = router.route(request, views, now, blocks, steering)
        unseen = self._unseen
        ahead = unseen.ahead(request.request_id, router.replica_salt)
        if ahead:
            decision = self._route_behind(request, views, now, decision, ahead, steering)
        unseen.on_own(now)
        prompt = decision.prompt_tokens
        # The ledger first: it refuses a request id already in flight before
        # the index holds anything for it.
        self._ledger.on_routed(
            request.request_id,
            decision.worker_id,
            max(0, prompt - decision.predicted_cached_tokens),
            prompt,
            decision.context.output_tokens,
            now,
        )
        router.on_routed(decision, now)
        if self._outbox is not None:
            self._record(_routed_fact(decision))
        return Admission(decision, tried)

    def _route_behind(
        self,
        request: RoutingRequest,
        views: Sequence[WorkerView],
        now: float,
        decision: Decision,
        ahead: int,
        steering: Steering | None = None,
    ) -> Decision:
        """Route ``request`` behind ``ahead`` stand-ins of itself (see :mod:`.unseen`).

        The stand-ins go in at most :data:`~prefixrouter.core.unseen.MAX_REROUTES`
        groups, each placed where the last routing went, in copies of the
        views (the caller's are left alone) as the ledger would place them;
        the request is routed again after each group.
        """
        copies = [replace(v) for v in views]
        by_id = {v.worker_id: v for v in copies}
        blocks = decision.context.blocks
        router = self._router
        groups = min(ahead, MAX_REROUTES)
        for g in range(groups):
            n = ahead // groups + (1 if g < ahead % groups else 0)
            view = by_id[decision.worker_id]
            prompt = decision.prompt_tokens
            view.in_flight += n
            view.pending_prefill_tokens += n * max(0, prompt - decision.predicted_cached_tokens)
            view.queued_prompt_tokens += n * prompt
            decision = router.route(request, copies, now, blocks, steering)
        decision.reason += f" (behind {ahead} unseen peer routings)"
        return decision

    def first_token(self, admission: Admission, now: float) -> None:
        """The engine sent the request's first token: its prefill is done.

        The ledger moves the request from prefilling to decoding, and the
        router's policy hears it (:meth:`Router.on_first_token`).
        """
        if admission.settled or admission.first_token:
            return
        admission.first_token = True
        rid = admission.request.request_id
        self._ledger.on_first_token(rid, now)
        self._router.on_first_token(admission.decision, now)
        if self._outbox is not None and not admission.origin:
            self._record(FirstTokenFact(rid))

    def reject(self, admission: Admission, now: float) -> None:
        """The engine did no prefill for this attempt: take its routing back.

        See :meth:`Router.on_rejected`: the speculative entries only this
        routing placed are withdrawn, so a retry is predicted cold.
        """
        if self._settle(admission):
            self._router.on_rejected(admission.decision, now)
            rid = admission.request.request_id
            self._record_settled(admission, SettledFact(rid, Settlement.REJECTED, 0))

    def complete(
        self,
        admission: Admission,
        outcome: Outcome,
        now: float,
        *,
        prompt_chars: int = 0,
        prompt_tokens: int = 0,
    ) -> bool:
        """Feed back the engine's answer. Returns True if it was a cache miss.

        ``Outcome(0, ttft, ok=False)`` is an answer without a report of reuse
        (or a failure after the engine may have prefilled): the routing stays,
        nothing is confirmed or corrected.

        ``prompt_chars`` and ``prompt_tokens`` (text mode, both > 0): the
        prompt's characters and the engine's count of its tokens. They teach
        the characters-per-token estimate first (:meth:`observe_prompt_tokens`,
        the global one and that of the prompt's prefix), so the engine's
        cached tokens are converted into chunks at what this answer taught:
        a request routed before its prefix's first answer (at the prior) was
        predicted in tokens of the wrong size, and its shortfall is no miss of
        the engine. They also travel in the recorded fact, so peers learn from
        this answer too: each replica of N otherwise learns from 1/N of the
        answers. The observation is kept even when the routing was settled
        already or its worker removed (the engine's count stands).
        """
        observed = prompt_chars > 0 and prompt_tokens > 0
        if observed:
            self.observe_prompt_tokens(prompt_chars, prompt_tokens, admission)
        if not self._settle(admission):
            return False
        router = self._router
        block_tokens = None
        if self.mode == "text" and admission.blocks.hashes:
            # The chunks at what the estimate knows now (see above).
            hasher = router.hasher
            block_tokens = hasher.chunk_chars / hasher.estimator.for_prefix(admission.blocks.hashes)
        miss = router.on_completed(admission.decision, outcome, now, block_tokens)
        if self._outbox is not None:  # built only when recording: this runs per request
            ttft = outcome.ttft_s
            self._record_settled(
                admission,
                SettledFact(
                    admission.request.request_id,
                    Settlement.COMPLETED if outcome.ok else Settlement.UNREPORTED,
                    outcome.actual_cached_tokens,
                    prompt_chars if observed else 0,
                    prompt_tokens if observed else 0,
                    ttft if ttft is not None and ttft >= 0 else -1.0,
                    outcome.output_tokens,
                ),
            )
        return miss

    def _record_settled(self, admission: Admission, fact: SettledFact) -> None:
        """Record ``fact`` for the peers, unless the routing was a peer's own."""
        if not admission.origin:
            self._record(fact)

    def _settle(self, admission: Admission) -> bool:
        """Mark settled, release the ledger and the pins; False if nothing is to be fed back.

        Nothing is, for an admission settled already or one whose worker was
        removed since (its in-flight entry and index entries are gone: feeding
        it back would bring entries of a worker that is gone).
        """
        if admission.settled:
            return False
        admission.settled = True
        rid = admission.request.request_id
        if self._ledger.worker_of(rid) != admission.worker:
            return False
        self._ledger.on_completed(rid)
        self._router.on_settled(admission.decision)
        return True

    # ------------------------------------------------------------- capacity

    def mirror_capacity(self, views: Iterable[WorkerView]) -> None:
        """Mirror each worker's KV room for cached prefixes in the index.

        One formula for every driver (:func:`prefix_room_blocks`), in index
        blocks. Call it when fresh figures arrive (each metrics poll live; each
        arrival in the simulator), with the ledger's figures filled in, and only
        for workers whose KV size is known.
        """
        if self._held is not None:
            self._apply_held()
        unit = self.index_block_tokens()
        set_capacity = self._router.set_worker_capacity
        for view in views:
            set_capacity(view.worker_id, prefix_room_blocks(view, unit))

    # ------------------------------------------------------------- workers

    def worker_down(self, worker: WorkerId, now: float) -> int:
        """The worker stopped answering: its entries are kept, demoted to speculative.

        Returns how many were demoted.
        """
        if self._held is not None:
            self._apply_held()
        if self._outbox is not None:
            self._record(WorkerFact(worker, WorkerChange.DOWN))
        return self._router.worker_down(worker, now)

    def worker_up(self, worker: WorkerId) -> None:
        """The worker answers again after an outage (:meth:`Router.worker_up`).

        Nothing is published: each replica's own checks see the worker come
        back, and its calibration is each replica's own.
        """
        if self._held is not None:
            self._apply_held()
        self._router.worker_up(worker)

    def worker_restarted(self, worker: WorkerId, now: float, *, clear_entries: bool = True) -> None:
        """The worker's engine is a new process with an empty cache: forget its entries.

        Its calibration restarts from the fleet's best either way
        (:meth:`Router.worker_restarted`). ``clear_entries=False``: its KV
        events reported the restart first and the entries are right; nothing
        is published then (every replica sees the events and the restart).
        """
        if self._held is not None:
            self._apply_held()
        if self._outbox is not None and clear_entries:
            self._record(WorkerFact(worker, WorkerChange.RESTARTED))
        self._router.worker_restarted(worker, now, clear_entries=clear_entries)

    def remove_worker(self, worker: WorkerId) -> list[RequestId]:
        """Forget a worker: index entries, calibration, policy state and in-flight requests.

        Returns the ids of its requests that were in flight; their admissions
        settle without feedback.
        """
        if self._held is not None:
            self._apply_held()
        self._router.remove_worker(worker)
        return self._ledger.drop_worker(worker)

    # ------------------------------------------------------------- peers

    def _record(self, fact: Fact) -> None:
        out = self._outbox
        if out is None:
            return
        if not out and self._on_first_fact is not None:
            self._on_first_fact()
        out.append(fact)

    def on_first_fact(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener`` whenever a fact lands in an empty outbox (None: stop).

        Lets a driver publish in batches without polling an empty outbox: it
        schedules one drain per batch when told the first fact is in. The
        listener runs inside the recording call; it must only schedule.
        """
        self._on_first_fact = listener

    def drain_facts(self) -> list[Fact]:
        """The facts recorded since the last drain, oldest first (empty if not recording)."""
        out = self._outbox
        if not out:
            return []
        self._outbox = []
        return out

    def hold_peer_facts(self, apply: Callable[[], None] | None) -> None:
        """The driver holds peer facts it heard and has not applied: ``apply`` applies them.

        ``apply`` (None: nothing is held any more) is called once, before the
        next call of this dispatcher that routes or reads or changes routing
        state other than settling one of this replica's own requests (routing,
        the in-flight figures, the index views, a worker or KV-event change,
        a peer going); the driver registers again for its next batch, and
        calls ``apply`` itself after a bound (state read from outside the
        dispatcher, such as a live :meth:`load` object, lags by that much at
        most). So no decision is made without the facts heard before it:
        holding them adds no staleness to routing, it only moves their
        application to the moment a decision needs them, and one pass then
        applies several messages. Sync's cost is mostly per wakeup on a busy
        machine (each message's decode and apply runs on caches other work
        has evicted): one pass per own request instead of one per message.

        A settlement of our own (:meth:`first_token`, :meth:`reject`,
        :meth:`complete`) does not apply them first: it touches its own
        routing and entries, and a peer's held routing of the same prefix,
        applied after it, adds its speculative entries as it would have
        before. :meth:`hash` (off the event loop) and :meth:`apply_peer`
        (what ``apply`` calls) do not either.
        """
        self._held = apply

    def _apply_held(self) -> None:
        apply, self._held = self._held, None
        if apply is not None:
            apply()

    def apply_peer(
        self, origin: str, fact: Fact, now: float, routed_at: float | None = None
    ) -> bool:
        """Apply a fact another replica recorded, at this replica's ``now``.

        ``origin`` names the peer and its epoch (one process lifetime): a
        restarted peer is another origin. The caller drops facts for workers
        it does not know. A peer's routing enters like one of our own: it
        places speculative entries on the worker, counts toward the policy's
        demand and in flight on the worker (as ``PEER origin/request``), and
        waits for its settlement. Facts applied here are never recorded again.

        ``routed_at`` (a routing, on this replica's clock: when the peer made
        it, as near as the driver knows; None: unknown, as for a replayed
        one) counts the routings of ours made without it, from which this
        replica expects how many peers' routings each of its own does not see
        and routes behind that many (:mod:`~prefixrouter.core.unseen`).

        Returns:
            False if the fact could not be applied: a settlement or first token
            of a routing this replica never heard (it joined after it, or the
            routing aged out of the stream), or a routing heard twice.
        """
        if isinstance(fact, RoutedFact):
            applied = self._apply_peer_routed(origin, fact, now)
            if applied and routed_at is not None:
                self._unseen.on_peer(origin, routed_at, now)
            return applied
        if isinstance(fact, WorkerFact):
            if fact.change is WorkerChange.DOWN:
                self._router.worker_down(fact.worker, now)
            else:
                self._router.worker_restarted(fact.worker, now)
            return True
        open_ = self._peer_open.get(origin)
        admission = open_.get(fact.request_id) if open_ is not None else None
        if admission is None or open_ is None:
            return False
        if isinstance(fact, FirstTokenFact):
            self.first_token(admission, now)
            return True
        if isinstance(fact, CountedFact):
            self.observe_prompt_tokens(fact.prompt_chars, fact.prompt_tokens, admission)
            return True
        del open_[fact.request_id]
        if fact.settlement is Settlement.REJECTED:
            self.reject(admission, now)
        else:
            ok = fact.settlement is Settlement.COMPLETED
            ttft = fact.ttft_s if fact.ttft_s >= 0 else None
            self.complete(
                admission,
                Outcome(fact.actual_cached_tokens, ttft, ok, fact.output_tokens),
                now,
                prompt_chars=fact.prompt_chars,
                prompt_tokens=fact.prompt_tokens,
            )
        return True

    def _apply_peer_routed(self, origin: str, fact: RoutedFact, now: float) -> bool:
        open_ = self._peer_open.setdefault(origin, {})
        if fact.request_id in open_:
            return False
        request_id = RequestId(f"{_PEER}{origin}/{fact.request_id}")
        namespace = self._namespaces.get(fact.namespace)
        if namespace is None:
            fields = fact.namespace
            namespace = CacheNamespace(
                fields.model_revision,
                fields.tokenizer_revision,
                fields.adapter_id,
                fields.template_version,
                fields.tenant,
            )
            if len(self._namespaces) >= _MAX_NAMESPACES:
                self._namespaces.clear()  # a bounded cache: rebuilding one is cheap
            self._namespaces[fact.namespace] = namespace
        request = RoutingRequest(
            request_id,
            namespace,
            text="",
            prompt_tokens=fact.prompt_tokens,
            max_tokens=fact.max_tokens,
            model=fact.model,
        )
        router = self._router
        blocks = PromptBlocks(fact.hashes, fact.block_tokens, fact.prompt_tokens)
        # The expected output from this replica's own estimate: it learns
        # from every replica's answers (SettledFact.output_tokens).
        output = router.output.expected(fact.max_tokens, fact.prefix_key)
        # The origin's match on the worker, as far as settling the routing
        # reads it: whether it rested on an unconfirmed entry (a shortfall is
        # then no miss, on every replica as at the origin). The codec refuses
        # a routing whose block size is not a positive number.
        matches: dict[WorkerId, WorkerMatch] = {}
        if fact.speculative:
            held = int(fact.predicted_cached_tokens // fact.block_tokens)
            matches[fact.worker] = WorkerMatch(held, 1.0, EntrySource.SPECULATIVE)
        ctx = RoutingContext(
            request, blocks, matches, now, fact.prefix_key, router.cost, router.index, output
        )
        # The chosen worker's record carries only the peer's uncalibrated
        # prediction (scale 1): on completion, Router.on_completed calibrates
        # the worker from it and the observed TTFT, as the peer did.
        candidates: tuple[CandidateScore, ...] = ()
        if fact.predicted_ttft_s > 0:
            terms = CostTerms(fact.predicted_ttft_s, 0.0, 0.0, 0.0, 0.0)
            candidates = (CandidateScore(fact.worker, terms=terms),)
        decision = Decision(
            request_id=request_id,
            namespace=namespace.key,
            prefix_key=fact.prefix_key,
            prefix_class="",
            policy=router.policy.name,
            worker_id=fact.worker,
            tier="peer",
            reason=f"routed by {origin}",
            predicted_cached_tokens=fact.predicted_cached_tokens,
            prompt_tokens=fact.prompt_tokens,
            candidates=candidates,
            filtered={},
            warm_abandoned=False,
            now=now,
            context=ctx,
        )
        prompt = fact.prompt_tokens
        self._ledger.on_routed(
            request_id,
            fact.worker,
            max(0, prompt - fact.predicted_cached_tokens),
            prompt,
            output,
            now,
        )
        router.on_routed(decision, now)
        open_[fact.request_id] = Admission(decision, origin=origin)
        return True

    def peer_gone(self, origin: str) -> int:
        """A peer stopped (no heartbeat) or restarted: settle what it had open here.

        Its routings stay in the index (the engines did get those requests);
        their in-flight counts go, since nobody will report their end.
        Returns how many routings were open.
        """
        if self._held is not None:
            self._apply_held()
        open_ = self._peer_open.pop(origin, None)
        if not open_:
            return 0
        for admission in open_.values():
            self._settle(admission)
        return len(open_)

    def peer_expire(self, before: float) -> int:
        """Settle, without feedback, every peer routing applied here before ``before``.

        The bound on a routing whose settlement was lost on the way (its
        origin lives on, so :meth:`peer_gone` never comes): a driver passes
        its clock minus the longest a request can be in flight at its origin.
        Returns how many were settled.
        """
        if self._held is not None:
            self._apply_held()
        n = 0
        for open_ in self._peer_open.values():
            old = [rid for rid, adm in open_.items() if adm.decision.now < before]
            for rid in old:
                self._settle(open_.pop(rid))
            n += len(old)
        return n

    def peer_inflight(self, origin: str) -> int:
        """Routings of ``origin`` applied here and not settled yet."""
        if self._held is not None:
            self._apply_held()
        open_ = self._peer_open.get(origin)
        return len(open_) if open_ is not None else 0

    # ------------------------------------------------------------- engine facts

    def apply_event(self, event: KvEvent, now: float, *, trusted: bool = True) -> None:
        """An engine KV event (``trusted=False``: stored blocks enter as speculative)."""
        if self._held is not None:
            self._apply_held()
        self._router.apply(event, now, trusted=trusted)

    def events_gap(self, worker: WorkerId, now: float) -> int:
        """A gap in ``worker``'s event sequence: its event-fed entries become speculative.

        A ``BlockRemoved`` may have been lost. Returns how many were demoted.
        """
        if self._held is not None:
            self._apply_held()
        return self._router.index.demote_events(worker, now)

    def wants_token_count(self, admission: Admission) -> bool:
        """Would the engine's token count of this text-mode prompt, asked now, teach the estimate?

        True when no anchor of the prompt's chunks covering at least half of
        them has an estimate of its own: a new document, or a conversation
        that more than doubled since its last answer. Its chunks then convert
        at the global estimate (the prior before any answer), which is off by
        as much as documents differ in characters per token (prose against
        code, CJK), until the prompt's first answer comes back. A request for
        the same document routed during that first prefill is mispredicted;
        one asked after the count came is not. A driver that can ask the
        engine (``POST /tokenize``) hands the count to :meth:`counted`.
        Changes nothing.
        """
        if self.mode != "text" or admission.request.tokens is not None:
            return False
        hashes = admission.blocks.hashes
        if not hashes:
            return False
        return 2 * self._router.hasher.estimator.learned_depth(hashes) < len(hashes)

    def counted(self, admission: Admission, chars: int, prompt_tokens: int) -> None:
        """The engine counted ``prompt_tokens`` for this routed text-mode prompt, before its answer.

        Teaches the estimate as an answer would (:meth:`observe_prompt_tokens`)
        and records a :class:`~prefixrouter.core.facts.CountedFact`, so every
        peer learns the prefix's ratio at once too (one router counts a new
        prefix once; replicas that did not hear of the count would each ask).
        """
        if chars <= 0 or prompt_tokens <= 0:
            return
        self.observe_prompt_tokens(chars, prompt_tokens, admission)
        if self._outbox is not None and not admission.origin:  # a routing of our own
            self._record(CountedFact(admission.request.request_id, chars, prompt_tokens))

    def observe_prompt_tokens(
        self, chars: int, prompt_tokens: int, admission: Admission | None = None
    ) -> None:
        """The engine counted ``prompt_tokens`` for a prompt of ``chars`` characters.

        Teaches text mode's characters-per-token estimate: the global one and,
        given the text-mode ``admission`` the answer is for, that of each
        prefix anchor of its chunks (:class:`~prefixrouter.core.hashing.TokenEstimator`),
        so the next request for the same document converts its matched chunks
        at the document's own ratio.
        """
        hashes: tuple[BlockHash, ...] = ()
        if admission is not None and admission.request.tokens is None:  # text mode's chunks
            hashes = admission.blocks.hashes
        self._router.hasher.estimator.observe(chars, prompt_tokens, hashes)

    def set_block_size(self, block_size: int) -> None:
        """Hash token-mode prompts in ``block_size``-token blocks (the engine's)."""
        hasher = self._router.hasher
        if hasher.block_size != block_size:
            self._router.hasher = replace(hasher, block_size=block_size)
