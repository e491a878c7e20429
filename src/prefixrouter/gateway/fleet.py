"""Fleet controls of one gateway: session affinity, one-class rollout, the drift alarm.

The routing core holds the pure parts (:mod:`prefixrouter.core.affinity`,
:mod:`prefixrouter.core.rollout`, :mod:`prefixrouter.core.drift`); this
module wires them to requests and exports what they do. Per request, the
proxy calls:

1. :meth:`FleetControls.steer` before routing: the rollout group (by prefix
   class, else by the hash of the session id or prefix key; the group's pool
   goes into the routing request, its policy into the
   :class:`~prefixrouter.core.router.Steering`), and, for the ``prefix``
   group, the session's pin from the ``affinity.header`` header (scoped per
   tenant; longer than :data:`MAX_SESSION_CHARS` is a 400);
2. :meth:`FleetControls.routed` on the first attempt's decision (counts the
   pin's fate);
3. :meth:`FleetControls.completed` when the request ends: the pin moves to
   the worker that served the turn; the group's figures are counted; the
   predicted (:func:`index_claim`) and engine-reported cached tokens go to
   the drift detector, and
   a class whose alarm fires gets one warning line: the class, the template
   version and the first divergent position (where the engine's reuse ended,
   and what the routed prompt holds there: a volatile field the linter's
   scanner finds, or none, which points at text the gateway never sees).

Series (read when ``/metrics`` is scraped):

* ``prefixrouter_affinity_total{result}``: requests with a session id:
  ``hit`` (kept on its worker), ``new`` (no pin yet) or why the pin broke
  (``down``, ``filtered``, ``evicted``, ``overloaded``);
  ``prefixrouter_affinity_sessions``: pins held;
* ``prefixrouter_rollout_requests_total{group,prefix_class}``,
  ``prefixrouter_rollout_ttft_seconds{group}`` (streams) and
  ``prefixrouter_rollout_input_tokens_total{group,kind}`` (``cached`` /
  ``uncached``), with a rollout;
* ``prefixrouter_drift_alarm{prefix_class}`` (1 firing, 0 clear; every class
  from the start) and ``prefixrouter_drift_alarms_total{prefix_class}``;
* ``prefixrouter_fleet_controls{control}``: 1 for each control that is on.

Every family is exported whether its control is on or not (without samples
when off), so dashboards and the metric reference find them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixrouter.core.affinity import BREAK_REASONS, HIT, SessionTable
from prefixrouter.core.dispatch import Dispatcher
from prefixrouter.core.drift import DriftChange, DriftDetector, DriftParams
from prefixrouter.core.hashing import PromptBlocks
from prefixrouter.core.policy import create_policy
from prefixrouter.core.rollout import GROUPS, PREFIX_GROUP, RolloutPlan
from prefixrouter.core.router import Decision, Steering
from prefixrouter.core.types import PrefixClass
from prefixrouter.gateway.config import GatewayConfig
from prefixrouter.gateway.errors import BadRequest
from prefixrouter.gateway.metrics import TTFT_BUCKETS, _Counter, _Histogram
from prefixrouter.gateway.request_builder import BuiltRequest
from prefixrouter.prompt.lint import scan_volatile

log = logging.getLogger("prefixrouter.gateway")

MAX_SESSION_CHARS = 256
NEW = "new"
"""A session id without a pin yet."""
_SCAN_BEFORE, _SCAN_AFTER = 256, 512
"""Characters around the first divergent position searched for a volatile field."""


@dataclass(slots=True)
class Steer:
    """What :meth:`FleetControls.steer` decided for one request.

    Attributes:
        steering: For ``Dispatcher.admit`` (None: route as without controls).
        session: The tenant-scoped session key (None: no session id).
        group: The rollout group (None: no rollout).
        blocks: The prompt's hashes when the group needed its prefix key.
    """

    steering: Steering | None = None
    session: str | None = None
    group: str | None = None
    blocks: PromptBlocks | None = None


MISCOUNTS_TO_WARN = 8
"""Prompts in a row an engine counts otherwise before the tokenizer warning."""


def miscounted(router_tokens: int, engine_tokens: int) -> bool:
    """Whether two counts of one prompt differ past a special token or two: by more than
    8 tokens and 2 % (a begin-of-text token the template leaves to the engine is not a
    mismatch; another tokenizer differs by tens of percent)."""
    return abs(router_tokens - engine_tokens) > max(8, 0.02 * max(router_tokens, engine_tokens))


class FleetControls:
    """Affinity, rollout and drift state of one gateway (module docstring)."""

    def __init__(self, config: GatewayConfig, dispatch: Dispatcher) -> None:
        self._dispatch = dispatch
        a = config.affinity
        self.session_header: str | None = a.header if a.enabled else None
        self.sessions = SessionTable(a.max_sessions, a.min_cached_share, max_wait_s=a.max_wait_s)
        r = config.rollout
        self.plan: RolloutPlan | None = None
        if r.enabled:
            self.plan = RolloutPlan(
                frozenset(r.classes), r.share, r.baseline_policy, r.prefix_pool, r.baseline_pool,
                r.seed,
            )  # fmt: skip
            dispatch.add_policy(create_policy(r.baseline_policy))
        d = config.drift
        self.drift: DriftDetector | None = None
        if d.enabled:
            self.drift = DriftDetector(
                DriftParams(
                    d.min_tokens, d.rel_tolerance, d.window, d.min_samples, d.fire_share,
                    d.clear_after,
                )
            )  # fmt: skip
        self._miscounts: dict[str, int] = {}  # worker -> prompts miscounted in a row
        self._miscount_warned: set[str] = set()
        self.affinity = _Counter(
            "prefixrouter_affinity",
            "Requests naming a session: hit (kept on its worker), new, or why the pin broke.",
            ("result",),
        )
        self.group_requests = _Counter(
            "prefixrouter_rollout_requests",
            "Finished requests by rollout group (prefix: routed by prefix; baseline).",
            ("group", "prefix_class"),
        )
        self.group_tokens = _Counter(
            "prefixrouter_rollout_input_tokens",
            "Prompt tokens by rollout group, cached (engine-reused) or uncached.",
            ("group", "kind"),
        )
        self.group_ttft = _Histogram(
            "prefixrouter_rollout_ttft_seconds",
            "Time to first token of streamed requests by rollout group.",
            ("group",),
            TTFT_BUCKETS,
        )
        self.alarms = _Counter(
            "prefixrouter_drift_alarms",
            "Drift alarms fired (predicted cached tokens the engines did not deliver).",
            ("prefix_class",),
        )

    # ------------------------------------------------------------- per request

    def steer(self, session_id: str | None, built: BuiltRequest) -> Steer:
        """The request's group, pool, policy and pin (module docstring, step 1).

        Raises:
            BadRequest: The session id is longer than :data:`MAX_SESSION_CHARS`.
        """
        out = Steer()
        if session_id and self.session_header is not None:
            if len(session_id) > MAX_SESSION_CHARS:
                raise BadRequest(
                    f"{self.session_header} is {len(session_id)} characters; "
                    f"at most {MAX_SESSION_CHARS}",
                    code="invalid_header",
                    param=self.session_header,
                )
            out.session = f"{built.routing.tenant}\x00{session_id}"
        rr = built.routing
        plan = self.plan
        if plan is not None:
            key = ""
            if plan.needs_key:
                if out.session is not None:
                    key = out.session
                else:
                    blocks = built.blocks
                    if blocks is None:
                        blocks = out.blocks = self._dispatch.hash(rr)
                    key = self._dispatch.prefix_key(rr, blocks)
            group = out.group = plan.group(str(rr.prefix_class), key)
            pool = plan.pool(group)
            if pool is not None:
                rr.pool = pool
            if group != PREFIX_GROUP:
                out.steering = Steering(plan.baseline_policy)
                return out  # the baseline group is routed as without prefixrouter: no pin
        pin = self.sessions.pin_for(out.session) if out.session is not None else None
        if pin is not None:
            out.steering = Steering(pin=pin)
        return out

    def routed(self, steer: Steer, decision: Decision) -> None:
        """The first attempt's decision: count what became of the session's pin."""
        if steer.session is None or steer.group not in (None, PREFIX_GROUP):
            return
        self.affinity.inc((decision.affinity or NEW,))

    def completed(
        self,
        steer: Steer,
        built: BuiltRequest,
        decision: Decision,
        ok: bool,
        prompt: int | None,
        cached: int | None,
        ttft_s: float | None,
    ) -> None:
        """The request ended (module docstring, step 3)."""
        if ok and steer.session is not None and steer.group in (None, PREFIX_GROUP):
            self.sessions.pin(steer.session, decision.worker_id, prompt or decision.prompt_tokens)
        group = steer.group
        if group is not None:
            self.group_requests.inc((group, decision.prefix_class))
            if ok and prompt and cached is not None:
                reused = min(cached, prompt)
                self.group_tokens.inc((group, "cached"), reused)
                self.group_tokens.inc((group, "uncached"), prompt - reused)
            if ttft_s is not None:
                self.group_ttft.observe((group,), ttft_s)
        if ok and prompt and built.routing.tokens is not None:
            self._check_token_count(decision, prompt)
        if self.drift is not None and ok and cached is not None:
            cls = decision.prefix_class
            change = self.drift.observe(cls, index_claim(decision), cached)
            if change is not None:
                if change.firing:
                    self.alarms.inc((cls,))
                self._log_change(change, built, prompt)

    def _check_token_count(self, decision: Decision, engine_tokens: int) -> None:
        """Token mode: say once per worker when its engine counts the prompts otherwise.

        The router tokenizes each prompt with ``routing.tokenizer`` and its
        chat template; an engine that counts :data:`MISCOUNTS_TO_WARN` prompts
        in a row more than :func:`miscounted` allows apart from the router
        uses another tokenizer or template: its blocks are not the router's,
        and every prediction of reuse on it is off. (The drift alarm sees
        only predictions the engine fell short of; an engine with a smaller
        vocabulary reuses no less, it reuses other blocks.)
        """
        worker = decision.worker_id
        if worker in self._miscount_warned:
            return
        if not miscounted(decision.prompt_tokens, engine_tokens):
            self._miscounts.pop(worker, None)
            return
        n = self._miscounts.get(worker, 0) + 1
        self._miscounts[worker] = n
        if n >= MISCOUNTS_TO_WARN:
            self._miscount_warned.add(worker)
            log.warning(
                "worker %s counted %d prompt tokens where the router counted %d (and so "
                "for %d prompts in a row): its tokenizer or chat template is not "
                "routing.tokenizer's, so the router's blocks are not its blocks and its "
                "predicted reuse is off; point routing.tokenizer at the served model's folder",
                worker,
                engine_tokens,
                decision.prompt_tokens,
                n,
            )

    # ------------------------------------------------------------- the alarm's line

    def _log_change(self, change: DriftChange, built: BuiltRequest, prompt: int | None) -> None:
        version = built.routing.namespace.template_version or "(none)"
        cls = change.prefix_class
        if not change.firing:
            log.info(
                "drift alarm cleared for prefix class %r (template version %r): "
                "predicted and engine-reported cached tokens agree again",
                cls,
                version,
            )
            return
        log.warning(
            "drift alarm firing for prefix class %r (template version %r): %d of the last %d "
            "requests the index predicted warm got fewer cached tokens (last: the index said "
            "%d, the engine reused %d); first divergent position: %s",
            cls,
            version,
            change.divergent,
            change.samples,
            change.predicted,
            change.actual,
            divergent_position(built, change.actual, prompt),
        )

    # ------------------------------------------------------------- export

    def collector(self) -> Collector:
        """The scrape-time collector of every series above."""
        return _FleetCollector(self)


def index_claim(decision: Decision) -> int:
    """The prompt tokens the index said the chosen worker holds, before trust.

    Not the decision's prediction: after two unexplained misses on a worker
    the index distrusts it and predicts cold, which then agrees with the
    engine while the cause (text the router does not see) stays. What the
    hash chain claims keeps disagreeing, so the drift stays visible. A
    decision without candidate records (a cache-blind policy) claims its
    prediction.
    """
    chosen = decision.chosen
    if chosen is None:
        return decision.predicted_cached_tokens
    return max(chosen.matched_tokens, decision.predicted_cached_tokens)


def divergent_position(built: BuiltRequest, actual: int, prompt: int | None) -> str:
    """Where the engine's view parted from the router's, in words.

    The engine reused ``actual`` tokens: the first divergent token is within
    the block after them. In the routed prompt's text (token positions at the
    request's own characters per token) the linter's scanner looks around
    that point for a volatile field; finding none means the engine sees text
    the router does not (a field its chat template writes, another tokenizer).
    """
    where = f"token {actual}"
    rendered = built.prompt
    if rendered is None or not prompt:
        return f"{where} (a prompt of token ids: no text to scan)"
    text = rendered.text
    char = min(len(text), int(actual * len(text) / prompt))
    where += f" (char ~{char} of {len(text)})"
    found = scan_volatile(text, max(0, char - _SCAN_BEFORE), min(len(text), char + _SCAN_AFTER))
    if found:
        m = found[0]
        return f"{where}: a volatile {m.kind} at char {m.start}: {text[m.start : m.end]!r}"
    return (
        f"{where}: the routed prompt holds no volatile field there, so either the engine no "
        "longer holds the prefix the index lists (evicted: compare "
        'prefixrouter_kv_evictions_total{source="observed"}) or it sees tokens the router does '
        "not (a field its chat template writes, a tokenizer mismatch)"
    )


class _FleetCollector(Collector):
    """Every family always (a dashboard finds them); zero samples for the controls that are on."""

    def __init__(self, fleet: FleetControls) -> None:
        self._f = fleet

    def collect(self) -> Iterator[Metric]:
        f = self._f
        if f.session_header is not None:
            for result in (HIT, NEW, *BREAK_REASONS):
                f.affinity.values.setdefault((result,), 0.0)
        yield f.affinity.family()
        yield GaugeMetricFamily(
            "prefixrouter_affinity_sessions",
            "Sessions pinned to a worker (bounded, least recently used dropped).",
            value=float(len(f.sessions)),
        )
        if f.plan is not None:
            for group in GROUPS:
                for kind in ("cached", "uncached"):
                    f.group_tokens.values.setdefault((group, kind), 0.0)
        yield f.group_requests.family()
        yield f.group_tokens.family()
        yield f.group_ttft.family()
        gauge = GaugeMetricFamily(
            "prefixrouter_drift_alarm",
            "1 while predicted and engine-reported cached tokens diverge for the class.",
            labels=["prefix_class"],
        )
        if f.drift is not None:
            states = f.drift.states()
            for cls in sorted({c.value for c in PrefixClass} | set(states)):
                gauge.add_metric([cls], 1.0 if states.get(cls) else 0.0)
        yield gauge
        yield f.alarms.family()
        yield _controls_info(f)


def _controls_info(f: FleetControls) -> Metric:
    fam = GaugeMetricFamily(
        "prefixrouter_fleet_controls", "1 for each fleet control that is on.", labels=["control"]
    )
    fam.add_metric(["affinity"], 1.0 if f.session_header is not None else 0.0)
    fam.add_metric(["rollout"], 1.0 if f.plan is not None else 0.0)
    fam.add_metric(["drift"], 1.0 if f.drift is not None else 0.0)
    return fam
