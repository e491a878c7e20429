"""``prefixrouter demo --envoy``: engines, the picker and a real Envoy, started as the demo does."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prefixrouter.demo.run import DemoConfig
from prefixrouter.harness.processes import Fleet
from tests.epp.fleet import chat_body, client, post


def test_demo_envoy_routes_through_the_picker_with_the_runs_admin_key(tmp_path: Path) -> None:
    from prefixrouter.demo.envoy import serve_envoy

    async def body() -> None:
        with Fleet() as fleet:
            stack = await serve_envoy(DemoConfig(workers=2), fleet, "demo-envoy-key", tmp_path)
            async with client() as s:
                answer = await post(s, stack.envoy.url, chat_body("Hello through Envoy"))
                assert answer.status == 200 and answer.text
                assert answer.worker in {f"127.0.0.1:{e.port}" for e in stack.engines}
                url = stack.picker.url + "/admin/workers"
                for auth, expected in ((None, 401), ("Bearer demo-envoy-key", 200)):
                    headers = {"Authorization": auth} if auth else None
                    async with s.get(url, headers=headers) as r:
                        assert r.status == expected
            servers = list(fleet.servers)
        # Leaving the fleet stopped every process it started.
        assert all(not srv.alive() for srv in servers)

    asyncio.run(asyncio.wait_for(body(), 60))
