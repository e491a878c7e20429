"""Emptying engines' prefix caches between runs: the simulated engine and real vLLM alike.

Two routers are compared fairly only if each starts on the same engines in
the same state. :func:`reset_prefix_caches` does, for every engine URL:

1. **drain**: wait until its ``/metrics`` shows nothing running or queued
   (``vllm:num_requests_running`` + ``vllm:num_requests_waiting``, which the
   simulated engine exports under vLLM's names): a reset under load would
   empty a cache that the previous router's requests are still filling;
2. **reset**: ``POST /reset_prefix_cache`` (the simulated engine always
   serves it, vLLM when started with ``VLLM_SERVER_DEV_MODE=1`` as
   :class:`~prefixrouter.real_engines.vllm_fleet.VllmFleet` does);
3. **announce**: one :data:`~prefixrouter.harness.health.PROBE` request
   straight to the engine. vLLM publishes the reset (``AllBlocksCleared``)
   only with its next step; this makes every engine publish it now, before a
   router that follows KV events is measured. The probe is shorter than a
   block, so it caches nothing.

Drain and announce can be turned off (an engine without ``/metrics``; a
probe that wants to see the announcement with its own request).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import aiohttp

from prefixrouter.harness.health import PROBE
from prefixrouter.prometheus import totals

BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")
"""The gauges whose sum is an engine's unfinished work."""


async def _busy(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}/metrics answered {resp.status}")
        return sum(totals(await resp.text(), BUSY).values())


async def _drain(session: aiohttp.ClientSession, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (busy := await _busy(session, url)) > 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} still had {busy:.0f} requests after {timeout_s:.0f} s")
        await asyncio.sleep(0.2)


async def reset_prefix_caches(
    urls: Sequence[str],
    *,
    drain_timeout_s: float | None = 120.0,
    announce: bool = True,
    model: str = "tiny",
    timeout_s: float = 30.0,
) -> None:
    """Drain, reset and announce on every engine (module doc).

    Args:
        urls: The engines' base URLs.
        drain_timeout_s: How long an engine may take to finish its work
            (None: no drain).
        announce: Send the probe request afterwards.
        model: The model name the probe asks for.
        timeout_s: Per HTTP request.

    Raises:
        RuntimeError: An engine still had work after ``drain_timeout_s`` (the
            next run would be measured on busy engines), or answered an error.
    """
    bases = [u.rstrip("/") for u in urls]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        if drain_timeout_s is not None:
            for url in bases:
                await _drain(session, url, drain_timeout_s)
        for url in bases:
            async with session.post(url + "/reset_prefix_cache") as resp:
                if resp.status != 200:
                    raise RuntimeError(f"POST {url}/reset_prefix_cache answered {resp.status}")
        if announce:
            probe = {**PROBE, "model": model}
            for url in bases:
                async with session.post(url + "/v1/chat/completions", json=probe) as resp:
                    await resp.read()
