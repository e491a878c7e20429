"""A simulated vLLM engine behind a real HTTP server (``prefixrouter engine``).

It lets the gateway, the peer routers and the benchmarks run against engines
that behave like vLLM — OpenAI endpoints, usage with cached tokens, vLLM's
Prometheus metrics, prefix caching, queueing and chunked prefill — on a laptop
and in tests, with no model and no accelerator. Timing comes from the
simulator's :class:`~prefixrouter.sim.engine.EngineModel` on the wall clock
(optionally sped up), token counts from :mod:`prefixrouter.tokenization`.

Modules: ``config`` (what to serve), ``runtime`` (drives the engine model in
real time), ``protocol`` (OpenAI wire format), ``metrics`` (vLLM metric names),
``app`` (the aiohttp application), ``cli`` (the ``engine`` command).
"""

from __future__ import annotations

from prefixrouter.simulated_engine.app import SERVER_KEY, EngineServer, create_app
from prefixrouter.simulated_engine.cli import engine, serve
from prefixrouter.simulated_engine.config import EngineServerConfig
from prefixrouter.simulated_engine.runtime import EngineRuntime, RequestHandle

__all__ = [
    "SERVER_KEY",
    "EngineRuntime",
    "EngineServer",
    "EngineServerConfig",
    "RequestHandle",
    "create_app",
    "engine",
    "serve",
]
