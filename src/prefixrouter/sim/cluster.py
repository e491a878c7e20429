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

The clock is the event heap's: entries are ``(time, kind, sequence, ...)``, so
simultaneous events run in a fixed order (engine outputs before arrivals) and
two runs with the same inputs produce identical records. Stale engine wakeups
are dropped by comparing the engine's ``epoch``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixrouter.core.dispatch import Admission, Dispatcher
from prefixrouter.core.hashing import BlockHasher
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


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The simulated fleet.

    Attributes:
        workers: Number of replicas.
        profile: Engine profile of every replica.
        kv_blocks: Per-replica KV blocks (None: the profile's).
        kv_events: Feed the engines' KV events to the router (exact index).
        decision_log: Keep the first N decisions as dicts (for inspection).
    """

    workers: int
    profile: EngineProfile
    kv_blocks: int | None = None
    kv_events: bool = False
    decision_log: int = 0


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
    ) -> None:
        self.workload = workload
        self.config = config
        block_size = config.profile.block_size
        if workload.block_size != block_size:
            raise ValueError(
                f"workload {workload.name} uses {workload.block_size}-token blocks, "
                f"profile {config.profile.name} {block_size}"
            )
        self.dispatch = Dispatcher(Router(policy, hasher=BlockHasher(block_size=block_size)))
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
        self._by_id: dict[str, tuple[RequestRecord, Admission]] = {}
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
        return SimRun(
            self.dispatch.policy_name, self._records, self._stats(), now, kv_events, self._logged
        )

    def _arrive(self, sreq: SimRequest, now: float) -> None:
        """An arrival: mirror the KV room, admit the request, hand it to its engine."""
        dispatch = self.dispatch
        views = self._views()
        dispatch.mirror_capacity(views)
        adm = dispatch.admit(routing_request(sreq), views, now)
        decision = adm.decision
        if len(self._logged) < self.config.decision_log:
            self._logged.append(decision.to_dict())
        prompt = adm.blocks.prompt_tokens
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
        self._by_id[sreq.request_id] = (rec, adm)
        i = self._engine_of[decision.worker_id]
        # Wakeups at or before `now` were processed first (heap order), as
        # EngineModel.submit requires.
        self.engines[i].submit(
            EngineRequest(sreq.request_id, adm.blocks.hashes, prompt, sreq.output_tokens, now), now
        )
        self._schedule(i)

    def _outputs(self, outputs: list[EngineOutput]) -> None:
        """An engine step's outputs: first tokens and completions fed back, KV events applied."""
        dispatch = self.dispatch
        for out in outputs:
            if isinstance(out, FirstToken):
                rec, adm = self._by_id[out.request_id]
                rec.first_token = out.time
                rec.cached_tokens = out.cached_tokens
                rec.queue_wait_s = out.queue_wait_s
                rec.kv_wait_s = out.kv_wait_s
                dispatch.first_token(adm)
            elif isinstance(out, Completed):
                rec, adm = self._by_id.pop(out.request_id)
                rec.completed = out.time
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
