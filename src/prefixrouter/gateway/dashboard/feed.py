"""The dashboard's figures: one snapshot a second, built from the gateway's own state.

A :class:`DashboardFeed` ticks every ``tick_s`` (1 s) and reads, without
touching the request path:

* the **decision log's ring** (:class:`~prefixrouter.gateway.decision_log.DecisionLog`):
  the records finished since the last tick. Every per-request figure of the
  dashboard (tokens, TTFT by warm/partial/cold, predicted against actual
  cached tokens, queue wait by decision, warm-abandoned share, tiers, per
  worker cached share and the prefixes it holds) is aggregated from them, per
  prefix class and for all classes (``"*"``). While fewer than the ring holds
  (``decision_log.ring_size``, 1,000 by default) finish in a tick, every one
  is counted; past that the newest ``ring_size`` are, and rates are scaled by
  ``made / seen`` (both are in the snapshot, the page shows them);
* the **metrics** (:class:`~prefixrouter.gateway.metrics.GatewayMetrics`):
  evictions and the age of what was evicted, and the requests answered
  before routing (``prefixrouter_requests_total{decision="none"}``: a bad
  body, a refused key, a tenant limit, no worker), which never reach the
  decision log (exact counters, so the page's error figures add up to the
  metric's);
* the **drift alarm** (:class:`~prefixrouter.core.drift.DriftDetector` of the
  gateway's fleet controls): which prefix classes fire, when it is on;
* the **worker registry** and the **dispatcher**: state, in flight, engine
  queue and KV use per worker, and whether the router's index still holds a
  prefix (:meth:`~prefixrouter.core.dispatch.Dispatcher.holds_prefix`). A
  worker's ``healthy`` is ``prefixrouter_worker_healthy``'s rule
  (:attr:`Worker.routable`), its ``state`` says why it is out of routing;
* the **cluster node**, for a replica: peers, their routings in flight here,
  and the propagation lag of recent messages.

The feed works only while someone watches: a stream is open, or was within
``watch_s`` (5 minutes, so a reload finds the history), or a snapshot was
asked for. Unwatched, a tick only moves its counters on, so a gateway nobody
looks at pays one timer a second; the first viewer after a pause starts from
an empty window and history, with the prefix rankings and the newest
decisions learned from the decision log's ring.

The decision *stream* is sampled: at most ``decisions_per_tick`` (12) records
a tick are rendered and sent, evenly spaced over those finished in the tick
(every ``ceil(seen / 12)``-th), so the payload stays bounded at any rate
(about 1 KB a decision with a handful of candidates; at 1,000 decisions a
second a tick is 15-25 KB). The snapshot keeps a window of ``window_ticks``
ticks (60) for the bar views and ``history_ticks`` (120) chart points, which
a client gets once when it connects.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import math
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from itertools import islice
from typing import TYPE_CHECKING, Any

import orjson

from prefixrouter.gateway.decision_log import LogEntry, render
from prefixrouter.gateway.metrics import AGE_BUCKETS
from prefixrouter.gateway.state import GatewayState
from prefixrouter.stats import nearest_rank

if TYPE_CHECKING:
    from prefixrouter.gateway.workers import Worker

ALL = "*"
"""The class key of the all-classes aggregate."""
HITS = ("warm", "partial", "cold")
MAX_CLASSES = 8
"""Prefix classes kept apart per tick; rarer ones are counted as ``other``."""
PREFIX_MEMORY = 4096
"""(worker, prefix) pairs remembered for the prefix ranking (least recently served go)."""
TOP_PREFIXES = 5
LAG_RECENT = 512
"""Newest propagation lags the lag percentiles are taken over."""
SUBSCRIBER_QUEUE = 4
"""Snapshots a slow client may have pending; older ones are dropped for it."""
AGE_LABELS = (*(f"≤{b:g}s" for b in AGE_BUCKETS), f">{AGE_BUCKETS[-1]:g}s")
"""The eviction-age histogram's buckets, as the page labels them."""
WATCH_S = 300.0
"""How long the feed keeps working after its last viewer left (a reload finds its history)."""


def empty_agg() -> dict[str, Any]:
    """An aggregate of no decisions (the shape every class's figures share)."""
    return {
        "n": 0,
        "errors": 0,
        "reported": 0,  # decisions whose engine reported cached tokens
        "cached": 0,
        "uncached": 0,
        "predicted": 0,
        "actual": 0,
        "abs_error": 0,
        "abandoned": 0,
        "ttft": {h: [0.0, 0] for h in HITS},  # [sum ms, count]
        "wait": {},  # tier -> [sum ms, count] of the predicted queue wait
        "tiers": {},  # tier -> count
    }


def add_agg(into: dict[str, Any], other: dict[str, Any]) -> None:
    """Add ``other``'s counts to ``into``."""
    for k in ("n", "errors", "reported", "cached", "uncached", "predicted", "actual"):
        into[k] += other[k]
    into["abs_error"] += other["abs_error"]
    into["abandoned"] += other["abandoned"]
    for h in HITS:
        a, b = into["ttft"][h], other["ttft"][h]
        a[0] += b[0]
        a[1] += b[1]
    for tier, (s, c) in other["wait"].items():
        w = into["wait"].setdefault(tier, [0.0, 0])
        w[0] += s
        w[1] += c
    for tier, c in other["tiers"].items():
        into["tiers"][tier] = into["tiers"].get(tier, 0) + c


def _mean(pair: list[Any]) -> float | None:
    return round(pair[0] / pair[1], 3) if pair[1] else None


class DashboardFeed:
    """Builds the dashboard's snapshots and hands them to subscribers (see the module docstring).

    Args:
        state: The gateway's state.
        tick_s: Seconds between snapshots.
        window_ticks: Ticks summed for the bar views and the per-worker figures.
        history_ticks: Chart points kept for a client that connects.
        decisions_per_tick: Decision records sent per tick at most.
        watch_s: How long the feed keeps working after its last viewer.
    """

    def __init__(
        self,
        state: GatewayState,
        tick_s: float = 1.0,
        window_ticks: int = 60,
        history_ticks: int = 120,
        decisions_per_tick: int = 12,
        watch_s: float = WATCH_S,
    ) -> None:
        self.st = state
        self.watch_s = watch_s
        self._watched_until = 0.0
        self.tick_s = tick_s
        self.decisions_per_tick = decisions_per_tick
        self._window: deque[dict[str, dict[str, Any]]] = deque(maxlen=window_ticks)
        self._by_worker: deque[dict[str, list[int]]] = deque(maxlen=window_ticks)
        self._history: deque[dict[str, Any]] = deque(maxlen=history_ticks)
        self._recent: deque[dict[str, Any]] = deque(maxlen=4 * decisions_per_tick)
        self._evicted: deque[tuple[float, list[float], dict[str, float]]] = deque(
            maxlen=window_ticks + 1
        )
        self._unrouted: deque[dict[str, float]] = deque(maxlen=window_ticks + 1)
        self._prefixes: OrderedDict[tuple[str, str], list[Any]] = OrderedDict()
        self._class_counts: dict[str, int] = {}
        self._subscribers: set[asyncio.Queue[bytes | None]] = set()
        self._recorded = state.decisions.recorded
        self._requests = state.requests_seen
        self._cluster_counts = self._cluster_totals()
        self._last = time.monotonic()
        self._started = self._last
        self.latest: dict[str, Any] = {}
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None
        self.tick()

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Start ticking in the running loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="dashboard")

    async def stop(self) -> None:
        """Stop ticking and end every subscriber's stream."""
        self.close_subscribers()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def close_subscribers(self) -> None:
        """Tell every subscriber its stream ends (the server is shutting down)."""
        for q in self._subscribers:
            _offer(q, None)

    @property
    def watched(self) -> bool:
        """Someone has a stream open, or had one (or asked for a snapshot) within ``watch_s``."""
        return bool(self._subscribers) or time.monotonic() < self._watched_until

    def watch(self) -> None:
        """A viewer is here: keep working for ``watch_s``; after a pause, start afresh.

        An unwatched feed only keeps its counters current (:meth:`_skip`), so the
        window and the history it left behind are from before the pause: they
        are dropped rather than shown as the last minute. The prefix rankings
        and the decision list catch up from the decision log's ring.
        """
        if not self.watched:
            for kept in (self._window, self._by_worker, self._history, self._recent):
                kept.clear()
            self._evicted.clear()
            self._unrouted.clear()
            # The counters first: the records the catch-up takes from the ring are then
            # not counted (nor listed) a second time by the tick, whenever they finished.
            self._skip()
            self._catch_up()
            self.tick()
        self._watched_until = time.monotonic() + self.watch_s

    def _skip(self) -> None:
        """A tick nobody watches: move the counters on, aggregate nothing."""
        st = self.st
        self._recorded = st.decisions.recorded
        self._requests = st.requests_seen
        self._cluster_counts = self._cluster_totals()
        self._last = time.monotonic()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            if not self.watched:
                self._skip()
                continue
            self.tick()
            if self._subscribers:
                self._watched_until = time.monotonic() + self.watch_s
                data = sse_event("tick", self.latest)
                for q in self._subscribers:
                    _offer(q, data)

    def subscribe(self) -> asyncio.Queue[bytes | None]:
        """A queue that gets every tick's event (None: the stream ends)."""
        q: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=SUBSCRIBER_QUEUE)
        self.watch()
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[bytes | None]) -> None:
        """Forget a subscriber."""
        self._subscribers.discard(q)

    @property
    def subscribers(self) -> int:
        """Clients connected to the stream."""
        return len(self._subscribers)

    # -- the snapshot --------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        """What a client gets first: the latest snapshot plus the chart history."""
        return {**self.latest, "history": list(self._history), "recent": list(self._recent)}

    def tick(self) -> dict[str, Any]:
        """Read the state once and build the snapshot (also kept as :attr:`latest`)."""
        st = self.st
        now = time.monotonic()
        dt = max(now - self._last, 1e-6)
        self._last = now
        self.ticks += 1
        log = st.decisions
        made = log.recorded - self._recorded
        self._recorded = log.recorded
        entries = log.newest(made)
        seen = len(entries)
        requests = st.requests_seen - self._requests
        self._requests = st.requests_seen

        classes, by_worker = self._aggregate(entries)
        self._window.append(classes)
        self._by_worker.append(by_worker)
        window: dict[str, dict[str, Any]] = {}
        for tick in self._window:
            for cls, agg in tick.items():
                add_agg(window.setdefault(cls, empty_agg()), agg)
        scale = made / seen if seen else 1.0
        point = self._chart_point(classes, scale, dt)
        cluster = self._cluster(dt)
        if cluster is not None:
            point["lag_p99_ms"] = cluster["lag_ms"]["p99"]
        self._history.append(point)
        decisions = self._sample(entries)
        self._recent.extend(decisions)
        self.latest = {
            "v": 1,
            "t": round(time.time(), 3),
            "tick_s": self.tick_s,
            "gateway": {
                "replica": self._replica(),
                "policy": st.dispatch.policy_name,
                "mode": st.config.routing.mode,
                "uptime_s": round(now - self._started, 1),
                "requests": st.requests_seen,
                "requests_per_s": round(requests / dt, 2),
                "decisions_per_s": round(made / dt, 2),
                "decisions_made": made,
                "decisions_seen": seen,
                "decisions_shown": len(decisions),
                "subscribers": len(self._subscribers),
            },
            "classes": self._class_order(),
            "point": point,
            "window": {
                "ticks": len(self._window),
                "classes": window,
                "evictions": self._evictions(),
                "unrouted": self._unrouted_window(),
            },
            "workers": self._workers(),
            "drift": self._drift(),
            "cluster": cluster,
            "decisions": decisions,
        }
        return self.latest

    def _aggregate(
        self, entries: Iterable[LogEntry]
    ) -> tuple[dict[str, dict[str, Any]], dict[str, list[int]]]:
        """Per class (and ``"*"``) aggregates and per worker [n, cached, prompt] of a tick.

        One pass, counting each decision into its class only (``"*"`` is their
        sum): a tick of 1,000 decisions takes about 6 ms of the loop (median, 4 workers).
        """
        hit_label = self.st.metrics.hit_label
        counts = self._class_counts
        classes: dict[str, dict[str, Any]] = {}
        by_worker: dict[str, list[int]] = {}
        wall = time.time()
        for e in entries:
            cls = str(e.prefix_class)
            counts[cls] = counts.get(cls, 0) + 1
            agg = classes.get(cls)
            if agg is None:
                if len(classes) >= MAX_CLASSES:
                    cls = "other"
                    agg = classes.get(cls)
                if agg is None:
                    agg = classes[cls] = empty_agg()
            w = by_worker.get(e.worker_id)
            if w is None:
                w = by_worker[e.worker_id] = [0, 0, 0]
            w[0] += 1
            cached = _add_entry(agg, e, hit_label)
            if cached is None:
                continue
            w[1] += cached
            w[2] += e.outcome.prompt_tokens or 0
            if cached > 0:
                self._remember(e, cls, cached, wall)
        total = empty_agg()
        for agg in classes.values():
            add_agg(total, agg)
        classes[ALL] = total
        return classes, by_worker

    def _remember(self, e: LogEntry, cls: str, cached: int, wall: float) -> None:
        """Count a decision's reused tokens to its (worker, prefix) pair, most recent last."""
        prefixes = self._prefixes
        key = (e.worker_id, e.prefix_key)
        rec = prefixes.get(key)
        if rec is None:
            rec = prefixes[key] = [0, cls, 0, wall]
            if len(prefixes) > PREFIX_MEMORY:
                prefixes.popitem(last=False)
        else:
            prefixes.move_to_end(key)
        rec[0] += cached
        rec[2] += 1
        rec[3] = wall

    def _catch_up(self) -> None:
        """On waking: learn the prefixes and the newest decisions from the whole ring.

        The rates start from the wake (the ring holds no timing a window could
        use), but the workers' prefix rankings and the decision list need not.
        """
        backlog = self.st.decisions.newest(self.st.decisions.recorded)
        wall = time.time()
        for e in backlog:
            o = e.outcome
            actual, prompt = o.actual_cached_tokens, o.prompt_tokens
            if actual is not None and prompt is not None and o.status < 400:
                cached = min(actual, prompt)
                if cached > 0:
                    self._remember(e, str(e.prefix_class), cached, wall)
        replica = self._replica()
        for e in backlog[-(self._recent.maxlen or 0) :]:
            self._recent.append({**render(e), "replica": replica, "sampled_every": 1})

    def _replica(self) -> str | None:
        """This replica's id (None: a lone gateway)."""
        node = self.st.cluster
        return node.options.replica_id if node is not None else None

    def _class_order(self) -> list[str]:
        """Prefix classes seen, most frequent first (at most ``MAX_CLASSES``)."""
        ranked = sorted(self._class_counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return [c for c, _ in ranked[:MAX_CLASSES]]

    def _chart_point(
        self, classes: dict[str, dict[str, Any]], scale: float, dt: float
    ) -> dict[str, Any]:
        """The tick's figures for the time charts, per class: rates and means."""
        out: dict[str, Any] = {}
        for cls, agg in classes.items():
            out[cls] = {
                "n": agg["n"],
                "ttft_ms": [_mean(agg["ttft"][h]) for h in HITS],
                "cached_per_s": round(agg["cached"] * scale / dt, 1),
                "uncached_per_s": round(agg["uncached"] * scale / dt, 1),
                "predicted": agg["predicted"],
                "actual": agg["actual"],
            }
        return {"t": round(time.time(), 3), "scale": round(scale, 3), "classes": out}

    def _sample(self, entries: list[LogEntry]) -> list[dict[str, Any]]:
        """At most ``decisions_per_tick`` records, evenly spaced over the tick's, rendered."""
        if not entries:
            return []
        stride = math.ceil(len(entries) / self.decisions_per_tick)
        replica = self._replica()
        picked = entries[len(entries) - 1 :: -stride][::-1]  # the newest is always shown
        out = []
        for e in picked:
            rec = render(e)
            rec["replica"] = replica
            rec["sampled_every"] = stride
            out.append(rec)
        return out

    def _workers(self) -> list[dict[str, Any]]:
        st = self.st
        dispatch = st.dispatch
        window: dict[str, list[int]] = {}
        for tick in self._by_worker:
            for wid, (n, cached, prompt) in tick.items():
                acc = window.setdefault(wid, [0, 0, 0])
                acc[0] += n
                acc[1] += cached
                acc[2] += prompt
        held: dict[str, list[tuple[int, str, list[Any]]]] = {}
        for (wid, key), rec in self._prefixes.items():
            held.setdefault(wid, []).append((rec[0], key, rec))
        rows = []
        for w in st.registry.workers.values():
            n, cached, prompt = window.get(w.id, (0, 0, 0))
            e = w.engine
            prefixes: list[dict[str, Any]] = []
            for saved, key, rec in heapq.nlargest(
                4 * TOP_PREFIXES, held.get(w.id, []), key=lambda x: x[0]
            ):
                if len(prefixes) == TOP_PREFIXES:
                    break
                if not dispatch.holds_prefix(w.id, key):
                    continue
                prefixes.append(
                    {"key": key, "class": rec[1], "saved_tokens": saved, "hits": rec[2]}
                )
            rows.append(
                {
                    "id": w.id,
                    "url": w.url,
                    "pool": w.config.pool,
                    "healthy": w.routable,
                    "state": worker_state(w),
                    "in_flight": dispatch.load(w.id).in_flight + w.foreign,
                    "queue": e.waiting,
                    "running": e.running,
                    "kv_usage": round(e.kv_usage, 4),
                    "index_blocks": dispatch.index_blocks(w.id),
                    # The index's default until the engine's KV size is known: not a fact.
                    "index_capacity": dispatch.index_capacity(w.id) if w.kv_size_known else None,
                    "requests": n,
                    "cached_share": round(cached / prompt, 4) if prompt else None,
                    "engine_hit_rate": (
                        round(e.prefix_hits / e.prefix_queries, 4)
                        if e.prefix_queries and e.prefix_hits is not None
                        else None
                    ),
                    "prefixes": prefixes,
                    "last_error": w.last_error,
                }
            )
        return rows

    def _evictions(self) -> dict[str, Any]:
        """Observed evictions over the window, with the age of what was evicted, per class too.

        The age histogram is labelled by prefix class: the buckets shown are
        the sum over the classes, and ``by_class`` counts each class's
        evictions in the window.
        """
        m = self.st.metrics
        width = len(AGE_BUCKETS) + 1
        counts = [0.0] * width
        per_class: dict[str, float] = {}
        for key, hist in m.evicted_age.series.items():
            for i in range(width):
                counts[i] += hist[i]
            per_class[key[0] if key else "unknown"] = sum(hist[:width])
        self._evicted.append((float(m.observed_evictions), counts, per_class))
        first_total, first, first_class = self._evicted[0]
        mirrored = self.st.dispatch.evicted_entries
        by_class = {
            cls: int(n - first_class.get(cls, 0.0))
            for cls, n in sorted(per_class.items())
            if n - first_class.get(cls, 0.0) > 0
        }
        return {
            "observed": int(m.observed_evictions - first_total),
            "observed_total": m.observed_evictions,
            "mirrored_total": mirrored,
            "age_buckets": [[AGE_LABELS[i], int(c - first[i])] for i, c in enumerate(counts)],
            "by_class": by_class,
        }

    def _unrouted_window(self) -> dict[str, Any]:
        """Requests answered before routing over the window, by status.

        Read from ``prefixrouter_requests_total{decision="none"}``: such a
        request (a malformed body, a refused key, an unknown model, a tenant
        limit, no worker to take it) has no decision record, so the classes'
        ``errors`` never count it. ``total`` plus the classes' errors is the
        metric's error count over the same window.
        """
        now: dict[str, float] = {}
        for (_, decision, status), n in self.st.metrics.requests.values.items():
            if decision == "none":
                now[status] = now.get(status, 0.0) + n
        self._unrouted.append(now)
        first = self._unrouted[0]
        by_status = {
            status: int(n - first.get(status, 0.0))
            for status, n in sorted(now.items())
            if n - first.get(status, 0.0) > 0
        }
        return {
            "total": sum(by_status.values()),
            "by_status": by_status,
            "total_ever": int(sum(now.values())),
        }

    def _drift(self) -> dict[str, Any]:
        """The drift alarm's state per prefix class, from the gateway's own detector.

        ``exported`` is False when the alarm is off in the configuration
        (``drift.enabled``); ``classes`` are the classes it has seen, each
        with whether it fires (``prefixrouter_drift_alarm{prefix_class}``).
        """
        detector = self.st.fleet.drift
        if detector is None:
            return {"exported": False, "firing": False, "state": "off", "classes": []}
        states = detector.states()
        firing = sorted(c for c, on in states.items() if on)
        return {
            "exported": True,
            "firing": bool(firing),
            "state": "firing: " + ", ".join(firing) if firing else "no alarm",
            "classes": [{"prefix_class": c, "firing": on} for c, on in sorted(states.items())],
        }

    def _cluster_totals(self) -> tuple[int, int]:
        node = self.st.cluster
        return (0, 0) if node is None else (node.stats.published_facts, node.stats.applied_facts)

    def _cluster(self, dt: float) -> dict[str, Any] | None:
        node = self.st.cluster
        if node is None:
            return None
        published, applied = self._cluster_totals()
        before = self._cluster_counts
        self._cluster_counts = (published, applied)
        lags = sorted(islice(reversed(node.stats.lags), LAG_RECENT))
        lag_ms = {
            "p50": round(nearest_rank(lags, 0.5) * 1e3, 3) if lags else None,
            "p99": round(nearest_rank(lags, 0.99) * 1e3, 3) if lags else None,
            "max": round(lags[-1] * 1e3, 3) if lags else None,
            "samples": len(lags),
        }
        return {
            "replica": node.options.replica_id,
            "life": node.origin,  # replica@epoch: a restart is a new life
            "connected": node.connected,
            "ready": node.ready,
            "peers": [
                {
                    "replica": p.replica,
                    "life": p.origin,
                    "in_flight_here": self.st.dispatch.peer_inflight(p.origin),
                }
                for p in node.registry.live()
            ],
            "facts_published_per_s": round((published - before[0]) / dt, 2),
            "facts_applied_per_s": round((applied - before[1]) / dt, 2),
            "lag_ms": lag_ms,
        }


def _add_entry(agg: dict[str, Any], e: LogEntry, hit_label: Any) -> int | None:
    """Count one decision into an aggregate; return its cached tokens (None: not reported)."""
    o = e.outcome
    tier = e.tier
    agg["n"] += 1
    tiers = agg["tiers"]
    tiers[tier] = tiers.get(tier, 0) + 1
    status = o.status
    if status >= 400:
        agg["errors"] += 1
    if e.warm_abandoned:
        agg["abandoned"] += 1
    chosen = e.worker_id
    for c in e.candidates:
        if c.worker_id == chosen:
            terms = c.terms
            if terms is not None:
                w = agg["wait"].get(tier)
                if w is None:
                    w = agg["wait"][tier] = [0.0, 0]
                w[0] += terms.queue_wait_s * 1e3
                w[1] += 1
            break
    actual, prompt = o.actual_cached_tokens, o.prompt_tokens
    if actual is None or prompt is None or status >= 400:
        return None
    cached = actual if actual < prompt else prompt
    predicted = e.predicted_cached_tokens
    agg["reported"] += 1
    agg["cached"] += cached
    agg["uncached"] += prompt - cached
    agg["predicted"] += predicted
    agg["actual"] += actual
    agg["abs_error"] += abs(predicted - actual)
    if o.ttft_s is not None:
        t = agg["ttft"][hit_label(actual, prompt)]
        t[0] += o.ttft_s * 1e3
        t[1] += 1
    return cached


def worker_state(w: Worker) -> str:
    """One word for a worker: ``healthy`` exactly when :attr:`Worker.routable`, else why it is out.

    When several reasons hold, the one an operator acts on first is named:
    ``draining`` (asked for), ``down`` (health checks fail), ``ejected``
    (outlier ejection: its answers fail although its health checks pass),
    ``suspect`` (a timeout, being checked now), ``not ready`` (Kubernetes
    readiness).
    """
    if w.draining:
        return "draining"
    if not w.healthy:
        return "down"
    if w.ejected:
        return "ejected"
    if w.suspect:
        return "suspect"
    if not w.ready:
        return "not ready"
    return "healthy"


def _offer(q: asyncio.Queue[bytes | None], item: bytes | None) -> None:
    """Queue ``item`` for a subscriber, dropping its oldest pending one when full."""
    if q.full():
        with contextlib.suppress(asyncio.QueueEmpty):
            q.get_nowait()
    q.put_nowait(item)


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event (``event:`` and a single ``data:`` line of JSON)."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
