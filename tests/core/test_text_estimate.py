"""Text mode's characters per token: set by the first answer, learned per prefix; stable keys.

Documents of different kinds are tokenized with the project's real BPE
tokenizer (prose about 3.2 characters per token, source code 2.2, numbers 1.7,
CJK 0.33), and a fake engine per worker reports what a prefix cache reports:
the longest token prefix it served before, in whole 16-token blocks.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from prefixrouter.core import (
    BlockHasher,
    CacheNamespace,
    Dispatcher,
    Outcome,
    RequestId,
    Router,
    RoutingRequest,
    TokenEstimator,
    WorkerId,
    WorkerView,
)
from prefixrouter.core.hashing import anchor_depths
from prefixrouter.core.types import BlockHash
from prefixrouter.tokenization import Tokenizer, load_tokenizer

NS = CacheNamespace("model-a")
BLOCK = 16
SYSTEM = "You answer questions about the document below, briefly and exactly.\n\n"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer()


def documents() -> dict[str, str]:
    """Four documents whose characters per token differ by a factor of ten."""
    rng = random.Random(7)
    words = [
        "the", "committee", "reviewed", "every", "item", "and", "approved", "it", "after",
        "a", "long", "discussion", "about", "budgets", "schedules", "staffing", "risks",
    ]  # fmt: skip
    prose = " ".join(rng.choice(words) for _ in range(5_000))
    code = "\n".join(
        f"def step_{i}(x, y):\n    return x * {i} + y  # line {rng.randrange(999)}"
        for i in range(450)
    )
    numbers = " ".join(str(rng.randrange(10**9)) for _ in range(1_400))
    cjk = "".join(chr(0x4E00 + rng.randrange(2_000)) for _ in range(8_000))
    return {"prose": prose, "code": code, "numbers": numbers, "cjk": cjk}


class PrefixCache:
    """A worker's engine as the router sees it: cached tokens of the longest prefix served."""

    def __init__(self) -> None:
        self.served: list[list[int]] = []

    def run(self, ids: list[int]) -> int:
        best = 0
        for old in self.served:
            n = 0
            for a, b in zip(old, ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        self.served.append(ids)
        return min(best, len(ids) - 1) // BLOCK * BLOCK


def text_dispatcher(estimator: TokenEstimator | None = None) -> Dispatcher:
    hasher = BlockHasher(block_size=BLOCK, estimator=estimator or TokenEstimator())
    return Dispatcher(Router("prefix_aware", hasher), mode="text")


def views(n: int) -> list[WorkerView]:
    return [
        WorkerView(WorkerId(f"w{i}"), kv_capacity_blocks=100_000, block_size=BLOCK)
        for i in range(n)
    ]


def ask(
    d: Dispatcher, engines: dict[WorkerId, PrefixCache], tok: Tokenizer, rid: str, text: str
) -> tuple[int, int, str]:
    """One request through the dispatcher and its engine: (predicted, actual cached, key)."""
    adm = d.admit(RoutingRequest(RequestId(rid), NS, text=text), views(len(engines)), 0.0)
    ids = tok.encode(text)
    cached = engines[adm.worker].run(ids)
    d.complete(adm, Outcome(cached, 0.1), 0.0)
    d.observe_prompt_tokens(len(text), len(ids), adm)
    return adm.decision.predicted_cached_tokens, cached, adm.decision.prefix_key


# ---------------------------------------------------------------- the estimator


def test_the_first_answer_replaces_the_prior_then_weights_are_bounded() -> None:
    est = TokenEstimator(4.0, alpha=0.25)
    est.observe(2_000, 1_000)
    assert est.chars_per_token == 2.0  # not 4.0 crept toward 2.0
    est.observe(4_000, 1_000)
    assert est.chars_per_token == pytest.approx(3.0)  # the first 1/alpha: an equal-weight mean
    for _ in range(10):
        est.observe(3_000, 1_000)
    assert est.chars_per_token == pytest.approx(3.0)
    est.observe(7_000, 1_000)  # past 1/alpha observations a new one weighs alpha
    assert est.chars_per_token == pytest.approx(3.0 + 0.25 * 4.0)
    est.observe(0, 10)
    est.observe(10, 0)  # nothing to learn from
    assert est.chars_per_token == pytest.approx(4.0) and est.prior == 4.0
    with pytest.raises(ValueError, match="alpha"):
        TokenEstimator(alpha=0.0)
    with pytest.raises(ValueError, match="max_prefixes"):
        TokenEstimator(max_prefixes=-1)


def chain(tag: int, n: int) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(tag * 1_000_000 + i) for i in range(n))


def test_per_prefix_estimates_at_the_deepest_known_anchor() -> None:
    assert list(anchor_depths(0)) == [] and [1 << k for k in anchor_depths(40)] == [
        1, 2, 4, 8, 16, 32
    ]  # fmt: skip
    est = TokenEstimator(4.0)
    a, b = chain(1, 40), chain(2, 40)
    est.observe(3_000, 1_000, a)
    est.observe(1_000, 1_000, b)
    assert est.chars_per_token == pytest.approx(2.0)  # the global mean of both
    assert est.for_prefix(a) == pytest.approx(3.0) and est.for_prefix(b) == pytest.approx(1.0)
    assert est.prefixes() == 12  # six anchors each
    # a longer prompt on a's chain (a conversation's next turn) finds a's anchors
    assert est.for_prefix((*a, *chain(3, 60))) == pytest.approx(3.0)
    # a prompt sharing only a's first 4 blocks gets the estimate kept at depth 4
    assert est.for_prefix((*a[:4], *chain(4, 30))) == pytest.approx(3.0)
    # nothing known: the global estimate
    assert est.for_prefix(chain(5, 40)) == est.chars_per_token == pytest.approx(2.0)
    assert est.for_prefix(()) == pytest.approx(2.0)
    # a shared anchor averages the prompts that share it, deeper ones stay apart
    c = (*a[:8], *chain(6, 32))
    est.observe(5_000, 1_000, c)
    assert est.for_prefix(a[:8]) == pytest.approx(4.0)  # (3 + 5) / 2 at depth 8
    assert est.for_prefix(a) == pytest.approx(3.0) and est.for_prefix(c) == pytest.approx(5.0)


def test_prefix_estimates_are_bounded_least_recently_observed_first_out() -> None:
    est = TokenEstimator(4.0, max_prefixes=3)
    a, b = chain(1, 4), chain(2, 4)  # three anchors each (1, 2, 4 blocks)
    est.observe(3_000, 1_000, a)
    est.observe(1_000, 1_000, b)
    assert est.prefixes() == 3
    assert est.for_prefix(b) == pytest.approx(1.0)
    assert est.for_prefix(a) == est.chars_per_token  # a's anchors went first
    est.for_prefix(b)  # reads change nothing
    est.observe(3_000, 1_000, a)
    assert est.for_prefix(a) == pytest.approx(3.0) and est.for_prefix(b[:1]) == est.chars_per_token
    off = TokenEstimator(4.0, max_prefixes=0)
    off.observe(3_000, 1_000, a)
    assert off.prefixes() == 0 and off.for_prefix(a) == 3.0  # global only


def test_text_blocks_convert_at_the_prefix_estimate() -> None:
    est = TokenEstimator(4.0)
    hasher = BlockHasher(chunk_chars=256, estimator=est)
    text = "abcdefgh" * 400  # 3,200 characters: 12 whole chunks
    first = hasher.text_blocks(0, text)
    assert first.block_tokens == 64.0 and first.prompt_tokens == 800
    est.observe(len(text), 1_600, first.hashes)  # this prompt: 2 characters per token
    est.observe(100_000, 10_000)  # and the fleet's other prompts: 10
    again = hasher.text_blocks(0, text + " and a question")
    assert again.block_tokens == pytest.approx(128.0) and again.prompt_tokens == 1_608
    other = hasher.text_blocks(0, "z" * 3_200)
    assert other.block_tokens == pytest.approx(256 / est.chars_per_token)


# ---------------------------------------------------------------- doc QA, real token counts


def rounds(docs: dict[str, str], n: int) -> Iterator[tuple[int, str, str]]:
    """Interleaved questions: every document once, then again (round, kind, prompt)."""
    for r in range(n):
        for kind, doc in docs.items():
            yield r, kind, f"{SYSTEM}{doc}\n\nQuestion {r}: what does part {r * 7} say?"


def test_predicted_cached_tokens_within_5_percent_from_the_second_request(tok: Tokenizer) -> None:
    docs = documents()
    ratios = {k: len(v) / len(tok.encode(v)) for k, v in docs.items()}
    assert ratios["prose"] > 3.0 > ratios["code"] > 2.0 > ratios["numbers"] > 1.5
    assert ratios["cjk"] < 0.5
    d = text_dispatcher()
    engines = {WorkerId(f"w{i}"): PrefixCache() for i in range(2)}
    seen: dict[str, list[tuple[int, int, str]]] = {k: [] for k in docs}
    for r, kind, prompt in rounds(docs, 4):
        seen[kind].append(ask(d, engines, tok, f"{kind}-{r}", prompt))
    for kind, results in seen.items():
        (_, a0, _), *later = results
        assert a0 < 100  # the system prompt at most
        for predicted, actual, _ in later:
            assert actual > 6_000, (kind, actual)  # warm: the document was reused
            assert abs(predicted - actual) <= 0.05 * actual, (kind, predicted, actual)
        assert len({key for _, _, key in results}) == 1, kind  # one key per document
    # the global estimate alone would miss most kinds by far: the test can fail
    cpt = d.chars_per_token
    for kind in ("prose", "cjk"):
        _, actual, _ = seen[kind][-1]
        chunks = (len(SYSTEM) + len(docs[kind])) // 256
        assert abs(chunks * 256 / cpt - actual) > 0.2 * actual, kind
    assert len({results[0][2] for results in seen.values()}) == 4  # and one key each


def test_one_prefix_key_per_document_whatever_the_estimate_does(tok: Tokenizer) -> None:
    doc = documents()["prose"]
    est = TokenEstimator(4.0)
    d = text_dispatcher(est)
    ws = views(2)

    def key(rid: str, text: str) -> str:
        adm = d.admit(RoutingRequest(RequestId(rid), NS, text=text), ws, 0.0)
        d.reject(adm, 0.0)
        return adm.decision.prefix_key

    first = key("a", doc + " first question")
    for i, cpt in enumerate((1.0, 0.3, 9.0, 3.2)):
        # the global estimate jumps, and this document's own estimate moves too
        blocks = d.hash(RoutingRequest(RequestId("x"), NS, text=doc))
        est.observe(round(len(doc)), round(len(doc) / cpt), blocks.hashes)
        assert key(f"b{i}", doc + f" question {i}") == first
    # the key covers prefix_key_tokens at the prior: 1,024 x 4.0 characters, 16 chunks
    assert d.router.hasher.text_key_blocks(1024) == 16
    assert key("c", doc[:4096] + "a different document from here on" * 20) == first
    assert key("d", doc[:4000] + "a different document from here on" * 20) != first
    blocks = d.hash(RoutingRequest(RequestId("y"), NS, text=doc))
    assert first == f"{blocks.hashes[15]:016x}"


def test_a_request_routed_before_the_first_answer_is_no_miss() -> None:
    """Predicted at the prior, answered after the estimate learned: converted at what it knows."""
    d = text_dispatcher()  # the prior: 4.0 characters per token
    ws = views(2)
    doc = "abcdefghij" * 2_000  # 20,000 characters that the engine counts 5 to a token

    def admit(rid: str) -> Any:
        text = doc + f" question {rid}"
        return d.admit(RoutingRequest(RequestId(rid), NS, text=text), ws, 0.0), len(text)

    (first, chars1), (second, chars2) = admit("a"), admit("b")  # both before any answer
    assert second.worker == first.worker  # the routed, not yet prefilled, copy
    predicted = second.decision.predicted_cached_tokens
    actual = 4_000  # 20,000 characters / 5, in whole 16-token blocks
    assert predicted == 78 * 64 and predicted - actual > 10 * 64  # over by 15 chunks: the prior
    d.observe_prompt_tokens(chars1, chars1 // 5, first)
    assert d.complete(first, Outcome(0, 0.5), 1.0) is False
    d.observe_prompt_tokens(chars2, chars2 // 5, second)
    assert d.complete(second, Outcome(actual, 0.1), 1.0) is False  # no miss: 78 chunks held
    assert d.router.index.unexplained_misses == 0
    third, _ = admit("c")
    assert third.worker == first.worker
    assert abs(third.decision.predicted_cached_tokens - actual) <= 0.05 * actual


def test_a_token_count_is_wanted_until_the_prefix_has_an_estimate_of_its_own() -> None:
    """``wants_token_count``: true for a new document or a prompt more than doubled, once each."""
    d = text_dispatcher()
    ws = views(2)
    doc = "abcdefghij" * 2_000  # 20,000 characters, 78 chunks

    def admit(rid: str, text: str) -> Any:
        return d.admit(RoutingRequest(RequestId(rid), NS, text=text), ws, 0.0)

    first = admit("a", doc + " question a")
    assert d.wants_token_count(first)  # nothing learned yet
    second = admit("b", doc + " question b")
    assert second.decision.predicted_cached_tokens == 78 * 64  # the prior: 4.0 a token
    # The engine's count of the first prompt (POST /tokenize) teaches its prefix's estimate...
    d.observe_prompt_tokens(len(doc) + 11, (len(doc) + 11) // 5, first)
    third = admit("c", doc + " question c")
    assert not d.wants_token_count(third)
    # ...so the next request is predicted at its own 5 characters a token, before any answer.
    assert abs(third.decision.predicted_cached_tokens - 4_000) <= 0.05 * 4_000
    # A prompt that more than doubles the learned prefix wants a count again.
    longer = admit("d", doc * 3)
    assert d.wants_token_count(longer)
    # Token mode never does.
    tokens = Dispatcher(Router("prefix_aware", BlockHasher(block_size=BLOCK)), mode="token")
    adm = tokens.admit(RoutingRequest(RequestId("t"), NS, tokens=list(range(2_000))), ws, 0.0)
    assert not tokens.wants_token_count(adm)
