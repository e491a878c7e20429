"""The proxy's upstream client against real loopback servers that misbehave on purpose.

Each test starts an ``asyncio`` TCP server whose handler reads one HTTP
request at a time and answers it byte by byte as scripted, so the client
meets keep-alive, chunked and read-until-close bodies, early closes,
garbage, silence and interim responses exactly as they come off a socket.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trustme

from prefixrouter.gateway.upstream import (
    Endpoint,
    FirstByteTimeout,
    PoolStats,
    StallTimeout,
    UpstreamClient,
    UpstreamError,
)

Reader = asyncio.StreamReader
Writer = asyncio.StreamWriter
Handler = Callable[[Reader, Writer, "Server"], Awaitable[None]]


class Server:
    """A loopback server: connections seen, requests read, a scripted handler."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[bytes, dict[str, str], bytes]] = []
        self.disconnected = asyncio.Event()
        self.port = 0

    async def _serve(self, reader: Reader, writer: Writer) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.disconnected.set()
            writer.close()

    async def read_request(self, reader: Reader) -> bool:
        """Read one request; False at a clean end of the connection."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        line, *fields = head[:-4].split(b"\r\n")
        headers = {}
        for f in fields:
            name, _, value = f.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        self.requests.append((line, headers, body))
        return True


@asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[Server]:
    server = Server(handler)
    srv = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    server.port = srv.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        srv.close()


def endpoint(server: Server, prefix: str = "", headers: dict[str, str] | None = None) -> Endpoint:
    return Endpoint.from_url(f"http://127.0.0.1:{server.port}{prefix}", headers)


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n"
        b"Content-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)
    )


async def answer_each(reader: Reader, writer: Writer, server: Server) -> None:
    """Keep-alive: answer every request with its own body echoed back."""
    while await server.read_request(reader):
        writer.write(ok(server.requests[-1][2]))
        await writer.drain()


async def test_keep_alive_reuses_one_connection_and_sends_the_request_as_given() -> None:
    async with serve(answer_each) as server:
        client = UpstreamClient(connect_timeout_s=2, total_timeout_s=5)
        ep = endpoint(server, "/engine", {"Authorization": "Bearer k"})
        for i in range(5):
            resp = await client.post(ep, "/v1/completions", b'{"n": %d}' % i)
            assert client.pool_stats(ep) == PoolStats(opened=1, idle=0, busy=1)
            assert resp.status == 200
            assert resp.content_type == "application/json"
            assert await resp.read() == b'{"n": %d}' % i
            resp.release()
        assert client.pool_stats(ep) == PoolStats(opened=1, idle=1, busy=0)
        await client.close()
    assert server.connections == 1
    line, headers, _ = server.requests[0]
    assert line == b"POST /engine/v1/completions HTTP/1.1"
    assert headers["host"] == f"127.0.0.1:{server.port}"
    assert headers["authorization"] == "Bearer k"
    assert headers["content-type"] == "application/json"


async def test_a_response_ends_once() -> None:
    async with serve(answer_each) as server:
        client = UpstreamClient(2, 5)
        ep = endpoint(server)
        first = await client.post(ep, "/x", b"1")
        await first.read()
        first.release()
        first.release()  # a second release must not pool the connection twice
        assert client.idle_connections(ep) == 1
        second = await client.post(ep, "/x", b"2")  # reuses that connection
        first.close()  # late: must not close the connection `second` is using
        assert await second.read() == b"2"
        second.release()
        assert client.pool_stats(ep) == PoolStats(opened=1, idle=1, busy=0)
        await client.close()


async def test_chunked_stream_arrives_chunk_by_chunk_before_the_end() -> None:
    step = asyncio.Event()

    async def stream(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
        for event in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await step.wait()  # the next chunk only once the client has read this one
            step.clear()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await server.read_request(reader)  # keep the connection open

    async with serve(stream) as server:
        client = UpstreamClient(2, 5)
        resp = await client.post(endpoint(server), "/v1/chat/completions", b"{}")
        assert resp.content_type == "text/event-stream"
        assert await resp.readany() == b"data: 1\n\n"
        step.set()
        assert await resp.readany() == b"data: 2\n\n"
        step.set()
        assert await resp.readany() == b""
        resp.release()
        assert client.idle_connections(endpoint(server)) == 1
        await client.close()


async def test_body_without_length_ends_when_the_server_closes() -> None:
    async def until_close(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npart one, ")
        await writer.drain()
        writer.write(b"part two")
        await writer.drain()

    async with serve(until_close) as server:
        client = UpstreamClient(2, 5)
        resp = await client.post(endpoint(server), "/x", b"{}")
        assert await resp.read() == b"part one, part two"
        resp.release()
        assert client.idle_connections(endpoint(server)) == 0  # never reused
        await client.close()


async def test_close_before_answering_is_an_upstream_error() -> None:
    async def hang_up(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)

    async with serve(hang_up) as server:
        client = UpstreamClient(2, 5)
        with pytest.raises(UpstreamError, match="before answering"):
            await client.post(endpoint(server), "/x", b"{}")
        await client.close()


async def test_close_mid_body_fails_the_read() -> None:
    async def cut(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()

    async with serve(cut) as server:
        client = UpstreamClient(2, 5)
        resp = await client.post(endpoint(server), "/x", b"{}")
        with pytest.raises(UpstreamError, match="before the response was complete"):
            while await resp.readany():
                pass
        resp.release()
        await client.close()


async def test_refused_connection_is_an_os_error() -> None:
    async with serve(answer_each) as server:
        port = server.port
    client = UpstreamClient(2, 5)
    with pytest.raises(OSError):
        await client.post(Endpoint.from_url(f"http://127.0.0.1:{port}"), "/x", b"{}")
    await client.close()


async def test_silent_worker_times_out_and_the_connection_is_closed() -> None:
    async def silent(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        await reader.read()  # until the client gives up

    async with serve(silent) as server:
        client = UpstreamClient(connect_timeout_s=2, total_timeout_s=0.2)
        with pytest.raises(TimeoutError, match=r"0\.2 s"):
            await client.post(endpoint(server), "/x", b"{}")
        await asyncio.wait_for(server.disconnected.wait(), 2)
        await client.close()


async def test_abandoned_response_closes_its_connection() -> None:
    async def slow_stream(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await reader.read()  # the client's close ends this

    async with serve(slow_stream) as server:
        client = UpstreamClient(2, 5)
        ep = endpoint(server)
        resp = await client.post(ep, "/x", b"{}")
        assert await resp.readany() == b"first"
        resp.close()  # the client left: the engine must see the request end
        await asyncio.wait_for(server.disconnected.wait(), 2)
        assert client.idle_connections(ep) == 0
        await client.close()


async def test_cancelled_request_closes_its_connection() -> None:
    async def silent(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        await reader.read()

    async with serve(silent) as server:
        client = UpstreamClient(2, 30)
        task = asyncio.ensure_future(client.post(endpoint(server), "/x", b"{}"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.disconnected.wait(), 2)
        await client.close()


async def test_idle_connection_closed_by_the_server_leaves_the_pool() -> None:
    async def one_then_close(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(ok(b"{}"))
        await writer.drain()  # then close while the client holds it idle

    async with serve(one_then_close) as server:
        client = UpstreamClient(2, 5)
        ep = endpoint(server)
        resp = await client.post(ep, "/x", b"{}")
        await resp.read()
        resp.release()
        await asyncio.wait_for(server.disconnected.wait(), 2)
        for _ in range(50):  # the close reaches the client's protocol
            if client.idle_connections(ep) == 0:
                break
            await asyncio.sleep(0.01)
        assert client.idle_connections(ep) == 0
        resp = await client.post(ep, "/x", b"{}")  # a fresh connection, not the dead one
        assert resp.status == 200
        resp.release()
        assert server.connections == 2
        await client.close()


async def test_connection_idle_past_keepalive_is_not_reused() -> None:
    async with serve(answer_each) as server:
        client = UpstreamClient(2, 5, keepalive_s=0.05)
        ep = endpoint(server)
        for _ in range(2):
            resp = await client.post(ep, "/x", b"{}")
            await resp.read()
            resp.release()
            await asyncio.sleep(0.1)
        assert server.connections == 2
        await client.close()


async def test_connection_close_response_is_not_reused() -> None:
    async def close_each(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(ok(b"{}", b"Connection: close\r\n"))
        await writer.drain()
        await server.read_request(reader)

    async with serve(close_each) as server:
        client = UpstreamClient(2, 5)
        ep = endpoint(server)
        resp = await client.post(ep, "/x", b"{}")
        await resp.read()
        resp.release()
        assert client.idle_connections(ep) == 0
        await client.close()


async def test_garbage_is_an_upstream_error() -> None:
    async def garbage(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with serve(garbage) as server:
        client = UpstreamClient(2, 5)
        with pytest.raises(UpstreamError, match="invalid HTTP response"):
            await client.post(endpoint(server), "/x", b"{}")
        await client.close()


async def test_interim_response_is_skipped() -> None:
    async def early_hints(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b'{"final": true}'))
        await writer.drain()
        await server.read_request(reader)

    async with serve(early_hints) as server:
        client = UpstreamClient(2, 5)
        resp = await client.post(endpoint(server), "/x", b"{}")
        assert resp.status == 200 and await resp.read() == b'{"final": true}'
        resp.release()
        await client.close()


async def test_error_status_and_body_pass_through() -> None:
    async def refuse(reader: Reader, writer: Writer, server: Server) -> None:
        while await server.read_request(reader):
            body = b'{"error": "busy"}'
            head = b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: %d\r\n\r\n"
            writer.write(head % len(body))
            writer.write(body)
            await writer.drain()

    async with serve(refuse) as server:
        client = UpstreamClient(2, 5)
        ep = endpoint(server)
        resp = await client.post(ep, "/x", b"{}")
        assert resp.status == 429 and resp.content_type == ""
        assert await resp.read() == b'{"error": "busy"}'
        resp.release()
        assert client.idle_connections(ep) == 1  # an error answer still leaves it clean
        await client.close()


async def test_large_body_survives_reading_pauses() -> None:
    payload = bytes(range(256)) * 16384  # 4 MiB, far past the high-water mark below

    async def big(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(ok(payload))
        await writer.drain()
        await server.read_request(reader)

    async with serve(big) as server:
        client = UpstreamClient(2, 10, high_water_bytes=16 * 1024)
        resp = await client.post(endpoint(server), "/x", b"{}")
        received = bytearray()
        most = 0
        while chunk := await resp.readany():
            received += chunk
            most = max(most, resp.buffered_bytes + len(chunk))  # held before this read
            await asyncio.sleep(0.001)  # a slow reader: the socket must pause, not buffer it all
        assert bytes(received) == payload
        # At most the mark plus one socket read (uvloop reads up to 256 KiB at once).
        assert 0 < most <= 16 * 1024 + 256 * 1024
        resp.release()
        await client.close()


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def sse_chunk(event: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(event), event)


async def test_no_answer_within_the_first_byte_timeout_closes_the_connection() -> None:
    async def frozen(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        await reader.read()  # accepted, never answered (a SIGSTOPped engine)

    async with serve(frozen) as server:
        client = UpstreamClient(2, 60)
        with pytest.raises(FirstByteTimeout, match=r"first byte within 0\.2 s"):
            await client.post(endpoint(server), "/x", b"{}", first_byte_timeout_s=0.2)
        await asyncio.wait_for(server.disconnected.wait(), 2)  # the engine sees the abort
        await client.close()


async def test_stream_headers_without_a_first_event_hit_the_first_byte_timeout() -> None:
    async def headers_only(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(STREAM_HEAD)  # vLLM sends a stream's headers at once
        await writer.drain()
        await reader.read()

    async with serve(headers_only) as server:
        client = UpstreamClient(2, 60)
        resp = await client.post(endpoint(server), "/x", b"{}", first_byte_timeout_s=0.2)
        assert resp.status == 200
        with pytest.raises(FirstByteTimeout):
            await resp.readany()
        resp.close()
        await asyncio.wait_for(server.disconnected.wait(), 2)
        await client.close()


async def test_a_stream_silent_after_its_first_event_hits_the_stall_timeout() -> None:
    async def stall(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(STREAM_HEAD + sse_chunk(b"data: 1\n\n"))
        await writer.drain()
        await reader.read()

    async with serve(stall) as server:
        client = UpstreamClient(2, 60, stall_timeout_s=0.2)
        resp = await client.post(endpoint(server), "/x", b"{}", first_byte_timeout_s=5)
        assert await resp.readany() == b"data: 1\n\n"
        with pytest.raises(StallTimeout, match=r"nothing for 0\.2 s"):
            await resp.readany()
        resp.close()
        await asyncio.wait_for(server.disconnected.wait(), 2)
        await client.close()


async def test_a_steady_stream_longer_than_both_timeouts_is_not_cut() -> None:
    async def steady(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(STREAM_HEAD)
        for i in range(8):
            writer.write(sse_chunk(b"data: %d\n\n" % i))
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await server.read_request(reader)

    async with serve(steady) as server:
        client = UpstreamClient(2, 60, stall_timeout_s=0.3)
        resp = await client.post(endpoint(server), "/x", b"{}", first_byte_timeout_s=0.3)
        body = await resp.read()  # 0.8 s in all, no gap near 0.3 s
        assert body.count(b"data: ") == 8
        resp.release()
        assert client.idle_connections(endpoint(server)) == 1  # clean: reusable
        await client.close()


async def test_a_request_queued_on_a_live_worker_is_not_cut() -> None:
    """Timeouts cut a silent worker, not a slow request: while the worker sends
    bytes on another connection, a request still waiting for its first byte,
    or a stream paused between events, waits (an engine admits in order)."""
    release = asyncio.Event()

    async def busy(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        line = server.requests[-1][0]
        writer.write(STREAM_HEAD)
        await writer.drain()
        if b"/queued" in line:
            await release.wait()  # behind the other request: nothing for it yet
            writer.write(sse_chunk(b"data: late\n\n") + b"0\r\n\r\n")
        else:
            for i in range(12):  # the engine is busy and alive: another stream flows
                writer.write(sse_chunk(b"data: %d\n\n" % i))
                await writer.drain()
                await asyncio.sleep(0.1)
            release.set()
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with serve(busy) as server:
        client = UpstreamClient(2, 60, stall_timeout_s=0.3)
        ep = endpoint(server)
        other = await client.post(ep, "/flowing", b"{}")
        queued = await client.post(ep, "/queued", b"{}", first_byte_timeout_s=0.3)
        flowing = asyncio.create_task(other.read())
        # 1.2 s without a byte of its own, four times its first-byte timeout.
        assert await queued.read() == b"data: late\n\n"
        assert (await flowing).count(b"data: ") == 12
        queued.release()
        other.release()
        await client.close()


async def test_a_passed_health_check_counts_as_a_sign_of_life() -> None:
    async def frozen(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        await reader.read()

    async with serve(frozen) as server:
        client = UpstreamClient(2, 60)
        ep = endpoint(server)

        async def health_checks() -> None:
            for _ in range(6):
                client.heard_from(ep)
                await asyncio.sleep(0.1)

        checks = asyncio.create_task(health_checks())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(FirstByteTimeout):
            await client.post(ep, "/x", b"{}", first_byte_timeout_s=0.2)
        waited = loop.time() - t0
        await checks
        # Cut one window after the last check (0.5 s), not at 0.2 s.
        assert waited >= 0.65
        await client.close()


async def test_a_slow_reader_is_not_a_stall() -> None:
    payload = bytes(range(256)) * 16384  # 4 MiB: reading pauses at the mark below

    async def big(reader: Reader, writer: Writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(ok(payload))
        await writer.drain()
        await server.read_request(reader)

    async with serve(big) as server:
        client = UpstreamClient(2, 60, high_water_bytes=16 * 1024, stall_timeout_s=0.2)
        resp = await client.post(endpoint(server), "/x", b"{}")
        received = bytearray(await resp.readany())
        await asyncio.sleep(0.6)  # the reader is busy: the worker is not silent
        while chunk := await resp.readany():
            received += chunk
        assert bytes(received) == payload
        resp.release()
        await client.close()


def test_endpoint_rejects_what_it_cannot_reach() -> None:
    with pytest.raises(ValueError, match="http"):
        Endpoint.from_url("ftp://host/x")
    with pytest.raises(ValueError, match="host"):
        Endpoint.from_url("http:///v1")
    ep = Endpoint.from_url("https://engine.example:8443/base/")
    assert (ep.scheme, ep.host, ep.port, ep.base_path) == ("https", "engine.example", 8443, "/base")
    assert ep.request_head("/v1/x", 7).startswith(b"POST /base/v1/x HTTP/1.1\r\n")
    assert b"Content-Length: 7\r\n\r\n" in ep.request_head("/v1/x", 7)


async def test_https_worker_is_verified_against_the_trusted_cas() -> None:
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_ctx)
    server = Server(answer_each)
    srv = await asyncio.start_server(server._serve, "127.0.0.1", 0, ssl=server_ctx)
    port = srv.sockets[0].getsockname()[1]
    ep = Endpoint.from_url(f"https://localhost:{port}")
    try:
        trusting = ssl.create_default_context()
        ca.configure_trust(trusting)
        client = UpstreamClient(2, 5, ssl_context=trusting)
        resp = await client.post(ep, "/v1/x", b'{"tls": 1}')
        assert resp.status == 200 and await resp.read() == b'{"tls": 1}'
        resp.release()
        await client.close()
        stranger = UpstreamClient(2, 5)  # the system's CAs do not know this one
        with pytest.raises(ssl.SSLCertVerificationError):
            await stranger.post(ep, "/v1/x", b"{}")
        await stranger.close()
    finally:
        srv.close()
