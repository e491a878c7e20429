"""The envelope of every cluster message: who sent it, in which life, under which configuration.

Each message a replica publishes starts with a fixed header::

    u8 version, u8 kind, u64 epoch, u64 fingerprint, f64 sent_wall, u64 seq, u16 len, replica id

* ``kind``: :data:`FACTS` (a batch of :mod:`~prefixrouter.cluster.codec`
  facts follows) or :data:`HEARTBEAT` (a small JSON object follows: the
  per-field fingerprint digests, and whether it is a starting replica's hello);
* ``epoch``: one per process start (:func:`new_epoch`), so facts of a
  restarted replica's earlier life are told apart from its current ones;
* ``fingerprint``: the 64-bit digest of the configuration that must agree for
  block hashes to agree (:mod:`~prefixrouter.cluster.fingerprint`);
* ``sent_wall``: the sender's wall clock when it published, in Unix seconds;
  the receiver's wall clock minus it is the propagation lag (exact on one
  machine, off by the clock offset across machines);
* ``seq``: the facts message's number in its sender's life (1, 2, ...; 0 on
  heartbeats). A replica hears a message on the live subscription, on the
  stream's replay or on both around the switch from one to the other
  (:mod:`~prefixrouter.cluster.transport`); the receiver applies a life's
  messages in increasing ``seq`` only, so none is applied twice, and a jump
  tells it how many it missed.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

VERSION = 6
"""The wire version: 3 added the codec's ``COUNTED`` fact, 4 the answer's
``output_tokens`` in ``SETTLED``, 5 ``speculative`` in ``ROUTED``, 6 changed the
fingerprint's fields (the gateway's ``fingerprint_fields``). A replica ignores
messages of another version (:class:`OtherVersion`: an older one would not
decode the new layout, and fingerprints of two versions do not compare), so
during a rolling upgrade the two versions route side by side without sharing,
and no new replica is refused for an old one's fingerprint."""
FACTS = 1
HEARTBEAT = 2

_HEAD = struct.Struct("<BBQQdQH")
_TAIL = _HEAD.size - 2  # where the replica id's length starts


class EnvelopeError(ValueError):
    """A message without a well-formed envelope (or of an unknown version)."""


class OtherVersion(EnvelopeError):
    """A well-formed message of another wire version (a replica of another release).

    Attributes:
        version: Its version.
    """

    def __init__(self, version: int) -> None:
        super().__init__(f"envelope version {version} (this replica speaks {VERSION})")
        self.version = version


@dataclass(frozen=True, slots=True)
class Envelope:
    """The header of one message (module doc)."""

    kind: int
    replica: str
    epoch: int
    fingerprint: int
    sent_wall: float
    seq: int = 0

    @property
    def origin(self) -> str:
        """``replica@epoch``: the dispatcher's name for this sender's life."""
        return f"{self.replica}@{self.epoch}"


def new_epoch() -> int:
    """An epoch for a process starting now: wall-clock nanoseconds (later starts are larger).

    Ordered, so a receiver can tell a stale epoch from a new one; distinct for
    any two starts of one replica id more than a nanosecond apart.
    """
    return time.time_ns()


def pack(head: Envelope, body: bytes) -> bytes:
    """The message: the header, then ``body``."""
    replica = head.replica.encode("utf-8")
    fixed = _HEAD.pack(
        VERSION, head.kind, head.epoch, head.fingerprint, head.sent_wall, head.seq, len(replica)
    )
    return b"".join((fixed, replica, body))


def sender_key(head: Envelope) -> tuple[bytes, bytes]:
    """What :func:`is_from` compares: the bytes of a sender's version, kind, epoch and
    fingerprint, and of its replica id with its length."""
    fixed = _HEAD.pack(VERSION, head.kind, head.epoch, head.fingerprint, 0.0, 0, 0)
    replica = head.replica.encode("utf-8")
    return fixed[:18], struct.pack("<H", len(replica)) + replica


def is_from(data: bytes, key: tuple[bytes, bytes]) -> bool:
    """Whether ``data`` was sent by the life :func:`sender_key` made ``key`` of.

    Compares bytes without unpacking: a replica hears its own messages on the
    stream and skips them, so this check is on the path of every message.
    """
    fixed, tail = key
    return data[:18] == fixed and data[_TAIL : _TAIL + len(tail)] == tail


def unpack(data: bytes) -> tuple[Envelope, memoryview]:
    """The header and the body of a message.

    Raises:
        EnvelopeError: Too short, or a version this replica does not speak.
    """
    if len(data) < _HEAD.size:
        raise EnvelopeError(f"message of {len(data)} bytes has no envelope")
    version, kind, epoch, fingerprint, sent, seq, n = _HEAD.unpack_from(data, 0)
    if version != VERSION:
        raise OtherVersion(version)
    end = _HEAD.size + n
    if end > len(data):
        raise EnvelopeError("replica id runs past the end")
    view = memoryview(data)
    replica = str(view[_HEAD.size : end], "utf-8")
    return Envelope(kind, replica, epoch, fingerprint, sent, seq), view[end:]
