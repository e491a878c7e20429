"""The engine's fault injection (``/admin/faults``) and served log, over real HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from prefixrouter.harness.faults import read_served
from prefixrouter.simulated_engine.faults import ServedLog, parse_faults
from prefixrouter.simulated_engine.protocol import ApiError
from tests.simulated_engine.conftest import served


def _chat(tag: str, stream: bool = True, max_tokens: int = 6) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"hello {tag}"}],
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
        "user": tag,
    }


def _events(raw: bytes) -> list[bytes]:
    return [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]


async def test_admin_faults_is_served_only_with_fault_injection() -> None:
    async with served(time_scale=20) as (client, _):
        assert (await client.get("/admin/faults")).status == 404
    async with served(time_scale=20, fault_injection=True) as (client, _):
        resp = await client.get("/admin/faults")
        assert resp.status == 200 and (await resp.json())["status"] is None
        bad = await client.post("/admin/faults", json={"slow": 0.5})
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "slow"
        bad = await client.post("/admin/faults", json={"explode": True})
        assert bad.status == 400 and "explode" in (await bad.json())["error"]["message"]


@pytest.mark.parametrize(
    "body, param",
    [([], None), ({"status": 200}, "status"), ({"every": 0}, "every"),
     ({"truncate": "yes"}, "truncate"), ({"drop_kv_events": -1}, "drop_kv_events")],
)  # fmt: skip
def test_bad_fault_settings_name_the_field(body: Any, param: str | None) -> None:
    with pytest.raises(ApiError) as err:
        parse_faults(body)
    assert err.value.status == 400 and err.value.param == param


async def test_status_fault_hits_one_request_in_every_then_heals() -> None:
    async with served(time_scale=20, fault_injection=True) as (client, _):
        await client.post("/admin/faults", json={"status": 500, "every": 2})
        statuses = []
        for i in range(4):
            resp = await client.post("/v1/chat/completions", json=_chat(f"s{i}", stream=False))
            statuses.append(resp.status)
            if resp.status == 500:
                assert (await resp.json())["error"]["code"] == 500
        assert statuses == [200, 500, 200, 500]
        await client.post("/admin/faults", json={})
        resp = await client.post("/v1/chat/completions", json=_chat("ok", stream=False))
        assert resp.status == 200


async def test_truncated_and_malformed_streams_end_without_done() -> None:
    async with served(time_scale=20, fault_injection=True) as (client, _):
        await client.post("/admin/faults", json={"truncate": True})
        async with client.post("/v1/chat/completions", json=_chat("t")) as resp:
            events = _events(await resp.read())
        # The role chunk and half of the 6 tokens; no usage, no [DONE].
        assert len(events) == 4 and b"[DONE]" not in events
        assert all(b'"usage"' not in e for e in events)
        await client.post("/admin/faults", json={"malformed": True})
        async with client.post("/v1/chat/completions", json=_chat("m")) as resp:
            events = _events(await resp.read())
        assert b"[DONE]" not in events
        with pytest.raises(json.JSONDecodeError):
            json.loads(events[-1])
        resp = await client.post("/v1/chat/completions", json=_chat("u", stream=False))
        with pytest.raises(json.JSONDecodeError):
            json.loads(await resp.read())  # unstreamed: the JSON body cut short


async def test_bad_usage_sends_wrong_signs_and_types() -> None:
    async with served(time_scale=20, fault_injection=True) as (client, _):
        await client.post("/admin/faults", json={"bad_usage": True})
        async with client.post("/v1/chat/completions", json=_chat("b")) as resp:
            events = _events(await resp.read())
        assert events[-1] == b"[DONE]"
        use = json.loads(events[-2])["usage"]
        assert use["prompt_tokens"] < 0 and isinstance(use["completion_tokens"], str)
        assert use["prompt_tokens_details"]["cached_tokens"] > -use["prompt_tokens"]


async def test_slow_runs_the_engine_that_many_times_slower() -> None:
    async with served(time_scale=20, fault_injection=True) as (client, server):
        step = server.runtime.token_interval()  # one decode step, idle, in wall seconds
        await client.post("/admin/faults", json={"slow": 10})
        assert server.runtime.time_scale == pytest.approx(2.0)
        assert server.runtime.token_interval() == pytest.approx(10 * step)
        t0 = time.perf_counter()
        resp = await client.post("/v1/chat/completions", json=_chat("x", False, 100))
        assert resp.status == 200
        # 100 decode steps at a tenth of the speed: a lower bound, whatever the load.
        assert time.perf_counter() - t0 >= 0.9 * 100 * 10 * step
        await client.post("/admin/faults", json={})
        assert server.runtime.time_scale == pytest.approx(20.0)
        assert server.runtime.token_interval() == pytest.approx(step)


async def test_served_log_records_each_request_by_tag(tmp_path: Path) -> None:
    log = tmp_path / "served.jsonl"
    async with served(time_scale=20, served_log=str(log), fault_injection=True) as (client, _):
        async with client.post("/v1/chat/completions", json=_chat("a")) as resp:
            rid = json.loads(_events(await resp.read())[0])["id"]
        await client.post("/admin/faults", json={"status": 503})
        await client.post("/v1/chat/completions", json=_chat("b"))
        # A client that leaves mid-stream: its request ends "gone".
        await client.post("/admin/faults", json={"slow": 50})
        resp = await client.post("/v1/chat/completions", json=_chat("c", max_tokens=200))
        await resp.content.readuntil(b"\n\n")
        resp.close()
        for _ in range(100):
            if len(read_served({"e": log})) == 3 and all(s.how for s in read_served({"e": log})):
                break
            await asyncio.sleep(0.02)
    by_tag = {s.tag: s for s in read_served({"e": log})}
    assert by_tag["a"].rid == rid and by_tag["a"].how == "done" and by_tag["a"].t_first
    assert by_tag["b"].how == "error" and by_tag["b"].t_first is None
    assert by_tag["c"].how == "gone"
    assert by_tag["a"].t_recv <= by_tag["a"].t_first <= time.monotonic()


async def test_a_streamed_answer_is_logged_done_before_its_last_bytes_go_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A SIGKILL between the client getting [DONE] and the log's end line would
    # count an answer the client got whole as lost: the line must come first.
    order: list[str] = []
    real_write = web.StreamResponse.write

    async def write(self: web.StreamResponse, data: bytes) -> None:
        if b"[DONE]" in bytes(data):
            order.append("DONE written")
        await real_write(self, data)

    real_event = ServedLog.event

    def event(self: ServedLog, ev: str, rid: str, **extra: Any) -> None:
        if ev == "end":
            order.append(f"end {extra.get('how')}")
        real_event(self, ev, rid, **extra)

    monkeypatch.setattr(web.StreamResponse, "write", write)
    monkeypatch.setattr(ServedLog, "event", event)
    log = tmp_path / "served.jsonl"
    async with (
        served(time_scale=20, served_log=str(log)) as (client, _),
        client.post("/v1/chat/completions", json=_chat("a")) as resp,
    ):
        assert b"[DONE]" in await resp.read()
    assert order[:2] == ["end done", "DONE written"]
    assert read_served({"e": log})[0].how == "done"
