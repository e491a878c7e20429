"""The expected output: a client's max_tokens is a cap, the answers say how much of it is used."""

from __future__ import annotations

import pytest

from prefixrouter.core import Dispatcher, Outcome, Router
from prefixrouter.core.facts import SettledFact
from prefixrouter.core.output import DEFAULT_FIRST_GUESS_TOKENS, OutputEstimate
from tests.core.conftest import request, tokens, workers

DOC = tokens(1, 16 * 20)


def test_before_any_answer_a_cap_is_taken_at_most_at_the_first_guess() -> None:
    est = OutputEstimate()
    assert est.expected(4096, "k") == DEFAULT_FIRST_GUESS_TOKENS
    assert est.expected(200, "k") == 200  # a cap below the guess is taken at its word
    assert est.expected(1, "k") == 1
    assert est.expected(0, "k") == DEFAULT_FIRST_GUESS_TOKENS  # no cap: the guess too


def test_the_first_answer_sets_the_fill_and_later_ones_average_it() -> None:
    est = OutputEstimate(window=4)
    est.observe(2048, 256, "k")  # an eighth of the cap
    assert est.expected(2048, "k") == 256
    assert est.expected(1024, "k") == 128  # the fill, at another cap
    est.observe(2048, 768, "k")  # running mean of 1/8 and 3/8
    assert est.expected(2048, "k") == 512


def test_a_prefix_keeps_its_own_fill_and_a_new_one_takes_the_global() -> None:
    est = OutputEstimate()
    for _ in range(10):
        est.observe(1000, 100, "short-answers")
        est.observe(1000, 900, "long-answers")
    assert est.expected(1000, "short-answers") == 100
    assert est.expected(1000, "long-answers") == 900
    assert est.expected(1000, "never-seen") == 500  # the mean over all answers


def test_clients_that_send_the_answers_length_are_taken_at_their_word() -> None:
    est = OutputEstimate()
    for n in (50, 300, 4000):
        est.observe(n, n, "k")  # every answer used its whole max_tokens
    assert est.expected(7000, "k") == 7000
    est.observe(100, 250, "k")  # an engine that overran the cap counts as full
    assert est.expected(7000, "k") == 7000


def test_requests_without_a_cap_expect_what_such_answers_decoded() -> None:
    est = OutputEstimate(window=4)
    est.observe(0, 1800, "essay")  # no max_tokens: a long generation
    assert est.expected(0, "essay") == 1800  # not cut to any nominal cap
    est.observe(0, 2200, "essay")
    assert est.expected(0, "essay") == 2000
    est.observe(0, 40, "chat")
    assert est.expected(0, "chat") == 40
    assert est.expected(0, "new") == round((1800 + 2200 + 40) / 3)  # the uncapped mean


def test_capped_and_uncapped_answers_are_learned_apart() -> None:
    est = OutputEstimate()
    est.observe(2048, 205, "k")  # a fill of a tenth
    est.observe(0, 900, "k")  # a client without a cap, same prefix
    assert est.expected(2048, "k") == 205  # the fill is not moved by 900 of "no cap"
    assert est.expected(0, "k") == 900  # nor is 900 read as a tenth of a cap
    assert est.expected(0, "other") == 900 and est.expected(4096, "other") == 410


def test_the_prefixes_kept_are_bounded_oldest_first() -> None:
    est = OutputEstimate(max_prefixes=2)
    est.observe(100, 10, "a")
    est.observe(100, 90, "b")
    est.observe(100, 50, "c")  # "a" goes
    assert est.expected(100, "b") == 90
    assert est.expected(100, "a") == 50  # the global mean of 10, 90, 50


@pytest.mark.parametrize("kwargs", [{"window": 0}, {"max_prefixes": 0}, {"first_guess_tokens": 0}])
def test_bad_parameters_are_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        OutputEstimate(**kwargs)


def test_the_router_learns_from_answers_and_the_ledger_holds_the_expected_decode() -> None:
    d = Dispatcher(Router("prefix_aware"))
    ws = workers(2)
    first = d.admit(request("r0", DOC, max_tokens=2048), ws, 0.0)
    assert first.decision.context.output_tokens == DEFAULT_FIRST_GUESS_TOKENS
    d.first_token(first, 0.1)
    assert d.load(first.worker).decode_tokens_remaining == DEFAULT_FIRST_GUESS_TOKENS
    d.complete(first, Outcome(0, 0.1, True, 128), 2.0)  # the answer ended at 128 tokens
    second = d.admit(request("r1", DOC, max_tokens=2048), ws, 3.0)
    assert second.decision.context.output_tokens == 128
    d.first_token(second, 3.1)
    assert d.load(second.worker).decode_tokens_remaining == 128
    # A failed answer teaches nothing.
    d.complete(second, Outcome(0, 0.1, False, 2048), 4.0)
    assert (
        d.admit(request("r2", DOC, max_tokens=2048), ws, 5.0).decision.context.output_tokens == 128
    )


def test_a_peer_learns_the_fill_from_the_origins_answers() -> None:
    a, b = (Dispatcher(Router("prefix_aware"), record_facts=True) for _ in range(2))
    adm = a.admit(request("r0", DOC, max_tokens=1000), workers(2), 0.0)
    a.complete(adm, Outcome(0, 0.1, True, 250), 1.0)
    facts = a.drain_facts()
    settled = [f for f in facts if isinstance(f, SettledFact)]
    assert [f.output_tokens for f in settled] == [250]
    for f in facts:
        b.apply_peer("a@1", f, 1.0)
    assert (
        b.admit(request("r1", DOC, max_tokens=1000), workers(2), 2.0).decision.context.output_tokens
        == 250
    )
