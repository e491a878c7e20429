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
  engine's ``prompt_tokens`` (``Dispatcher.observe_prompt_tokens``, as the
  gateway's proxy does). The
  engine keeps its exact token-level model: it hashes the token ids in its
  own blocks. KV events are token blocks, which text-mode hashes never
  match, so a text-mode run refuses ``kv_events``.

The clock is the event heap's: entries are ``(time, kind, sequence, ...)``, so
simultaneous events run in a fixed order (engine outputs before arrivals) and
two runs with the same inputs produce identical records. Stale engine wakeups
are dropped by comparing the engine's ``epoch``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from prefixrouter.core.dispatch import Admission, Dispatcher, RoutingMode
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
from prefixrouter.core.types import RoutingRequest, WorkerId, WorkerView
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

_WAKEUP, _ARRIVAL = 0, 1


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
    chars_per_token: float | None = None  # text mode: the estimate learned by the end


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
    """

    workers: int
    profile: EngineProfile
    kv_blocks: int | None = None
    kv_events: bool = False
    decision_log: int = 0
    mode: RoutingMode = "token"

    def __post_init__(self) -> None:
        if self.mode not in ("text", "token"):
            raise ValueError(f"unknown routing mode {self.mode!r}: expected 'text' or 'token'")
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


def routing_request(req: SimRequest) -> RoutingRequest:
    """The router's view of a simulated request (token mode)."""
    return RoutingRequest(
        request_id=req.request_id,
        namespace=req.namespace,
        tokens=req.tokens(),
        max_tokens=req.output_tokens,
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
            hasher = replace(text_hasher(), block_size=block_size)
            self._renderer = renderer or TextRenderer(workload.requests)
        else:
            hasher = BlockHasher(block_size=block_size)
        self.dispatch = Dispatcher(Router(policy, hasher=hasher), self.mode)
        kv_blocks = config.kv_blocks
        self.engines = [
            EngineModel(WorkerId(f"w{i:02d}"), config.profile, kv_blocks, config.kv_events)
            for i in range(config.workers)
        ]
        self._engine_of = {eng.worker_id: i for i, eng in enumerate(self.engines)}
        self.dispatch.mirror_capacity(self._views())
        self._on_progress = on_progress
        # One run's state (reset by run()).
        self._records: list[RequestRecord] = []
        # request id -> (record, admission, prompt characters in text mode)
        self._by_id: dict[str, tuple[RequestRecord, Admission, int]] = {}
        self._logged: list[dict[str, object]] = []
        self._done = 0
        self._heap: list[tuple[float, int, int, int, int]] = []  # time, kind, seq, engine, epoch
        self._seq = 0

    def _views(self) -> list[WorkerView]:
        prof = self.config.profile
        fill = self.dispatch.fill
        return [
            fill(
                WorkerView(
                    worker_id=eng.worker_id,
                    kv_capacity_blocks=eng.kv_capacity_blocks,
                    kv_used_blocks=eng.kv_used_blocks,
                    block_size=prof.block_size,
                    max_slots=prof.max_num_seqs,
                    profile=prof.speed,
                )
            )
            for eng in self.engines
        ]

    def run(self) -> SimRun:
        """Simulate until every request has completed.

        The event loop: the earliest engine wakeup runs first unless an
        arrival comes before it (a tie goes to the engine); a wakeup whose
        ``epoch`` is stale is dropped.
        """
        requests = self.workload.requests
        self._records, self._by_id, self._logged, self._done = [], {}, [], 0
        heap = self._heap = []
        self._seq = 0
        now = 0.0
        next_arrival = 0
        while next_arrival < len(requests) or heap:
            if heap and (
                next_arrival >= len(requests) or heap[0][0] <= requests[next_arrival].arrival
            ):
                now, _, _, i, epoch = heapq.heappop(heap)
                eng = self.engines[i]
                if epoch == eng.epoch:
                    self._outputs(eng.advance(now))
                    self._schedule(i)
                continue
            sreq = requests[next_arrival]
            next_arrival += 1
            now = sreq.arrival
            self._arrive(sreq, now)
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
        )

    def _arrive(self, sreq: SimRequest, now: float) -> None:
        """An arrival: mirror the KV room, admit the request, hand it to its engine."""
        dispatch = self.dispatch
        views = self._views()
        dispatch.mirror_capacity(views)
        renderer = self._renderer
        if renderer is None:  # token mode: the engine shares the router's hashes
            adm = dispatch.admit(routing_request(sreq), views, now)
            chars = 0
            engine_hashes, prompt = adm.blocks.hashes, adm.blocks.prompt_tokens
        else:  # text mode: the router sees text, the engine its token blocks
            request, chars = text_routing_request(sreq, renderer)
            adm = dispatch.admit(request, views, now)
            prompt = sreq.prompt_tokens
            engine_hashes = hash_token_blocks(
                sreq.namespace.seed, sreq.tokens(), self.config.profile.block_size
            )
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
        )
        self._records.append(rec)
        self._by_id[sreq.request_id] = (rec, adm, chars)
        i = self._engine_of[decision.worker_id]
        # Wakeups at or before `now` were processed first (heap order), as
        # EngineModel.submit requires.
        self.engines[i].submit(
            EngineRequest(sreq.request_id, engine_hashes, prompt, sreq.output_tokens, now), now
        )
        self._schedule(i)

    def _outputs(self, outputs: list[EngineOutput]) -> None:
        """An engine step's outputs: first tokens and completions fed back, KV events applied."""
        dispatch = self.dispatch
        for out in outputs:
            if isinstance(out, FirstToken):
                rec, adm, _ = self._by_id[out.request_id]
                rec.first_token = out.time
                rec.cached_tokens = out.cached_tokens
                rec.queue_wait_s = out.queue_wait_s
                rec.kv_wait_s = out.kv_wait_s
                dispatch.first_token(adm)
            elif isinstance(out, Completed):
                rec, adm, chars = self._by_id.pop(out.request_id)
                rec.completed = out.time
                if chars:  # text mode learns characters per token first, as the gateway does
                    dispatch.observe_prompt_tokens(chars, rec.prompt_tokens, adm)
                dispatch.complete(adm, Outcome(rec.cached_tokens, rec.ttft_s), out.time)
                self._done += 1
                if self._on_progress is not None:
                    self._on_progress(self._done)
            elif isinstance(out, KvEventOut) and self.config.kv_events:
                dispatch.apply_event(out.event, out.time)

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
