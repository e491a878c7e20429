"""vLLM's KV-cache events: decoding the wire format and translating to the router's hashes.

Pure code (no sockets, no clock); :mod:`prefixrouter.real_engines.kv_subscriber`
does the I/O.

**Wire format** (vLLM's ZMQ publisher, also SGLang's): a message has three
frames, ``topic`` (UTF-8, one per engine), ``seq`` (uint64 big-endian, from 0
per publisher) and a msgpack payload ``[ts, [event, ...], data_parallel_rank]``.
An event is either a map with a ``"type"`` key (vLLM since mid-2026) or a
positional array whose first item is the type name (older vLLM, SGLang), with
the fields in declaration order:

* ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx (later fields optional);
* ``BlockRemoved``: block_hashes, medium, group_idx;
* ``AllBlocksCleared``: nothing.

Block hashes are integers or bytes (the low 64 bits, or the digest, of the
engine's SHA-256 chain). Only full blocks are reported; one ``BlockStored`` per
prefill chunk, whose ``token_ids`` hold ``len(block_hashes) * block_size``
tokens, and one per block filled during decode (its tokens include generated
ones); a prompt cache hit sends nothing; ``BlockRemoved`` only on eviction.

**Translation.** The engine's chain runs over the full 32-byte parent digests,
which the events do not carry, and it is salted per process; the router cannot
extend it. So :class:`EventTranslator` recomputes *its own* chain
(:func:`~prefixrouter.core.hashing.hash_token_blocks`, seeded by the cache
namespace) from the events' token ids: a stored block's own hash is the
router's hash of its parent (looked up in the engine-hash -> own-hash map)
chained with its tokens; a chain's first block starts from the namespace seed.
The namespace comes from the event: the engine's model, the LoRA adapter
(``lora_name``) and the tenant, read back from the ``cache_salt`` that vLLM puts
in the first block's ``extra_keys``. The map is what ``BlockRemoved`` needs to
find the router's hashes of evicted blocks. A block whose parent the map does
not know (its ``BlockStored`` was lost, or came from an unknown namespace) is
skipped: guessing would put wrong entries in the index.

Only the GPU tier counts (``medium`` absent or ``GPU``): blocks offloaded to
CPU memory must be loaded back before use and are not a prefill the engine
skips for free. Only KV-cache group 0 counts (hybrid models publish one group
per attention kind; group 0 covers full attention).

**Sequence numbers** (:class:`SequenceTracker`): a jump forward means lost
messages (a gap): the replay socket is asked for the missed range when one is
configured, and the worker's event-fed index entries fall back to speculative
unless the replay repairs the gap completely. A number lower than expected is
either a **duplicate** (the same bytes under a number heard within the last
``SEQ_WINDOW`` messages: the publisher is reached over two connections, e.g.
two spellings of one address) or a **restart** (the publisher starts again at
0, though the new process's first messages may be lost while it connects):
only a restart means the engine's cache is new.

**Bad events** (:func:`decode_batch`): a message whose frames or payload are
not the format is refused whole; one malformed event inside a good batch
(a token id out of range, a ``medium`` that is not a string) is counted and
left out, and the batch's other events are kept.
"""

from __future__ import annotations

import posixpath
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack

from prefixrouter.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from prefixrouter.core.hashing import hash_token_blocks
from prefixrouter.core.types import BlockHash, WorkerId

EngineHash = int | bytes
"""An engine's block id, as the event carries it (compared, never interpreted)."""

ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
"""The address schemes of a ZMQ endpoint (the publisher's, the subscriber's, a replay's)."""
GPU_MEDIA = frozenset({None, "GPU", "gpu", "cuda", "CUDA"})
STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""vLLM's replay socket ends a replay with this sequence frame."""
SEQ_WINDOW = 64
"""Recent messages per topic whose content is remembered, to recognise a repeat."""


def endpoint_key(address: str) -> str:
    """``address`` in one spelling, so that two spellings of one ZMQ socket compare equal.

    Pure text (no DNS, no file system): an ``ipc://`` path is normalised
    (``/tmp/./e.ipc`` and ``/tmp/e.ipc``, ``a//b`` and ``a/b``), a ``tcp://``
    host is lower-cased, ``localhost`` is ``127.0.0.1`` (ZMQ resolves it to
    IPv4 unless IPv6 is enabled) and the port loses leading zeros. Two names
    that only DNS or a symbolic link equate still differ here; the feed then
    sees every message twice and says so (:class:`SequenceTracker`'s duplicates).
    """
    scheme, sep, rest = address.partition("://")
    if not sep:
        return address
    scheme = scheme.lower()
    if scheme == "ipc" and rest and not rest.startswith("@"):  # "@name": Linux abstract socket
        return f"ipc://{posixpath.normpath(rest)}"
    if scheme == "tcp" and ";" not in rest:  # "src;dst" binds a source address: left alone
        host, colon, port = rest.rpartition(":")
        if colon and port.isdigit():
            host = host.lower()
            if host == "localhost":
                host = "127.0.0.1"
            return f"tcp://{host}:{int(port)}"
        return f"tcp://{rest.lower()}"
    return f"{scheme}://{rest}"


class KvEventDecodeError(ValueError):
    """A message that is not vLLM's KV-event format."""


@dataclass(frozen=True, slots=True)
class EngineBlockStored:
    """The engine cached full blocks (engine hashes, with their tokens)."""

    block_hashes: tuple[EngineHash, ...]
    parent_hash: EngineHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_name: str | None = None
    extra_keys: Any = None
    medium: str | None = None
    group: int = 0


@dataclass(frozen=True, slots=True)
class EngineBlockRemoved:
    """The engine evicted blocks."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group: int = 0


@dataclass(frozen=True, slots=True)
class EngineAllBlocksCleared:
    """The engine dropped its whole prefix cache."""


EngineEvent = EngineBlockStored | EngineBlockRemoved | EngineAllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: its events in order.

    Attributes:
        bad_events: Events left out as malformed (each a decode error).
        error: Why the first of them was left out.
    """

    ts: float
    events: tuple[EngineEvent, ...]
    dp_rank: int | None = None
    bad_events: int = 0
    error: str | None = None


def _fields(raw: Any, names: Sequence[str]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    return dict(zip(names, raw[1:], strict=False))


def _hashes(value: Any, what: str) -> tuple[EngineHash, ...]:
    if not isinstance(value, list | tuple) or not all(
        isinstance(h, int | bytes) and not isinstance(h, bool) for h in value
    ):
        raise KvEventDecodeError(f"{what}: block_hashes must be a list of integers or bytes")
    return tuple(value)


def _medium(value: Any, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise KvEventDecodeError(f"{what}: medium must be a string")
    return value


def _group(value: Any, what: str) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise KvEventDecodeError(f"{what}: group_idx must be an integer")
    return value


def decode_event(raw: Any) -> EngineEvent | None:
    """One event (map or positional array); None for an event type we do not use.

    Every field the translation uses is checked here, so a decoded event never
    fails later: token ids are integers in ``[0, 2**32)`` (what the router's
    hashing packs), ``medium`` is a string or absent, ``group_idx`` an integer.

    Raises:
        KvEventDecodeError: A known event type with malformed fields.
    """
    if isinstance(raw, dict):
        kind = raw.get("type")
    elif isinstance(raw, list | tuple) and raw:
        kind = raw[0]
    else:
        raise KvEventDecodeError(f"an event must be a map or an array, got {type(raw).__name__}")
    if isinstance(kind, bytes):
        kind = kind.decode("utf-8", "replace")
    if kind == "BlockStored":
        f = _fields(raw, STORED_FIELDS)
        tokens = f.get("token_ids")
        size = f.get("block_size")
        if not isinstance(tokens, list | tuple):
            raise KvEventDecodeError("BlockStored: token_ids must be a list of integers")
        try:
            # One pass in C checks and packs: a non-integer is a TypeError, an
            # id outside uint32 an OverflowError. The packed ids are what the
            # translation hashes (hash_token_blocks takes them as they are).
            packed = array("I", tokens)
        except TypeError:
            raise KvEventDecodeError("BlockStored: token_ids must be a list of integers") from None
        except OverflowError:
            raise KvEventDecodeError("BlockStored: token_ids must be from 0 to 2**32-1") from None
        if not isinstance(size, int) or size <= 0:
            raise KvEventDecodeError("BlockStored: block_size must be a positive integer")
        parent = f.get("parent_block_hash")
        if parent is not None and not isinstance(parent, int | bytes):
            raise KvEventDecodeError("BlockStored: parent_block_hash must be an integer or bytes")
        lora = f.get("lora_name")
        return EngineBlockStored(
            block_hashes=_hashes(f.get("block_hashes"), "BlockStored"),
            parent_hash=parent,
            token_ids=packed,
            block_size=size,
            lora_name=lora if isinstance(lora, str) and lora else None,
            extra_keys=f.get("extra_keys"),
            medium=_medium(f.get("medium"), "BlockStored"),
            group=_group(f.get("group_idx"), "BlockStored"),
        )
    if kind == "BlockRemoved":
        f = _fields(raw, REMOVED_FIELDS)
        return EngineBlockRemoved(
            block_hashes=_hashes(f.get("block_hashes"), "BlockRemoved"),
            medium=_medium(f.get("medium"), "BlockRemoved"),
            group=_group(f.get("group_idx"), "BlockRemoved"),
        )
    if kind == "AllBlocksCleared":
        return EngineAllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """A message's msgpack payload ``[ts, [events...], dp_rank]``.

    Each event is decoded on its own: a malformed one is left out and counted
    in the batch's ``bad_events`` (with the first one's reason), and the
    others are kept, as the engine did cache what they say.

    Raises:
        KvEventDecodeError: Not msgpack, or not that shape.
    """
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise KvEventDecodeError(f"payload is not msgpack: {exc}") from None
    if isinstance(obj, dict):  # a map-encoded batch
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    elif isinstance(obj, list | tuple) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    else:
        raise KvEventDecodeError("payload must be [ts, [events...], data_parallel_rank]")
    if not isinstance(events, list | tuple):
        raise KvEventDecodeError("payload's events must be a list")
    decoded: list[EngineEvent] = []
    bad = 0
    error: str | None = None
    for raw in events:
        try:
            event = decode_event(raw)
        except KvEventDecodeError as exc:
            bad += 1
            error = error or str(exc)
            continue
        if event is not None:
            decoded.append(event)
    return EventBatch(
        float(ts) if isinstance(ts, int | float) else 0.0,
        tuple(decoded),
        rank if isinstance(rank, int) else None,
        bad,
        error,
    )


def decode_seq(frame: bytes) -> int:
    """The sequence frame (uint64 big-endian)."""
    if len(frame) != 8:
        raise KvEventDecodeError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


class SeqStatus(Enum):
    """What a sequence number says about the feed."""

    OK = "ok"
    FIRST = "first"  # the first message heard from this publisher
    GAP = "gap"  # messages were lost
    RESTART = "restart"  # the publisher started again (from 0)
    DUPLICATE = "duplicate"  # a message heard already (the same number and bytes)


class SequenceTracker:
    """Expected next sequence number per topic, for the live feed only.

    One ZMQ connection delivers a publisher's messages in order and never
    twice, so a number lower than expected has two causes, told apart by the
    message's content (``digest``, any value that differs between different
    payloads):

    * the **same message again**: the number is one of the last
      :data:`SEQ_WINDOW` heard and the digest is the one recorded for it. The
      publisher is reached twice (two spellings of one address, two gateways'
      configurations merged): the copy is a :attr:`SeqStatus.DUPLICATE`, to
      ignore, and the expectation does not move;
    * **another process**: any other lower number (a digest that differs,
      since every batch carries the engine's timestamp, or a number too old
      to remember): the publisher restarted, usually at 0, but its first
      messages can be lost while it reconnects (ZMQ's slow joiner), so any
      lower number counts. Two engines publishing on one topic look like a
      restart at every switch; the subscriber recognises that pattern.

    Replies to a replay request come on another socket and are not checked here.
    """

    def __init__(self) -> None:
        self._next: dict[str, int] = {}
        # topic -> seq -> digest of the last SEQ_WINDOW messages (insertion order is age).
        self._recent: dict[str, dict[int, object]] = {}

    def expected(self, topic: str) -> int | None:
        """The next sequence number expected on ``topic`` (None before the first)."""
        return self._next.get(topic)

    def check(self, topic: str, seq: int, digest: object = None) -> SeqStatus:
        """Classify ``seq`` and (unless it is a duplicate) advance the expectation past it.

        Args:
            digest: The message's content (its payload, or a hash of it);
                None = unknown, and a lower number is never a duplicate.
        """
        expected = self._next.get(topic)
        recent = self._recent.setdefault(topic, {})
        if expected is None:
            status = SeqStatus.FIRST if seq == 0 else SeqStatus.GAP
        elif seq == expected:
            status = SeqStatus.OK
        elif seq > expected:
            status = SeqStatus.GAP
        elif digest is not None and seq in recent and recent[seq] == digest:
            return SeqStatus.DUPLICATE
        else:
            status = SeqStatus.RESTART
            recent.clear()  # a new process: the old one's numbers mean nothing now
        self._next[topic] = seq + 1
        if digest is not None:
            recent.pop(seq, None)
            recent[seq] = digest
            if len(recent) > SEQ_WINDOW:
                del recent[next(iter(recent))]
        return status

    def expect(self, topic: str, seq: int) -> None:
        """Expect ``seq`` next on ``topic`` from a new process (forget what was heard)."""
        self._next[topic] = seq
        self._recent.pop(topic, None)

    def forget(self, topic: str) -> None:
        """Forget a topic (its worker was removed)."""
        self._next.pop(topic, None)
        self._recent.pop(topic, None)


NamespaceSeed = Callable[[str | None, str | None], int | None]
"""(LoRA adapter name or None, cache salt or None) -> namespace seed, or None if unknown."""


def salt_of(extra_keys: Any, lora_name: str | None) -> str | None:
    """The ``cache_salt`` vLLM folded into the first block's extra keys, if any.

    vLLM's first-block extra keys are a tuple (per block, a list of them) of
    the LoRA name, multimodal hashes and the salt, in that order, so the salt
    is the last string that is not the LoRA name.
    """
    keys = extra_keys
    if isinstance(keys, list | tuple) and keys and isinstance(keys[0], list | tuple | type(None)):
        keys = keys[0]  # per-block lists: the salt is on the first block
    if keys is None:
        return None
    if isinstance(keys, str):
        return keys if keys != lora_name else None
    if not isinstance(keys, list | tuple):
        return None
    for key in reversed(keys):
        if isinstance(key, str) and key != lora_name:
            return key
    return None


class EventTranslator:
    """One worker's engine-hash -> router-hash map, and the translation of its events.

    Args:
        worker_id: The worker the events come from.
        namespace_seed: The seed of the namespace a chain starts in.
        max_blocks: Bound on the map (the engine's block count is the natural
            size; past it, the oldest mappings go first).
    """

    def __init__(
        self, worker_id: WorkerId, namespace_seed: NamespaceSeed, max_blocks: int = 1 << 20
    ) -> None:
        self.worker_id = worker_id
        self.namespace_seed = namespace_seed
        self.max_blocks = max_blocks
        # Insertion order is age: past max_blocks the oldest mapping goes first.
        self._ours: OrderedDict[EngineHash, BlockHash] = OrderedDict()
        # Own hash -> own parent hash (None for a chain's first block): lets a
        # chunk's event name its whole chain, so the index keeps prefix closure.
        self._parent: dict[BlockHash, BlockHash | None] = {}
        self.skipped_blocks = 0
        """Stored blocks that could not be translated (unknown parent or namespace)."""

    def __len__(self) -> int:
        return len(self._ours)

    def own_hash(self, engine_hash: EngineHash) -> BlockHash | None:
        """The router's hash of an engine block, if known."""
        return self._ours.get(engine_hash)

    def translate(self, event: EngineEvent) -> KvEvent | None:
        """The event in the router's hashes; None when there is nothing to apply."""
        if isinstance(event, EngineBlockStored):
            return self._stored(event)
        if isinstance(event, EngineBlockRemoved):
            if event.medium not in GPU_MEDIA or event.group:
                return None
            ours: list[BlockHash] = []
            for engine_hash in event.block_hashes:
                own = self._ours.pop(engine_hash, None)
                if own is not None:
                    self._parent.pop(own, None)
                    ours.append(own)
            return BlockRemoved(self.worker_id, ours) if ours else None
        self.clear()
        return AllBlocksCleared(self.worker_id)

    def clear(self) -> None:
        """Forget every mapping (the cache was cleared or the engine restarted)."""
        self._ours.clear()
        self._parent.clear()

    def _stored(self, event: EngineBlockStored) -> BlockStored | None:
        if event.medium not in GPU_MEDIA or event.group:
            return None
        n = len(event.block_hashes)
        parent: BlockHash | None = None
        if event.parent_hash is None:
            seed = self.namespace_seed(event.lora_name, salt_of(event.extra_keys, event.lora_name))
        else:
            parent = self._ours.get(event.parent_hash)
            seed = parent
        if seed is None or len(event.token_ids) < n * event.block_size:
            self.skipped_blocks += n
            return None
        new = hash_token_blocks(seed, event.token_ids[: n * event.block_size], event.block_size)
        table, parents = self._ours, self._parent
        up = parent
        for engine_hash, own in zip(event.block_hashes, new, strict=True):
            table[engine_hash] = own
            parents[own] = up
            up = own
        while len(table) > self.max_blocks:
            parents.pop(table.popitem(last=False)[1], None)
        return BlockStored(self.worker_id, (*self._ancestors(parent), *new), None)

    def _ancestors(self, block: BlockHash | None) -> list[BlockHash]:
        """The known chain ending at ``block``, first block first (empty for None).

        Stops early where a link was removed; the index then verifies that
        worker block by block (it saw the ``BlockRemoved``).
        """
        chain: list[BlockHash] = []
        parents = self._parent
        while block is not None and len(chain) <= len(parents):
            chain.append(block)
            block = parents.get(block)
        chain.reverse()
        return chain
