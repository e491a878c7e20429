"""The engine's KV-event publisher: dropped batches leave a gap that its replay socket fills."""

from __future__ import annotations

import asyncio
import contextlib

import zmq
import zmq.asyncio

from prefixrouter.core.events import AllBlocksCleared
from prefixrouter.core.types import WorkerId
from prefixrouter.harness.ports import free_port
from prefixrouter.real_engines.kv_events import decode_batch, decode_seq
from prefixrouter.real_engines.kv_subscriber import parse_replay_reply
from prefixrouter.simulated_engine.kv_publisher import KvEventPublisher

CLEAR = [AllBlocksCleared(WorkerId("e0"))]


async def test_dropped_batches_are_a_gap_and_replayed() -> None:
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = free_port()
    sub.bind(f"tcp://127.0.0.1:{port}")
    replay = f"tcp://127.0.0.1:{free_port()}"
    pub = KvEventPublisher(f"tcp://127.0.0.1:{port}", "e0", 16, 64, replay_endpoint=replay)
    server = asyncio.create_task(pub.serve_replay())
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        # Until the subscription has reached the publisher (ZMQ's slow joiner).
        heard = None
        for _ in range(100):
            pub.publish(CLEAR)
            if await sub.poll(100):
                heard = decode_seq((await sub.recv_multipart())[1])
                break
        assert heard is not None
        while await sub.poll(200):  # the rest of the warm-up
            heard = decode_seq((await sub.recv_multipart())[1])
        pub.drop_next(2)
        for _ in range(3):  # two dropped, the third heard: a gap
            pub.publish(CLEAR)
        assert await sub.poll(5000)
        assert decode_seq((await sub.recv_multipart())[1]) == heard + 3
        assert not await sub.poll(100)  # nothing else came
        dealer.connect(replay)
        await dealer.send_multipart([b"", (heard + 1).to_bytes(8, "big")])
        got = []
        for _ in range(10):
            assert await dealer.poll(5000)
            parsed = parse_replay_reply(await dealer.recv_multipart())
            if parsed is None:
                break  # the end marker
            got.append(parsed[0])
            assert decode_batch(parsed[1]).events
        assert got == [heard + 1, heard + 2, heard + 3]  # the missed range, and what followed
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
        dealer.close()
        sub.close()
        pub.close()
        ctx.term()
