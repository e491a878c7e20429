"""The dashboard page in Debian's Chromium: keys as typed by people, a gateway without one, state.

Fake engines and gateways on loopback, each served from a thread of its own
(:mod:`tests.dashboard.threaded`: Playwright's sync API owns this thread's
loop); Chromium as in ``test_browser.py`` (the system's, a new empty
profile). The test checks that:

* a key with ``%`` and ``&`` opens the page through :func:`dashboard_url`
  (URL-encoded) and leaves the address bar; one pasted unencoded is not a
  script error: it leaves the address bar too and the key form says why;
* the page loads with no console error (no ``/favicon.ico`` 404);
* an ejected worker reads ``ejected``, one whose engine was never reached has
  an ``unknown`` index capacity, and errors before routing are counted;
* without an admin key configured the page says the dashboard is off and
  which setting turns it on, and asks for no key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prefixrouter.gateway.dashboard import dashboard_url
from prefixrouter.harness.faults import until
from prefixrouter.harness.ports import HOST, free_port
from tests.dashboard.test_browser import CHROMIUM_ARGS, SHOW_MS, chromium_path
from tests.dashboard.threaded import Served, served_gateway
from tests.gateway.helpers import Env

KEY = "s3cr%zz&x=1"
"""An admin key chosen by hand: a bare ``%`` and ``&`` (and ``=``)."""
EJECT = {"consecutive_failures": 3, "base_ejection_s": 60.0, "max_ejection_s": 120.0}


def test_dashboard_url_encodes_the_key() -> None:
    url = dashboard_url("http://127.0.0.1:8080/", KEY)
    assert url == "http://127.0.0.1:8080/dashboard#key=s3cr%25zz%26x%3D1"
    assert dashboard_url("http://h:1", "Ab-_9") == "http://h:1/dashboard#key=Ab-_9"
    assert dashboard_url("http://h:1") == "http://h:1/dashboard"


async def _state(env: Env, worker: str) -> str:
    r = await env.client.get("/admin/workers", headers={"Authorization": f"Bearer {KEY}"})
    w = next(w for w in (await r.json())["workers"] if w["id"] == worker)
    return "ejected" if w["ejected"] else "healthy" if w["healthy"] else "down"


async def _eject_w0(env: Env) -> None:
    """w2's engine is never reached: wait until it is down, then fail w0 until it is ejected."""

    async def down() -> bool:
        return await _state(env, "w2") == "down"

    await until(down, "w2 to be down", 10.0)
    env.engines[0].status = 500  # passes /health, fails every answer

    async def ejected() -> bool:
        await env.chat(f"question {free_port()} " * 20)
        return await _state(env, "w0") == "ejected"

    await until(ejected, "w0 to be ejected", 15.0, 0.0)


async def _bad_json(env: Env) -> int:
    return (await env.client.post("/v1/chat/completions", data=b"{not json")).status


@pytest.mark.timeout(120)
def test_the_page_with_keys_people_type_a_gateway_without_one_and_worker_states(
    tmp_path: Path,
) -> None:
    from playwright.sync_api import expect, sync_playwright

    chromium = chromium_path()
    nobody = f"http://{HOST}:{free_port()}"  # nothing listens there
    keyed: dict[str, Any] = {
        "overrides": {"server": {"admin_api_key": KEY}, "outlier": EJECT},
        "worker_options": [{}, {}, {"url": nobody}],
    }
    with (
        served_gateway(3, **keyed) as gw,
        served_gateway(1, overrides={"server": {"admin_api_key": None}}) as open_gw,
        sync_playwright() as pw,
    ):
        gw.call(_eject_w0, timeout=30)
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1440, "height": 1100},
        )
        try:
            _keyed_page(context, gw, expect)
            _unencoded_key(context, gw, expect)
            _no_admin_key(context, open_gw, expect)
        finally:
            context.close()


def _keyed_page(context: Any, gw: Served, expect: Any) -> None:
    """The encoded key opens the page; no console error; the workers' state as the router's."""
    page = context.new_page()
    errors: list[str] = []
    asked: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: asked.append(r.url))
    page.goto(dashboard_url(gw.url, KEY))
    expect(page.get_by_test_id("status")).to_have_text("live", timeout=SHOW_MS)
    assert "key=" not in page.url
    row = page.locator('#workers tr[data-worker="w0"]')
    expect(row.locator("td").nth(1)).to_have_text("ejected", timeout=SHOW_MS)
    expect(row.locator("td.st-ejected")).to_have_count(1)
    expect(page.locator('#workers tr[data-worker="w1"] td').nth(1)).to_have_text("healthy")
    # Never reached: the index's default capacity is not shown as the engine's.
    expect(page.locator('#workers tr[data-worker="w2"] td').nth(8)).to_have_text("0 / unknown")
    expect(page.locator('#workers tr[data-worker="w1"] td').nth(8)).not_to_contain_text("unknown")
    # A request refused before routing: counted, by status.
    assert gw.call(_bad_json) == 400
    expect(page.get_by_test_id("unrouted")).to_have_text("1", timeout=SHOW_MS)
    expect(page.get_by_test_id("unrouted-by")).to_have_text("400 ×1")
    page.reload()  # a second load: the icon, if one were asked for, is asked for again
    expect(page.get_by_test_id("status")).to_have_text("live", timeout=SHOW_MS)
    assert errors == [], errors
    assert not [u for u in asked if u.endswith("/favicon.ico")], asked
    page.close()


def _unencoded_key(context: Any, gw: Served, expect: Any) -> None:
    """A key pasted without encoding: out of the address bar, and the form says why."""
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{gw.url}/dashboard#key={KEY}")
    expect(page.locator("#key-form")).to_be_visible(timeout=SHOW_MS)
    expect(page.locator("#key-error")).to_contain_text("URL-encoded")
    assert "key=" not in page.url and KEY not in page.url
    page.fill("#key", KEY)
    page.click("#key-form button")
    expect(page.get_by_test_id("status")).to_have_text("live", timeout=SHOW_MS)
    assert errors == [], errors
    page.close()


def _no_admin_key(context: Any, gw: Served, expect: Any) -> None:
    """No admin key configured: the page loads and says how to turn the dashboard on."""
    page = context.new_page()
    page.goto(f"{gw.url}/dashboard")
    expect(page.get_by_test_id("status")).to_have_text("dashboard off", timeout=SHOW_MS)
    off = page.get_by_test_id("off")
    expect(off).to_be_visible()
    expect(off).to_contain_text("server.admin_api_key")
    expect(page.locator("#off-detail")).to_contain_text("admin_api_key")
    expect(page.locator("#key-form")).to_be_hidden()
    expect(page.locator("#decisions tbody tr")).to_have_count(0)
    page.close()
