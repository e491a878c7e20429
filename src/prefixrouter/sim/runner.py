"""Run a scenario under several policies on the same fleet and the same requests.

Load is a fraction of the fleet's **capacity**, defined as the requests per
second the fleet could serve if every request prefilled only what the lower
bound says it must (each reusable prefix computed once, see
:func:`~prefixrouter.sim.report.first_seen_prefill`) and decoded in batches of
``REFERENCE_BATCH``::

    service(r)   = prefill_time(new_r, context=prompt_r - new_r)
                 + output_r * decode_step_time(B, B * (prompt_r + output_r / 2)) / B
    capacity_rps = workers / mean(service)

So load 0.9 is close to saturation for a router that reuses every prefix
once, and beyond saturation for one that recomputes prefixes: the regime in
which routing decides the outcome. On ``unique`` (nothing to reuse) it is the
plain cold capacity. Trace replays keep their own times unless a load or a
rate is given; then their clock, from the first arrival to the last, is
stretched to that mean rate, keeping the trace's own burstiness.

The capacity, the report's prefill bound and its TTFT floor all read one scan
of the prompts (:func:`~prefixrouter.sim.report.first_seen`, which hashes
every one): :func:`plan` keeps the scan it made in the plan
(:attr:`RunPlan.first_seen`), so that a caller reuses it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefixrouter.core.dispatch import RoutingMode
from prefixrouter.core.policy import create_policy
from prefixrouter.errors import ConfigError
from prefixrouter.sim.cluster import ClusterConfig, SimRun, Simulation
from prefixrouter.sim.profiles import EngineProfile
from prefixrouter.sim.report import FirstSeen, first_seen, first_seen_prefill, summarize
from prefixrouter.sim.text import TextRenderer
from prefixrouter.sim.workload import SimRequest, Workload

REFERENCE_BATCH = 32


class RequestTooLarge(ConfigError):
    """A request whose prompt and output could never fit one engine's KV cache.

    The engine model refuses such a request when it arrives (vLLM refuses it
    at its API, via ``max_model_len``); :func:`plan` finds it before any
    policy runs. The attributes let a caller name the option to change.

    Attributes:
        request: The first request of the workload that does not fit.
        kv_blocks: The engines' KV cache in blocks.
        block_size: Tokens per block.
        source: Where ``kv_blocks`` came from: ``"kv_blocks"`` (the caller),
            ``"scenario"`` (the workload's default) or ``"profile"``.
    """

    def __init__(
        self, request: SimRequest, kv_blocks: int, block_size: int, source: str = "kv_blocks"
    ) -> None:
        self.request, self.kv_blocks, self.block_size = request, kv_blocks, block_size
        self.source = source
        super().__init__(
            f"request {request.request_id} needs {self.needed_tokens:,} tokens "
            f"({request.prompt_tokens:,} prompt + {request.output_tokens:,} output), "
            f"the KV cache holds {self.capacity_tokens:,} ({kv_blocks:,} blocks of {block_size})"
        )

    @property
    def needed_tokens(self) -> int:
        """Prompt plus output tokens of the request."""
        return self.request.prompt_tokens + self.request.output_tokens

    @property
    def capacity_tokens(self) -> int:
        """Tokens the KV cache holds."""
        return self.kv_blocks * self.block_size


def check_fits(workload: Workload, profile: EngineProfile, kv_blocks: int | None = None) -> None:
    """Refuse a workload with a request that no engine's KV cache can hold.

    The same test as :meth:`prefixrouter.sim.engine.EngineModel.submit`'s, so
    that a run never stops halfway through on it. ``kv_blocks``: as
    :func:`plan` takes it (None: the workload's default, else the profile's).

    Raises:
        RequestTooLarge: Naming the first such request.
    """
    if kv_blocks is not None:
        blocks, source = kv_blocks, "kv_blocks"
    elif workload.default_kv_blocks is not None:
        blocks, source = workload.default_kv_blocks, "scenario"
    else:
        blocks, source = profile.kv_blocks, "profile"
    bs = profile.block_size
    for req in workload.requests:
        if -(-(req.prompt_tokens + req.output_tokens) // bs) > blocks:
            raise RequestTooLarge(req, blocks, bs, source)


def capacity_rps(
    workload: Workload, profile: EngineProfile, workers: int, seen: FirstSeen | None = None
) -> float:
    """Requests per second the fleet serves with ideal prefix reuse (module doc).

    ``seen``: the workload's scan, if the caller has it (None: scanned here).
    """
    speed = profile.speed
    new = first_seen_prefill(workload, seen)
    b = min(REFERENCE_BATCH, profile.max_num_seqs)
    total = 0.0
    for req, fresh in zip(workload.requests, new, strict=True):
        ctx = req.prompt_tokens + req.output_tokens / 2
        per_token = speed.decode_step_time(b, b * ctx) / b
        total += speed.prefill_time(fresh, req.prompt_tokens - fresh)
        total += req.output_tokens * per_token
    mean = total / max(1, len(workload.requests))
    return workers / mean if mean > 0 else math.inf


@dataclass(frozen=True, slots=True)
class Replicas:
    """Router replicas in front of the fleet (see :mod:`prefixrouter.sim.cluster`).

    Attributes:
        routers: How many (arrivals go to them round robin).
        sync: Deliver each replica's routing facts to the others.
        lag_s: Seconds from a fact's recording to its application at the peers
            (none applies without ``sync``: the replicas share nothing to delay).
    """

    routers: int = 1
    sync: bool = True
    lag_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The report's ``replicas`` field: the lag that applied (0 without sync)."""
        lag_ms = self.lag_s * 1e3 if self.sync else 0.0
        return {"routers": self.routers, "sync": self.sync, "sync_lag_ms": lag_ms}


ONE_ROUTER = Replicas()


@dataclass(frozen=True, slots=True)
class RunPlan:
    """One scenario at one load on one fleet, for every policy in ``policies``."""

    workload: Workload
    profile: EngineProfile
    workers: int
    kv_blocks: int | None
    policies: Sequence[str]
    rate: float | None  # requests per second; None for fixed-time traces
    load: float | None  # fraction of capacity; None when a rate was given or trace times
    kv_events: bool = False
    mode: RoutingMode = "token"
    replicas: Replicas = ONE_ROUTER
    token_count: bool = True
    client_max_tokens: int = 0
    first_seen: FirstSeen | None = None
    """The scan made for the capacity (a load), of the workload's requests; None if none was."""


class RateError(ConfigError):
    """A load or rate that gives no usable arrival rate (an overflow to infinity).

    Attributes:
        option: ``"load"`` or ``"rate"``: the argument to change.
        value: Its value.
    """

    def __init__(self, option: str, value: float, message: str) -> None:
        self.option, self.value = option, value
        super().__init__(message)


def plan(
    workload: Workload,
    profile: EngineProfile,
    policies: Sequence[str],
    *,
    workers: int | None = None,
    kv_blocks: int | None = None,
    load: float | None = None,
    rate: float | None = None,
    kv_events: bool = False,
    mode: RoutingMode = "token",
    replicas: Replicas = ONE_ROUTER,
    token_count: bool = True,
    client_max_tokens: int = 0,
    scan: Callable[[Workload], FirstSeen] = first_seen,
) -> RunPlan:
    """Resolve defaults and the arrival rate; returns the plan with a scaled workload.

    ``rate`` overrides ``load`` (the plan's ``load`` is then None).
    ``replicas`` does not change the rate: the load is the engines' (the
    same fleet, whatever number of routers spreads the traffic over it).
    ``token_count``: text mode's engine count of a new prefix
    (:attr:`~prefixrouter.sim.cluster.ClusterConfig.token_count`);
    ``client_max_tokens``: the cap clients send
    (:attr:`~prefixrouter.sim.cluster.ClusterConfig.client_max_tokens`).
    ``scan``: how to make the first-seen scan that a load needs (the command
    line's shows progress); the plan keeps it.

    Raises:
        RequestTooLarge: A request does not fit the engines' KV cache.
        RateError: The load or rate gives no finite arrival rate or times.
        ValueError: A bad argument.
        KeyError: An unknown policy.
    """
    n = workers or workload.default_workers
    kv = kv_blocks if kv_blocks is not None else workload.default_kv_blocks
    # Fail early on bad arguments.
    _config(n, profile, kv, kv_events, mode, replicas, token_count, client_max_tokens)
    for name in policies:
        create_policy(name)  # fail early, naming the policy
    check_fits(workload, profile, kv_blocks)
    if rate is not None:
        load = None  # a rate overrides the load: the plan records what applies
        if not (rate > 0 and math.isfinite(rate)):
            raise RateError("rate", rate, "expected a positive finite number of requests/s")
    elif load is None and workload.fixed_times:  # a trace at its own times
        return RunPlan(
            workload, profile, n, kv, policies, None, None, kv_events, mode, replicas,
            token_count, client_max_tokens,
        )  # fmt: skip
    seen = None
    if rate is None:
        load = 0.6 if load is None else load
        seen = scan(workload)
        rate = _rate(load, capacity_rps(workload, profile, n, seen))
    try:
        # A trace keeps its own burstiness: only its clock is stretched to the rate.
        timed = workload.stretched(rate) if workload.fixed_times else workload.scaled(rate)
    except ValueError as exc:  # times past a float's range (a tiny rate)
        raise _times_error(load, rate, exc) from None
    return RunPlan(
        timed, profile, n, kv, policies, rate, load, kv_events, mode, replicas,
        token_count, client_max_tokens, seen,
    )  # fmt: skip


def _rate(load: float, capacity: float) -> float:
    """``load`` times the capacity, refused when that is no finite rate.

    Raises:
        RateError: Naming the load.
    """
    rate = load * capacity
    if not (rate > 0 and math.isfinite(rate)):
        raise RateError("load", load, f"the arrival rate it gives ({rate:g} req/s) is not finite")
    return rate


def _times_error(load: float | None, rate: float, cause: ValueError) -> RateError:
    """The :class:`RateError` for arrival times that overflowed at ``rate``: naming the
    load when the rate came from one."""
    option, value = ("load", load) if load is not None else ("rate", rate)
    return RateError(option, value, f"the arrival times it gives are not finite ({cause})")


def _config(
    workers: int,
    profile: EngineProfile,
    kv_blocks: int | None,
    kv_events: bool,
    mode: RoutingMode,
    replicas: Replicas,
    token_count: bool = True,
    client_max_tokens: int = 0,
) -> ClusterConfig:
    return ClusterConfig(
        workers,
        profile,
        kv_blocks,
        kv_events,
        mode=mode,
        routers=replicas.routers,
        sync=replicas.sync,
        sync_lag_s=replicas.lag_s,
        token_count=token_count,
        client_max_tokens=client_max_tokens,
    )


def run_plan(
    p: RunPlan,
    *,
    on_start: Callable[[str, int], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> tuple[list[dict[str, Any]], list[SimRun]]:
    """Simulate every policy of the plan; returns their summaries and raw runs."""
    results: list[dict[str, Any]] = []
    runs: list[SimRun] = []
    config = _config(
        p.workers, p.profile, p.kv_blocks, p.kv_events, p.mode, p.replicas, p.token_count,
        p.client_max_tokens,
    )  # fmt: skip
    # Text mode: one renderer for every policy, so each shared segment is rendered once.
    renderer = TextRenderer(p.workload.requests) if p.mode == "text" else None
    for name in p.policies:
        if on_start is not None:
            on_start(name, len(p.workload.requests))
        sim = Simulation(p.workload, config, name, on_progress=on_progress, renderer=renderer)
        run = sim.run()
        runs.append(run)
        results.append(summarize(run))
    return results, runs
