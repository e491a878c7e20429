"""The replica registry (epochs, TTL, fingerprints) and the configuration fingerprint."""

from __future__ import annotations

from prefixrouter.cluster.envelope import FACTS, Envelope
from prefixrouter.cluster.fingerprint import Fingerprint
from prefixrouter.cluster.registry import (
    FINGERPRINT,
    SELF,
    STALE_EPOCH,
    UNKNOWN_EPOCH,
    PeerRegistry,
)

FP = 42
WALL = 1_000_000.0  # the receiver's wall clock in these tests


def msg(replica: str, epoch: int, sent_ago: float = 0.0, fp: int = FP) -> Envelope:
    return Envelope(FACTS, replica, epoch, fp, WALL - sent_ago)


def reg() -> PeerRegistry:
    return PeerRegistry("me", 100, FP, ttl_s=5.0)


def test_own_messages_are_skipped_but_an_earlier_life_of_mine_is_a_peer() -> None:
    r = reg()
    assert r.admit(msg("me", 100), 0.0, WALL).drop == SELF
    assert r.admit(msg("me", 50), 0.0, WALL).drop is None  # restoring my previous life
    assert r.live() == []  # not counted among the peers


def test_a_newer_epoch_ends_the_older_life_and_the_older_is_stale_after() -> None:
    r = reg()
    assert r.admit(msg("a", 1), 0.0, WALL).drop is None
    got = r.admit(msg("a", 2), 1.0, WALL)
    assert got.drop is None and got.gone == ("a@1",)
    assert r.admit(msg("a", 1), 2.0, WALL).drop == STALE_EPOCH
    assert [p.origin for p in r.live()] == ["a@2"]


def test_an_older_life_still_speaking_is_a_peer_again_once_the_newer_expires() -> None:
    # Two processes under one id: the newer (2) was refused and exited; the older
    # (1) kept running. Stale while 2 lives, a live peer again once 2's life expired.
    r = reg()
    r.admit(msg("a", 1), 0.0, WALL)
    assert r.admit(msg("a", 2), 1.0, WALL).gone == ("a@1",)
    assert r.admit(msg("a", 1), 2.0, WALL).drop == STALE_EPOCH
    assert r.expire(5.5) == []  # 2 heard at 1.0: not silent for the TTL yet
    assert r.expire(6.5) == ["a@2"]
    assert r.admit(msg("a", 1), 7.0, WALL).drop is None
    assert [p.origin for p in r.live()] == ["a@1"]


def test_other_fingerprints_and_epoch_zero_are_dropped() -> None:
    r = reg()
    assert r.admit(msg("a", 1, fp=7), 0.0, WALL).drop == FINGERPRINT
    assert r.admit(msg("a", 0), 0.0, WALL).drop == UNKNOWN_EPOCH
    assert r.live() == []


def test_a_silent_peer_expires_after_the_ttl_and_comes_back_if_it_speaks() -> None:
    r = reg()
    r.admit(msg("a", 1), 10.0, WALL)
    r.admit(msg("b", 1), 10.0, WALL)
    assert r.expire(14.9) == []
    r.admit(msg("b", 1), 14.0, WALL)  # b heartbeats, a does not
    assert r.expire(15.5) == ["a@1"]
    assert [p.replica for p in r.live()] == ["b"]
    r.admit(msg("a", 1), 16.0, WALL)  # a partition healed: the same life is live again
    assert [p.replica for p in r.live()] == ["a", "b"]


def test_a_replayed_message_is_dated_by_its_send_time() -> None:
    r = reg()
    # Heard now, sent an hour ago: the peer's last sign of life is an hour old.
    r.admit(msg("a", 1, sent_ago=3600.0), 5000.0, WALL)
    assert r.expire(5000.0) == ["a@1"]


def test_a_fingerprint_names_the_fields_that_differ() -> None:
    base = {"routing.mode": "text", "routing.chunk_chars": "64", "salt_secret": "s3cret"}
    a = Fingerprint.of(base)
    b = Fingerprint.of({**base, "routing.chunk_chars": "128"})
    assert a.value != b.value
    assert a.differing(b.fields) == ["routing.chunk_chars"]
    assert a.differing({k: v for k, v in a.fields.items() if k != "salt_secret"}) == ["salt_secret"]
    assert Fingerprint.of(dict(reversed(base.items()))) == a  # order does not matter
    assert Fingerprint.from_fields(a.fields).value == a.value
    assert all("s3cret" not in d for d in a.fields.values())  # a digest, never the value
