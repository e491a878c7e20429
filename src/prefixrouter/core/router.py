"""The router: filters, one prefix match, a policy, and the feedback calls.

``Router.route(request, workers, now)`` does, in order:

1. hash the prompt into chained blocks (or take the caller's precomputed ones);
2. **filter** (permission before latency): unhealthy workers, workers that do
   not serve the model or adapter, workers that do not admit the tenant, and
   workers outside the requested pool are removed before anything is scored;
3. **match once**: the shared :class:`~prefixrouter.core.index.PrefixIndex`
   gives each surviving worker's longest held prefix;
4. the **policy** selects; the :class:`Decision` records everything it saw.

A caller may steer one request (:class:`Steering`): route it with another
policy added to the router (:meth:`Router.add_policy`; a rollout's baseline
group), or keep it on a session's worker while the pin holds
(:func:`~prefixrouter.core.affinity.hold_pin`: tier ``affinity``; else the
policy decides and the decision says why the pin broke). A decision's
feedback goes to the policy that made it.

``route`` changes no state. :meth:`Router.on_routed` records a routing once
the request is sent, and :meth:`Router.on_completed` feeds back what the
engine reported (the index's confirmations and misses, the cost model's
calibration, the policy's hooks); or, when the engine did no prefill for it
(refused it, or it was cut off before its first byte), :meth:`Router.on_rejected`
takes the routing back. Engine KV events go to :meth:`Router.apply`.

Drivers do not call these themselves: the
:class:`~prefixrouter.core.dispatch.Dispatcher` is their one caller (with the
in-flight ledger and the capacity mirror), and the live gateway, the KV-event
subscriber and the simulator drive it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import xxhash

from prefixrouter.core.affinity import Pin, hold_pin
from prefixrouter.core.cost import CostModel, CostParams
from prefixrouter.core.events import KvEvent
from prefixrouter.core.hashing import BlockHasher, PromptBlocks
from prefixrouter.core.index import IndexParams, Placement, PrefixIndex
from prefixrouter.core.output import OutputEstimate
from prefixrouter.core.policy import (
    CandidateScore,
    Outcome,
    Policy,
    RoutingContext,
    create_policy,
)
from prefixrouter.core.types import EntrySource, RoutingRequest, WorkerId, WorkerView
from prefixrouter.errors import NoWorkerAvailable

DEFAULT_PREFIX_KEY_TOKENS = 1024

_worker_id = attrgetter("worker_id")


@dataclass(slots=True)
class Decision:
    """One routing decision and everything it was based on.

    Attributes:
        request_id: The request.
        namespace: The cache namespace key.
        prefix_key: Hex id of the leading prefix (up to ``prefix_key_tokens``).
        prefix_class: The request's prefix class.
        policy: Name of the policy that decided.
        worker_id: The chosen worker.
        tier: ``exact`` / ``partial`` / ``cold`` / ``cold_pool`` or the policy's label.
        reason: Why, in one sentence.
        predicted_cached_tokens: Tokens expected to be reused on the chosen worker.
        prompt_tokens: Prompt length (estimated in text mode).
        candidates: Every candidate with its terms.
        filtered: worker -> the filter that removed it.
        warm_abandoned: A warm worker was left because its wait made it too slow.
        now: Decision time.
        context: The routing context (hashes and matches), for feedback calls.
        placed: The speculative index entries :meth:`Router.on_routed` holds
            for this decision (taken back by :meth:`Router.on_rejected`).
        affinity: With a session pin: ``hit`` (it held) or why it broke
            (:data:`~prefixrouter.core.affinity.BREAK_REASONS`); "" without one.
        warm_up: The worker the policy wants the prefix copied to by a
            prefill-only request (:meth:`Dispatcher.warm_up`); None for none.
    """

    request_id: str
    namespace: str
    prefix_key: str
    prefix_class: str
    policy: str
    worker_id: WorkerId
    tier: str
    reason: str
    predicted_cached_tokens: int
    prompt_tokens: int
    candidates: tuple[CandidateScore, ...]
    filtered: dict[WorkerId, str]
    warm_abandoned: bool
    now: float
    context: RoutingContext
    placed: Placement | None = None
    affinity: str = ""
    warm_up: WorkerId | None = None

    @property
    def chosen(self) -> CandidateScore | None:
        """The chosen worker's candidate record, if the policy scored candidates."""
        for c in self.candidates:
            if c.worker_id == self.worker_id:
                return c
        return None

    @property
    def rests_on_speculative(self) -> bool:
        """Whether the prediction rested on an entry that only a routing had placed.

        No answer or engine event had confirmed the chosen worker's match
        when the request was routed, so a shortfall at settlement is a
        prefill still running there, not the worker's cache
        (:meth:`PrefixIndex.on_completed`). A peer's routing carries its
        origin's verdict (``RoutedFact.speculative``) as its context's match.
        """
        held = self.context.matches.get(self.worker_id)
        return held is not None and held.source is EntrySource.SPECULATIVE

    @property
    def predicted_ttft_s(self) -> float | None:
        """The cost model's TTFT for the chosen worker, if the policy used it."""
        c = self.chosen
        return c.terms.ttft_s if c is not None and c.terms is not None else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record for the decision log."""
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "namespace": self.namespace,
            "prefix_key": self.prefix_key,
            "prefix_class": self.prefix_class,
            "policy": self.policy,
            "selected_worker": self.worker_id,
            "tier": self.tier,
            "reason": self.reason,
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "prompt_tokens": self.prompt_tokens,
            "expected_output_tokens": self.context.output_tokens,
            "candidate_workers": [c.to_dict() for c in self.candidates],
            "filtered": dict(self.filtered),
            "warm_abandoned": self.warm_abandoned,
            "time": self.now,
        }
        if self.affinity:
            out["affinity"] = self.affinity
        if self.warm_up is not None:
            out["warm_up"] = self.warm_up
        return out


@dataclass(frozen=True, slots=True)
class Steering:
    """How a caller steers one request (every field optional).

    Attributes:
        policy: Route with this policy, added with :meth:`Router.add_policy`
            (None: the router's own).
        pin: Keep the request on this session's worker while the pin holds
            (:func:`~prefixrouter.core.affinity.hold_pin`).
    """

    policy: str | None = None
    pin: Pin | None = None


def filter_workers(
    request: RoutingRequest, workers: Sequence[WorkerView]
) -> tuple[list[WorkerView], dict[WorkerId, str]]:
    """Split workers into those allowed to serve ``request`` and why others are not.

    A worker's ``tenants`` list admits requests by the tenant that asks
    (``request.tenant``), never by the namespace: tenants that share their
    cache all have the same, empty, namespace tenant field.

    Returns:
        (allowed workers sorted by id, worker -> name of the filter that removed it)
    """
    allowed: list[WorkerView] = []
    removed: dict[WorkerId, str] = {}
    tenant = request.tenant
    model, adapter, pool = request.model, request.adapter, request.pool
    for w in workers:
        if not w.healthy:
            removed[w.worker_id] = "health"
        elif model and w.models and model not in w.models:
            removed[w.worker_id] = "model"
        elif adapter and adapter not in w.adapters:
            removed[w.worker_id] = "adapter"
        elif w.tenants is not None and tenant not in w.tenants:
            removed[w.worker_id] = "tenant"
        elif pool is not None and w.pool != pool:
            removed[w.worker_id] = "pool"
        else:
            allowed.append(w)
    allowed.sort(key=_worker_id)
    return allowed, removed


def replica_salt(replica_id: str) -> int:
    """A router replica's tie-break salt from its id (``Router(replica_salt=)``; "" -> 0).

    Stable across processes and restarts (xxh3 of the id), distinct per id.
    """
    return int(xxhash.xxh3_64_intdigest(replica_id.encode("utf-8"))) if replica_id else 0


class Router:
    """The routing core: one per gateway process or simulated cluster.

    Args:
        policy: A policy instance or a registered name (default ``prefix_aware``).
        hasher: Block hashing settings (block size, text chunk size, estimator).
        index_params: Prefix-index settings.
        cost_params: Cost-model calibration settings.
        prefix_key_tokens: Depth of the prefix key used for demand and logs
            (text mode: as many characters as they take at the estimator's
            prior, fixed, so a prefix keeps its key while the estimate learns).
        replica_salt: This router replica's tie-break salt: replicas that
            share one view (their peers' routings reach them after a lag) break
            near-ties by it apart instead of all picking the same worker.
            0 (one router) keeps the deterministic order.
    """

    def __init__(
        self,
        policy: Policy | str = "prefix_aware",
        hasher: BlockHasher | None = None,
        index_params: IndexParams | None = None,
        cost_params: CostParams | None = None,
        prefix_key_tokens: int = DEFAULT_PREFIX_KEY_TOKENS,
        replica_salt: int = 0,
    ) -> None:
        self.policy = create_policy(policy) if isinstance(policy, str) else policy
        self.hasher = hasher or BlockHasher()
        self.index = PrefixIndex(index_params)
        self.cost = CostModel(cost_params)
        self.output = OutputEstimate()
        self.prefix_key_tokens = prefix_key_tokens
        # Router replicas that share one (stale) view break near-ties apart:
        # see prefix_aware.tie_band_picker. 0 is one router's order.
        self.replica_salt = replica_salt
        # Policies a request may be steered to (Steering.policy), by name.
        self._extra_policies: dict[str, Policy] = {}

    def add_policy(self, policy: Policy) -> None:
        """Make ``policy`` available to steered requests (``Steering(policy=name)``).

        Its hooks get the feedback of the decisions it made. The router's own
        policy needs no adding.
        """
        if policy.name != self.policy.name:
            self._extra_policies[policy.name] = policy

    def _policy_named(self, name: str | None) -> Policy:
        if name is None or name == self.policy.name:
            return self.policy
        policy = self._extra_policies.get(name)
        if policy is None:
            raise ValueError(f"policy {name!r} was not added to the router (add_policy)")
        return policy

    def _policy_of(self, decision: Decision) -> Policy:
        """The policy that made ``decision`` (the router's own for unknown names)."""
        own = self.policy
        if decision.policy == own.name:
            return own
        return self._extra_policies.get(decision.policy, own)

    def blocks_for(self, request: RoutingRequest) -> PromptBlocks:
        """The request's chained block hashes (token mode if it has tokens)."""
        seed = request.namespace.seed
        if request.tokens is not None:
            return self.hasher.token_blocks(seed, request.tokens)
        assert request.text is not None
        return self.hasher.text_blocks(seed, request.text, request.prompt_tokens)

    def route(
        self,
        request: RoutingRequest,
        workers: Sequence[WorkerView],
        now: float,
        blocks: PromptBlocks | None = None,
        steering: Steering | None = None,
    ) -> Decision:
        """Choose a worker for ``request``. Changes no state.

        Args:
            request: The request.
            workers: Snapshots of every known worker.
            now: Decision time on the driver's clock.
            blocks: Precomputed block hashes (the simulator shares them with its engines).
            steering: Another policy or a session pin for this request (:class:`Steering`).

        Raises:
            NoWorkerAvailable: No worker passed the filters.
        """
        allowed, removed = filter_workers(request, workers)
        if not allowed:
            why = ", ".join(f"{w}: {f}" for w, f in sorted(removed.items())) or "no workers"
            raise NoWorkerAvailable(
                f"no worker can serve request {request.request_id} ({why})", removed.items()
            )
        if blocks is None:
            blocks = self.blocks_for(request)
        matches = self.index.match(blocks.hashes, now)
        key = self._prefix_key(request, blocks)
        output = self.output.expected(request.max_tokens, key)
        ctx = RoutingContext(
            request, blocks, matches, now, key, self.cost, self.index, output, self.replica_salt
        )
        policy = self.policy
        affinity = ""
        sel = None
        if steering is not None:
            policy = self._policy_named(steering.policy)
            if steering.pin is not None:
                sel, affinity = hold_pin(steering.pin, allowed, removed, ctx)
        if sel is None:
            sel = policy.select(ctx, allowed)
            if affinity:
                sel.reason = f"session pin broken ({affinity}): {sel.reason}"
        # Positional, in field order (each value is named after its field):
        # matching 15 keyword names costs more than the rest of this call.
        return Decision(
            request.request_id,
            request.namespace.key,
            ctx.prefix_key,
            str(request.prefix_class),
            policy.name,
            sel.worker_id,
            sel.tier,
            sel.reason,
            sel.predicted_cached_tokens,
            blocks.prompt_tokens,
            sel.candidates,
            removed,  # filtered
            sel.warm_abandoned,
            now,
            ctx,  # context
            None,  # placed
            affinity,
            sel.warm_up,
        )

    def admit_warm_up(self, decision: Decision, now: float) -> bool:
        """Whether the copy ``decision`` asks for (``Decision.warm_up``) goes out now:
        its policy's budget (``Policy.admit_warm_up``), given the copy's predicted
        prefill on its worker. A yes is spent."""
        target = decision.warm_up
        if target is None:
            return False
        prefill_s = 0.0
        for c in decision.candidates:
            if c.worker_id == target and c.terms is not None:
                prefill_s = c.terms.prefill_s
                break
        return self._policy_of(decision).admit_warm_up(target, prefill_s, now)

    def on_routed(self, decision: Decision, now: float) -> None:
        """The request was sent to ``decision.worker_id``.

        Its blocks enter the index and stay pinned there (eviction passes
        over them, as the engine cannot evict a running request's blocks)
        until :meth:`on_settled`.
        """
        ctx = decision.context
        worker, hashes = decision.worker_id, ctx.blocks.hashes
        # Pinned first: the eviction that makes room for them passes over them.
        self.index.pin(worker, hashes)
        decision.placed = self.index.on_routed(worker, hashes, now)
        self._policy_of(decision).on_routed(ctx, worker)

    def on_settled(self, decision: Decision) -> None:
        """The request :meth:`on_routed` recorded has ended, however it ended: unpin its blocks.

        Call exactly once per routing, before its feedback (:meth:`on_rejected`,
        :meth:`on_completed`) if it has any; not after :meth:`remove_worker`
        of its worker, which dropped its pins.
        """
        self.index.unpin(decision.worker_id, decision.context.blocks.hashes)

    def on_first_token(self, decision: Decision, now: float) -> None:
        """The engine sent the request's first token: its prompt is prefilled there.

        The policy hears it (``Policy.on_first_token``). The index does not
        change: its entries stay speculative until the engine's report of
        reuse confirms them on completion (:meth:`on_completed`).
        """
        self.policy.on_first_token(decision.context, decision.worker_id)

    def on_rejected(self, decision: Decision, now: float) -> None:
        """The engine did no prefill for the request: take its routing back.

        For an answer that cannot have cached anything: a refusal (4xx, 429,
        503), a failure or a client that left before the first byte. The
        index drops the speculative entries this routing placed that no other
        routing holds and the engine has not confirmed
        (:meth:`PrefixIndex.withdraw`), so an identical retry is predicted
        cold and real prefixes are not displaced by phantoms for a TTL; the
        policy takes back its per-request state (``Policy.on_rejected``).
        What the routing evicted to make room is not restored: the index
        cannot tell whether the engine still holds it. Call it instead of
        :meth:`on_completed`, at most once per :meth:`on_routed`.
        """
        ctx = decision.context
        placed = decision.placed
        decision.placed = None
        if placed:
            self.index.withdraw(decision.worker_id, placed)
        self._policy_of(decision).on_rejected(ctx, decision.worker_id)

    def on_completed(
        self,
        decision: Decision,
        outcome: Outcome,
        now: float,
        block_tokens: float | None = None,
    ) -> bool:
        """Feed back what the engine reported. Returns True if it was a cache miss.

        ``block_tokens``: tokens one of the request's blocks stands for as
        known now, if that differs from the decision's (text mode: the
        estimate may have learned since). The engine's cached tokens are then
        converted into blocks at it, and the prediction (made in the
        decision's units) is rescaled to match, so a shortfall that is only
        the decision's wrong estimate is not taken for a miss.
        """
        ctx = decision.context
        decision.placed = None  # finished: not withdrawn any more (and frees the entries)
        miss = False
        if outcome.ok:
            then = ctx.blocks.block_tokens
            predicted = decision.predicted_cached_tokens
            if block_tokens is None or block_tokens == then:
                block_tokens = then
            else:
                predicted = int(predicted * block_tokens / then)
            miss = self.index.on_completed(
                decision.worker_id,
                ctx.blocks.hashes,
                block_tokens,
                predicted,
                outcome.actual_cached_tokens,
                now,
                decision.now,
                speculative=decision.rests_on_speculative,
            )
            self.output.observe(ctx.request.max_tokens, outcome.output_tokens, ctx.prefix_key)
            chosen = decision.chosen
            if outcome.ttft_s is not None and chosen is not None and chosen.terms is not None:
                self.cost.observe(decision.worker_id, chosen.terms, outcome.ttft_s)
        self._policy_of(decision).on_completed(ctx, decision.worker_id, outcome)
        return miss

    def apply(self, event: KvEvent, now: float, *, trusted: bool = True) -> None:
        """Apply an engine KV event to the index (see :meth:`PrefixIndex.apply`)."""
        self.index.apply(event, now, trusted=trusted)

    def set_worker_capacity(self, worker: WorkerId, blocks: int) -> None:
        """Mirror a worker's engine-reported KV size in the index."""
        self.index.set_capacity(worker, blocks)

    def remove_worker(self, worker: WorkerId) -> None:
        """Forget a worker: its index entries, calibration and policy state."""
        self.index.remove_worker(worker)
        self.cost.forget(worker)
        self.policy.on_worker_removed(worker)
        for policy in self._extra_policies.values():
            policy.on_worker_removed(worker)

    def worker_down(self, worker: WorkerId, now: float) -> int:
        """The worker stopped answering: keep its entries, demoted to speculative.

        Returns how many were demoted (see :meth:`PrefixIndex.demote_worker`).
        """
        return self.index.demote_worker(worker, now)

    def worker_up(self, worker: WorkerId) -> None:
        """The worker answers again after an outage, the same process with its cache:
        its entries stay as they are (demoted to speculative when it went down), and
        its calibration, as old as the outage, restarts from the fleet's best
        (:meth:`CostModel.restarted`)."""
        self.cost.restarted(worker)

    def worker_restarted(self, worker: WorkerId, now: float, *, clear_entries: bool = True) -> None:
        """The worker's engine is a new process with an empty cache: forget its entries.

        Requests routed to it before ``now`` that miss are put down to the
        restart, not to hashing what the engine does not see. Its calibration
        restarts from the fleet's best (:meth:`CostModel.restarted`).
        ``clear_entries=False``: the entries are right already (the engine's
        KV events reported the restart and what the new process stored since).
        """
        if clear_entries:
            self.index.clear_worker(worker, now)
        self.cost.restarted(worker)

    def prefix_key(self, request: RoutingRequest, blocks: PromptBlocks) -> str:
        """The request's prefix key (as its decision would carry it). Changes no state."""
        return self._prefix_key(request, blocks)

    def _prefix_key(self, request: RoutingRequest, blocks: PromptBlocks) -> str:
        hashes = blocks.hashes
        if not hashes:
            return f"{request.namespace.seed:016x}"
        # The block at depth max(1, prefix_key_tokens / block) or the last one,
        # with the min/max written out (this runs on every request). In text
        # mode the depth is a fixed number of characters (the estimator's
        # prior): at the moving estimate a document got a new key each time
        # the estimate crossed a chunk.
        if request.tokens is None:
            depth = self.hasher.text_key_blocks(self.prefix_key_tokens)
        else:
            depth = int(self.prefix_key_tokens // blocks.block_tokens)
            depth = depth if depth > 1 else 1
        n = len(hashes)
        return f"{hashes[(n if n < depth else depth) - 1]:016x}"
