"""The dashboard in a real browser: Debian's Chromium, driven by Playwright.

Two ``prefixrouter engine`` processes behind a gateway (``conftest.live``)
get questions about three documents plus unique prompts; Chromium (the
system's, never a downloaded one: ``executable_path``, a new empty profile,
no network but loopback) opens ``/dashboard#key=...`` and the test checks
that the live figures appear, that they change when more traffic comes,
that clicking a decision explains it (its candidates with their cost terms,
the tier, the reason), that without the key the page asks for it, and that
the page loaded nothing from anywhere but the gateway. It saves a screenshot
in the test's temporary directory; with ``PREFIXROUTER_DASHBOARD_PNG=PATH``
it sends half a minute more traffic and saves one at ``PATH`` too
(``docs/dashboard.png`` is made this way).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.dashboard.conftest import Live
from tests.dashboard.traffic import send

# Bounds on what the page must show after the gateway's next tick (one a
# second): generous, a loaded machine is slow, never this slow.
SETUP_CHROMIUM = Path(__file__).resolve().parents[2] / "scripts" / "setup_chromium.sh"
SHOW_MS = 15_000
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def _number(text: str) -> float:
    cleaned = text.replace(",", "").replace("%", "").strip()
    return float(cleaned) if re.fullmatch(r"-?\d+(\.\d+)?", cleaned) else float("nan")


def _traffic(url: str, rounds: int, unique: int, seed: int) -> int:
    # In its own thread: Playwright's sync API owns this thread's event loop.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, send(url, rounds, unique, seed)).result(timeout=90)


@pytest.mark.timeout(120)
def chromium_path() -> str:
    """Debian's chromium, installed on a fresh machine as the README's test command needs."""
    chromium = shutil.which("chromium")
    if chromium is None:
        subprocess.run(["bash", str(SETUP_CHROMIUM)], check=False, timeout=600)
        chromium = shutil.which("chromium")
    assert chromium, f"the dashboard test drives Debian's chromium ({SETUP_CHROMIUM.name} failed)"
    return chromium


def test_the_dashboard_shows_live_figures_and_explains_a_decision(
    live: Live, tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    chromium = chromium_path()
    assert _traffic(live.url, rounds=3, unique=3, seed=1) == 12

    outside: list[str] = []
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # a new, empty user-data-dir
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1440, "height": 1100},
        )
        try:
            page = context.new_page()
            page.on(
                "request",
                lambda req: None if req.url.startswith(live.url) else outside.append(req.url),
            )
            page.goto(f"{live.url}/dashboard#key={live.key}")
            expect(page.get_by_test_id("status")).to_have_text("live", timeout=SHOW_MS)
            # The key left the address bar (it stays in the tab's session storage).
            assert "key=" not in page.url

            # Every worker, with figures.
            rows = page.locator("#workers tbody tr")
            expect(rows).to_have_count(2, timeout=SHOW_MS)
            for worker in live.workers:
                expect(page.locator(f'#workers tr[data-worker="{worker}"]')).to_contain_text(
                    "healthy"
                )
            # Traffic from before the page opened: the prefixes and decisions it left in the
            # decision log's ring are there at once (the rates start with the first viewer).
            held = page.locator("#workers td.prefixes").filter(has_text="document")
            expect(held).not_to_have_count(0, timeout=SHOW_MS)
            decisions = page.locator("#decisions tbody tr")
            expect(decisions).not_to_have_count(0, timeout=SHOW_MS)
            requests = page.get_by_test_id("requests-total")
            expect(requests).to_have_text(re.compile(r"^\d[\d,]*$"), timeout=SHOW_MS)
            before = _number(requests.inner_text())
            assert before >= 12
            expect(page.get_by_test_id("drift")).to_have_text("no alarm")

            # Traffic while it watches: the figures appear, then move.
            assert _traffic(live.url, rounds=2, unique=4, seed=2) == 10
            page.wait_for_function(
                "([id, before]) => Number(document.getElementById(id).textContent"
                ".replace(/,/g, '')) >= before + 10",
                arg=["t-requests", before],
                timeout=SHOW_MS,
            )
            share = page.get_by_test_id("cached-share")
            expect(share).to_have_text(re.compile(r"^\d+\.\d %$"), timeout=SHOW_MS)
            assert _number(share.inner_text()) > 0
            expect(page.locator("#c-ttft path.series")).not_to_have_count(0, timeout=SHOW_MS)
            document = page.locator("#classes tr[data-class=document] td").nth(1)
            expect(document).to_have_text(re.compile(r"^\d+$"), timeout=SHOW_MS)
            counted = _number(document.inner_text())
            assert counted >= 6
            assert _traffic(live.url, rounds=2, unique=0, seed=3) == 6
            page.wait_for_function(
                "(before) => Number(document.querySelector("
                "'#classes tr[data-class=document] td:nth-child(2)').textContent) >= before + 6",
                arg=counted,
                timeout=SHOW_MS,
            )

            # Click a decision about a document: it is explained.
            row = decisions.filter(has_text="document").first
            request_id = row.get_attribute("data-request")
            row.click()
            explain = page.get_by_test_id("explain")
            expect(explain).to_contain_text("Why ")
            expect(explain).to_contain_text(request_id or "")
            expect(explain).to_contain_text("reason")
            expect(explain).to_contain_text("tier")
            candidates = explain.locator("[data-testid=candidates] tbody tr")
            expect(candidates).to_have_count(2)
            expect(explain.locator("tr.chosen")).to_have_count(1)
            head = explain.locator("[data-testid=candidates] thead")
            expect(head).to_contain_text("queue wait ms")
            # The holders' KV wait on what finishing requests free (holder_kv_wait).
            expect(head).to_contain_text("memory (freed) ms")
            expect(explain).to_contain_text("actual cached")

            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.read_bytes()[:4] == b"\x89PNG"
            if target := os.environ.get("PREFIXROUTER_DASHBOARD_PNG"):
                # For the README: half a minute of traffic first, so the charts have a history.
                end = time.monotonic() + 30
                seed = 100
                while time.monotonic() < end:
                    _traffic(live.url, rounds=1, unique=2, seed=seed)
                    seed += 1
                    page.wait_for_timeout(300)  # pacing the traffic, not waiting on a condition
                page.screenshot(path=target, full_page=True)

            # A tab without the key is asked for it; the key opens the stream.
            other = context.new_page()
            other.goto(f"{live.url}/dashboard")
            expect(other.locator("#key-form")).to_be_visible(timeout=SHOW_MS)
            expect(other.get_by_test_id("status")).to_have_text("admin key needed")
            other.fill("#key", live.key)
            other.click("#key-form button")
            expect(other.get_by_test_id("status")).to_have_text("live", timeout=SHOW_MS)
        finally:
            context.close()
    assert outside == [], f"the dashboard loaded from elsewhere: {outside}"
