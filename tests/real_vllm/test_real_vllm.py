"""The router against real vLLM CPU engines: exact predictions, evictions, TTFT, tenants, restarts.

Run with ``pytest -m vllm`` (see ``tests/real_vllm/conftest.py`` for the
fleet). The tests share one fleet and run in file order; each uses documents
of its own, so one test's cache contents never decide another's result.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from typing import Any

import pytest

from prefixrouter.core.dispatch import Dispatcher
from prefixrouter.core.hashing import BlockHasher
from prefixrouter.core.policy import create_policy
from prefixrouter.core.router import Router
from prefixrouter.core.types import CacheNamespace, WorkerId
from prefixrouter.harness.ports import free_port
from prefixrouter.real_engines.kv_subscriber import KvEventSubscriber
from prefixrouter.real_engines.vllm_fleet import VllmEngine
from tests.cluster.live import metric
from tests.real_vllm.conftest import (
    BLOCK,
    KV_BLOCKS,
    VllmCluster,
    chat,
    decisions,
    document,
    post_chat,
    until,
    workers,
)

pytestmark = pytest.mark.vllm


def test_a_repeated_documents_are_predicted_exactly(vllm: VllmCluster) -> None:
    gw = vllm.gateway
    assert gw is not None

    async def body() -> None:
        ids = []
        for doc_seed in (101, 102):
            doc = document(doc_seed, 3000)
            for q in range(3):
                ids.append((await post_chat(gw.url, chat(doc, f"Question {q}?")))["id"])
        recs = await decisions(gw, ids)
        for i, r in enumerate(recs):
            actual, predicted = r["actual_cached_tokens"], r["predicted_cached_tokens"]
            print(f"{r['selected_worker']} predicted {predicted} actual {actual}")
            assert actual % BLOCK == 0
            if i % 3 == 0:
                assert actual == 0  # a new document: cold
            else:
                assert actual >= 2900  # the document is cached...
            assert predicted == actual  # ...and the router knew exactly how much

    asyncio.run(body())


def test_b_evicted_blocks_are_no_longer_predicted(vllm: VllmCluster) -> None:
    gw = vllm.gateway
    assert gw is not None

    async def body() -> None:
        doc = document(201, 8000)
        first = await post_chat(gw.url, chat(doc, "First?"))
        worker = first["worker"]
        before = (await workers(gw))[worker]["kv_events"]["removed_events"]
        # Three other 8k documents straight to that engine: its 20k-token pool
        # must evict. Only the engine's BlockRemoved events can tell the router.
        url = vllm.engine_url(worker)
        for seed in (202, 203, 204):
            await post_chat(url, chat(document(seed, 8000), "Fill?"))

        async def removed() -> bool:
            return bool((await workers(gw))[worker]["kv_events"]["removed_events"] > before)

        await until(removed, 10, "BlockRemoved events")
        again = await post_chat(gw.url, chat(doc, "Again?"))
        (rec,) = await decisions(gw, [again["id"]])
        print(
            f"after eviction: {rec['selected_worker']} predicted "
            f"{rec['predicted_cached_tokens']} actual {rec['actual_cached_tokens']}"
        )
        assert rec["actual_cached_tokens"] < 7900  # the document was (partly) evicted
        assert rec["predicted_cached_tokens"] == rec["actual_cached_tokens"]

    asyncio.run(body())


async def doc_qa(url: str, seeds: list[int], questions: int, gap_s: float) -> list[dict[str, Any]]:
    """Questions on each document, rounds in shuffled order, one request every ``gap_s``.

    Four 8,000-token documents on two engines whose pools hold 20,480 tokens
    each: two documents per engine fit, all four on one do not. The order is
    shuffled per round (seeded) so that round robin does not pin documents to
    engines by accident. Each result also names its document (``doc``).
    """
    docs = {s: document(s, 8000) for s in seeds}
    tasks = []
    asked = []
    for q in range(questions):
        order = list(seeds)
        random.Random(q).shuffle(order)
        for s in order:
            body = chat(docs[s], f"Question {q} about document {s}?")
            tasks.append(asyncio.create_task(post_chat(url, body)))
            asked.append(s)
            await asyncio.sleep(gap_s)
    return [{**r, "doc": s} for r, s in zip(await asyncio.gather(*tasks), asked, strict=True)]


def print_placement(
    name: str, out: list[dict[str, Any]], records: list[dict[str, Any]] | None
) -> None:
    """Per request, in arrival order: document, engine, cached tokens, and the decision.

    What a failing run needs to be read: where each document went, round by
    round, and (for our gateway) the tier, prediction and reason of each decision.
    """
    print(f"--- {name}: placement in arrival order")
    for i, r in enumerate(out):
        cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        line = f"{i:2d} doc {r['doc']} -> {r['worker']} ttft {r['ttft_s']:.2f} s cached {cached}"
        if records is not None:
            d = records[i]
            line += f" | {d['tier']} predicted {d['predicted_cached_tokens']}: {d['reason'][:110]}"
        print(line)


def test_c_doc_qa_ttft_beats_round_robin(vllm: VllmCluster) -> None:
    gw = vllm.gateway
    assert gw is not None
    seeds = [301, 302, 303, 304]
    rr = vllm.start_gateway("round_robin", events=False, name="rr")
    results = {}
    try:
        for name, url in (("round_robin", rr.url), ("prefix_aware", gw.url)):
            vllm.reset_caches()
            t0 = time.monotonic()
            out = asyncio.run(doc_qa(url, seeds, questions=8, gap_s=0.5))
            records = None
            if name == "prefix_aware":
                records = asyncio.run(decisions(gw, [r["id"] for r in out]))
            print_placement(name, out, records)
            ttfts = [r["ttft_s"] for r in out]
            usage = [r["usage"] for r in out]
            cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
            prompt = sum(u["prompt_tokens"] for u in usage)
            results[name] = (statistics.mean(ttfts), cached / prompt)
            print(
                f"{name}: mean TTFT {statistics.mean(ttfts):.3f} s, "
                f"p50 {statistics.median(ttfts):.3f} s, cached {cached / prompt:.1%}, "
                f"{time.monotonic() - t0:.0f} s"
            )
    finally:
        vllm.stop_gateway(rr)
    ratio = results["prefix_aware"][0] / results["round_robin"][0]
    print(f"TTFT ratio prefix_aware / round robin: {ratio:.2f}")
    assert results["prefix_aware"][1] > results["round_robin"][1]
    assert results["prefix_aware"][1] >= 0.8  # the ceiling is 7/8: each document's first ask
    assert ratio < 1.0


def test_d_salted_tenants_share_nothing(vllm: VllmCluster) -> None:
    gw = vllm.gateway
    assert gw is not None

    async def body() -> None:
        doc = document(401, 3000)
        acme = [
            (await post_chat(gw.url, chat(doc, f"A{i}?"), {"Authorization": "Bearer k-acme"}))["id"]
            for i in range(2)
        ]
        globex = (await post_chat(gw.url, chat(doc, "G?"), {"Authorization": "Bearer k-globex"}))[
            "id"
        ]
        a0, a1, g = await decisions(gw, [*acme, globex])
        print(
            f"acme {a1['predicted_cached_tokens']}/{a1['actual_cached_tokens']}, "
            f"globex {g['predicted_cached_tokens']}/{g['actual_cached_tokens']}"
        )
        assert a0["actual_cached_tokens"] == 0
        assert a1["actual_cached_tokens"] >= 2900
        assert a1["predicted_cached_tokens"] == a1["actual_cached_tokens"]
        assert g["actual_cached_tokens"] == 0  # the engine kept the salts apart
        assert g["predicted_cached_tokens"] == 0  # and the router never predicted a share

    asyncio.run(body())


def test_e_killed_engine_is_dropped_and_comes_back_cold(vllm: VllmCluster) -> None:
    """Down: out of routing, its entries kept (speculative). Back as a new process:
    vLLM's ``process_start_time_seconds`` changed, so its entries are cleared."""
    gw = vllm.gateway
    assert gw is not None

    async def body() -> VllmEngine:
        doc = document(501, 3000)
        first = await post_chat(gw.url, chat(doc, "Before?"))
        victim_id = first["worker"]
        assert (await workers(gw))[victim_id]["index_blocks"] > 0
        victim = next(e for e in vllm.engines.engines if vllm.worker_id(e.index) == victim_id)
        vllm.engines.kill(victim)
        # Requests keep succeeding, on the other engine (retried before any byte).
        during = [await post_chat(gw.url, chat(doc, f"During {i}?")) for i in range(3)]
        assert all(r["worker"] != victim_id for r in during)
        state = (await workers(gw))[victim_id]
        assert not state["healthy"]
        assert state["index_blocks"] > 0  # kept through the outage, as speculative entries
        return victim

    victim = asyncio.run(body())
    new = vllm.engines.restart(victim)  # same port, topic and replay socket; cold

    async def after() -> None:
        victim_id = vllm.worker_id(new.index)

        async def healthy() -> bool:
            return bool((await workers(gw))[victim_id]["healthy"])

        await until(healthy, 30, "the restarted engine to be healthy again")
        state = (await workers(gw))[victim_id]
        assert state["restarts"] == 1 and state["index_blocks"] == 0  # a new process: cleared
        # A burst of new documents: the restarted engine is empty and idle, so
        # it takes its share, cold. (One at a time, both engines idle, every
        # request would go to whichever predicts faster: that is not a
        # restarted engine being avoided, so the burst is concurrent.)
        out = await asyncio.gather(
            *(post_chat(gw.url, chat(document(510 + i, 3000), "New?")) for i in range(4))
        )
        mine = [r for r in out if r["worker"] == victim_id]
        assert mine, "the restarted engine never got a request"
        (rec,) = await decisions(gw, [mine[0]["id"]])
        assert rec["actual_cached_tokens"] == 0 and rec["predicted_cached_tokens"] == 0

    asyncio.run(after())


def test_f_metrics_and_replay_socket_of_a_real_engine(vllm: VllmCluster) -> None:
    """The block size and KV size come from vLLM's metrics; the replay protocol works."""
    gw = vllm.gateway
    assert gw is not None
    engine = vllm.engines.engines[0]

    async def body() -> None:
        state = (await workers(gw))[vllm.worker_id(engine.index)]
        assert state["engine"]["block_size"] == BLOCK
        assert state["engine"]["num_blocks"] == KV_BLOCKS
        assert state["view"]["kv_capacity_blocks"] == KV_BLOCKS
        # Make sure the engine has published something, then ask its replay
        # socket for everything it buffered, through a subscriber of our own
        # (not bound where the engines publish).
        await post_chat(engine.url, chat(document(601, 1000), "Replay?"))
        router = Router(create_policy("prefix_aware"), BlockHasher(block_size=BLOCK))
        sub = KvEventSubscriber(f"tcp://127.0.0.1:{free_port()}", Dispatcher(router), lambda: 0.0)
        seed = CacheNamespace("tiny").seed
        feed = sub.add_worker(
            WorkerId("r"), "unused", lambda lora, salt: seed, engine.replay_endpoint
        )
        await sub.start()
        try:
            applied = await sub.replay(feed, 0, 1 << 62)
        finally:
            await sub.stop()
        print(f"replayed {applied} batches, {feed.stats.stored} BlockStored")
        assert applied > 0 and feed.stats.stored > 0
        assert router.index.blocks_of(WorkerId("r")) > 0

    asyncio.run(body())


def test_g_text_mode_predicts_a_document_before_its_first_answer(vllm: VllmCluster) -> None:
    """Text mode: a request sent during a document's first request is predicted within 5 %.

    The gateway has no tokenizer; it learns characters per token from vLLM
    (about 1.9 for the tiny model's tokenizer, against a 4.0 prior). The
    first answer about a document comes only after its prefill and decode,
    so the count the gateway asks of vLLM's ``POST /tokenize`` when it routes
    the first request is what teaches the document's estimate in time.
    """
    gw = vllm.start_gateway("prefix_aware", events=False, name="text", mode="text")

    async def body() -> None:
        ids, cached = [], []
        for n, doc_seed in enumerate((701, 702)):
            doc = document(doc_seed, 3000)
            # Decodes long enough that its answer is not back before the second's.
            first = asyncio.create_task(post_chat(gw.url, chat(doc, "Question 0?", 4000)))
            await until(lambda n=n: _counted(gw.url, n + 1), 60, "the document's token count")
            second = await post_chat(gw.url, chat(doc, "Question 1?"))
            assert not first.done()  # no answer about this document has come back
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            ids.append(second["id"])
            cached.append(second["usage"]["prompt_tokens_details"]["cached_tokens"])
        for rec, actual in zip(await decisions(gw, ids), cached, strict=True):
            predicted = rec["predicted_cached_tokens"]
            print(f"text mode: predicted {predicted} actual {actual}")
            assert rec["actual_cached_tokens"] == actual >= 2900
            assert abs(predicted - actual) <= 0.05 * actual

    try:
        asyncio.run(body())
    finally:
        vllm.stop_gateway(gw)


async def _counted(url: str, n: float) -> bool:
    """At least ``n`` token counts came back to the gateway at ``url``."""
    return await metric(url, "prefixrouter_token_counts_total", {"outcome": "ok"}) >= n
