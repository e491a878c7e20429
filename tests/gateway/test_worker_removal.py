"""Removing workers over the admin API, and what a model's requests get once its workers go.

Real HTTP on loopback: a gateway in front of fake vLLM engines (:mod:`tests.gateway.fakes`).

* A worker is drained once: a second ``DELETE`` joins the drain under way and
  never touches a worker added since under the same id (nor leaves its poller
  running); a drain whose caller left still ends in the removal.
* A model whose workers are draining or removed is an outage (503 with
  ``Retry-After``, which clients retry), not an unknown model (404); a name no
  worker ever listed stays a 404, even while a worker that never listed its
  models is down.
* ``DELETE`` takes an id with ``/`` and refuses a ``timeout`` that is not a
  finite number of seconds, 0 or more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import openai
import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestServer

from prefixrouter.core.types import WorkerId
from prefixrouter.gateway import workers as workers_module
from prefixrouter.gateway.config import WorkerConfig
from prefixrouter.harness.ports import free_port
from prefixrouter.prometheus import samples
from tests.gateway.fakes import FakeEngine
from tests.gateway.helpers import gateway_env, run


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for ``cond`` (polled), failing the test after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


def _sample(scrape: str, name: str, worker: str) -> float:
    (value,) = [x.value for x in samples(scrape) if x.name == name and x.labels["worker"] == worker]
    return value


async def _error(r: ClientResponse) -> dict[str, Any]:
    data = await r.json()
    assert set(data) == {"error"}
    return dict(data["error"])


async def _unavailable(r: ClientResponse) -> None:
    """A 503 ``no_healthy_worker`` with ``Retry-After``: an outage, which clients retry."""
    assert r.status == 503, await r.text()
    assert r.headers["Retry-After"] == "1"
    err = await _error(r)
    assert (err["type"], err["code"]) == ("service_unavailable", "no_healthy_worker")


async def _unknown(r: ClientResponse, model: str) -> None:
    """A 404 ``model_not_found``: a name no worker ever listed."""
    assert r.status == 404, await r.text()
    assert "Retry-After" not in r.headers
    err = await _error(r)
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    assert model in err["message"]


def _pollers(worker_id: str) -> list[asyncio.Task[Any]]:
    """The health pollers running for ``worker_id`` (the registry names them ``poll-ID``)."""
    return [t for t in asyncio.all_tasks() if t.get_name() == f"poll-{worker_id}" and not t.done()]


def test_a_second_delete_joins_the_drain_and_never_touches_a_worker_added_since() -> None:
    """The duplicate-DELETE race: one drain, one removal, of the worker it was started on."""

    async def body() -> None:
        async with gateway_env(engines=[FakeEngine(delay_s=1.5)]) as env:
            reg, wid = env.state.registry, WorkerId("w0")
            old = reg.workers[wid]
            old_poller = old.task
            assert old_poller is not None and _pollers("w0") == [old_poller]
            slow = asyncio.ensure_future(env.chat("a request that outlives the drain"))
            await _until(lambda: env.state.dispatch.load(wid).in_flight == 1)
            first = asyncio.ensure_future(env.admin("DELETE", "/admin/workers/w0?timeout=0.2"))
            await _until(lambda: old.draining)
            second = asyncio.ensure_future(env.admin("DELETE", "/admin/workers/w0?timeout=5"))
            url = str(env.servers[0].make_url(""))
            r = await env.admin("POST", "/admin/workers", json={"url": url, "id": "w0"})
            err = await _error(r)  # it holds its id until removed
            assert r.status == 409 and err["param"] == "id" and "draining" in err["message"]
            r = await first
            got = await r.json()
            assert r.status == 200
            assert (got["removed"], got["drained"], got["in_flight_left"]) == (True, False, 1)
            # The id is free: the engine comes back under it (replacing an engine).
            r = await env.admin("POST", "/admin/workers", json={"url": url, "id": "w0"})
            assert r.status == 201
            new = reg.workers[wid]
            assert new is not old
            # The second DELETE joined the first drain: same answer, not a wait of its own
            # (5 s, on a load figure the ledger dropped) that then removed the new worker.
            r = await second
            assert r.status == 200 and await r.json() == got
            assert reg.workers.get(wid) is new and not new.draining
            # The old worker's poller is gone, the new one's runs: no orphan acting on the id.
            assert old_poller.done() and old.task is None
            assert new.task is not None and _pollers("w0") == [new.task]
            assert (await slow).status == 200  # a removed worker's request completes
            r = await env.chat("after the race")
            assert r.status == 200 and r.headers["X-Prefixrouter-Worker"] == "w0"
            # Now the new worker drains (nothing in flight) and goes, poller and all.
            r = await env.admin("DELETE", "/admin/workers/w0?timeout=5")
            assert r.status == 200 and (await r.json())["drained"] is True
            assert wid not in reg.workers and _pollers("w0") == []
            r = await env.admin("DELETE", "/admin/workers/w0")
            assert r.status == 404

    run(body)


def test_a_drain_whose_caller_left_still_removes_the_worker() -> None:
    """The gateway cancels the handler of a client that disconnects: the drain goes on."""

    async def body() -> None:
        async with gateway_env(engines=[FakeEngine(delay_s=0.5)]) as env:
            reg, wid = env.state.registry, WorkerId("w0")
            w = reg.workers[wid]
            slow = asyncio.ensure_future(env.chat("in flight while the caller leaves"))
            await _until(lambda: env.state.dispatch.load(wid).in_flight == 1)
            caller = asyncio.ensure_future(reg.drain_and_remove(wid, 5.0))
            await _until(lambda: w.draining)
            # Out of routing on purpose: the metric the down alert leaves such a worker by.
            scrape = await (await env.client.get("/metrics")).text()
            assert _sample(scrape, "prefixrouter_worker_healthy", "w0") == 0
            assert _sample(scrape, "prefixrouter_worker_draining", "w0") == 1
            caller.cancel()
            assert (await slow).status == 200
            # Not left draining for ever: removed once its request finished.
            await _until(lambda: wid not in reg.workers)
            assert w.removed and w.drain is not None
            result = await w.drain  # ends once its poller has stopped
            assert result["drained"] is True and _pollers("w0") == []

    run(body)


def test_a_model_whose_workers_drain_or_go_gets_503_with_retry_after() -> None:
    """Draining or removing a model's last worker (or every worker) is an outage, not a 404."""

    async def body() -> None:
        engines = [FakeEngine(model="tiny"), FakeEngine(model="other", delay_s=0.8)]
        async with gateway_env(engines=engines) as env:
            reg, w1 = env.state.registry, WorkerId("w1")
            slow = asyncio.ensure_future(env.chat("a long answer", model="other"))
            await _until(lambda: env.state.dispatch.load(w1).in_flight == 1)
            drain = asyncio.ensure_future(env.admin("DELETE", "/admin/workers/w1?timeout=5"))
            await _until(lambda: reg.workers[w1].draining)
            await _unavailable(await env.chat("while its worker drains", model="other"))
            assert (await slow).status == 200
            r = await drain
            assert r.status == 200 and (await r.json())["drained"] is True
            await _unavailable(await env.chat("after its worker left", model="other"))
            await _unknown(await env.chat("a typo", model="nope"), "nope")
            r = await env.chat("the other model is served", model="tiny")
            assert r.status == 200
            # The whole fleet gone: every model it served is an outage, a typo is still a 404.
            r = await env.admin("DELETE", "/admin/workers/w0?timeout=5")
            assert r.status == 200 and not reg.workers
            for model in ("tiny", "other"):
                await _unavailable(await env.chat("no worker at all", model=model))
            await _unknown(await env.chat("a typo", model="nope"), "nope")
            # What an OpenAI SDK makes of it: a server error (retried), not NotFoundError.
            base = str(env.client.make_url("/v1"))
            async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as sdk:
                with pytest.raises(openai.InternalServerError) as info:
                    await sdk.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                    )
                assert info.value.status_code == 503
            # A worker of the model comes back: served again.
            url = str(env.servers[1].make_url(""))
            r = await env.admin("POST", "/admin/workers", json={"url": url, "id": "w1"})
            assert r.status == 201
            env.engines[1].delay_s = 0.0
            r = await env.chat("back", model="other")
            assert r.status == 200 and r.headers["X-Prefixrouter-Worker"] == "w1"

    run(body)


def test_removed_workers_models_are_remembered_within_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The names kept after their workers left are the newest ``GONE_MODELS_KEPT``."""
    monkeypatch.setattr(workers_module, "GONE_MODELS_KEPT", 2)

    async def body() -> None:
        engines = [FakeEngine(model=m) for m in ("m0", "m1", "m2")]
        async with gateway_env(engines=engines) as env:
            for wid in ("w0", "w1", "w2"):
                r = await env.admin("DELETE", f"/admin/workers/{wid}?timeout=0")
                assert r.status == 200
            await _unknown(await env.chat("forgotten: the oldest", model="m0"), "m0")
            for model in ("m1", "m2"):
                await _unavailable(await env.chat("remembered", model=model))

    run(body)


@pytest.mark.parametrize("unhealthy_after", [1, 3])
def test_a_worker_never_reached_stops_making_every_model_known(unhealthy_after: int) -> None:
    """A dead worker that never listed its models: a typo is a 404 once its first check failed.

    With ``unhealthy_after: 3`` it is still in routing after that first
    failure; its unknown model list counts no longer all the same.
    """

    async def body() -> None:
        overrides = {"health": {"unhealthy_after": unhealthy_after}}
        async with gateway_env(n=1, overrides=overrides) as env:
            reg = env.state.registry
            dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
            # Not checked yet, it may serve anything: no name is unknown.
            w = reg._add(WorkerConfig(url=dead, id="x"))
            assert reg.serves("nope")
            assert not await reg.check(w)
            assert not reg.serves("nope") and reg.serves("tiny")
            await reg._remove(w)
            # Through the admin API: added (its first check fails), then a typo.
            r = await env.admin("POST", "/admin/workers", json={"url": dead, "id": "dead"})
            assert r.status == 201
            assert (await r.json())["healthy"] is (unhealthy_after > 1)
            await _unknown(await env.chat("a typo", model="nope"), "nope")
            r = await env.chat("the served model")
            assert r.status == 200 and r.headers["X-Prefixrouter-Worker"] == "w0"

    run(body)


def test_a_worker_that_lists_no_models_counts_only_while_healthy() -> None:
    """A server that does not list its models may serve any: while it answers, not while down."""

    async def body() -> None:
        up = [True]
        app = web.Application()

        async def health(request: web.Request) -> web.Response:
            return web.Response(status=200 if up[0] else 503)

        async def no_list(request: web.Request) -> web.Response:
            return web.Response(status=404)

        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", no_list)
        server = TestServer(app)
        await server.start_server()
        try:
            async with gateway_env(n=1) as env:
                reg = env.state.registry
                worker = {"url": str(server.make_url("")), "id": "u", "metrics_path": ""}
                r = await env.admin("POST", "/admin/workers", json=worker)
                assert r.status == 201 and (await r.json())["models"] == []
                assert reg.serves("anything")  # it may serve it
                up[0] = False
                await _until(lambda: not reg.workers[WorkerId("u")].healthy)
                await _unknown(await env.chat("while it is down", model="anything"), "anything")
                r = await env.chat("a listed model", model="tiny")
                assert r.status == 200 and r.headers["X-Prefixrouter-Worker"] == "w0"
                up[0] = True
                await _until(lambda: reg.workers[WorkerId("u")].healthy)
                assert reg.serves("anything")
        finally:
            await server.close()

    run(body)


def test_delete_takes_an_id_with_a_slash_and_refuses_a_timeout_that_is_not_finite() -> None:
    async def body() -> None:
        async with gateway_env(n=1) as env:
            reg = env.state.registry
            url = str(env.servers[0].make_url(""))
            for bad in ("inf", "-inf", "nan", "1e999", "-1", "soon"):
                r = await env.admin("DELETE", f"/admin/workers/w0?timeout={bad}")
                assert r.status == 400, bad
                err = await _error(r)
                assert err["param"] == "timeout" and err["message"].startswith("timeout:")
            w0 = reg.workers[WorkerId("w0")]
            assert not w0.draining  # nothing happened to it
            r = await env.admin("DELETE", "/admin/workers/w0?timeout=0")
            assert r.status == 200 and (await r.json())["id"] == "w0"
            for path in ("rack1/gpu0", "rack1%2Fgpu0"):
                r = await env.admin("POST", "/admin/workers", json={"url": url, "id": "rack1/gpu0"})
                assert r.status == 201
                r = await env.admin("DELETE", f"/admin/workers/{path}?timeout=0")
                assert r.status == 200, (path, await r.text())
                assert (await r.json())["id"] == "rack1/gpu0" and not reg.workers
            r = await env.admin("DELETE", "/admin/workers/rack1/gpu0")
            assert r.status == 404
            assert "'rack1/gpu0'" in (await _error(r))["message"]  # no worker, not "no route"

    run(body)
