"""``GET /ready``: the one readiness rule (:meth:`Admin.readiness`), shutdown checked first.

The gateway's handlers take a ``shutting_down`` hook; the endpoint picker
passes its drain flag, so its HTTP ``/ready`` and gRPC readiness agree.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from prefixrouter.gateway.admin import Admin, add_observability_routes
from prefixrouter.gateway.config import config_from_dict
from prefixrouter.gateway.state import build_state


async def _ready(admin: Admin) -> tuple[int, dict[str, Any]]:
    app = web.Application()
    add_observability_routes(app, admin)
    async with TestClient(TestServer(app)) as c, c.get("/ready") as r:
        body: dict[str, Any] = await r.json()
        return r.status, body


async def test_a_lone_gateway_is_ready_until_it_shuts_down() -> None:
    st = build_state(config_from_dict({"workers": [{"url": "http://127.0.0.1:9"}]}))
    draining = False
    admin = Admin(st, shutting_down=lambda: draining)
    assert await _ready(admin) == (200, {"status": "ready"})
    assert await _ready(Admin(st)) == (200, {"status": "ready"})  # no hook: never shutting down
    draining = True
    assert await _ready(admin) == (503, {"status": "shutting_down"})
    assert admin.readiness() == (False, {"status": "shutting_down"})


async def test_a_replica_keeps_its_fields_and_shutdown_comes_first() -> None:
    st = build_state(config_from_dict({"workers": [{"url": "http://127.0.0.1:9"}]}))
    node = SimpleNamespace(
        status="ready",
        ready=True,
        origin="a",
        connected=True,
        link=SimpleNamespace(replayed=7),
        registry=SimpleNamespace(live=lambda: [SimpleNamespace(origin="b")]),
    )
    st.cluster = node  # type: ignore[assignment]
    draining = False
    admin = Admin(st, shutting_down=lambda: draining)
    fields = {"replica": "a", "connected": True, "replayed": 7, "peers": ["b"]}
    assert await _ready(admin) == (200, {"status": "ready", **fields})
    node.status, node.ready = "replaying", False
    assert await _ready(admin) == (503, {"status": "replaying", **fields})
    node.status, node.ready = "ready", True
    draining = True
    assert await _ready(admin) == (503, {"status": "shutting_down", **fields})
