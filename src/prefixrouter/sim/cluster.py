"""The discrete-event cluster simulation: workload -> Router -> engines -> feedback.

One run replays a :class:`~prefixrouter.sim.workload.Workload` through the
product's own :class:`~prefixrouter.core.router.Router` (with any registered
policy) in front of ``workers`` :class:`~prefixrouter.sim.engine.EngineModel`
instances:

* **arrival** at ``t``: the prompt is hashed once (the router and the engine
  share the hashes), the router sees a :class:`WorkerView` per engine (load
  from the in-flight ledger, as the live gateway has; KV usage from the
  engine, as a metrics poll would give), the capacity mirror is refreshed
  from them, and the :class:`~prefixrouter.core.dispatch.Dispatcher` admits
  the request (route, record, count in flight); the engine gets it;
* **engine wakeup**: the engine advances; each first token is noted; each
  completion is fed back (``Dispatcher.complete``) with the engine's cached
  tokens and the observed TTFT; KV events go to ``Dispatcher.apply_event``
  when the run enables them.

The gateway drives the same dispatcher with the same calls.

**Two routing modes** (:attr:`ClusterConfig.mode`), as the gateway has:

* ``token``: the router hashes the prompt's token ids in engine blocks, and
  the engine shares those hashes (one hashing per request);
* ``text`` (the gateway's default, and ``prefixrouter simulate``'s): the
  request becomes the chat body a client would send
  (:mod:`prefixrouter.sim.text`), built and hashed through the gateway's
  request path (character chunks of the rendered ChatML, the gateway's
  defaults: 256-character chunks, 4.0 characters per token to start,
  131,072 prompt tokens hashed at most), and each completion teaches the
  characters-per-token estimate, global and of the prompt's prefixes, with the
  engine's ``prompt_tokens`` (``Dispatcher.complete``'s ``prompt_chars``, as
  the gateway's proxy does). A prompt whose prefix has no estimate of its
  own yet is also counted by the engine as soon as it is routed
  (:attr:`ClusterConfig.token_count`, the gateway's ``POST /tokenize``
  probe), so its document's next requests are predicted at its own ratio
  before its first answer. The
  engine keeps its exact token-level model: it hashes the token ids in its
  own blocks. KV events are token blocks, which text-mode hashes never
  match, so a text-mode run refuses ``kv_events``.

**Several router replicas** (:attr:`ClusterConfig.routers`), as gateway
replicas behind a Kubernetes Service: each replica is its own
:class:`~prefixrouter.core.dispatch.Dispatcher` (its own index, policy state,
in-flight ledger, workers' speed calibration and, in text mode,
characters-per-token estimate), and arrivals go to them round robin. A
replica sees the engines as the single router does (its own worker views and
capacity mirror on its own arrivals; every engine's KV events when the run
has them) and the first tokens and completions of its own requests only.
With sync on, every replica records its routing facts
(:mod:`prefixrouter.core.facts`); after each dispatcher call the caller
drains them, and one event at ``now + sync_lag`` hands the batch to every
other replica's ``apply_peer``, in the order recorded (the facts are shared
values, never copied). A peer's answer carries its TTFT and, in text mode,
the prompt's characters and token count, so each replica calibrates and
learns characters per token from every answer, as one router does. With
sync off nothing is delivered: each replica learns placement, load and
calibration from its own share of the traffic only. Replica ``r`` breaks
near-ties with ``replica_salt=r`` (the gateway: a salt from its replica id),
so replicas that route on one view within the lag spread over the workers
that count as equal instead of piling onto one. One replica (the default,
salt 0) is the plain simulation, event for event.

The clock is the event heap's: entries are ``(time, kind, sequence, ...)``, so
simultaneous events run in a fixed order (engine outputs, then peers' facts,
then arrivals) and two runs with the same inputs produce identical records.
Stale engine wakeups are dropped by comparing the engine's ``epoch``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from prefixrouter.core.dispatch import Admission, Dispatcher, RoutingMode, routing_mode
from prefixrouter.core.facts import Fact
from prefixrouter.core.hashing import (
    DEFAULT_CHARS_PER_TOKEN,
    DEFAULT_CHUNK_CHARS,
    DEFAULT_MAX_PROMPT_TOKENS,
    BlockHasher,
    TokenEstimator,
    hash_token_blocks,
)
from prefixrouter.core.policy import Outcome, Policy
from prefixrouter.core.router import Router
from prefixrouter.core.types import BlockHash, RoutingRequest, WorkerId, WorkerView
from prefixrouter.sim.engine import (
    Completed,
    EngineModel,
    EngineOutput,
    EngineRequest,
    FirstToken,
    KvEventOut,
)
from prefixrouter.sim.profiles import EngineProfile
from prefixrouter.sim.text import TextRenderer, text_routing_request
from prefixrouter.sim.workload import SimRequest, Workload

# Heap entry kinds, in the order simultaneous events run (arrivals are not on
# the heap: they run after every heap entry at or before their time).
_WAKEUP, _FACTS, _COUNT = 0, 1, 2

NO_MAX_TOKENS = -1
"""``ClusterConfig.client_max_tokens`` for clients that send no ``max_tokens``."""
TOKEN_COUNT_BASE_S = 0.001
"""Text mode's token-count probe (``POST /tokenize``): a loopback round trip."""
TOKEN_COUNT_PER_TOKEN_S = 1e-6
"""...plus the engine's tokenizer, about a million tokens a second (a fast BPE on one core)."""


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request.

    Times are seconds on the simulated clock; ``-1`` means "did not happen".
    """

    request_id: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    prefix_class: str
    group: str
    worker: str = ""
    tier: str = ""
    warm_abandoned: bool = False
    predicted_cached_tokens: int = 0
    cached_tokens: int = 0
    first_token: float = -1.0
    completed: float = -1.0
    queue_wait_s: float = 0.0
    kv_wait_s: float = 0.0
    router: int = 0  # the router replica that admitted it

    @property
    def ttft_s(self) -> float:
        """Time to first token (``-1`` if none)."""
        return self.first_token - self.arrival if self.first_token >= 0 else -1.0

    @property
    def e2e_s(self) -> float:
        """Arrival to last token (``-1`` if not completed)."""
        return self.completed - self.arrival if self.completed >= 0 else -1.0


@dataclass(slots=True)
class WorkerStats:
    """One engine's totals at the end of a run."""

    worker: str
    busy_time_s: float
    requests: int
    prefill_tokens: int
    cached_tokens: int
    evictions: int
    eviction_mean_age_s: float
    kv_wait_s: float


@dataclass(slots=True)
class SimRun:
    """The outcome of one simulation run."""

    policy: str
    records: list[RequestRecord]
    workers: list[WorkerStats]
    end_time: float
    kv_events: bool
    decisions_logged: list[dict[str, object]] = field(default_factory=list)
    chars_per_token: float | None = None  # text mode: router 0's estimate at the end
    routers: int = 1  # router replicas (RequestRecord.router says which admitted each)
    warm_ups: int = 0  # the routers' own prefill-only copies (Dispatcher.warm_up), not in records


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The simulated fleet.

    Attributes:
        workers: Number of replicas.
        profile: Engine profile of every replica.
        kv_blocks: Per-replica KV blocks (None: the profile's).
        kv_events: Feed the engines' KV events to the router (exact index).
        decision_log: Keep the first N decisions as dicts (for inspection).
        mode: How the router sees prompts: ``token`` ids or ``text`` (module docstring).
        routers: Router replicas in front of the fleet (arrivals round robin).
        sync: Deliver each replica's routing facts to the others (``routers > 1``).
        sync_lag_s: Seconds from a fact's recording to its application at the peers.
        token_count: Text mode: ask the engine to count a new prefix's tokens
            when it is routed (the gateway's ``routing.token_count``), and
            learn its characters per token from the count
            (:data:`TOKEN_COUNT_BASE_S` plus :data:`TOKEN_COUNT_PER_TOKEN_S` a
            token later) instead of from its first answer.
        client_max_tokens: The ``max_tokens`` clients send, a cap as chat
            clients set it (each answer still ends at its own length, as at
            the end of its text; a request longer than the cap asks for its
            own length). 0: every client sends its answer's exact length,
            as a benchmark client does. :data:`NO_MAX_TOKENS` (-1): clients
            send no ``max_tokens`` at all, as many chat applications do (the
            engine decodes to the end of the answer; the router sees 0, no
            cap).
    """

    workers: int
    profile: EngineProfile
    kv_blocks: int | None = None
    kv_events: bool = False
    decision_log: int = 0
    mode: RoutingMode = "token"
    routers: int = 1
    sync: bool = True
    sync_lag_s: float = 0.0
    token_count: bool = True
    client_max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.client_max_tokens < NO_MAX_TOKENS:
            raise ValueError(
                f"client max_tokens must be >= 0, or {NO_MAX_TOKENS} for none; "
                f"got {self.client_max_tokens}"
            )
        if self.routers < 1:
            raise ValueError(f"router replicas must be at least 1, got {self.routers}")
        # Also refuses NaN; an infinite lag is no sync at all (facts that never
        # arrive), which `sync=False` says, and JSON cannot write. The one check:
        # `simulate --sync-lag-ms inf` (typer's min=0 lets it through) ends here too.
        if not (self.sync_lag_s >= 0.0 and math.isfinite(self.sync_lag_s)):
            raise ValueError(f"sync lag must be finite and >= 0 seconds, got {self.sync_lag_s}")
        routing_mode(self.mode)  # a string from outside the type checker's view
        if self.kv_events and self.mode != "token":
            raise ValueError(
                "KV events need token mode: engine events name token blocks, which "
                "text-mode hashes (character chunks) never match; use --mode token"
            )


def text_hasher() -> BlockHasher:
    """Text mode's hasher with the gateway's defaults (``routing`` in its configuration)."""
    return BlockHasher(
        chunk_chars=DEFAULT_CHUNK_CHARS,
        estimator=TokenEstimator(DEFAULT_CHARS_PER_TOKEN),
        max_prompt_tokens=DEFAULT_MAX_PROMPT_TOKENS,
    )


def routing_request(req: SimRequest, max_tokens: int | None = None) -> RoutingRequest:
    """The router's view of a simulated request (token mode).

    ``max_tokens``: what the client sends; None: the answer's own length; 0:
    none (the gateway's ``routing.default_max_tokens`` 0).
    """
    return RoutingRequest(
        request_id=req.request_id,
        namespace=req.namespace,
        tokens=req.tokens(),
        max_tokens=req.output_tokens if max_tokens is None else max_tokens,
        prefix_class=req.prefix_class,
        first_user_offset=req.first_user_offset,
    )


class Simulation:
    """Runs one workload through one policy on one simulated fleet."""

    def __init__(
        self,
        workload: Workload,
        config: ClusterConfig,
        policy: Policy | str,
        *,
        on_progress: Callable[[int], None] | None = None,
        renderer: TextRenderer | None = None,
    ) -> None:
        """``renderer``: text mode's bodies (share one across runs of one workload)."""
        self.workload = workload
        self.config = config
        block_size = config.profile.block_size
        if workload.block_size != block_size:
            raise ValueError(
                f"workload {workload.name} uses {workload.block_size}-token blocks, "
                f"profile {config.profile.name} {block_size}"
            )
        self.mode = config.mode
        self._renderer: TextRenderer | None = None
        if self.mode == "text":
            self._renderer = renderer or TextRenderer(workload.requests)
        if config.routers > 1 and not isinstance(policy, str):
            raise ValueError("several router replicas need the policy by name (one state each)")
        # Facts are recorded only where they are delivered (sync on, peers to hear them).
        self._syncing = config.routers > 1 and config.sync
        # Each replica its own router: its own hasher (text mode's estimator),
        # cost model, index, policy state and ledger; sync feeds them peers' facts.
        # Each replica its own tie-break salt (Router's replica_salt); the
        # first keeps 0, so one router is the plain simulation.
        self.routers = [
            Dispatcher(
                Router(policy, hasher=self._hasher(), replica_salt=r),
                self.mode,
                record_facts=self._syncing,
            )
            for r in range(config.routers)
        ]
        self.dispatch = self.routers[0]
        self._origins = [f"r{r:02d}@0" for r in range(config.routers)]
        kv_blocks = config.kv_blocks
        self.engines = [
            EngineModel(WorkerId(f"w{i:02d}"), config.profile, kv_blocks, config.kv_events)
            for i in range(config.workers)
        ]
        self._engine_of = {eng.worker_id: i for i, eng in enumerate(self.engines)}
        for r, dispatch in enumerate(self.routers):
            dispatch.mirror_capacity(self._views(r, 0.0))
        self._on_progress = on_progress
        # One run's state (reset by run()).
        self._records: list[RequestRecord] = []
        # request id -> (record, admission, prompt characters in text mode, router)
        self._by_id: dict[str, tuple[RequestRecord, Admission, int, int]] = {}
        self._logged: list[dict[str, object]] = []
        self._done = 0
        # time, kind, seq, engine (wakeup) or origin router (facts), engine epoch (wakeup)
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._now = 0.0
        # seq of a _FACTS entry -> the facts it delivers (shared by every peer, not copied)
        self._batches: dict[int, tuple[list[Fact], float]] = {}
        # seq of a _COUNT entry -> (router, admission, characters, tokens) of a token count
        self._counts: dict[int, tuple[int, Admission, int, int]] = {}
        self._counting: set[tuple[int, str]] = set()  # (router, prefix key) with a count pending
        # request id of a warm-up -> (admission, router, cached tokens at its first token)
        self._warm_ups: dict[str, tuple[Admission, int, int]] = {}
        self._warm_up_count = 0

    def _hasher(self) -> BlockHasher:
        block_size = self.config.profile.block_size
        if self.mode == "text":
            return replace(text_hasher(), block_size=block_size)
        return BlockHasher(block_size=block_size)

    def _views(self, router: int, now: float) -> list[WorkerView]:
        """Router ``router``'s snapshot of every engine at ``now`` (its ledger's figures filled)."""
        prof = self.config.profile
        fill = self.routers[router].fill
        return [
            fill(
                WorkerView(
                    worker_id=eng.worker_id,
                    kv_capacity_blocks=eng.kv_capacity_blocks,
                    kv_used_blocks=eng.kv_used_blocks,
                    block_size=prof.block_size,
                    max_slots=prof.max_num_seqs,
                    profile=prof.speed,
                ),
                now,
            )
            for eng in self.engines
        ]

    def run(self) -> SimRun:
        """Simulate until every request has completed.

        The event loop: the earliest heap entry (an engine wakeup, or a batch
        of peers' facts) runs first unless an arrival comes before it (a tie
        goes to the heap); a wakeup whose ``epoch`` is stale is dropped.
        Arrival ``k`` goes to router replica ``k mod routers``.
        """
        requests = self.workload.requests
        self._records, self._by_id, self._logged, self._done = [], {}, [], 0
        heap = self._heap = []
        self._batches = {}
        self._counts, self._counting = {}, set()
        self._warm_ups, self._warm_up_count = {}, 0
        self._seq = 0
        now = self._now = 0.0
        next_arrival = 0
        routers = len(self.routers)
        while next_arrival < len(requests) or heap:
            if heap and (
                next_arrival >= len(requests) or heap[0][0] <= requests[next_arrival].arrival
            ):
                now, kind, seq, i, epoch = heapq.heappop(heap)
                self._now = now
                if kind == _FACTS:
                    self._deliver(i, *self._batches.pop(seq), now)
                    continue
                if kind == _COUNT:
                    self._counted(seq)
                    continue
                eng = self.engines[i]
                if epoch == eng.epoch:
                    self._outputs(eng.advance(now))
                    self._schedule(i)
                continue
            sreq = requests[next_arrival]
            router = next_arrival % routers
            next_arrival += 1
            now = self._now = sreq.arrival
            self._arrive(sreq, now, router)
        kv_events = self.config.kv_events
        cpt = self.dispatch.chars_per_token if self.mode == "text" else None
        return SimRun(
            self.dispatch.policy_name,
            self._records,
            self._stats(),
            now,
            kv_events,
            self._logged,
            cpt,
            routers,
            self._warm_up_count,
        )

    def _publish(self, router: int, t: float) -> None:
        """Send what ``router`` just recorded to its peers, to arrive ``sync_lag_s`` after ``t``.

        ``t`` is the time of the dispatcher call; an engine's outputs can be
        timed inside the step just simulated, so the delivery is never before
        the simulated clock (the heap does not run the past).
        """
        if not self._syncing:
            return
        facts = self.routers[router].drain_facts()
        if not facts:
            return
        self._seq += 1
        self._batches[self._seq] = (facts, t)
        at = max(t + self.config.sync_lag_s, self._now)
        heapq.heappush(self._heap, (at, _FACTS, self._seq, router, 0))

    def _deliver(self, origin: int, facts: list[Fact], recorded: float, now: float) -> None:
        """Every replica but ``origin`` applies ``origin``'s facts, in the order recorded
        (at ``recorded``: a routing's time, from which peers count what they routed without it)."""
        name = self._origins[origin]
        for r, dispatch in enumerate(self.routers):
            if r == origin:
                continue
            apply = dispatch.apply_peer
            for fact in facts:
                apply(name, fact, now, recorded)

    def _arrive(self, sreq: SimRequest, now: float, router: int = 0) -> None:
        """An arrival at ``router``: mirror the KV room, admit the request, hand it on."""
        dispatch = self.routers[router]
        views = self._views(router, now)
        dispatch.mirror_capacity(views)
        renderer = self._renderer
        if renderer is None:  # token mode: the engine shares the router's hashes
            adm = dispatch.admit(routing_request(sreq, self._cap(sreq)), views, now)
            chars = 0
            engine_hashes, prompt = adm.blocks.hashes, adm.blocks.prompt_tokens
        else:  # text mode: the router sees text, the engine its token blocks
            request, chars = text_routing_request(sreq, renderer, max_tokens=self._cap(sreq))
            adm = dispatch.admit(request, views, now)
            prompt = sreq.prompt_tokens
            if self.config.token_count and dispatch.wants_token_count(adm):
                self._count_tokens(router, adm, chars, prompt, now)
            engine_hashes = hash_token_blocks(
                sreq.namespace.seed, sreq.tokens(), self.config.profile.block_size
            )
        self._publish(router, now)
        decision = adm.decision
        if len(self._logged) < self.config.decision_log:
            self._logged.append(decision.to_dict())
        rec = RequestRecord(
            request_id=sreq.request_id,
            arrival=now,
            prompt_tokens=prompt,
            output_tokens=sreq.output_tokens,
            prefix_class=str(sreq.prefix_class),
            group=sreq.group,
            worker=decision.worker_id,
            tier=decision.tier,
            warm_abandoned=decision.warm_abandoned,
            predicted_cached_tokens=decision.predicted_cached_tokens,
            router=router,
        )
        self._records.append(rec)
        self._by_id[sreq.request_id] = (rec, adm, chars, router)
        i = self._engine_of[decision.worker_id]
        # Wakeups at or before `now` were processed first (heap order), as
        # EngineModel.submit requires.
        self.engines[i].submit(
            EngineRequest(sreq.request_id, engine_hashes, prompt, sreq.output_tokens, now), now
        )
        self._schedule(i)
        if decision.warm_up is not None:
            self._warm_up(router, adm, engine_hashes, prompt, now)

    def _cap(self, sreq: SimRequest) -> int:
        """The ``max_tokens`` the client sends (0: none)."""
        cap = self.config.client_max_tokens
        if cap == NO_MAX_TOKENS:
            return 0
        return max(cap, sreq.output_tokens) if cap else sreq.output_tokens

    def _warm_up(
        self,
        router: int,
        adm: Admission,
        engine_hashes: tuple[BlockHash, ...],
        prompt: int,
        now: float,
    ) -> None:
        """Send the prefill-only copy the decision asks for, as the gateway does (not a record)."""
        dispatch = self.routers[router]
        warm = dispatch.warm_up(adm, self._views(router, now), now)
        if warm is None:
            return
        self._publish(router, now)
        rid = warm.request.request_id
        self._warm_ups[rid] = (warm, router, 0)
        self._warm_up_count += 1
        i = self._engine_of[warm.worker]
        self.engines[i].submit(EngineRequest(rid, engine_hashes, prompt, 1, now), now)
        self._schedule(i)

    def _count_tokens(
        self, router: int, adm: Admission, chars: int, tokens: int, now: float
    ) -> None:
        """Ask the engine for a new prefix's token count, as the gateway does (one per key)."""
        key = (router, adm.decision.prefix_key)
        if key in self._counting:
            return
        self._counting.add(key)
        self._seq += 1
        self._counts[self._seq] = (router, adm, chars, tokens)
        at = now + TOKEN_COUNT_BASE_S + TOKEN_COUNT_PER_TOKEN_S * tokens
        heapq.heappush(self._heap, (at, _COUNT, self._seq, router, 0))

    def _counted(self, seq: int) -> None:
        """A token count came back: it teaches the estimate (global and per prefix), peers' too."""
        router, adm, chars, tokens = self._counts.pop(seq)
        self._counting.discard((router, adm.decision.prefix_key))
        self.routers[router].counted(adm, chars, tokens)  # the peers hear of it too
        self._publish(router, self._now)

    def _outputs(self, outputs: list[EngineOutput]) -> None:
        """An engine step's outputs: first tokens and completions fed back, KV events applied.

        A request's first token and completion go to the replica that admitted
        it (it proxies the answer); KV events to every replica (each
        subscribes to every engine).
        """
        routers = self.routers
        warm_ups = self._warm_ups
        for out in outputs:
            if warm_ups and isinstance(out, (FirstToken, Completed)) and out.request_id in warm_ups:
                self._warm_up_output(out)
            elif isinstance(out, FirstToken):
                rec, adm, _, r = self._by_id[out.request_id]
                rec.first_token = out.time
                rec.cached_tokens = out.cached_tokens
                rec.queue_wait_s = out.queue_wait_s
                rec.kv_wait_s = out.kv_wait_s
                routers[r].first_token(adm, out.time)
                self._publish(r, out.time)
            elif isinstance(out, Completed):
                rec, adm, chars, r = self._by_id.pop(out.request_id)
                rec.completed = out.time
                # Text mode learns characters per token from the engine's
                # count, as the gateway does (chars is 0 in token mode); the
                # settled fact carries the observation to the peers.
                routers[r].complete(
                    adm,
                    Outcome(rec.cached_tokens, rec.ttft_s, True, rec.output_tokens),
                    out.time,
                    prompt_chars=chars,
                    prompt_tokens=rec.prompt_tokens,
                )
                self._publish(r, out.time)
                self._done += 1
                if self._on_progress is not None:
                    self._on_progress(self._done)
            elif isinstance(out, KvEventOut) and self.config.kv_events:
                for dispatch in routers:
                    dispatch.apply_event(out.event, out.time)

    def _warm_up_output(self, out: FirstToken | Completed) -> None:
        """A warm-up's first token or answer, fed back as any admission's (module doc)."""
        warm, r, cached = self._warm_ups[out.request_id]
        dispatch = self.routers[r]
        if isinstance(out, FirstToken):
            self._warm_ups[out.request_id] = (warm, r, out.cached_tokens)
            dispatch.first_token(warm, out.time)
        else:
            del self._warm_ups[out.request_id]
            dispatch.complete(warm, Outcome(cached, None), out.time)
        self._publish(r, out.time)

    def _schedule(self, i: int) -> None:
        """Push engine ``i``'s next wakeup (if it has one) on the event heap."""
        eng = self.engines[i]
        t = eng.next_wakeup()
        if t is not None:
            self._seq += 1
            heapq.heappush(self._heap, (t, _WAKEUP, self._seq, i, eng.epoch))

    def _stats(self) -> list[WorkerStats]:
        records = self._records
        return [
            WorkerStats(
                worker=eng.worker_id,
                busy_time_s=eng.busy_time,
                requests=sum(1 for r in records if r.worker == eng.worker_id),
                prefill_tokens=eng.prefill_tokens_computed,
                cached_tokens=eng.cached_tokens_total,
                evictions=eng.evictions,
                eviction_mean_age_s=eng.eviction_ages.mean_age,
                kv_wait_s=eng.kv_wait_total,
            )
            for eng in self.engines
        ]
