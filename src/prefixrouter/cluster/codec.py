"""The wire codec of routing facts: one compact binary message per batch.

Sync must cost little CPU per request (the target is 0.05 ms per request per
replica for publish and apply together), and a request makes two or three
facts, so the codec avoids the per-object work of JSON: a message is one
:mod:`struct` header per fact and the block hashes of a routing as one
``array('Q')`` copy (read back by one ``struct`` call straight into the
tuple the fact holds), with the strings of the batch (worker ids, namespace
fields, models, request ids) written once each in a string table and named by
index. The table is one UTF-8 blob with the strings' lengths in code points,
so the receiver decodes it with one call and cuts it by slicing. A batch of
facts of one namespace pays for its namespace once, and a receiver builds
each namespace's fields once (a small cache across messages).

Layout (little-endian)::

    message := u16 n_strings, u16 * n_strings (lengths in code points),
               u32 blob_bytes, utf-8 blob, u32 n_facts, fact * n_facts
    fact    := u8 tag, then by tag:
      ROUTED   u16 request_id, u16 worker, u16 * 5 namespace fields, u16 model,
               u16 prefix_key, f64 block_tokens, u32 prompt_tokens,
               u32 predicted_cached_tokens, u32 max_tokens, f64 predicted_ttft_s,
               u8 speculative, u32 n_hashes, u64 * n_hashes
      FIRST    u16 request_id
      SETTLED  u16 request_id, u8 settlement, u32 actual_cached_tokens,
               u32 prompt_chars, u32 prompt_tokens, f64 ttft_s, u32 output_tokens
      WORKER   u16 worker, u8 change
      COUNTED  u16 request_id, u32 prompt_chars, u32 prompt_tokens

The envelope (who sent it, when, under which configuration) is
:mod:`~prefixrouter.cluster.envelope`'s. :func:`encode_facts` splits a batch
into messages that each stay under a byte budget (give or take the strings
of its last fact) (NATS refuses a payload over
the server's ``max_payload``, 1 MiB by default) and under the string table's
65,535 entries. Counts that could exceed 32 bits are clamped to them (a
prompt of four billion tokens is not one the gateway accepts).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable
from typing import Any, cast

from prefixrouter.core.facts import (
    CountedFact,
    Fact,
    FirstTokenFact,
    NamespaceFields,
    RoutedFact,
    SettledFact,
    Settlement,
    WorkerChange,
    WorkerFact,
)

TAG_ROUTED, TAG_FIRST, TAG_SETTLED, TAG_WORKER, TAG_COUNTED = 1, 2, 3, 4, 5

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_ROUTED = struct.Struct("<B9HdIIIdBI")
_FIRST = struct.Struct("<BH")
_SETTLED = struct.Struct("<BHBIIIdI")
_WORKER = struct.Struct("<BHB")
_COUNTED = struct.Struct("<BHII")
_MAX_STRINGS = 0xFFFF
_MAX_NAMESPACES = 1024  # the decoder's cache of namespace fields (cleared when full)
_SETTLEMENTS = {int(v): v for v in Settlement}
_CHANGES = {int(v): v for v in WorkerChange}
_U32_MAX = 0xFFFFFFFF
_SWAP = sys.byteorder != "little"  # array('Q') is native; the wire is little-endian

DEFAULT_MAX_BYTES = 512 * 1024
"""A message's byte budget: half of NATS's default ``max_payload``, room for the envelope."""


class DecodeError(ValueError):
    """A message that is not a well-formed batch of facts."""


def _u32(n: int) -> int:
    return n if 0 <= n <= _U32_MAX else (0 if n < 0 else _U32_MAX)


class _Batch:
    """One message being built: its string table and its fact records."""

    __slots__ = ("facts", "index", "parts", "size", "strings")

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.strings: list[str] = []
        self.parts: list[bytes] = []
        self.facts = 0
        self.size = 10  # the three counts

    def s(self, value: str) -> int:
        i = self.index.get(value)
        if i is None:
            if len(value) > 0xFFFF:
                raise ValueError(f"string of {len(value)} characters is too long for the wire")
            i = self.index[value] = len(self.strings)
            self.strings.append(value)
            # Bytes, not characters, count toward the budget; ASCII is one byte a character.
            self.size += 2 + (len(value) if value.isascii() else len(value.encode("utf-8")))
        return i

    def add(self, fact: Fact) -> None:
        s = self.s
        if isinstance(fact, RoutedFact):
            ns = fact.namespace
            head = _ROUTED.pack(
                TAG_ROUTED,
                s(fact.request_id),
                s(fact.worker),
                s(ns.model_revision),
                s(ns.tokenizer_revision),
                s(ns.adapter_id),
                s(ns.template_version),
                s(ns.tenant),
                s(fact.model),
                s(fact.prefix_key),
                fact.block_tokens,
                _u32(fact.prompt_tokens),
                _u32(fact.predicted_cached_tokens),
                _u32(fact.max_tokens),
                fact.predicted_ttft_s,
                fact.speculative,
                len(fact.hashes),
            )
            hashes = array("Q", fact.hashes)
            if _SWAP:  # pragma: no cover - big-endian hosts only
                hashes.byteswap()
            body = hashes.tobytes()
            self.parts.append(head)
            self.parts.append(body)
            self.size += len(head) + len(body)
        elif isinstance(fact, FirstTokenFact):
            self.parts.append(_FIRST.pack(TAG_FIRST, s(fact.request_id)))
            self.size += _FIRST.size
        elif isinstance(fact, SettledFact):
            rec = _SETTLED.pack(
                TAG_SETTLED,
                s(fact.request_id),
                int(fact.settlement),
                _u32(fact.actual_cached_tokens),
                _u32(fact.prompt_chars),
                _u32(fact.prompt_tokens),
                fact.ttft_s,
                _u32(fact.output_tokens),
            )
            self.parts.append(rec)
            self.size += _SETTLED.size
        elif isinstance(fact, CountedFact):
            rec = _COUNTED.pack(
                TAG_COUNTED, s(fact.request_id), _u32(fact.prompt_chars), _u32(fact.prompt_tokens)
            )
            self.parts.append(rec)
            self.size += _COUNTED.size
        else:
            self.parts.append(_WORKER.pack(TAG_WORKER, s(fact.worker), int(fact.change)))
            self.size += _WORKER.size
        self.facts += 1

    def bytes(self) -> bytes:
        strings = self.strings
        lengths = array("H", [len(v) for v in strings])
        if _SWAP:  # pragma: no cover - big-endian hosts only
            lengths.byteswap()
        blob = "".join(strings).encode("utf-8")
        out = [_U16.pack(len(strings)), lengths.tobytes(), _U32.pack(len(blob)), blob]
        out.append(_U32.pack(self.facts))
        out.extend(self.parts)
        return b"".join(out)


def encode_facts(facts: Iterable[Fact], max_bytes: int = DEFAULT_MAX_BYTES) -> list[bytes]:
    """Encode ``facts`` as few messages as fit ``max_bytes`` each (module doc).

    A single fact larger than ``max_bytes`` (a routing of more than 64k blocks
    at the default budget) gets a message of its own.
    """
    out: list[bytes] = []
    batch = _Batch()
    for fact in facts:
        # A fact's records (its strings are not counted: short, and often written already);
        # nine strings at most per fact: a new message before the table can overflow.
        if isinstance(fact, RoutedFact):
            need = _ROUTED.size + 8 * len(fact.hashes)
        else:
            need = _SETTLED.size  # the largest of the other records
        full = batch.size + need > max_bytes or len(batch.strings) > _MAX_STRINGS - 9
        if batch.facts and full:
            out.append(batch.bytes())
            batch = _Batch()
        batch.add(fact)
    if batch.facts:
        out.append(batch.bytes())
    return out


def count_facts(data: bytes | memoryview) -> int:
    """How many facts a message of :func:`encode_facts` holds (its header only, not checked)."""
    (n_strings,) = _U16.unpack_from(data, 0)
    pos = 2 + 2 * n_strings
    (n_bytes,) = _U32.unpack_from(data, pos)
    (n_facts,) = _U32.unpack_from(data, pos + 4 + n_bytes)
    return int(n_facts)


def decode_facts(data: bytes | memoryview) -> list[Fact]:
    """The facts of one message, in the order they were encoded.

    Raises:
        DecodeError: A truncated message, an unknown tag or a bad string index.
    """
    view = memoryview(data)
    try:
        return _decode(view)
    except (struct.error, IndexError, ValueError) as exc:
        raise DecodeError(f"bad facts message: {exc}") from None


_INF = float("inf")
_NAMESPACES: dict[tuple[str, ...], NamespaceFields] = {}
_HASHES: dict[int, struct.Struct] = {}  # "<nQ" by n (block counts repeat: a small set)


def _hashes(n: int) -> struct.Struct:
    st = _HASHES.get(n)
    if st is None:
        if len(_HASHES) >= 4096:
            _HASHES.clear()
        st = _HASHES[n] = struct.Struct(f"<{n}Q")
    return st


def _decode(view: memoryview) -> list[Fact]:
    (n_strings,) = _U16.unpack_from(view, 0)
    pos = 2 + 2 * n_strings
    if pos > len(view):
        raise ValueError("string lengths run past the end")
    lengths = array("H")
    lengths.frombytes(view[2:pos])
    if _SWAP:  # pragma: no cover - big-endian hosts only
        lengths.byteswap()
    (n_bytes,) = _U32.unpack_from(view, pos)
    pos += 4
    end = pos + n_bytes
    if end > len(view):
        raise ValueError("string table runs past the end")
    blob = str(view[pos:end], "utf-8")
    pos = end
    strings: list[str] = []
    at = 0
    for n in lengths:
        strings.append(blob[at : at + n])
        at += n
    if at != len(blob):
        raise ValueError("string lengths do not match the string table")
    (n_facts,) = _U32.unpack_from(view, pos)
    pos += 4
    # Built positionally from the table's str (RequestId and WorkerId are str at runtime).
    facts: list[Any] = []
    namespaces = _NAMESPACES
    append = facts.append
    routed_size = _ROUTED.size
    for _ in range(n_facts):
        tag = view[pos]
        if tag == TAG_ROUTED:
            (_, rid, worker, mr, tr, ad, tv, te, model, pk, bt, pt, pc, mt, ttft, spec, nh) = (
                _ROUTED.unpack_from(view, pos)
            )
            pos += routed_size
            if not 0.0 < bt < _INF:
                # A peer's settlement divides the engine's cached tokens by it.
                raise ValueError(f"a routing's block size is {bt}, not a positive number")
            if pos + 8 * nh > len(view):
                raise ValueError("block hashes run past the end")
            hashes = _hashes(nh).unpack_from(view, pos)
            pos += 8 * nh
            key = (strings[mr], strings[tr], strings[ad], strings[tv], strings[te])
            ns = namespaces.get(key)
            if ns is None:
                if len(namespaces) >= _MAX_NAMESPACES:
                    namespaces.clear()
                ns = namespaces[key] = NamespaceFields(*key)
            append(
                RoutedFact(
                    strings[rid],
                    strings[worker],
                    ns,
                    strings[model],
                    strings[pk],
                    hashes,
                    bt,
                    pt,
                    pc,
                    mt,
                    ttft,
                    spec != 0,
                )
            )
        elif tag == TAG_FIRST:
            (_, rid) = _FIRST.unpack_from(view, pos)
            pos += _FIRST.size
            append(FirstTokenFact(strings[rid]))
        elif tag == TAG_SETTLED:
            (_, rid, settlement, cached, chars, tokens, ttft, output) = _SETTLED.unpack_from(
                view, pos
            )
            pos += _SETTLED.size
            append(
                SettledFact(
                    strings[rid], _SETTLEMENTS[settlement], cached, chars, tokens, ttft, output
                )
            )
        elif tag == TAG_WORKER:
            (_, worker, change) = _WORKER.unpack_from(view, pos)
            pos += _WORKER.size
            append(WorkerFact(strings[worker], _CHANGES[change]))
        elif tag == TAG_COUNTED:
            (_, rid, chars, tokens) = _COUNTED.unpack_from(view, pos)
            pos += _COUNTED.size
            append(CountedFact(strings[rid], chars, tokens))
        else:
            raise ValueError(f"unknown fact tag {tag}")
    if pos != len(view):
        raise ValueError(f"{len(view) - pos} bytes after the last fact")
    return cast("list[Fact]", facts)
