"""Reading a running gateway's admin API from tests (decision records, worker state)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp


async def decisions(base_url: str, ids: list[str], limit: int = 5000) -> list[dict[str, Any]]:
    """The decision records of ``ids``, once each has its outcome (polls briefly)."""
    async with aiohttp.ClientSession() as s:
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
    async with aiohttp.ClientSession() as s, s.get(base_url + "/admin/workers") as r:
        data = await r.json()
    return {w["id"]: w for w in data["workers"]}
