"""Messages captured from a real vLLM 0.32 engine decode and translate as the router needs.

The fixture (``tests/real_engines/data``, see its README) holds the raw ZMQ frames
of a chat, its decode block, a completion, a salted chat, evictions and a
cache reset, as vLLM published them.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from prefixrouter.core.dispatch import Dispatcher
from prefixrouter.core.events import AllBlocksCleared, BlockStored
from prefixrouter.core.hashing import BlockHasher, hash_token_blocks
from prefixrouter.core.policy import create_policy
from prefixrouter.core.router import Router
from prefixrouter.core.types import WorkerId
from prefixrouter.real_engines.kv_events import (
    EngineBlockRemoved,
    EngineBlockStored,
    EventTranslator,
    decode_batch,
    decode_seq,
)
from prefixrouter.real_engines.kv_subscriber import KvEventSubscriber

DATA = Path(__file__).parent / "data" / "vllm_events.msgpack.jsonl"
BASE, SALTED = 1111, 2222


def messages() -> list[tuple[str, list[bytes]]]:
    out = []
    for line in DATA.read_text().splitlines():
        record = json.loads(line)
        out.append((record["what"], [base64.b64decode(f) for f in record["frames"]]))
    return out


def seeds(lora: str | None, salt: str | None) -> int | None:
    return SALTED if salt == "abc" else BASE


def test_every_captured_message_decodes() -> None:
    msgs = messages()
    assert len(msgs) == 8
    kinds = set()
    for _, frames in msgs:
        assert len(frames) == 3
        decode_seq(frames[1])
        batch = decode_batch(frames[2])
        assert batch.events
        kinds |= {type(e).__name__ for e in batch.events}
    assert kinds == {"EngineBlockStored", "EngineBlockRemoved", "EngineAllBlocksCleared"}


def test_captured_chains_translate_to_our_hashes_of_the_same_tokens() -> None:
    translators: dict[str, EventTranslator] = {}
    stored: list[tuple[EngineBlockStored, BlockStored]] = []
    removed = 0
    cleared = 0
    for _, frames in messages():
        topic = frames[0].decode()
        tr = translators.setdefault(topic, EventTranslator(WorkerId(topic), seeds))
        for raw in decode_batch(frames[2]).events:
            event = tr.translate(raw)
            if isinstance(raw, EngineBlockStored):
                assert isinstance(event, BlockStored)
                stored.append((raw, event))
            elif isinstance(raw, EngineBlockRemoved):
                removed += event is not None
            else:
                assert event == AllBlocksCleared(WorkerId(topic))
                cleared += 1
    assert cleared == 1
    # The chat (first line): 19 blocks chained from the namespace seed.
    chat_raw, chat = stored[0]
    assert chat_raw.parent_hash is None and len(chat.block_hashes) == 19
    assert tuple(chat.block_hashes) == hash_token_blocks(BASE, chat_raw.token_ids, 32)
    # Its decode block: the event names the whole chain of 20, ours extended.
    dec_raw, dec = stored[1]
    assert dec_raw.parent_hash == chat_raw.block_hashes[-1]
    full = [*chat_raw.token_ids, *dec_raw.token_ids]
    assert tuple(dec.block_hashes) == hash_token_blocks(BASE, full, 32)
    # The salted chat lands in the salt's namespace.
    salted_raw, salted = next((r, ev) for r, ev in stored if r.extra_keys and r.extra_keys[0])
    assert salted.block_hashes[0] == hash_token_blocks(SALTED, salted_raw.token_ids, 32)[0]
    # The small engine's evictions name blocks whose BlockStored came before the
    # capture started, so the map cannot place them: nothing wrong is removed.
    assert removed == 0


def test_captured_feed_through_the_subscriber() -> None:
    router = Router(create_policy("prefix_aware"), BlockHasher(block_size=32))
    sub = KvEventSubscriber("tcp://127.0.0.1:1", Dispatcher(router), lambda: 5.0)
    topics = sorted({frames[0].decode() for _, frames in messages()})
    for t in topics:
        sub.add_worker(WorkerId(t), t, seeds)
    for _, frames in messages():
        sub.handle(frames)
    big = sub.feed(WorkerId(topics[0]))
    assert big is not None
    # Sequence numbers of the captured lines skip (other messages were not
    # captured): each skip is a gap, and entries fall back to speculative.
    assert big.stats.gaps >= 1 and big.stats.decode_errors == 0
    assert router.index.blocks_of(WorkerId(topics[0])) > 0
