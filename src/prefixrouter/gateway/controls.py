"""Per-tenant limits and priority on live requests, and their per-tenant metrics.

The rules are :mod:`prefixrouter.gateway.limits`'s; this module applies them
in the proxy, once a request's tenant is known from its key, and before it is
routed:

1. **priority**: the tenant's ``priority``; a request's ``X-Priority`` header
   (an integer from -100 to 100) may lower it, never raise it above the
   tenant's (a client cannot promote itself); a header that is no such
   integer is a 400 naming ``X-Priority``;
2. **tenant limits**: over ``max_in_flight`` or ``requests_per_s`` -> 429
   ``too_many_in_flight`` / ``rate_limit_exceeded`` with ``Retry-After``;
3. **overload**: with ``overload.max_in_flight`` set and that many requests
   in the gateway, the request waits in the priority queue
   (:class:`~prefixrouter.gateway.limits.WaitQueue`); shed (queue full, or
   waited past ``overload.max_wait_s``) -> 503 ``overloaded`` with
   ``Retry-After``. A client that leaves while waiting leaves the queue.

Steps 1 and 2 need the headers only and run before the body is read (a
refused request costs no parse); step 3 runs once the body is validated.

A capacity of ``"slots"`` with no routable worker (or any capacity that is
not a positive number) lets requests through to routing, which answers the
usual 503 ``no_healthy_worker``: a queue would only delay that answer.

Metrics (never labelled by API key; ``tenant`` is the resolved tenant, ``""``
anonymous; past :data:`TENANT_LABELS_MAX` distinct tenants the rest share
``tenant="_other"``, so a trusted ``X-Tenant`` cannot grow the series without
bound)::

    prefixrouter_tenant_requests_total{tenant,status}
    prefixrouter_tenant_rejected_total{tenant,reason}   max_in_flight | rate
                                                        | queue_full | queue_timeout
    prefixrouter_tenant_in_flight{tenant}               admitted, not finished
    prefixrouter_tenant_waiting{tenant}                 in the overload queue
    prefixrouter_tenant_ttft_seconds{tenant}            streamed requests
    prefixrouter_tenant_queue_wait_seconds{tenant}      time in the overload queue
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixrouter.gateway.config import OTHER_TENANTS, GatewayConfig, TenantRule
from prefixrouter.gateway.errors import BadRequest, Overloaded, TooManyRequests
from prefixrouter.gateway.limits import Refusal, TenantLimit, TenantLimiter, WaitQueue
from prefixrouter.gateway.metrics import (
    TTFT_BUCKETS,
    WAIT_BUCKETS,
    LabelledCounter,
    LabelledHistogram,
)

PRIORITY_HEADER = "X-Priority"
PRIORITY_MIN, PRIORITY_MAX = -100, 100
TENANT_LABELS_MAX = 64


def _limit(rule: TenantRule) -> TenantLimit:
    return TenantLimit(rule.max_in_flight, rule.requests_per_s, rule.burst)


def request_priority(tenant_priority: int, header: str | None) -> int:
    """A request's priority: the tenant's, or lower where ``X-Priority`` says so.

    Raises:
        BadRequest: The header is not an integer from -100 to 100.
    """
    if header is None:
        return tenant_priority
    text = header.strip()
    body = text[1:] if text[:1] in "+-" else text
    if not body.isascii() or not body.isdigit() or len(body) > 3:
        raise BadRequest(
            f"{PRIORITY_HEADER} must be an integer from {PRIORITY_MIN} to {PRIORITY_MAX}",
            code="invalid_priority",
            param=PRIORITY_HEADER,
        )
    value = int(text)
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise BadRequest(
            f"{PRIORITY_HEADER} must be an integer from {PRIORITY_MIN} to {PRIORITY_MAX}",
            code="invalid_priority",
            param=PRIORITY_HEADER,
        )
    return min(value, tenant_priority)


@dataclass(slots=True, eq=False)
class Ticket:
    """An admitted request: what :meth:`TenantControls.release` gives back.

    Attributes:
        tenant: Its tenant.
        priority: Its priority.
        waited_s: Time it spent in the overload queue.
        slot: It holds one of the gateway's overload slots.
    """

    tenant: str
    priority: int
    waited_s: float = 0.0
    slot: bool = False


@dataclass(slots=True, eq=False)
class _Waiter:
    tenant: str
    future: asyncio.Future[Refusal | None] = field(repr=False)


class TenantMetrics(Collector):
    """The per-tenant series (module docstring); counters kept as plain dicts."""

    def __init__(
        self,
        in_flight: Callable[[], dict[str, int]],
        waiting: Callable[[], dict[str, int]],
    ) -> None:
        self._in_flight = in_flight
        self._waiting = waiting
        self._labels: dict[str, str] = {}
        self.requests = LabelledCounter(
            "prefixrouter_tenant_requests",
            "Completion requests by tenant and HTTP status.",
            ("tenant", "status"),
        )
        self.rejected = LabelledCounter(
            "prefixrouter_tenant_rejected",
            "Requests refused by a tenant limit (429) or shed under overload (503), by reason.",
            ("tenant", "reason"),
        )
        self.ttft = LabelledHistogram(
            "prefixrouter_tenant_ttft_seconds",
            "Time to first token of streamed requests, by tenant.",
            ("tenant",),
            TTFT_BUCKETS,
        )
        self.queue_wait = LabelledHistogram(
            "prefixrouter_tenant_queue_wait_seconds",
            "Time requests waited in the overload queue, by tenant.",
            ("tenant",),
            WAIT_BUCKETS,
        )

    def label(self, tenant: str) -> str:
        """The ``tenant`` label of a tenant (bounded: see the module docstring)."""
        label = self._labels.get(tenant)
        if label is None:
            label = tenant if len(self._labels) < TENANT_LABELS_MAX else OTHER_TENANTS
            if label != OTHER_TENANTS:
                self._labels[tenant] = label
        return label

    def collect(self) -> Iterator[Metric]:
        for series in (self.requests, self.rejected, self.ttft, self.queue_wait):
            yield series.family()
        for name, doc, values in (
            (
                "prefixrouter_tenant_in_flight",
                "Requests admitted and not finished.",
                self._in_flight(),
            ),
            ("prefixrouter_tenant_waiting", "Requests in the overload queue.", self._waiting()),
        ):
            fam = GaugeMetricFamily(name, doc, labels=["tenant"])
            summed: dict[str, int] = {}
            for tenant, n in values.items():
                key = self.label(tenant)
                summed[key] = summed.get(key, 0) + n
            for label, n in sorted(summed.items()):
                fam.add_metric([label], float(n))
            yield fam


class TenantControls:
    """Limits, priority and the overload queue of one gateway (module docstring).

    Args:
        config: The gateway configuration.
        routable_slots: The routable workers' ``max_slots`` summed (for ``"slots"``).
        clock: Monotonic seconds.
    """

    def __init__(
        self, config: GatewayConfig, routable_slots: Callable[[], int], clock: Callable[[], float]
    ) -> None:
        self.config = config
        self._clock = clock
        self._slots = routable_slots
        self._rules = config.tenants
        self._default = config.default_tenant
        self.limiter = TenantLimiter(
            {t: _limit(r) for t, r in config.tenants.items()},
            _limit(config.default_tenant),
            config.proxy.retry_after_s,
        )
        ov = config.overload
        self._capacity_setting = ov.max_in_flight
        self._max_wait_s = ov.max_wait_s
        self._retry_after = config.proxy.retry_after_s
        self.queue: WaitQueue[_Waiter] = WaitQueue(ov.aging_s, ov.max_queue)
        self.in_flight = 0  # requests holding an overload slot
        self.metrics = TenantMetrics(self.limiter.in_flight, self._waiting)

    def _waiting(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for w in self.queue.items():
            out[w.tenant] = out.get(w.tenant, 0) + 1
        return out

    def capacity(self) -> int | None:
        """Requests the gateway holds before newcomers wait (None: no queue)."""
        setting = self._capacity_setting
        if setting is None:
            return None
        cap = self._slots() if setting == "slots" else setting
        return cap if cap > 0 else None

    def priority(self, tenant: str, header: str | None) -> int:
        """The request's priority (:func:`request_priority` with the tenant's rule)."""
        return request_priority(self._rules.get(tenant, self._default).priority, header)

    def acquire(self, tenant: str, priority_header: str | None) -> Ticket:
        """Admit one request of ``tenant`` past its limits (from its headers alone).

        Called before the body is read, so a refused request costs no parse.
        The ticket must be given back (:meth:`release`) however the request ends.

        Raises:
            BadRequest: An invalid ``X-Priority``.
            TooManyRequests: Over a tenant limit.
        """
        priority = self.priority(tenant, priority_header)
        refusal = self.limiter.acquire(tenant, self._clock())
        if refusal is not None:
            self._reject(tenant, refusal)
        return Ticket(tenant, priority)

    async def wait(self, ticket: Ticket) -> None:
        """Under overload, wait in the priority queue for a slot (at once otherwise).

        Raises:
            Overloaded: Shed (the queue is full, or it waited past ``max_wait_s``).
        """
        await self._take_slot(ticket)

    async def admit(self, tenant: str, priority_header: str | None) -> Ticket:
        """:meth:`acquire` then :meth:`wait` (the tenant's count given back if shed)."""
        ticket = self.acquire(tenant, priority_header)
        try:
            await self.wait(ticket)
        except BaseException:
            self.release(ticket)
            raise
        return ticket

    async def _take_slot(self, ticket: Ticket) -> None:
        cap = self.capacity()
        if cap is None:
            return
        if self.in_flight < cap and not len(self.queue):
            self.in_flight += 1
            ticket.slot = True
            return
        t0 = self._clock()
        waiter = _Waiter(ticket.tenant, asyncio.get_running_loop().create_future())
        shed = self.queue.push(waiter, ticket.priority, t0)
        if shed is not None:
            full = Refusal(
                "queue_full",
                self._retry_after,
                f"the gateway is overloaded: {len(self.queue)} requests wait "
                "and this one has the lowest priority",
            )
            if shed is waiter:
                self._reject(ticket.tenant, full)
            shed.future.set_result(full)
        self._grant()  # room may have come meanwhile (a worker added, say)
        timer = asyncio.get_running_loop().call_later(self._max_wait_s, self._expire, waiter)
        try:
            refusal = await waiter.future
        except asyncio.CancelledError:  # the client left while waiting
            if not self.queue.remove(waiter):
                fut = waiter.future
                if fut.done() and not fut.cancelled() and fut.result() is None:
                    self.in_flight -= 1  # granted just before the client left
                    self._grant()
            raise
        finally:
            timer.cancel()
        ticket.waited_s = self._clock() - t0
        self.metrics.queue_wait.observe((self.metrics.label(ticket.tenant),), ticket.waited_s)
        if refusal is not None:
            self._reject(ticket.tenant, refusal)
        ticket.slot = True  # _grant counted it

    def _expire(self, waiter: _Waiter) -> None:
        if self.queue.remove(waiter) and not waiter.future.done():
            waiter.future.set_result(
                Refusal(
                    "queue_timeout",
                    self._retry_after,
                    f"the gateway is overloaded: waited {self._max_wait_s:g} s for capacity",
                )
            )

    def _grant(self) -> None:
        """Admit waiters while there is room (all of them when the capacity is gone)."""
        while len(self.queue):
            cap = self.capacity()
            if cap is not None and self.in_flight >= cap:
                return
            waiter = self.queue.pop()
            if waiter is None or waiter.future.done():
                continue
            self.in_flight += 1
            waiter.future.set_result(None)

    def _reject(self, tenant: str, refusal: Refusal) -> None:
        self.metrics.rejected.inc((self.metrics.label(tenant), refusal.reason))
        headers = {"Retry-After": str(refusal.retry_after_s)}
        if refusal.reason == "max_in_flight":
            raise TooManyRequests(refusal.message, code="too_many_in_flight", headers=headers)
        if refusal.reason == "rate":
            raise TooManyRequests(refusal.message, headers=headers)
        raise Overloaded(refusal.message, headers=headers)

    def release(self, ticket: Ticket) -> None:
        """An admitted request finished: free its tenant count and its slot."""
        self.limiter.release(ticket.tenant)
        if ticket.slot:
            ticket.slot = False
            self.in_flight -= 1
            self._grant()

    def finished(self, tenant: str, status: int, ttft_s: float | None) -> None:
        """Count one finished completion request of ``tenant``."""
        label = self.metrics.label(tenant)
        self.metrics.requests.inc((label, str(status)))
        if ttft_s is not None:
            self.metrics.ttft.observe((label,), ttft_s)
