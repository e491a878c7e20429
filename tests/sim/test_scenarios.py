"""Named scenarios (prefixrouter.sim.scenarios): registry, determinism and shape."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from functools import cache

import numpy as np
import pytest

from prefixrouter.core.types import PrefixClass
from prefixrouter.sim.scenarios import SCENARIOS, get_scenario
from prefixrouter.sim.workload import SimRequest, Workload

EXPECTED = {
    "doc-qa",
    "system-prompt",
    "templates",
    "templates-bad",
    "rag",
    "multi-turn",
    "hot-prefix",
    "unique",
    "llmd-customers",
    "gsp",
    "mooncake-conversation",
}
SYNTHETIC = sorted(EXPECTED - {"mooncake-conversation"})
# Small enough to keep the test run fast, large enough for every structure to show up.
SMALL = {"mooncake-conversation": 200}


@cache
def _default(name: str) -> Workload:
    """Each scenario at its defaults (seed 0), built once per test session."""
    return get_scenario(name).build(0, SMALL.get(name))


def _fingerprint(wl: Workload) -> list[tuple[object, ...]]:
    return [
        (
            r.request_id,
            r.arrival,
            r.namespace,
            r.tokens().tobytes(),
            r.output_tokens,
            r.prefix_class,
            r.group,
            r.first_user_offset,
        )
        for r in wl.requests
    ]


def _first_block(r: SimRequest, block: int = 16) -> bytes:
    return r.tokens()[:block].tobytes()


# --------------------------------------------------------------------------- registry


def test_registry_holds_every_scenario() -> None:
    assert set(SCENARIOS) == EXPECTED
    for name, spec in SCENARIOS.items():
        assert spec.name == name
        assert spec.summary and "\n" not in spec.summary and len(spec.summary) <= 100
    assert not SCENARIOS["unique"].shared_prefix
    assert not SCENARIOS["templates-bad"].shared_prefix
    assert sum(not s.shared_prefix for s in SCENARIOS.values()) == 2


def test_get_scenario_unknown_name_lists_known_ones() -> None:
    assert get_scenario("doc-qa") is SCENARIOS["doc-qa"]
    with pytest.raises(KeyError) as info:
        get_scenario("nope")
    message = str(info.value)
    assert "nope" in message and "doc-qa" in message and "mooncake-conversation" in message


# --------------------------------------------------------------------------- every scenario


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_scenario_basic_invariants(name: str) -> None:
    wl = _default(name)
    assert wl.name == name
    assert wl.requests
    assert wl.fixed_times == (name == "mooncake-conversation")
    assert wl.block_size == 16
    assert 4 <= wl.default_workers <= 16
    arrivals = [r.arrival for r in wl.requests]
    assert arrivals == sorted(arrivals)
    assert len({r.request_id for r in wl.requests}) == len(wl.requests)
    for r in wl.requests:
        assert r.output_tokens >= 1
        assert 0 <= r.first_user_offset <= r.prompt_tokens
        assert all(s.typecode == "I" for s in r.segments)
        assert r.prompt_tokens == len(r.tokens())
    sample = np.frombuffer(wl.requests[-1].tokens(), dtype=np.uint32)
    assert sample.max() < 32_000


@pytest.mark.parametrize("name", SYNTHETIC)
def test_synthetic_scenarios_are_unit_rate(name: str) -> None:
    wl = _default(name)
    rate = len(wl.requests) / wl.requests[-1].arrival  # unit-rate time starts at 0
    assert rate == pytest.approx(1.0, rel=0.15)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_same_seed_same_workload_other_seed_differs(name: str) -> None:
    build = get_scenario(name).build
    a = build(1, 40)
    b = build(1, 40)
    c = build(2, 40)
    assert len(a.requests) == 40
    assert _fingerprint(a) == _fingerprint(b)
    assert [r.tokens().tobytes() for r in a.requests] != [r.tokens().tobytes() for r in c.requests]
    if not a.fixed_times:
        assert [r.arrival for r in a.requests] != [r.arrival for r in c.requests]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shared_prefix_flag_matches_the_content(name: str) -> None:
    wl = _default(name)
    firsts = Counter(_first_block(r) for r in wl.requests)
    if SCENARIOS[name].shared_prefix:
        assert firsts.most_common(1)[0][1] > 1
    else:
        assert max(firsts.values()) == 1  # no two requests share even their first block


@pytest.mark.parametrize("name", SYNTHETIC)
def test_gamma_arrivals_change_timing_only(name: str) -> None:
    spec = get_scenario(name)
    poisson = spec.build(3, 60, "poisson")
    gamma = spec.build(3, 60, "gamma")
    assert [r.tokens().tobytes() for r in poisson.requests] == [
        r.tokens().tobytes() for r in gamma.requests
    ]
    assert [r.arrival for r in poisson.requests] != [r.arrival for r in gamma.requests]


def test_bad_arguments_are_rejected() -> None:
    build = get_scenario("system-prompt").build
    with pytest.raises(ValueError):
        build(0, 0)
    with pytest.raises(ValueError):
        build(-1, 10)
    with pytest.raises(ValueError, match="arrival process"):
        build(0, 10, "uniform")


# --------------------------------------------------------------------------- shapes


def test_doc_qa_three_documents_in_phases() -> None:
    wl = _default("doc-qa")
    assert len(wl.requests) == 600
    assert wl.default_workers == 4
    assert wl.default_kv_blocks is not None and 5_000 < wl.default_kv_blocks <= 7_000
    docs = {id(r.segments[1]): r.segments[1] for r in wl.requests}
    assert len(docs) == 3
    assert all(len(d) == 40_000 for d in docs.values())
    by_group: dict[str, list[float]] = defaultdict(list)
    for r in wl.requests:
        assert r.prefix_class is PrefixClass.DOCUMENT
        assert 50 <= len(r.segments[2]) <= 200
        assert 100 <= r.output_tokens <= 300
        by_group[r.group].append(r.arrival)
    assert sorted(by_group) == ["doc-1", "doc-2", "doc-3"]
    assert all(len(v) == 200 for v in by_group.values())
    # Phases in order, with at most a small overlap at the boundaries.
    for early, late in (("doc-1", "doc-2"), ("doc-2", "doc-3")):
        assert np.percentile(by_group[early], 85) < np.percentile(by_group[late], 15)
        assert max(by_group[early]) < np.median(by_group[late])


def test_system_prompt_shares_one_long_prompt() -> None:
    wl = _default("system-prompt")
    system = wl.requests[0].segments[0]
    assert len(system) == 4_000
    assert all(r.segments[0] is system for r in wl.requests)
    assert all(100 <= len(r.segments[1]) <= 800 for r in wl.requests)
    assert len({_first_block(r, 4_016) for r in wl.requests}) == len(wl.requests)


def test_templates_change_only_the_end() -> None:
    wl = _default("templates")
    forms = {id(r.segments[0]): r.segments[0] for r in wl.requests}
    assert len(forms) == 6
    assert all(2_000 <= len(f) <= 5_000 for f in forms.values())
    assert all(r.first_user_offset == len(r.segments[0]) for r in wl.requests)
    counts = Counter(r.group for r in wl.requests)
    assert counts["form-1"] > counts["form-6"]  # popularity falls with rank


def test_templates_bad_is_templates_with_a_timestamp_first() -> None:
    good = get_scenario("templates").build(0)
    bad = _default("templates-bad")
    assert len(good.requests) == len(bad.requests)
    for g, b in zip(good.requests, bad.requests, strict=True):
        assert b.arrival == g.arrival
        assert b.segments[1].tobytes() == g.segments[0].tobytes()  # the same form
        assert b.tokens().tobytes().endswith(g.tokens().tobytes())
        assert 0 < b.prompt_tokens - g.prompt_tokens <= 16
    assert len({_first_block(r) for r in bad.requests}) == len(bad.requests)


def test_rag_stable_layer_fragments_and_tenants() -> None:
    wl = _default("rag")
    by_app: dict[str, set[int]] = defaultdict(set)
    for r in wl.requests:
        assert r.prefix_class is PrefixClass.RAG
        assert r.namespace.tenant == r.group
        by_app[r.group].add(id(r.segments[0]))
        assert 2_500 <= len(r.segments[0]) <= 3_500
        fragments = r.segments[1:-1]
        assert 3 <= len(fragments) <= 5
        assert all(450 <= len(f) <= 550 for f in fragments)
        assert len({id(f) for f in fragments}) == len(fragments)
    assert len(by_app) == 4
    assert all(len(ids) == 1 for ids in by_app.values())  # one stable layer per app
    # Zipf popularity: some fragment is reused often.
    uses = Counter(id(f) for r in wl.requests for f in r.segments[1:-1])
    assert uses.most_common(1)[0][1] > 50


def test_multi_turn_history_is_a_prefix() -> None:
    wl = _default("multi-turn")
    sessions: dict[str, list[SimRequest]] = defaultdict(list)
    for r in wl.requests:
        assert r.prefix_class is PrefixClass.SESSION
        sessions[r.group].append(r)
    assert len(sessions) == 100
    assert all(3 <= len(turns) <= 8 for turns in sessions.values())
    for turns in sessions.values():
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.arrival > prev.arrival
            # Same array objects: previous prompt, then the previous answer.
            assert len(nxt.segments) == len(prev.segments) + 2  # + answer + new user message
            assert all(a is b for a, b in zip(nxt.segments, prev.segments, strict=False))
            answer = nxt.segments[len(prev.segments)]
            assert len(answer) == prev.output_tokens
            assert nxt.tokens().tobytes().startswith(prev.tokens().tobytes())
    # Sessions interleave: the first session's turns are not back to back.
    order = [r.group for r in wl.requests]
    first = order[0]
    span = [i for i, g in enumerate(order) if g == first]
    assert span[-1] - span[0] + 1 > len(span)


def test_multi_turn_request_override_is_exact() -> None:
    wl = get_scenario("multi-turn").build(0, 123)
    assert len(wl.requests) == 123


def test_hot_prefix_mix() -> None:
    wl = _default("hot-prefix")
    counts = Counter(r.group for r in wl.requests)
    assert counts["contract"] / len(wl.requests) == pytest.approx(0.7, abs=0.05)
    assert len(counts) == 21
    for r in wl.requests:
        doc = r.segments[1]
        if r.group == "contract":
            assert len(doc) == 20_000
        else:
            assert 8_000 <= len(doc) <= 20_000


def test_unique_has_no_shared_first_block() -> None:
    wl = _default("unique")
    assert len({_first_block(r) for r in wl.requests}) == len(wl.requests)
    assert all(500 <= r.prompt_tokens <= 4_000 for r in wl.requests)
    assert all(r.first_user_offset == 0 for r in wl.requests)


def test_gsp_groups_of_sixteen() -> None:
    wl = _default("gsp")
    assert len(wl.requests) == 64 * 16
    groups: dict[str, list[SimRequest]] = defaultdict(list)
    for r in wl.requests:
        groups[r.group].append(r)
        assert len(r.segments[0]) == 2_048
        assert len(r.segments[1]) == 128
        assert r.output_tokens == 256
    assert len(groups) == 64
    assert all(len(v) == 16 for v in groups.values())
    assert all(len({id(r.segments[0]) for r in v}) == 1 for v in groups.values())
    # Shuffled: the first 16 requests are not one group.
    assert len({r.group for r in wl.requests[:16]}) > 1


def test_llmd_customers_750_users_in_150_groups() -> None:
    wl = _default("llmd-customers")
    assert wl.default_workers == 8
    assert wl.default_kv_blocks is not None
    # The 150 resident contexts fill ~73 % of 8 workers' KV cache.
    resident = 150 * 6_000 / 16
    assert resident / (8 * wl.default_kv_blocks) == pytest.approx(0.73, abs=0.01)
    users: dict[str, set[int]] = defaultdict(set)
    for r in wl.requests:
        assert len(r.segments[0]) == 6_000
        assert len(r.segments[1]) == 1_200
        assert r.output_tokens == 1_000
        users[r.group].add(id(r.segments[1]))
    assert len(users) == 150
    assert all(len(u) == 5 for u in users.values())
    assert sum(len(u) for u in users.values()) == 750


def test_llmd_customers_rate_ladder_rises() -> None:
    wl = get_scenario("llmd-customers").build(0, 4_000)
    t = np.array([r.arrival for r in wl.requests])
    assert len(t) / t[-1] == pytest.approx(1.0, rel=0.05)
    # Warm-up stage (15 req/s of a ~33 req/s mean) then 3 req/s, then up to 60 req/s.
    gaps = np.diff(t)
    warmup = gaps[:150].mean()
    slow = gaps[180:190].mean()  # inside the 3 req/s stage
    peak = gaps[-300:].mean()  # the 60 req/s stage
    assert slow > warmup > peak
    assert slow / peak == pytest.approx(20.0, rel=0.5)


def test_mooncake_scenario_replays_the_bundled_trace() -> None:
    wl = _default("mooncake-conversation")
    assert wl.fixed_times
    assert wl.default_workers == 16
    assert len(wl.requests) == 200
    assert wl.requests[0].arrival == 0.0
    # Every request starts with the trace's shared block 0.
    first = wl.requests[0].segments[0]
    assert all(r.segments[0] is first for r in wl.requests)
