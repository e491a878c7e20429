"""The live gateway: an OpenAI-compatible HTTP proxy that routes with the core router.

Modules (each small, each with its reason in its docstring):

* :mod:`.app`: the application factory and lifespan (pollers, flusher, session);
* :mod:`.proxy`: forwarding, retries before the first byte, streaming, feedback;
* :mod:`.flow`: admission (parse, tenant, model, route) and settlement (feedback,
  metrics, decision log), shared with the endpoint picker (:mod:`prefixrouter.epp`);
* :mod:`.upstream`: the proxy's lean HTTP/1.1 keep-alive client (httptools);
* :mod:`.request_builder`: request body -> routing request (the prompt path of
  :mod:`prefixrouter.prompt.request`, plus tenancy, namespace and the 400s);
* :mod:`.tenancy`: tenants from API keys (``X-Tenant`` only when trusted),
  cache sharing, ``cache_salt``;
* :mod:`.workers`: registry, health with backoff, ``/metrics`` polls, drain and remove;
* :mod:`.sse`: streaming relay that reads and (if asked) strips the usage chunk;
* :mod:`.decision_log`: JSON-lines decision log and the admin ring;
* :mod:`.metrics`: Prometheus metrics in a per-app registry;
* :mod:`.errors`: OpenAI-shaped errors and the exception -> status mapping;
* :mod:`.admin`: ``/admin/*``, ``/v1/models``, ``/health``, ``/metrics``
  (:func:`~.admin.add_observability_routes`, which the endpoint picker's HTTP port serves too);
* :mod:`.dashboard`: ``GET /dashboard`` (live, server-sent events) and ``prefixrouter top``;
* :mod:`.cli`: ``prefixrouter serve`` / ``python -m prefixrouter.gateway``.
"""

from prefixrouter.gateway.app import create_app
from prefixrouter.gateway.cli import build_config, run_gateway, serve
from prefixrouter.gateway.state import STATE, GatewayState, build_state

__all__ = [
    "STATE",
    "GatewayState",
    "build_config",
    "build_state",
    "create_app",
    "run_gateway",
    "serve",
]
