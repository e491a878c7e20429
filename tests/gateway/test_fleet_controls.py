"""Fleet controls live: one-class rollout, the drift alarm and session affinity.

Real HTTP on loopback: three ``python -m prefixrouter.simulated_engine``
processes (real tokenizer and prefix cache; their ``template_clock`` fault
writes the time ahead of every prompt, as a chat template calling
``strftime_now`` does, where no router sees it)
behind three ``python -m prefixrouter.gateway`` processes:

* ``rollout`` (text mode): prefix routing for the ``document`` class only,
  round robin for the rest; the drift test runs on it too (its documents are
  in the prefix group, so the router predicts their reuse);
* ``text`` and ``token``: session affinity in each routing mode, with a
  queue-wait bound small enough that one request in flight on the pinned
  worker breaks the pin.

Processes are started on free ports by the harness's Fleet and stopped by
PID; every wait is bounded. The test that kills an engine runs last.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest

from prefixrouter.harness.engines import reset_prefix_caches
from prefixrouter.harness.processes import Fleet, Server, kill_process
from prefixrouter.prometheus import samples
from tests.admin_client import ADMIN_CONFIG, ADMIN_HEADERS, decisions
from tests.gateway.helpers import gateway_env
from tests.gateway.helpers import run as run_async

ENGINE_ARGS = ["--profile", "tiny-cpu", "--time-scale", "4", "--model", "tiny"]
ENGINE_ARGS += ["--kv-blocks", "8192"]  # no eviction in these tests but the ones they cause
ENGINE_ARGS += ["--fault-injection"]  # the drift test's hidden timestamp
SYSTEM = "You answer questions about the documents you are given."
TEMPLATE_VERSION = "minutes-v7"
BOUND_S = 20.0


def document(seed: int, sections: int = 80) -> str:
    """A long, distinct document (a user message this long is class ``document``)."""
    return " ".join(
        f"Section {seed}.{i}: the committee reviewed item {i * 7 + seed} and approved it."
        for i in range(sections)
    )


GATEWAYS: dict[str, dict[str, Any]] = {
    "rollout": {
        "routing": {"template_version": TEMPLATE_VERSION},
        "rollout": {"enabled": True, "classes": ["document"], "baseline_policy": "round_robin"},
    },
    "text": {"affinity": {"max_wait_s": 0.0005}},
    "token": {"affinity": {"max_wait_s": 0.0005}, "routing": {"mode": "token"}},
}


@dataclass
class Up:
    fleet: Fleet
    engines: dict[str, Server]
    gateways: dict[str, Server]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("fleet-controls")
    with Fleet() as fleet:
        engines = {
            f"e{i}": fleet.start(f"e{i}", "prefixrouter.simulated_engine", ENGINE_ARGS)
            for i in range(3)
        }
        asyncio.run(fleet.wait_healthy(list(engines.values()), timeout_s=30.0))
        gateways = {}
        for name, extra in GATEWAYS.items():
            cfg = tmp / f"{name}.yaml"
            cfg.write_bytes(
                orjson.dumps(  # JSON is YAML
                    {
                        "workers": [{"url": e.url, "id": n} for n, e in engines.items()],
                        "server": ADMIN_CONFIG,
                        "metrics_poll": {"interval_s": 0.5},
                        "health": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0},
                        **extra,
                    }
                )
            )
            gateways[name] = fleet.start(name, "prefixrouter.gateway", ["--config", str(cfg)])
        asyncio.run(fleet.wait_healthy(list(gateways.values()), timeout_s=30.0))
        for gw in gateways.values():  # round robin counts on every worker being routable
            asyncio.run(wait_workers(gw, lambda ws: all(w["healthy"] for w in ws.values())))
        yield Up(fleet, engines, gateways)


async def wait_workers(gw: Server, until: Callable[[dict[str, Any]], bool]) -> None:
    """Poll ``gw``'s ``/admin/workers`` until ``until(worker id -> record)`` (bounded)."""
    async with aiohttp.ClientSession(headers=ADMIN_HEADERS) as s, asyncio.timeout(BOUND_S):
        while True:
            async with s.get(f"{gw.url}/admin/workers") as r:
                workers = {w["id"]: w for w in (await r.json())["workers"]}
            if until(workers):
                return
            await asyncio.sleep(0.1)


@dataclass
class Answer:
    request_id: str
    worker: str
    cached: int
    content: str


async def ask(
    s: aiohttp.ClientSession,
    gw: Server,
    messages: list[dict[str, str]],
    headers: dict[str, str] | None = None,
    *,
    stream: bool = False,
    **extra: Any,
) -> Answer:
    """One chat completion through ``gw`` (a stream asks for its usage chunk)."""
    body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 4, **extra}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    async with s.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        rid, worker = r.headers["X-Request-Id"], r.headers["X-Prefixrouter-Worker"]
        if not stream:
            data = await r.json()
            cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
            return Answer(rid, worker, cached, data["choices"][0]["message"]["content"])
        usage: dict[str, Any] = {}
        async for line in r.content:
            if line.startswith(b"data: {"):
                usage = orjson.loads(line[6:]).get("usage") or usage
        return Answer(rid, worker, usage["prompt_tokens_details"]["cached_tokens"], "")


def chat(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


async def metric(s: aiohttp.ClientSession, gw: Server, name: str, **labels: str) -> float:
    """The value of one sample of ``gw``'s ``/metrics`` (0 when absent)."""
    async with s.get(f"{gw.url}/metrics") as r:
        text = await r.text()
    return sum(
        x.value
        for x in samples(text)
        if x.name == name and all(x.labels.get(k) == v for k, v in labels.items())
    )


async def set_faults(
    s: aiohttp.ClientSession, engines: Iterable[Server], faults: dict[str, Any]
) -> None:
    """Set every engine's faults (``{}``: healthy)."""
    for engine in engines:
        async with s.post(f"{engine.url}/admin/faults", json=faults) as r:
            assert r.status == 200, await r.text()


def run(coro: Any) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, 60)

    return asyncio.run(bounded())


# ---------------------------------------------------------------- rollout


def test_rollout_to_one_class_routes_it_by_prefix_and_the_rest_round_robin(up: Up) -> None:
    gw = up.gateways["rollout"]

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            others = [
                await ask(s, gw, chat(f"Say hello number {i}."), stream=True) for i in range(6)
            ]
            docs = {d: document(d) for d in (1, 2)}  # two: round robin would part them
            answers = {d: [] for d in docs}  # type: dict[int, list[Answer]]
            for q in range(3):
                for d, doc in docs.items():
                    user = f"{doc}\n\nQuestion {q}: what was item {q * 7 + d}?"
                    answers[d].append(await ask(s, gw, chat(user), stream=True))
            # A short request stated to be a document goes with its class.
            stated = await ask(s, gw, chat("Short."), {"X-Prefix-Class": "document"}, stream=True)
            records = {
                r["request_id"]: r
                for r in await decisions(
                    gw.url,
                    [a.request_id for a in (*others, stated)]
                    + [a.request_id for seen in answers.values() for a in seen],
                )
            }
            # The others: round robin, each worker in turn, blind to the cache.
            assert [a.worker for a in others] == ["e0", "e1", "e2", "e0", "e1", "e2"]
            assert {records[a.request_id]["policy"] for a in others} == {"round_robin"}
            # The documents: prefix routing, each question where its document is cached.
            for seen in answers.values():
                assert len({a.worker for a in seen}) == 1, [a.worker for a in seen]
                assert all(a.cached > 1000 for a in seen[1:]), [a.cached for a in seen]
                assert {records[a.request_id]["policy"] for a in seen} == {"prefix_aware"}
            assert records[stated.request_id]["policy"] == "prefix_aware"
            # The metrics set the two groups side by side.
            requests = "prefixrouter_rollout_requests_total"
            assert await metric(s, gw, requests, group="prefix", prefix_class="document") == 7
            assert await metric(s, gw, requests, group="baseline") == 6
            tokens = "prefixrouter_rollout_input_tokens_total"
            cached = await metric(s, gw, tokens, group="prefix", kind="cached")
            assert (
                cached == sum(a.cached for seen in answers.values() for a in seen) + stated.cached
            )
            assert await metric(s, gw, tokens, group="baseline", kind="uncached") > 0
            ttft = "prefixrouter_rollout_ttft_seconds_count"
            assert await metric(s, gw, ttft, group="prefix") == 7
            assert await metric(s, gw, ttft, group="baseline") == 6

    run(main())


# ---------------------------------------------------------------- drift alarm


def test_a_hidden_timestamp_fires_the_drift_alarm_and_clean_requests_clear_it(up: Up) -> None:
    gw = up.gateways["rollout"]
    alarm = "prefixrouter_drift_alarm"
    doc = document(40)

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            assert await metric(s, gw, alarm, prefix_class="document") == 0
            # The engines' template writes the time ahead of the document each
            # time; the router never sees it, so it predicts the document warm.
            await set_faults(s, up.engines.values(), {"template_clock": True})
            try:
                fired_after = None
                for i in range(24):
                    await ask(s, gw, chat(f"{doc}\n\nQuestion {i}?"))
                    if await metric(s, gw, alarm, prefix_class="document") == 1:
                        fired_after = i + 1
                        break
            finally:  # the template fixed: the other tests' engines are healthy
                await set_faults(s, up.engines.values(), {})
            assert fired_after is not None, "the alarm never fired"
            assert (
                await metric(s, gw, "prefixrouter_drift_alarms_total", prefix_class="document") == 1
            )
            assert await metric(s, gw, alarm, prefix_class="session") == 0  # per class
            # Clean requests: the engine's reuse meets the prediction again.
            cleared_after = None
            for i in range(60):
                await ask(s, gw, chat(f"{doc}\n\nClean question {i}?"))
                if await metric(s, gw, alarm, prefix_class="document") == 0:
                    cleared_after = i + 1
                    break
            assert cleared_after is not None, "the alarm never cleared"

    run(main())
    lines = [ln for ln in gw.log_tail(200_000).splitlines() if "drift alarm firing" in ln]
    assert len(lines) == 1, lines  # one line per firing
    (line,) = lines
    assert "prefix class 'document'" in line and f"template version {TEMPLATE_VERSION!r}" in line
    # Reuse ended in the date line, the engine's first block (16 tokens: tiny-cpu).
    found = re.search(r"first divergent position: token (\d+) ", line)
    assert found is not None and int(found.group(1)) <= 16, line
    assert "no volatile field there" in line  # the date is in no text the router saw


# ---------------------------------------------------------------- session affinity


@pytest.mark.parametrize("mode", ["text", "token"])
def test_a_session_sticks_to_its_worker_until_overload_or_eviction_breaks_the_pin(
    up: Up, mode: str
) -> None:
    gw = up.gateways[mode]
    session = {"X-Session-ID": f"conversation-{mode}"}
    history = chat(f"{document(70 + len(mode))}\n\nSummarise section 1.")

    async def turn(s: aiohttp.ClientSession, question: str, **kw: Any) -> dict[str, Any]:
        answer = await ask(s, gw, [*history, {"role": "user", "content": question}], session, **kw)
        history.extend(
            [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer.content},
            ]
        )
        (record,) = await decisions(gw.url, [answer.request_id])
        return {**record, "cached": answer.cached}

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            first = await turn(s, "Who chaired the meeting?")
            assert "affinity" not in first  # no pin yet: the policy decided
            home = first["selected_worker"]
            for q in range(3):
                rec = await turn(s, f"And what about item {q}?")
                assert (rec["affinity"], rec["tier"], rec["selected_worker"]) == (
                    "hit",
                    "affinity",
                    home,
                )
                assert rec["cached"] > 500  # the worker did hold the history
            # Overloaded: a turn streaming on the pinned worker, then the next one.
            # (1,000 tokens: 0.75 s on the engine, the next turn is routed meanwhile)
            body = {"model": "tiny", "messages": history, "max_tokens": 1000, "stream": True}
            async with s.post(f"{gw.url}/v1/chat/completions", json=body, headers=session) as r:
                assert r.status == 200 and r.headers["X-Prefixrouter-Worker"] == home
                await r.content.readline()  # its first byte: in flight on the worker
                busy = await turn(s, "Meanwhile, who took the minutes?")
                await r.read()
            assert busy["affinity"] == "overloaded", busy["reason"]
            assert busy["reason"].startswith("session pin broken (overloaded)")
            home = busy["selected_worker"]  # the pin moved with the turn
            rec = await turn(s, "Which items were deferred?")
            assert (rec["affinity"], rec["selected_worker"]) == ("hit", home)
            # Evicted: the engine loses the history; once the router learns it, the pin breaks.
            await reset_prefix_caches([up.engines[home].url], announce=False)
            seen = [await turn(s, f"Was item {q} approved?") for q in range(3)]
            results = [r["affinity"] for r in seen]
            assert "evicted" in results, results
            assert results[: results.index("evicted")] == ["hit"] * results.index("evicted")
            assert await metric(s, gw, "prefixrouter_affinity_total", result="hit") >= 5
            for why in ("overloaded", "evicted"):
                assert await metric(s, gw, "prefixrouter_affinity_total", result=why) == 1
            assert await metric(s, gw, "prefixrouter_affinity_total", result="new") == 1
            assert await metric(s, gw, "prefixrouter_affinity_sessions") == 1

    run(main())


def test_a_dead_worker_breaks_the_pin(up: Up) -> None:
    """Runs last: it kills an engine."""
    gw = up.gateways["text"]
    session = {"X-Session-ID": "conversation-dead"}
    history = chat(f"{document(90)}\n\nSummarise it.")

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            first = await ask(s, gw, history, session)
            kill_process(up.engines[first.worker].process)
            # Until the gateway's health checks see the worker down.
            await wait_workers(gw, lambda ws: not ws[first.worker]["healthy"])
            again = await ask(s, gw, [*history, {"role": "user", "content": "More?"}], session)
            (rec,) = await decisions(gw.url, [again.request_id])
            assert rec["affinity"] == "down" and again.worker != first.worker
            assert await metric(s, gw, "prefixrouter_affinity_total", result="down") == 1

    run(main())


def test_an_engine_that_counts_prompts_otherwise_is_named_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Token mode: the fake engine counts 4 characters a token, the router's tokenizer
    about 2.5 here; after MISCOUNTS_TO_WARN prompts one warning names the worker."""
    from prefixrouter.gateway.fleet import MISCOUNTS_TO_WARN, miscounted

    assert not miscounted(1000, 1001) and not miscounted(100, 108)  # a special token or two
    assert miscounted(1461, 1006) and miscounted(100, 120)

    async def body() -> None:
        async with gateway_env(1, {"routing": {"mode": "token"}}) as env:
            for i in range(MISCOUNTS_TO_WARN + 3):
                r = await env.chat(f"Question {i}: " + "The quick brown fox. " * 60)
                assert r.status == 200

    with caplog.at_level(logging.WARNING, logger="prefixrouter.gateway"):
        run_async(body)
    said = [r.getMessage() for r in caplog.records]
    lines = [m for m in said if "prompt tokens where the router counted" in m]
    assert len(lines) == 1 and lines[0].startswith("worker w0 counted")
    assert "routing.tokenizer" in lines[0]
