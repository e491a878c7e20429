"""The wire codec and the envelope: every fact survives a round trip, bad bytes are refused."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrouter.cluster import envelope
from prefixrouter.cluster.codec import DecodeError, count_facts, decode_facts, encode_facts
from prefixrouter.cluster.envelope import FACTS, Envelope, EnvelopeError
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
from prefixrouter.core.types import BlockHash, RequestId, WorkerId

text = st.text(max_size=40)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
namespaces = st.builds(NamespaceFields, text, text, text, text, text)
routed = st.builds(
    RoutedFact,
    request_id=text.map(RequestId),
    worker=text.map(WorkerId),
    namespace=namespaces,
    model=text,
    prefix_key=text,
    hashes=st.lists(st.integers(0, 2**64 - 1).map(BlockHash), max_size=50).map(tuple),
    block_tokens=st.floats(min_value=0.0, exclude_min=True, allow_infinity=False),
    prompt_tokens=u32,
    predicted_cached_tokens=u32,
    max_tokens=u32,
    predicted_ttft_s=st.floats(allow_nan=False, allow_infinity=False),
    speculative=st.booleans(),
)
facts: st.SearchStrategy[Fact] = st.one_of(
    routed,
    st.builds(FirstTokenFact, text.map(RequestId)),
    st.builds(
        SettledFact,
        text.map(RequestId),
        st.sampled_from(Settlement),
        u32,
        u32,
        u32,
        st.floats(allow_nan=False, allow_infinity=False),
        u32,
    ),
    st.builds(WorkerFact, text.map(WorkerId), st.sampled_from(WorkerChange)),
    st.builds(CountedFact, text.map(RequestId), u32, u32),
)


def _routed(i: int, blocks: int = 3) -> RoutedFact:
    return RoutedFact(
        RequestId(f"r{i}"),
        WorkerId("w0"),
        NamespaceFields("tiny", "tok1", "", "v2", "tenant:acme"),
        "tiny",
        "pk",
        tuple(BlockHash(2**64 - 1 - j) for j in range(blocks)),
        3.5,
        100,
        48,
        16,
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(facts, max_size=30), st.integers(min_value=64, max_value=4096))
def test_any_batch_round_trips_in_order_whatever_the_split(batch: list[Fact], budget: int) -> None:
    messages = encode_facts(batch, budget)
    decoded = [f for m in messages for f in decode_facts(m)]
    assert decoded == batch
    # The header's count (what a dropped message's facts are counted by) is each message's.
    assert [count_facts(m) for m in messages] == [len(decode_facts(m)) for m in messages]
    if batch:
        assert messages


def test_a_batch_of_one_namespace_writes_its_strings_once() -> None:
    one = encode_facts([_routed(0)])[0]
    ten = encode_facts([_routed(i) for i in range(10)])[0]
    # Each further routing costs its fixed record (tag, nine string indices,
    # block tokens, four counts, predicted TTFT, the speculative flag), its
    # hashes and its own request id (length and three characters) only.
    per_fact = (len(ten) - len(one)) / 9
    assert per_fact < 1 + 18 + 8 + 16 + 8 + 1 + 3 * 8 + 2 + 3, per_fact


def test_the_byte_budget_splits_a_batch_and_an_oversized_fact_goes_alone() -> None:
    batch = [_routed(i, blocks=100) for i in range(10)]
    messages = encode_facts(batch, 2000)
    assert len(messages) == 5  # two routings of 100 blocks fit 2,000 bytes, three do not
    assert all(len(m) <= 2000 + 100 for m in messages)
    assert [f for m in messages for f in decode_facts(m)] == batch
    (alone,) = encode_facts([_routed(0, blocks=1000)], 100)
    assert len(alone) > 8000


@pytest.mark.parametrize("cut", [1, 5, 20, 40])
def test_a_truncated_message_is_a_decode_error(cut: int) -> None:
    data = encode_facts([_routed(0), SettledFact(RequestId("r0"), Settlement.COMPLETED, 48)])[0]
    with pytest.raises(DecodeError):
        decode_facts(data[:-cut])


def test_trailing_bytes_and_unknown_tags_are_decode_errors() -> None:
    data = encode_facts([FirstTokenFact(RequestId("r0"))])[0]
    with pytest.raises(DecodeError):
        decode_facts(data + b"\0")
    bad = bytearray(data)
    bad[-3] = 99  # the fact's tag
    with pytest.raises(DecodeError):
        decode_facts(bytes(bad))


@pytest.mark.parametrize("block_tokens", [0.0, -16.0, float("nan"), float("inf")])
def test_a_routing_whose_block_size_is_not_a_positive_number_is_a_decode_error(
    block_tokens: float,
) -> None:
    # A peer settling that routing would divide the engine's cached tokens by it.
    fact = dataclasses.replace(_routed(0), block_tokens=block_tokens)
    with pytest.raises(DecodeError, match="block size"):
        decode_facts(encode_facts([fact])[0])


def test_the_envelope_round_trips_and_names_the_origin() -> None:
    head = Envelope(FACTS, "replica-é", 1234567890123, 2**64 - 1, 1.7e9, 2**40 + 3)
    got, body = envelope.unpack(envelope.pack(head, b"payload"))
    assert got == head and bytes(body) == b"payload"
    assert got.origin == "replica-é@1234567890123"


def test_a_short_or_foreign_envelope_is_refused() -> None:
    with pytest.raises(EnvelopeError):
        envelope.unpack(b"\x01\x01")
    data = bytearray(envelope.pack(Envelope(FACTS, "a", 1, 2, 3.0), b""))
    data[0] = 9  # a version this replica does not speak
    with pytest.raises(EnvelopeError, match="version 9"):
        envelope.unpack(bytes(data))


def test_epochs_of_later_starts_are_larger() -> None:
    first = envelope.new_epoch()
    assert envelope.new_epoch() >= first > 0


def test_a_sender_knows_its_own_messages_without_unpacking_them() -> None:
    mine = Envelope(FACTS, "a", 5, 9, 0.0)
    key = envelope.sender_key(mine)
    assert envelope.is_from(envelope.pack(Envelope(FACTS, "a", 5, 9, 123.0, 77), b"x"), key)
    for other in (
        Envelope(FACTS, "a", 6, 9, 0.0),  # another life
        Envelope(FACTS, "ab", 5, 9, 0.0),  # another replica
        Envelope(FACTS, "a", 5, 8, 0.0),  # another configuration
    ):
        assert not envelope.is_from(envelope.pack(other, b"x"), key)
