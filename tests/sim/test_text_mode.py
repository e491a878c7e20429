"""Text mode in the simulator: the token -> text mapping, the mode switch, the learned estimate."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from prefixrouter.cli import app
from prefixrouter.core import PrefixClass, RequestId
from prefixrouter.core.hashing import (
    DEFAULT_CHARS_PER_TOKEN,
    DEFAULT_CHUNK_CHARS,
    DEFAULT_MAX_PROMPT_TOKENS,
)
from prefixrouter.gateway.config import RoutingConfig
from prefixrouter.prompt.request import CHAT, build_prompt_request
from prefixrouter.sim.cluster import ClusterConfig, Simulation, text_hasher
from prefixrouter.sim.profiles import get_profile
from prefixrouter.sim.report import summarize
from prefixrouter.sim.runner import plan, run_plan
from prefixrouter.sim.scenarios import get_scenario
from prefixrouter.sim.text import (
    TextRenderer,
    text_routing_request,
    text_tokens,
    token_word,
    tokens_text,
)
from prefixrouter.sim.workload import SIM_NAMESPACE, SimRequest, Workload, random_tokens

PROFILE = get_profile("llama3-8b-h100")
token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=40)
small_lists = st.lists(st.integers(0, 40_000), max_size=40)


# ------------------------------------------------------------------ the mapping


def test_words_are_bijective_base_26() -> None:
    assert [token_word(t) for t in (0, 25, 26, 27, 701, 702)] == [
        " a", " z", " aa", " ab", " zz", " aaa"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="non-negative"):
        token_word(-1)


@given(token_lists, token_lists)
def test_text_preserves_prefixes_and_concatenation(a: list[int], b: list[int]) -> None:
    assert tokens_text(a + b) == tokens_text(a) + tokens_text(b)
    assert tokens_text(a + b).startswith(tokens_text(a))


@given(token_lists)
def test_text_is_injective(tokens: list[int]) -> None:
    assert text_tokens(tokens_text(tokens)) == tokens


@given(small_lists, small_lists)
def test_different_tokens_give_different_text(a: list[int], b: list[int]) -> None:
    assert (tokens_text(a) == tokens_text(b)) == (a == b)
    # and the first token that differs starts a word that differs
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if common is not None:
        assert tokens_text(a[: common + 1]) != tokens_text(b[: common + 1])


def test_about_four_characters_per_token() -> None:
    tokens = random_tokens(np.random.default_rng(0), 40_000)
    assert 4.2 < len(tokens_text(tokens)) / len(tokens) < 4.6


def _req(i: int, segments: tuple[array[int], ...], offset: int) -> SimRequest:
    return SimRequest(
        RequestId(f"r{i}"), float(i), SIM_NAMESPACE, segments, 8, PrefixClass.DOCUMENT, "g", offset
    )


def test_body_system_then_user_and_shared_segments_cached() -> None:
    system, doc = array("I", range(10)), array("I", range(100, 400))
    reqs = [_req(i, (system, doc, array("I", [900 + i] * 5)), len(system)) for i in range(3)]
    renderer = TextRenderer(reqs)
    body = renderer.chat_body(reqs[0])
    assert body["model"] == SIM_NAMESPACE.model_revision and body["max_tokens"] == 8
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert body["messages"][0]["content"] == tokens_text(system)
    assert body["messages"][1]["content"] == tokens_text(list(doc) + [900] * 5)
    # the shared segments' text objects are reused, the unique question's is not kept
    again = renderer.chat_body(reqs[1])["messages"][0]["content"]
    assert again is body["messages"][0]["content"]
    assert renderer.segment_text(doc) is renderer.segment_text(doc)
    # an offset inside a segment splits it; no offset: no system message
    split = renderer.messages(_req(5, (array("I", range(20)),), 5))
    assert [m["content"] for m in split] == [tokens_text(range(5)), tokens_text(range(5, 20))]
    assert [m["role"] for m in renderer.messages(_req(6, (doc,), 0))] == ["user"]


def test_rendered_prompts_share_the_shared_prefix() -> None:
    system, doc = array("I", range(50)), array("I", range(1000, 3000))
    a, b = (_req(i, (system, doc, array("I", [7 + i] * 30)), len(system)) for i in range(2))
    renderer = TextRenderer([a, b])
    (ra, _), (rb, _) = text_routing_request(a, renderer), text_routing_request(b, renderer)
    assert ra.text is not None and rb.text is not None
    shared = len(tokens_text(system)) + len(tokens_text(doc))
    assert ra.text[: shared + 30] == rb.text[: shared + 30]  # markup + system + document
    assert ra.text != rb.text
    # the gateway's request path built it: the same text as the body gives there
    body = renderer.chat_body(a)
    assert ra.text == build_prompt_request(body, CHAT).prompt.text


def test_text_mode_uses_the_gateways_defaults() -> None:
    cfg = RoutingConfig()
    hasher = text_hasher()
    assert cfg.mode == "text"
    assert (
        (cfg.chunk_chars, cfg.chars_per_token, cfg.max_prompt_tokens)
        == (
            hasher.chunk_chars,
            hasher.estimator.chars_per_token,
            hasher.max_prompt_tokens,
        )
        == (DEFAULT_CHUNK_CHARS, DEFAULT_CHARS_PER_TOKEN, DEFAULT_MAX_PROMPT_TOKENS)
    )


# ------------------------------------------------------------------ the mode switch


def _workload() -> Workload:
    return get_scenario("doc-qa").build(3, 80)


def test_text_mode_routes_on_text_and_learns_chars_per_token() -> None:
    wl = _workload()
    cfg = ClusterConfig(4, PROFILE, mode="text", decision_log=5)
    sim = Simulation(wl, cfg, "prefix_aware")
    assert sim.dispatch.mode == "text" and sim.dispatch.chars_per_token == 4.0
    run = sim.run()
    # learned from the engine's prompt_tokens: the mapping's characters per
    # token plus the ChatML markup's share (the estimate converges to it)
    chars = [len(text_routing_request(r, TextRenderer([r]))[0].text or "") for r in wl.requests]
    target = sum(chars) / wl.prompt_token_total()
    assert run.chars_per_token is not None
    assert abs(run.chars_per_token - target) < 0.02 * target
    assert summarize(run)["chars_per_token"] == round(run.chars_per_token, 4)
    # the engine kept its token truth: prompt tokens as in token mode
    token_run = Simulation(wl, ClusterConfig(4, PROFILE), "prefix_aware").run()
    assert [r.prompt_tokens for r in run.records] == [r.prompt_tokens for r in token_run.records]
    assert "chars_per_token" not in summarize(token_run)
    # text mode estimates a prompt's tokens; the first decision used the initial 4.0
    first = run.decisions_logged[0]
    assert first["prompt_tokens"] == round(chars[0] / 4.0)
    # prefix reuse still works: documents are cached, as in token mode
    assert summarize(run)["cached_tokens"] > 0.8 * summarize(token_run)["cached_tokens"]


def test_estimate_converges_from_a_bad_start() -> None:
    wl = _workload()
    sim = Simulation(wl, ClusterConfig(4, PROFILE, mode="text"), "round_robin")
    sim.dispatch.observe_prompt_tokens(1, 1)  # knocks the estimate toward 1 char/token
    start = sim.dispatch.chars_per_token
    run = sim.run()
    assert run.chars_per_token is not None and start < 3.8 < run.chars_per_token < 4.8


def _kinds_workload() -> Workload:
    """Three documents whose words differ in length, asked about in turn, one at a time.

    Token ``t``'s word is 2 characters for ``t < 26``, 4 for ``702 <= t < 18,278``
    and about 4.4 over the whole vocabulary: 2.0, 4.0 and 4.4 characters per
    token. Each question arrives after the one before it completed.
    """
    rng = np.random.default_rng(3)
    system = array("I", rng.integers(0, 32_000, 200).tolist())
    docs = {
        "short": array("I", rng.integers(0, 26, 8_000).tolist()),
        "long": array("I", rng.integers(702, 18_278, 8_000).tolist()),
        "mixed": random_tokens(rng, 8_000),
    }
    reqs: list[SimRequest] = []
    for r in range(4):
        for name, doc in docs.items():
            i = len(reqs)
            question = array("I", rng.integers(0, 32_000, 30).tolist())
            rid, segments = RequestId(f"{name}-{r}"), (system, doc, question)
            doc_class = PrefixClass.DOCUMENT
            reqs.append(SimRequest(rid, 10.0 * i, SIM_NAMESPACE, segments, 8, doc_class, name, 200))
    return Workload("kinds", "three kinds of document", reqs, fixed_times=True, default_workers=2)


def test_predicted_cached_tokens_follow_each_documents_own_ratio() -> None:
    wl = _kinds_workload()
    cfg = ClusterConfig(2, PROFILE, mode="text", decision_log=12)
    run = Simulation(wl, cfg, "prefix_aware").run()
    by_doc: dict[str, list[tuple[int, int]]] = {}
    for rec in run.records:
        by_doc.setdefault(rec.group, []).append((rec.predicted_cached_tokens, rec.cached_tokens))
    for group, seen in by_doc.items():
        for predicted, actual in seen[1:]:  # from the second request of a document on
            assert actual > 7_000, (group, actual)
            assert abs(predicted - actual) <= 0.05 * actual, (group, predicted, actual)
    # one prefix key per document, whatever the estimate did between its requests
    keys: dict[str, set[object]] = {}
    for d in run.decisions_logged:
        keys.setdefault(str(d["request_id"]).split("-")[0], set()).add(d["prefix_key"])
    assert sorted(len(k) for k in keys.values()) == [1, 1, 1]
    assert len(set().union(*keys.values())) == 3


def test_same_seed_same_output_in_both_modes() -> None:
    wl = get_scenario("system-prompt").build(1, 120)
    for mode in ("text", "token"):
        p = plan(wl, PROFILE, ["prefix_aware", "round_robin"], workers=4, load=0.8, mode=mode)
        assert run_plan(p)[0] == run_plan(p)[0]


def test_kv_events_need_token_mode() -> None:
    with pytest.raises(ValueError, match="KV events need token mode"):
        ClusterConfig(4, PROFILE, kv_events=True, mode="text")
    with pytest.raises(ValueError, match="unknown routing mode"):
        ClusterConfig(4, PROFILE, mode="chars")  # type: ignore[arg-type]


# ------------------------------------------------------------------ the CLI

runner = CliRunner()


def _simulate(tmp_path: Path, *extra: str) -> dict:  # type: ignore[type-arg]
    out = tmp_path / "r.json"
    args = ["simulate", "--scenario", "system-prompt", "--requests", "60", "--workers", "4"]
    args += ["--policies", "prefix_aware", "--json", str(out), *extra]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_cli_defaults_to_text_mode(tmp_path: Path) -> None:
    default = _simulate(tmp_path)
    assert default["mode"] == "text" and "chars_per_token" in default["results"][0]
    assert _simulate(tmp_path, "--mode", "text") == default
    token = _simulate(tmp_path, "--mode", "token")
    assert "mode" not in token and "chars_per_token" not in token["results"][0]
    assert token["results"][0]["prompt_tokens"] == default["results"][0]["prompt_tokens"]


def test_cli_mode_errors() -> None:
    for args, needle in (
        (["--kv-events"], "--kv-events needs --mode token"),
        (["--mode", "text", "--kv-events"], "--kv-events needs --mode token"),
        (["--mode", "chars"], "--mode: expected 'text' or 'token'"),
    ):
        res = runner.invoke(app, ["simulate", *args])
        assert res.exit_code == 2, res.output
        assert needle in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("count", [True, False])
def test_a_document_is_predicted_at_its_own_ratio_before_its_first_answer(count: bool) -> None:
    """The engine's token count, asked when a new document is routed, teaches it in time.

    The first request decodes for seconds; the second arrives after the first
    prefill, before any answer. With ``token_count`` its prediction is within
    5 % of the engine's cached tokens; without, it is converted at the 4.0
    prior, about 10 % more tokens per chunk than this rendering has.
    """
    rng = np.random.default_rng(5)
    system, doc = random_tokens(rng, 20), random_tokens(rng, 8_000)
    reqs = [
        SimRequest(
            RequestId(f"r{i}"),
            2.0 * i,
            SIM_NAMESPACE,
            (system, doc, random_tokens(rng, 30)),
            out,
            PrefixClass.DOCUMENT,
            "g",
            len(system),
        )
        for i, out in enumerate((2_000, 8))
    ]
    wl = Workload("doc", "one document, two requests", reqs, fixed_times=True, default_workers=2)
    cfg = ClusterConfig(2, PROFILE, mode="text", token_count=count)
    run = Simulation(wl, cfg, "prefix_aware").run()
    first, second = sorted(run.records, key=lambda r: r.arrival)
    assert first.completed > second.arrival  # no answer before the second was routed
    assert second.worker == first.worker and second.cached_tokens >= 7_900
    error = abs(second.predicted_cached_tokens - second.cached_tokens) / second.cached_tokens
    assert (error <= 0.05) is count, (second.predicted_cached_tokens, second.cached_tokens)
