"""Proactive copies: the router's own prefill-only requests (``policy.params.proactive_copy``).

When ``prefix_aware``'s hot-prefix rule decides that a prefix needs another
replica, the request that found it out is routed as if no copy were due and
its decision names the worker to copy to (``Decision.warm_up``). Sending a
user request there would make that user pay the copy's cold prefill (a
40,000-token document: seconds), and every request routed to the copy while
it prefills waits behind it. :class:`WarmUpSender` sends the copy itself: the
same body (the same rendered prompt, so the same cached blocks; the tenant's
``cache_salt`` where the worker takes one) with ``max_tokens`` 1 and no
stream, to that worker, admitted through
:meth:`~prefixrouter.core.dispatch.Dispatcher.warm_up` (counted in flight
there, as any request), and fed back like any answer: its arrival is the
first token (the prefix is prefilled there: the hot-prefix rule reads it as
settled), then the completion with the engine's cached tokens. No
calibration is taken from it (its time is not a user's TTFT) and it is
neither in the decision log nor in the request metrics: it is the router's
work, counted in ``prefixrouter_warm_ups_total{outcome}`` (``ok``,
``error``, ``skipped``: over the in-flight bound, ``over_budget``: over the
policy's copy budget).

Bounded: at most ``max_in_flight`` copies out at once (the hot-prefix rule
asks for one per prefix and replica it lacks, and never on a worker whose
queue is past the maximum wait), at most the policy's share of each
worker's time (``policy.params.copy_budget_share``, checked by the
dispatcher), each cut after ``timeout_s``; one that
fails is taken back (:meth:`~prefixrouter.core.dispatch.Dispatcher.reject`),
as an attempt the engine did no prefill for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

import aiohttp
import orjson

from prefixrouter.core.dispatch import Admission, Dispatcher
from prefixrouter.core.policy import Outcome
from prefixrouter.core.types import WorkerId, WorkerView
from prefixrouter.gateway.background import BackgroundTasks
from prefixrouter.gateway.metrics import GatewayMetrics
from prefixrouter.gateway.request_builder import BuiltRequest
from prefixrouter.gateway.sse import json_usage, usage_figures
from prefixrouter.gateway.workers import Worker

log = logging.getLogger("prefixrouter.gateway")

OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "stream", "stream_options", "n")
"""Fields of the user's body that the copy replaces (one token, one answer, no stream)."""


def warm_up_body(built: BuiltRequest, salt: str | None) -> bytes:
    """The copy's body: ``built``'s, asking for one token of one answer, not streamed."""
    body = {k: v for k, v in built.body.items() if k not in OUTPUT_FIELDS}
    body["max_tokens"] = 1
    body["stream"] = False
    if salt is not None:
        body["cache_salt"] = salt
    return orjson.dumps(body)


class WarmUpSender:
    """Sends the copies that decisions ask for, in the background (module docstring).

    Args:
        dispatch: The dispatcher that admits and settles the copies.
        metrics: Where the outcomes are counted.
        clock: The gateway's clock.
        max_in_flight: Copies out at once.
        timeout_s: Time allowed for one copy (a long document's cold prefill).
    """

    def __init__(
        self,
        dispatch: Dispatcher,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
        max_in_flight: int = 4,
        timeout_s: float = 120.0,
    ) -> None:
        self.dispatch = dispatch
        self.metrics = metrics
        self.clock = clock
        self.max_in_flight = max_in_flight
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._tasks = BackgroundTasks()

    def routed(
        self,
        built: BuiltRequest,
        admission: Admission,
        views: Sequence[WorkerView],
        workers: Mapping[WorkerId, Worker],
        path: str,
        session: aiohttp.ClientSession | None,
    ) -> None:
        """A first attempt was routed: send the copy its decision asks for, if any."""
        target = admission.decision.warm_up
        if target is None or session is None:
            return
        worker = workers.get(target)
        if worker is None:
            return
        if len(self._tasks) >= self.max_in_flight:
            self.metrics.warm_up("skipped")
            return
        warm = self.dispatch.warm_up(admission, views, self.clock())
        if warm is None:
            # The worker left routing since, or the policy's copy budget said no.
            if any(v.worker_id == target for v in views):
                self.metrics.warm_up("over_budget")
            return
        body = warm_up_body(built, built.cache_salt_on(worker.config.supports_cache_salt))
        self._tasks.spawn(self._send(session, worker, path, body, warm), "warm-up")
        log.info(
            "hot prefix %s: warming %s with a prefill-only copy",
            admission.decision.prefix_key,
            worker.id,
        )

    async def _send(
        self,
        session: aiohttp.ClientSession,
        worker: Worker,
        path: str,
        body: bytes,
        warm: Admission,
    ) -> None:
        try:
            async with session.post(
                worker.url + path,
                data=body,
                headers={**worker.headers, "Content-Type": "application/json"},
                timeout=self.timeout,
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}: {raw[:120]!r}")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.dispatch.reject(warm, self.clock())
            self.metrics.warm_up("error")
            log.warning("warm-up copy on %s failed: %s", worker.id, exc)
            return
        except asyncio.CancelledError:
            self.dispatch.reject(warm, self.clock())
            raise
        now = self.clock()
        _, cached = usage_figures(json_usage(raw))
        self.dispatch.first_token(warm, now)
        # No TTFT: a copy's time is not a user's, and must not calibrate the worker.
        self.dispatch.complete(warm, Outcome(cached or 0, None), now)
        self.metrics.warm_up("ok")

    async def close(self) -> None:
        """Cancel the copies still out (the application's cleanup)."""
        await self._tasks.close()
