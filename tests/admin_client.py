"""Reading a running gateway's admin API from tests (decision records, worker state).

The admin API is off without ``server.admin_api_key``: the tests' gateways
are configured with :data:`ADMIN_KEY` (``ADMIN_CONFIG``) and these helpers send it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

ADMIN_KEY = "test-admin-key"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
ADMIN_CONFIG = {"admin_api_key": ADMIN_KEY}
"""The ``server`` section that turns the admin API on with :data:`ADMIN_KEY`."""


async def decisions(base_url: str, ids: list[str], limit: int = 5000) -> list[dict[str, Any]]:
    """The decision records of ``ids``, once each has its outcome (polls briefly)."""
    async with aiohttp.ClientSession(headers=ADMIN_HEADERS) as s:
        for _ in range(200):
            async with s.get(f"{base_url}/admin/decisions?limit={limit}") as r:
                data = await r.json()
            by_id = {d["request_id"]: d for d in data["decisions"]}
            if all(i in by_id and by_id[i].get("actual_cached_tokens") is not None for i in ids):
                return [by_id[i] for i in ids]
            await asyncio.sleep(0.05)
    raise AssertionError(f"no complete decision records for {ids}")


async def workers(base_url: str) -> dict[str, dict[str, Any]]:
    """``GET /admin/workers``, by worker id."""
    async with (
        aiohttp.ClientSession(headers=ADMIN_HEADERS) as s,
        s.get(base_url + "/admin/workers") as r,
    ):
        data = await r.json()
    return {w["id"]: w for w in data["workers"]}
