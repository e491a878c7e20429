"""Replicas over a real NATS JetStream: shared placement, replay, faults, refusal, tenancy.

Real processes on loopback: a ``nats-server -js`` with a temporary store,
two simulated engines (module-wide; every test uses documents of its own),
and per test its gateway replicas (``python -m prefixrouter.gateway
--cluster ... --replica-id ...``), all stopped by PID. What a replica
predicted is read from its decision records (``/admin/decisions``); where a
request went, from the ``X-Prefixrouter-Worker`` header.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from nats import connect as nats_connect

from prefixrouter.harness.health import wait_healthy
from prefixrouter.harness.nats import NatsServer
from prefixrouter.harness.processes import Fleet, Server, kill_process
from prefixrouter.harness.replicas import start_replica, wait_ready_async
from tests.cluster.live import (
    cached,
    chat,
    decision,
    doc,
    get_status,
    metric,
    post,
    start_engines,
    synced,
    until,
    write_config,
)
from tests.core.test_text_estimate import documents


@pytest.fixture(scope="module")
def engines() -> Iterator[list[Server]]:
    with Fleet() as fleet:
        servers = start_engines(fleet, 2)
        wait_healthy(servers, 30.0)
        yield servers


@pytest.fixture
def nats() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    with Fleet() as f:
        yield f


def _run(coro: object) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(coro, 90)  # type: ignore[arg-type]

    asyncio.run(bounded())


async def _start(fleet: Fleet, cfg: Path, nats: NatsServer, *ids: str) -> list[Server]:
    servers = [start_replica(fleet, cfg, nats.url, rid) for rid in ids]
    await wait_ready_async(servers, 30.0)
    return servers


async def _warm_through(a: Server, b: Server, text: str, **kw: str) -> None:
    """``text`` through ``a``, then through ``b``: ``b`` predicts it warm on ``a``'s worker."""
    headers = kw or None
    st, ha, body = await post(a.url, chat(text + " Q1?"), headers)
    assert st == 200 and cached(body) < 100  # cold: at most the shared template's first block
    await synced(a.url, b.url)
    st, hb, body = await post(b.url, chat(text + " Q2?"), headers)
    assert st == 200
    assert hb["X-Prefixrouter-Worker"] == ha["X-Prefixrouter-Worker"]
    rec = await decision(b.url, hb["X-Request-Id"])
    assert rec["predicted_cached_tokens"] > 500, rec
    assert cached(body) > 500


async def _refused(nats: NatsServer, cfg: Path, replica: str) -> list[str]:
    """Start a replica that must be refused: its stderr lines (exit status 2, no traceback)."""
    cmd = [sys.executable, "-m", "prefixrouter.gateway", "--config", str(cfg)]
    cmd += ["--port", "0", "--cluster", nats.url, "--replica-id", replica]
    proc = await asyncio.to_thread(
        subprocess.run, cmd, capture_output=True, timeout=60, check=False
    )
    err = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 2, err
    assert not any("Traceback" in line for line in err)
    assert [line for line in err if line.startswith("error:")] == [err[-1]]
    return err


def test_a_document_through_a_then_b_is_warm_on_as_worker(
    engines: list[Server], nats: NatsServer, fleet: Fleet, tmp_path: Path
) -> None:
    async def body() -> None:
        cfg = write_config(tmp_path / "gw.yaml", engines)
        a, b = await _start(fleet, cfg, nats, "a", "b")
        await _warm_through(a, b, doc(1))
        # Lag was measured on live messages, and every fact reached b.
        assert await metric(b.url, "prefixrouter_cluster_propagation_lag_seconds_count") > 0
        assert await metric(b.url, "prefixrouter_cluster_peers") == 1
        assert await metric(b.url, "prefixrouter_cluster_connected") == 1

    _run(body())


def test_a_replica_started_later_replays_then_routes_warm(
    engines: list[Server], nats: NatsServer, fleet: Fleet, tmp_path: Path
) -> None:
    async def body() -> None:
        # A stream that takes a while to replay: many facts before c starts.
        cfg = write_config(tmp_path / "gw.yaml", engines)
        (a,) = await _start(fleet, cfg, nats, "a")
        text = doc(2)
        st, ha, _ = await post(a.url, chat(text + " Q1?"))
        assert st == 200
        await until(lambda: metric(a.url, "prefixrouter_cluster_facts_published_total"), "a")
        published = await metric(a.url, "prefixrouter_cluster_facts_published_total")
        c = start_replica(fleet, cfg, nats.url, "c")
        seen: list[int] = []

        async def ready() -> bool:
            try:
                status, _ = await get_status(c.url + "/ready")
            except OSError:
                return False
            seen.append(status)
            return status == 200

        await until(ready, "c to be ready")
        # Listening before it was ready: /ready answered 503 at least once
        # (the fingerprint check alone lasts 1.5 heartbeats).
        assert 503 in seen, seen
        # Ready means replayed: everything a published before c started is applied.
        assert await metric(c.url, "prefixrouter_cluster_facts_applied_total") >= published
        status, _ = await get_status(c.url + "/health")
        assert status == 200
        st, hc, body = await post(c.url, chat(text + " Q2?"))  # its first request
        assert st == 200 and hc["X-Prefixrouter-Worker"] == ha["X-Prefixrouter-Worker"]
        rec = await decision(c.url, hc["X-Request-Id"])
        assert rec["predicted_cached_tokens"] > 500
        assert cached(body) > 500

    _run(body())


def test_a_sigkilled_replica_the_others_stay_warm_and_its_in_flight_expires(
    engines: list[Server], nats: NatsServer, fleet: Fleet, tmp_path: Path
) -> None:
    async def body() -> None:
        cfg = write_config(tmp_path / "gw.yaml", engines)
        a, b = await _start(fleet, cfg, nats, "a", "b")
        text = doc(3)
        st, _, _ = await post(a.url, chat(text + " Q1?"))
        assert st == 200
        # Long streams in flight through a, seen by b as a's in-flight routings.
        streams = [
            asyncio.ensure_future(post(a.url, chat(text + f" L{i}?", max_tokens=2000)))
            for i in range(4)
        ]

        async def b_sees_in_flight() -> bool:
            return await metric(b.url, "prefixrouter_worker_in_flight") >= 4

        await until(b_sees_in_flight, "b to count a's routings in flight")
        kill_process(a.process)  # SIGKILL: no settlement of them will ever come
        ended = await asyncio.gather(*streams, return_exceptions=True)
        assert all(isinstance(e, Exception) for e in ended), ended  # cut by the kill
        fleet.servers.remove(a)

        async def expired() -> bool:
            return await metric(b.url, "prefixrouter_worker_in_flight") == 0

        await until(expired, "a's in-flight counts to expire on b")
        assert await metric(b.url, "prefixrouter_cluster_peers_gone_total") >= 1
        # b still routes a's document warm, from what a told it: b routed nothing
        # before, and a may have copied the document to the other engine for
        # its four streams (both engines hold it then; either one is warm).
        st, hb, body = await post(b.url, chat(text + " Q2?"))
        assert st == 200
        rec = await decision(b.url, hb["X-Request-Id"])
        chosen = next(c for c in rec["candidate_workers"] if c["worker"] == rec["selected_worker"])
        assert chosen["matched_tokens"] > 500, rec
        assert cached(body) > 500, rec

    _run(body())


def test_nats_stopped_and_restarted_routing_goes_on_and_catches_up(
    engines: list[Server], nats: NatsServer, fleet: Fleet, tmp_path: Path
) -> None:
    async def body() -> None:
        cfg = write_config(tmp_path / "gw.yaml", engines)
        a, b = await _start(fleet, cfg, nats, "a", "b")
        await _warm_through(a, b, doc(4))
        nats.stop()

        async def disconnected() -> bool:
            return await metric(a.url, "prefixrouter_cluster_connected") == 0

        await until(disconnected, "a to see NATS gone")
        # Routing continues on a's own view.
        text = doc(5)
        st, ha, _ = await post(a.url, chat(text + " Q1?"))
        assert st == 200
        st, _, body = await post(a.url, chat(text + " Q1b?"))
        assert st == 200 and cached(body) > 500
        nats.start()

        async def reconnected() -> bool:
            ok = await metric(a.url, "prefixrouter_cluster_connected") == 1
            return ok and await metric(b.url, "prefixrouter_cluster_connected") == 1

        await until(reconnected, "both to reconnect")
        # One line said NATS was gone (not one per failed reconnect), one that it is back.
        lines = a.log_tail(1_000_000).splitlines()
        assert sum("lost the connection to NATS" in line for line in lines) == 1, lines
        assert sum("reconnected to NATS" in line for line in lines) == 1, lines
        # Catch-up: what a routed while NATS was away reaches b (a's client
        # buffered it; b catches up from the stream, then goes live again).
        await synced(a.url, b.url)
        st, hb, body = await post(b.url, chat(text + " Q2?"))
        assert st == 200 and hb["X-Prefixrouter-Worker"] == ha["X-Prefixrouter-Worker"]
        rec = await decision(b.url, hb["X-Request-Id"])
        assert rec["predicted_cached_tokens"] > 500, rec
        # And live sync after the restart.
        await _warm_through(a, b, doc(6))

    _run(body())


def test_an_incompatible_replica_is_refused_with_the_field_named(
    engines: list[Server], nats: NatsServer, fleet: Fleet, tmp_path: Path
) -> None:
    async def body() -> None:
        cfg = write_config(tmp_path / "gw.yaml", engines)
        (a,) = await _start(fleet, cfg, nats, "a")
        other = write_config(tmp_path / "other.yaml", engines, routing={"chunk_chars": 128})
        err = await _refused(nats, other, "z")
        assert "routing.chunk_chars" in err[-1] and "'a'" in err[-1]
        # a is not disturbed.
        status, _ = await get_status(a.url + "/ready")
        assert status == 200

    _run(body())


def test_tenant_isolation_holds_across_replicas(
    engines: list[Server], nats: NatsServer, fleet: Fleet, tmp_path: Path
) -> None:
    async def body() -> None:
        cfg = write_config(tmp_path / "gw.yaml", engines)
        a, b = await _start(fleet, cfg, nats, "a", "b")
        text = doc(7)
        acme = {"Authorization": "Bearer k-acme"}
        globex = {"Authorization": "Bearer k-globex"}
        await _warm_through(a, b, text, **acme)
        # globex sends the same document through b: nothing of acme's is warm for it.
        st, hg, body = await post(b.url, chat(text + " Q3?"), globex)
        assert st == 200
        rec = await decision(b.url, hg["X-Request-Id"])
        assert rec["predicted_cached_tokens"] == 0, rec
        assert cached(body) < 100  # the engine keeps acme's blocks apart too (its salt)

    _run(body())


def test_a_new_documents_token_count_reaches_the_peers_before_its_answer(
    engines: list[Server], nats: NatsServer, fleet: Fleet, tmp_path: Path
) -> None:
    """Text mode: A's engine count of a new document teaches B too, before any answer.

    A document of numbers (about 1.7 characters per token, far from the 4.0
    prior) goes through A with a long answer; once A's count is back and B
    has A's facts, B routes a second question about it, while the first
    still decodes: B predicts the engine's reuse within 5 %.
    """

    async def body() -> None:
        cfg = write_config(tmp_path / "gw.yaml", engines)
        a, b = await _start(fleet, cfg, nats, "a", "b")
        text = "Replica count test.\n" + documents()["numbers"]
        first = asyncio.create_task(post(a.url, chat(text + " Q1?", max_tokens=3000)))
        ok = {"outcome": "ok"}

        async def counted() -> bool:
            return await metric(a.url, "prefixrouter_token_counts_total", ok) >= 1

        await until(counted, "A's token count")
        await synced(a.url, b.url)
        st, hb, answer = await post(b.url, chat(text + " Q2?"))
        assert st == 200 and not first.done()  # no answer about the document yet
        rec = await decision(b.url, hb["X-Request-Id"])
        actual = cached(answer)
        assert actual > 5_000 and rec["actual_cached_tokens"] == actual
        assert abs(rec["predicted_cached_tokens"] - actual) <= 0.05 * actual, rec
        assert await metric(b.url, "prefixrouter_token_counts_total") == 0  # B asked nothing
        status, _, _ = await first
        assert status == 200

    _run(body())


def test_a_second_replica_under_a_live_ones_id_is_refused_and_sharing_goes_on(
    engines: list[Server], nats: NatsServer, fleet: Fleet, tmp_path: Path
) -> None:
    """Two processes with one id would each end the other's life at every peer, which
    then drops the older one's facts (for good, before the registry forgot epochs)."""

    async def body() -> None:
        cfg = write_config(tmp_path / "gw.yaml", engines)
        a, b = await _start(fleet, cfg, nats, "a", "b")
        err = await _refused(nats, cfg, "a")
        assert "already uses the id 'a'" in err[-1] and "--replica-id" in err[-1], err
        # The newcomer heard a's heartbeat while it replayed and left before its
        # hello: b never took it for a's new life. (Had both started within one
        # check window, the older logs the duplicate, the newer is refused, and
        # b takes the older's facts again once the newer's life has expired.)
        _, ready_a = await get_status(a.url + "/ready")

        async def a_is_bs_peer() -> bool:
            _, ready_b = await get_status(b.url + "/ready")
            return bool(ready_b["peers"] == [ready_a["replica"]])

        await until(a_is_bs_peer, "b to keep a as its peer")
        await _warm_through(a, b, doc(8))
        stale = {"reason": "stale_epoch"}
        assert await metric(b.url, "prefixrouter_cluster_facts_dropped_total", stale) == 0

    _run(body())


async def _stream_config(nats: NatsServer, name: str) -> tuple[float, list[str]]:
    nc = await nats_connect(nats.url)
    try:
        info = await nc.jetstream().stream_info(name)
        return info.config.max_age or 0.0, list(info.config.subjects or [])
    finally:
        await nc.close()


def test_the_stream_is_the_clusters_a_replica_neither_cuts_nor_takes_it(
    engines: list[Server], nats: NatsServer, fleet: Fleet, tmp_path: Path
) -> None:
    async def body() -> None:
        cfg = write_config(tmp_path / "gw.yaml", engines)
        (a,) = await _start(fleet, cfg, nats, "a")
        assert await _stream_config(nats, "PREFIXROUTER_DEFAULT") == (
            600.0,
            ["prefixrouter.default.facts"],
        )
        # Other bounds: it joins, says so, and the stream keeps the cluster's bounds.
        short = write_config(tmp_path / "short.yaml", engines, cluster={"max_age_s": 5})
        (s,) = await _start(fleet, short, nats, "s")
        assert await _stream_config(nats, "PREFIXROUTER_DEFAULT") == (
            600.0,
            ["prefixrouter.default.facts"],
        )
        assert "keeps max_age 600s" in s.log_tail(1_000_000)
        # A cluster whose stream name is another cluster's ('DEFAULT' and 'default'
        # name one stream): refused, and the stream still captures this cluster's facts.
        other = write_config(tmp_path / "upper.yaml", engines, cluster={"name": "DEFAULT"})
        err = await _refused(nats, other, "u")
        assert "PREFIXROUTER_DEFAULT captures prefixrouter.default.facts" in err[-1], err
        assert "cluster.stream" in err[-1]
        assert (await _stream_config(nats, "PREFIXROUTER_DEFAULT"))[1] == [
            "prefixrouter.default.facts"
        ]
        await _warm_through(a, s, doc(9))

    _run(body())


def test_without_jetstream_a_replica_says_so_once_and_is_ready_standalone_after_the_wait(
    engines: list[Server], fleet: Fleet, tmp_path: Path
) -> None:
    async def body() -> None:
        with NatsServer(jetstream=False) as core_only:
            cfg = write_config(tmp_path / "gw.yaml", engines, cluster={"ready_without_nats_s": 2.0})
            r = start_replica(fleet, cfg, core_only.url, "r")

            async def status() -> tuple[int, dict[str, Any]] | None:
                try:
                    return await get_status(r.url + "/ready")
                except OSError:
                    return None

            code, first = await until(status, "r to listen")
            assert code == 503 and first["status"] in ("connecting", "replaying"), first

            async def standalone() -> dict[str, Any] | None:
                got = await status()
                return got[1] if got is not None and got[0] == 200 else None

            ready = await until(standalone, "r to be ready on its own view")
            assert ready["status"] == "standalone" and ready["replayed"] is False
            st, _, _ = await post(r.url, chat(doc(10) + " Q?"))
            assert st == 200
            lines = r.log_tail(1_000_000).splitlines()
            said = [line for line in lines if "JetStream is not enabled" in line]
            assert len(said) == 1 and "-js" in said[0], lines

    _run(body())


def test_with_tls_files_replicas_share_over_tls_and_a_plain_server_is_refused(
    engines: list[Server], nats: NatsServer, fleet: Fleet, tmp_path: Path
) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca_file, cert_file, key_file = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))

    async def body() -> None:
        with NatsServer(tls=(cert_file, key_file)) as secure:
            cfg = write_config(
                tmp_path / "tls.yaml", engines, cluster={"tls_ca_file": str(ca_file)}
            )
            a, b = await _start(fleet, cfg, secure, "a", "b")
            await _warm_through(a, b, doc(11))
            # Without the CA the server's certificate does not verify: said once, not ready.
            plain = write_config(tmp_path / "no-ca.yaml", engines)
            c = start_replica(fleet, plain, secure.url, "c")
            # Listening first: it tries NATS as it starts, and can say so before it serves.
            await fleet.wait_healthy([c])

            async def said() -> bool:
                return "CERTIFICATE_VERIFY_FAILED" in c.log_tail(1_000_000)

            await until(said, "c to say why it cannot connect")
            status, ready = await get_status(c.url + "/ready")
            assert status == 503 and ready["status"] == "connecting", ready
        # A replica that requires TLS is refused by a server that does not offer it.
        err = await _refused(nats, cfg, "d")
        assert "does not offer TLS" in err[-1], err

    _run(body())
