"""The replica registry: which peers are alive, in which epoch, and whose facts to apply.

Pure (times are arguments). For every message a replica hears,
:meth:`PeerRegistry.admit` says whether to apply it, and which peer lives
ended because of it:

* its own current life's messages are skipped (``"self"``);
* a message under another configuration fingerprint is dropped
  (``"fingerprint"``): its block hashes mean other prefixes here;
* epoch 0 is no process's epoch (``"unknown_epoch"``);
* an epoch older than the newest this registry heard for that replica id is
  a life that has ended (``"stale_epoch"``); a newer one ends the older life
  (returned as gone: its in-flight counts must go);
* anything else refreshes the peer's last-seen time.

**Last seen, on the local clock.** A message's age is the receiver's wall
clock minus the sender's (the envelope's ``sent_wall``), so a peer's last
message is dated ``now - age`` on the monotonic clock. This matters on
replay: a replica that starts reads facts of peers that died long ago, and
dating them by their send time (not by when they were read) lets
:meth:`PeerRegistry.expire` end those lives at its next sweep instead of
``peer_ttl_s`` later. Across machines the clock offset shifts the date; NTP's
milliseconds are far below any useful TTL.

A peer silent for ``ttl_s`` is gone (:meth:`expire`); it is forgotten, so if
it speaks again in the same epoch (a partition healed) it is a live peer again.
So is its newest epoch: an older epoch still speaking after the newest fell
silent is a live process too. That is two processes that shared one replica
id (a misconfiguration the newer one is refused for,
:mod:`~prefixrouter.cluster.node`); the older, which kept running, is a live
peer again once the newer one's life has expired, not stale for ever.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixrouter.cluster.envelope import Envelope

SELF = "self"
FINGERPRINT = "fingerprint"
UNKNOWN_EPOCH = "unknown_epoch"
STALE_EPOCH = "stale_epoch"


@dataclass(slots=True)
class Peer:
    """One peer replica's current life."""

    replica: str
    epoch: int
    last_seen: float

    @property
    def origin(self) -> str:
        return f"{self.replica}@{self.epoch}"


@dataclass(frozen=True, slots=True)
class Admitted:
    """What :meth:`PeerRegistry.admit` decided.

    Attributes:
        drop: Why the message is not applied (None: apply it).
        gone: Origins whose life ended by it (an older epoch of its sender).
    """

    drop: str | None
    gone: tuple[str, ...] = ()


class PeerRegistry:
    """Live peers by replica id (module doc).

    Args:
        replica: This replica's id.
        epoch: This process's epoch.
        fingerprint: This replica's configuration fingerprint (64-bit value).
        ttl_s: A peer silent this long is gone.
    """

    def __init__(self, replica: str, epoch: int, fingerprint: int, ttl_s: float) -> None:
        self.replica = replica
        self.epoch = epoch
        self.fingerprint = fingerprint
        self.ttl_s = ttl_s
        self._peers: dict[str, Peer] = {}
        # The newest epoch heard per replica id whose life has not expired.
        self._newest: dict[str, int] = {}

    def admit(self, env: Envelope, now: float, now_wall: float) -> Admitted:
        """Decide about one message heard at ``now`` (monotonic) and ``now_wall`` (Unix)."""
        if env.replica == self.replica and env.epoch == self.epoch:
            return Admitted(SELF)
        if env.fingerprint != self.fingerprint:
            return Admitted(FINGERPRINT)
        if env.epoch <= 0:
            return Admitted(UNKNOWN_EPOCH)
        newest = self._newest.get(env.replica, 0)
        if env.epoch < newest:
            return Admitted(STALE_EPOCH)
        seen = now - max(0.0, now_wall - env.sent_wall)
        peer = self._peers.get(env.replica)
        gone: tuple[str, ...] = ()
        if peer is not None and peer.epoch != env.epoch:  # a newer life: the old one ended
            gone = (peer.origin,)
            peer = None
        if peer is None:
            self._peers[env.replica] = Peer(env.replica, env.epoch, seen)
        elif seen > peer.last_seen:
            peer.last_seen = seen
        self._newest[env.replica] = env.epoch
        return Admitted(None, gone)

    def ends_life(self, env: Envelope) -> bool:
        """Whether admitting ``env`` would end a live peer's life (it comes from a newer epoch)."""
        peer = self._peers.get(env.replica)
        return peer is not None and peer.epoch != env.epoch

    def silent(self, now: float) -> bool:
        """Whether :meth:`expire` at ``now`` would end any peer's life."""
        cutoff = now - self.ttl_s
        return any(p.last_seen < cutoff for p in self._peers.values())

    def expire(self, now: float) -> list[str]:
        """Forget peers silent for ``ttl_s``; return their origins."""
        cutoff = now - self.ttl_s
        gone = [p for p in self._peers.values() if p.last_seen < cutoff]
        for p in gone:
            del self._peers[p.replica]
            if self._newest.get(p.replica) == p.epoch:
                del self._newest[p.replica]
        return [p.origin for p in gone]

    def live(self) -> list[Peer]:
        """The live peers, this replica's own earlier lives excluded, by replica id."""
        return sorted(
            (p for p in self._peers.values() if p.replica != self.replica),
            key=lambda p: p.replica,
        )
