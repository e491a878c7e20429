"""KV-event decoding, translation to the router's hashes, and the ZMQ addresses configs accept."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgpack
import pytest
from pydantic import ValidationError

from prefixrouter.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixrouter.core.hashing import hash_token_blocks
from prefixrouter.core.types import WorkerId
from prefixrouter.errors import ConfigError
from prefixrouter.gateway.config import KvEventsConfig
from prefixrouter.real_engines.kv_events import (
    EngineAllBlocksCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineHash,
    EventTranslator,
    KvEventDecodeError,
    SeqStatus,
    SequenceTracker,
    decode_batch,
    decode_event,
    decode_seq,
    salt_of,
)
from prefixrouter.simulated_engine.config import EngineServerConfig

W = WorkerId("w0")
BS = 4
SEED = 1234


def seeds(lora: str | None, salt: str | None) -> int | None:
    """Namespace seeds: base 1234, adapter 'a1' 99, salt 'known' 7, other salts unknown."""
    if salt is not None:
        return 7 if salt == "known" else None
    return 99 if lora == "a1" else SEED


def stored(
    hashes: Iterable[EngineHash], parent: EngineHash | None, tokens: Iterable[int], **kw: Any
) -> EngineBlockStored:
    return EngineBlockStored(tuple(hashes), parent, tuple(tokens), BS, **kw)


def test_decodes_map_and_array_events_alike() -> None:
    as_map = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": None,
    }
    as_array = ["BlockStored", [11, 12], None, list(range(8)), 4, None, "GPU"]
    assert decode_event(as_map) == decode_event(as_array)
    ev = decode_event(as_array)
    assert isinstance(ev, EngineBlockStored)
    assert ev.block_hashes == (11, 12) and ev.block_size == 4 and ev.medium == "GPU"
    assert decode_event(["BlockRemoved", [b"\x01" * 8], None]) == EngineBlockRemoved((b"\x01" * 8,))
    assert decode_event({"type": "AllBlocksCleared"}) == EngineAllBlocksCleared()
    assert decode_event(["SomethingNew", 1]) is None


@pytest.mark.parametrize(
    "bad",
    [
        ["BlockStored", "nope", None, [1, 2, 3, 4], 4],
        ["BlockStored", [1], None, "tokens", 4],
        ["BlockStored", [1], None, [1, 2, 3.0, 4], 4],
        ["BlockStored", [1], None, [1, 2, "3", 4], 4],
        ["BlockStored", [1], None, [1, 2, -3, 4], 4],
        ["BlockStored", [1], None, [1, 2, 1 << 32, 4], 4],
        ["BlockStored", [1], None, [1, 2, 3, 4], 0],
        ["BlockRemoved", [1.5]],
        42,
    ],
)
def test_malformed_events_raise_a_decode_error(bad: object) -> None:
    with pytest.raises(KvEventDecodeError):
        decode_event(bad)


def test_decodes_a_batch_payload_and_sequence_frame() -> None:
    payload = msgpack.packb([1.5, [["AllBlocksCleared"], ["BlockRemoved", [3], None]], 0])
    batch = decode_batch(payload)
    assert batch.ts == 1.5 and batch.dp_rank == 0
    assert batch.events == (EngineAllBlocksCleared(), EngineBlockRemoved((3,)))
    assert decode_seq((7).to_bytes(8, "big")) == 7
    with pytest.raises(KvEventDecodeError):
        decode_batch(b"\xc1not msgpack")
    with pytest.raises(KvEventDecodeError):
        decode_batch(msgpack.packb({"x": 1}))
    with pytest.raises(KvEventDecodeError):
        decode_seq(b"\x00")


def test_stored_chain_is_rehashed_in_the_routers_namespace() -> None:
    tr = EventTranslator(W, seeds)
    tokens = list(range(12))
    # First chunk: two blocks from the namespace seed; second chunk: one more block.
    ev1 = tr.translate(stored([101, 102], None, tokens[:8]))
    ev2 = tr.translate(stored([103], 102, tokens[8:12]))
    want = hash_token_blocks(SEED, tokens, BS)
    assert isinstance(ev1, BlockStored) and tuple(ev1.block_hashes) == want[:2]
    # A later chunk names its whole chain, so the index keeps prefix closure.
    assert isinstance(ev2, BlockStored) and tuple(ev2.block_hashes) == want
    assert tr.own_hash(103) == want[2]


def test_adapter_and_salt_select_the_namespace() -> None:
    tr = EventTranslator(W, seeds)
    tokens = list(range(4))
    lora = tr.translate(stored([1], None, tokens, lora_name="a1", extra_keys=[["a1"]]))
    salted = tr.translate(stored([2], None, tokens, extra_keys=[["known"]]))
    unknown = tr.translate(stored([3], None, tokens, extra_keys=[["mystery"]]))
    assert isinstance(lora, BlockStored)
    assert tuple(lora.block_hashes) == hash_token_blocks(99, tokens, BS)
    assert isinstance(salted, BlockStored)
    assert tuple(salted.block_hashes) == hash_token_blocks(7, tokens, BS)
    assert unknown is None and tr.skipped_blocks == 1
    # A child of an untranslated block cannot be placed either.
    assert tr.translate(stored([4], 3, tokens)) is None and tr.skipped_blocks == 2


def test_salt_is_read_from_the_first_blocks_extra_keys() -> None:
    assert salt_of(None, None) is None
    assert salt_of([("s1",), None], None) == "s1"
    assert salt_of(("lora-x", "mm", "s2"), "lora-x") == "s2"
    assert salt_of([("lora-x",)], "lora-x") is None
    assert salt_of("s3", None) == "s3"


def test_removed_and_cleared_use_the_map() -> None:
    tr = EventTranslator(W, seeds)
    tokens = list(range(8))
    tr.translate(stored([1, 2], None, tokens))
    want = hash_token_blocks(SEED, tokens, BS)
    removed = tr.translate(EngineBlockRemoved((2, 999)))
    assert removed == BlockRemoved(W, [want[1]])
    assert tr.own_hash(2) is None and tr.own_hash(1) == want[0]
    assert tr.translate(EngineBlockRemoved((999,))) is None
    assert tr.translate(EngineAllBlocksCleared()) == AllBlocksCleared(W)
    assert len(tr) == 0


def test_other_media_and_groups_are_ignored() -> None:
    tr = EventTranslator(W, seeds)
    assert tr.translate(stored([1], None, range(4), medium="CPU")) is None
    assert tr.translate(stored([1], None, range(4), group=1)) is None
    assert len(tr) == 0


def test_map_is_bounded() -> None:
    tr = EventTranslator(W, seeds, max_blocks=3)
    tr.translate(stored([1, 2, 3, 4, 5], None, range(20)))
    assert len(tr) == 3
    assert tr.own_hash(1) is None and tr.own_hash(5) is not None


def test_sequence_tracker_classifies_gaps_and_restarts() -> None:
    seq = SequenceTracker()
    assert seq.check("t", 0) is SeqStatus.FIRST
    assert seq.check("t", 1) is SeqStatus.OK
    assert seq.check("t", 4) is SeqStatus.GAP
    assert seq.expected("t") == 5
    # Lower than expected: a new publisher whose first messages were lost (the
    # live feed never repeats a number; replies to a replay do not come here).
    assert seq.check("t", 3) is SeqStatus.RESTART
    assert seq.expected("t") == 4
    assert seq.check("t", 0) is SeqStatus.RESTART
    assert seq.check("t", 1) is SeqStatus.OK
    # Joining a feed that is already running is a gap: earlier events are unknown.
    assert seq.check("u", 9) is SeqStatus.GAP
    seq.forget("u")
    assert seq.expected("u") is None


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "ipc:///tmp/kv", "inproc://kv"])
def test_gateway_and_engine_configs_take_zmq_addresses(endpoint: str) -> None:
    assert KvEventsConfig(endpoint=endpoint).endpoint == endpoint
    assert EngineServerConfig(kv_events_endpoint=endpoint).kv_events_endpoint == endpoint


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:5557", "127.0.0.1:5557", ""])
def test_gateway_and_engine_configs_refuse_other_addresses(endpoint: str) -> None:
    with pytest.raises(ValidationError, match="must be a ZMQ address"):
        KvEventsConfig(endpoint=endpoint)
    with pytest.raises(ConfigError, match="must be a ZMQ address"):
        EngineServerConfig(kv_events_endpoint=endpoint)
