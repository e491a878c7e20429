"""The dashboard's routes and feed against a gateway in front of fake engines (one event loop).

What a browser or ``prefixrouter top`` relies on: the page and its assets are
served (open, from the package, nothing from elsewhere), the data needs the
admin key in the header and is off (403) when none is configured, a snapshot
carries the figures of the traffic sent (errors before routing included), the
stream starts with ``hello`` and ticks, the decision stream is sampled to a
bound, the drift alarm is read from the metrics, and an open stream does not
hold up the server's shutdown.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import orjson

from prefixrouter.core.types import WorkerId
from prefixrouter.gateway.dashboard.feed import ALL, DashboardFeed
from prefixrouter.gateway.dashboard.routes import FEED, STATIC
from prefixrouter.prometheus import samples
from tests.admin_client import ADMIN_HEADERS
from tests.gateway.helpers import Env, gateway_env, run

DOC = "The handbook of the night shift. " * 120


async def _ask(env: Env, n: int, doc: str = DOC) -> None:
    for i in range(n):
        r = await env.chat(doc + f" Question {i}?", headers={"X-Prefix-Class": "document"})
        assert r.status == 200, await r.text()


def test_the_page_and_its_assets_are_served_from_the_package_without_a_key() -> None:
    async def body() -> None:
        async with gateway_env(1) as env:
            r = await env.client.get("/dashboard")
            assert r.status == 200
            assert r.content_type == "text/html"
            csp = r.headers["Content-Security-Policy"]
            assert "default-src 'none'" in csp and "script-src 'self'" in csp
            page = await r.text()
            for name, ctype in STATIC.items():
                assert f"/dashboard/static/{name}" in page
                a = await env.client.get(f"/dashboard/static/{name}")
                assert a.status == 200 and a.content_type == ctype
                text = await a.text()
                # Air-gapped: no address outside the gateway (the SVG namespace is a name).
                urls = set(re.findall(r"https?://[^\s\"'`)]+", text)) - {
                    "http://www.w3.org/2000/svg"
                }
                assert urls == set(), (name, urls)
            missing = await env.client.get("/dashboard/static/../../etc/passwd")
            assert missing.status == 404
            r = await env.client.get("/dashboard/static/nope.js")
            assert r.status == 404
            assert "nope.js" in (await r.json())["error"]["message"]

    run(body)


def test_the_data_needs_the_admin_key_in_the_header_when_one_is_configured() -> None:
    async def body() -> None:
        async with gateway_env(1) as env:
            for path in ("/dashboard/snapshot", "/dashboard/events"):
                assert (await env.client.get(path)).status == 401
                bad = {"Authorization": "Bearer wrong"}
                assert (await env.client.get(path, headers=bad)).status == 401
                # Never in the query string (access logs and proxies record it).
                key = ADMIN_HEADERS["Authorization"].split()[1]
                assert (await env.client.get(f"{path}?key={key}")).status == 401
            r = await env.client.get("/dashboard/snapshot", headers=ADMIN_HEADERS)
            assert r.status == 200
            assert [w["id"] for w in (await r.json())["workers"]] == ["w0"]

    run(body)


def test_without_an_admin_key_the_data_is_off_and_the_page_says_how_to_turn_it_on() -> None:
    """Per-request, per-tenant records are never anonymous: the data routes follow /admin/*."""

    async def body() -> None:
        async with gateway_env(1, overrides={"server": {"admin_api_key": None}}) as env:
            client_id = "beta-invoice-4711"
            r = await env.chat("An invoice question.", headers={"X-Request-Id": client_id})
            assert r.status == 200
            for path in ("/dashboard/snapshot", "/dashboard/events"):
                for headers in ({}, {"Authorization": "Bearer anything"}):
                    r = await env.client.get(path, headers=headers)
                    assert r.status == 403, path
                    assert client_id not in await r.text()
                    err = (await r.json())["error"]
                    assert err["code"] == "admin_api_disabled"  # as the admin API's
                    assert "server.admin_api_key" in err["message"]
            assert (await env.client.get("/admin/workers")).status == 403  # admin stays off
            # The page itself holds no data: it loads, and names the setting for its 403.
            page = await env.client.get("/dashboard")
            assert page.status == 200
            assert "server.admin_api_key" in await page.text()

    run(body)


def test_a_snapshot_holds_the_figures_of_the_traffic() -> None:
    async def body() -> None:
        async with gateway_env(2) as env:
            # A feed of the test's own, ticked by the test only (the app's ticks by itself).
            feed = DashboardFeed(env.state)
            await _ask(env, 6)
            r = await env.chat("A one-off question about nothing in particular.")
            assert r.status == 200
            snap = feed.tick()
            g = snap["gateway"]
            assert g["decisions_made"] == g["decisions_seen"] == 7
            assert g["replica"] is None and snap["cluster"] is None
            win = snap["window"]["classes"]
            assert win[ALL]["n"] == 7 and win["document"]["n"] == 6
            assert "document" in snap["classes"]
            doc = win["document"]
            assert doc["cached"] > 0 and doc["uncached"] > 0
            assert doc["tiers"].get("exact", 0) >= 4  # every question after the first is warm
            assert doc["predicted"] > 0 and doc["actual"] > 0
            assert sum(c for _, c in doc["wait"].values()) == 6  # queue wait by decision
            # The document's worker holds its prefix, ranked by the prefill it saved.
            holders = [w for w in snap["workers"] if w["prefixes"]]
            assert holders, snap["workers"]
            top = holders[0]["prefixes"][0]
            assert top["class"] == "document" and top["saved_tokens"] > 0 and top["hits"] >= 4
            assert holders[0]["cached_share"] is not None and holders[0]["cached_share"] > 0
            assert {w["state"] for w in snap["workers"]} == {"healthy"}
            # Decisions carry their explanation.
            d = snap["decisions"][-1]
            assert {"tier", "reason", "candidate_workers", "predicted_cached_tokens"} <= set(d)
            assert {"actual_cached_tokens", "replica", "sampled_every"} <= set(d)
            assert {c["worker"] for c in d["candidate_workers"]} == {"w0", "w1"}
            assert "queue_wait_ms" in d["candidate_workers"][0]
            # Nothing new: the next tick counts nothing, the window still holds it all.
            again = feed.tick()
            assert again["gateway"]["decisions_made"] == 0 and again["decisions"] == []
            assert again["window"]["classes"][ALL]["n"] == 7
            # A prefix the router's index no longer holds is not listed.
            worker = WorkerId(holders[0]["id"])
            env.state.dispatch.worker_restarted(worker, env.state.clock())  # an empty cache
            after = feed.tick()
            (row,) = [w for w in after["workers"] if w["id"] == worker]
            assert row["prefixes"] == []

    run(body)


def _events(raw: bytes) -> Iterator[tuple[str, dict[str, object]]]:
    for block in raw.split(b"\n\n"):
        lines = dict(line.split(b": ", 1) for line in block.split(b"\n") if b": " in line)
        if b"event" in lines:
            yield lines[b"event"].decode(), orjson.loads(lines[b"data"])


def test_the_stream_says_hello_then_ticks_and_ends_at_shutdown() -> None:
    async def body() -> None:
        async with gateway_env(1) as env:
            await _ask(env, 2)
            r = await env.client.get("/dashboard/events", headers=ADMIN_HEADERS)
            assert r.status == 200
            assert r.headers["Content-Type"] == "text/event-stream"
            raw = b""
            async with asyncio.timeout(10):
                while raw.count(b"event: tick") < 2:
                    raw += await r.content.readany()
            names = [name for name, _ in _events(raw)]
            assert names[0] == "hello" and names.count("hello") == 1
            hello = next(data for name, data in _events(raw) if name == "hello")
            assert {"history", "recent", "workers", "window"} <= set(hello)
            assert env.client.app[FEED].subscribers == 1
            # Shutdown ends the open stream instead of waiting out the server's timeout.
            t0 = time.monotonic()
            await asyncio.wait_for(env.client.server.close(), 10)
            assert time.monotonic() - t0 < 5

    run(body, timeout=30)


def test_the_decision_stream_is_sampled_to_a_bound_and_rates_scaled_past_the_ring() -> None:
    async def body() -> None:
        async with gateway_env(2, overrides={"decision_log": {"ring_size": 10}}) as env:
            feed = DashboardFeed(env.state, decisions_per_tick=4)
            await _ask(env, 9)
            snap = feed.tick()
            g = snap["gateway"]
            assert (g["decisions_made"], g["decisions_seen"], g["decisions_shown"]) == (9, 9, 3)
            assert [d["sampled_every"] for d in snap["decisions"]] == [3, 3, 3]
            newest = env.state.decisions.recent(1)[0]["request_id"]
            assert snap["decisions"][-1]["request_id"] == newest  # the newest is always shown
            # More finished than the ring holds: the newest ring-full is counted, rates scaled.
            await _ask(env, 25)
            snap = feed.tick()
            g = snap["gateway"]
            assert (g["decisions_made"], g["decisions_seen"]) == (25, 10)
            assert snap["point"]["scale"] == 2.5
            assert len(snap["decisions"]) == 4
            payload = orjson.dumps(feed.hello())
            assert len(payload) < 200_000

    run(body)


def test_evictions_are_counted_with_their_age_and_per_class() -> None:
    async def body() -> None:
        async with gateway_env(1) as env:
            feed = DashboardFeed(env.state)
            feed.tick()
            m = env.state.metrics
            m.eviction_observed(0.5, "document")
            m.eviction_observed(700.0, "document")
            m.eviction_observed(3.0, "conversation")
            ev = feed.tick()["window"]["evictions"]
            assert ev["observed"] == 3
            assert sum(n for _, n in ev["age_buckets"]) == 3  # every class's histogram
            assert ev["by_class"] == {"conversation": 1, "document": 2}

    run(body)


def test_the_drift_alarm_is_the_fleet_detector_s_state() -> None:
    async def body() -> None:
        async with gateway_env(1) as env:
            feed = DashboardFeed(env.state)
            detector = env.state.fleet.drift
            assert detector is not None  # on by default
            drift = feed.tick()["drift"]
            assert drift == {"exported": True, "firing": False, "state": "no alarm", "classes": []}
            # predicted warm, the engine reused nothing, request after request
            for _ in range(detector.params.window):
                detector.observe("document", 20_000, 0)
            drift = feed.tick()["drift"]
            assert drift["firing"] and drift["state"] == "firing: document"
            assert drift["classes"] == [{"prefix_class": "document", "firing": True}]

    run(body)


def test_an_unwatched_feed_counts_nothing_and_a_viewer_starts_it_afresh() -> None:
    async def body() -> None:
        async with gateway_env(1) as env:
            feed = DashboardFeed(env.state, watch_s=60)
            assert not feed.watched
            await _ask(env, 3)
            feed._skip()  # what a tick does while nobody watches
            feed.watch()  # a viewer: a fresh snapshot, from an empty window
            assert feed.watched
            g = feed.latest["gateway"]
            assert g["decisions_made"] == 0 and feed.latest["window"]["classes"][ALL]["n"] == 0
            assert len(feed.hello()["history"]) == 1
            await _ask(env, 2)
            assert feed.tick()["gateway"]["decisions_made"] == 2
            # The app's own feed: a snapshot request makes it watched and answers fresh.
            app_feed = env.client.app[FEED]
            assert not app_feed.watched
            r = await env.client.get("/dashboard/snapshot", headers=ADMIN_HEADERS)
            assert r.status == 200 and app_feed.watched
            assert (await r.json())["window"]["ticks"] == 1

    run(body)


def test_errors_before_routing_are_counted_as_the_metrics_count_them() -> None:
    """Requests answered before routing have no decision record: the window counts them too."""

    async def body() -> None:
        async with gateway_env(1) as env:
            feed = DashboardFeed(env.state)
            await _ask(env, 2)
            bad = [
                await env.client.post("/v1/chat/completions", data=b"{not json"),
                await env.chat("Which model?", model="no-such-model"),
                await env.chat("How long?", max_tokens=-3),
            ]
            assert [r.status for r in bad] == [400, 404, 400]
            window = feed.tick()["window"]
            text = await (await env.client.get("/metrics")).text()
            by_status: dict[str, int] = {}
            errors = 0
            for s in samples(text):
                if s.name != "prefixrouter_requests_total":
                    continue
                if s.labels["decision"] == "none":
                    status = s.labels["status"]
                    by_status[status] = by_status.get(status, 0) + int(s.value)
                errors += int(s.value) if int(s.labels["status"]) >= 400 else 0
            assert window["unrouted"]["by_status"] == by_status == {"400": 2, "404": 1}
            assert window["unrouted"]["total"] == 3
            # The routed errors (the classes') and these: the metric's error count.
            assert window["classes"][ALL]["errors"] + window["unrouted"]["total"] == errors
            # The next window starts from there: nothing new, nothing counted twice.
            assert feed.tick()["window"]["unrouted"]["total"] == 3

    run(body)


def test_a_viewer_after_a_pause_gets_each_recent_decision_once() -> None:
    async def body() -> None:
        async with gateway_env(1) as env:
            feed = DashboardFeed(env.state, watch_s=60)
            await _ask(env, 3)  # while nobody watched, before the feed's next tick
            feed.watch()
            ids = [d["request_id"] for d in feed.hello()["recent"]]
            assert sorted(ids) == sorted(d["request_id"] for d in env.state.decisions.recent(3))
            assert feed.latest["gateway"]["decisions_made"] == 0  # caught up, not counted

    run(body)
