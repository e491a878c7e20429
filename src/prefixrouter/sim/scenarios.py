"""Named simulator scenarios: the workloads every routing claim is measured on.

Each scenario is a :class:`ScenarioSpec` in :data:`SCENARIOS`; its ``build(seed,
requests, arrival)`` returns a :class:`~prefixrouter.sim.workload.Workload` in
unit-rate time (see :mod:`prefixrouter.sim.workload`), except the trace replay,
whose times are real. Token ids are random: what matters to a router and a KV
cache is which requests share which prefix and how long each part is, not what
the tokens say. Lengths are in tokens; "a-b" means uniform integers in [a, b].

Determinism: a scenario draws its content (prompts, lengths, mix) and its arrival
times from two independent streams, both seeded by ``(seed, scenario name)``.
The same seed therefore gives identical workloads byte for byte, and switching
``arrival`` between ``"poisson"`` and ``"gamma"`` changes the timing only, never
the prompts. ``requests`` overrides the request count (the structure - document
count, groups, sessions - is kept or scaled as each scenario says).

Scenarios and why they exist:

``doc-qa`` (4 workers, 600 requests, 6,000 KV blocks per worker)
    One 40,000-token policy document, 200 questions about it, then a second
    and a third document of the same size (200 questions each). Prompt = a
    150-token system prompt + document + a unique 50-200-token question;
    outputs 100-300. Documents arrive in phases (each phase's requests are
    spread over its share of the run with 5 % overlap at the boundaries).
    The KV size holds about two documents per worker (2 x 2,500 blocks) plus
    headroom for running requests: a router that spreads every document over
    every worker thrashes, one that keeps each document on few workers doesn't.
``system-prompt`` (8 workers, 800 requests)
    One 4,000-token system prompt shared by every conversation, then a unique
    100-800-token user message; outputs 50-400. The classic hot spot: a
    prefix-greedy router sends everything to one worker.
``templates`` (6 workers, 800 requests)
    Six standard forms of 2,000-5,000 tokens (popularity 1/rank) followed by
    what changes: customer fields (30-120 tokens, unique), a date (6 tokens,
    30 dates), a language (3 tokens, 6 languages) and a short task (20-60
    tokens, 12 tasks), all *after* the form; outputs 100-500.
``templates-bad`` (6 workers, 800 requests, no shared prefix)
    The same forms, fields and arrivals as ``templates`` (same seed, same
    tokens), but a 12-token timestamp (3 fixed tokens, 9 that change with
    every request) is put *before* the form, as careless prompt assembly does.
    Nothing is shared past the first block: no router can help; the prompt
    linter's job is to catch it. It shows the cost of the mistake.
``rag`` (8 workers, 800 requests)
    Four applications (tenants, traffic 40/30/20/10 %), each with a stable
    layer of instructions (400-600) + policy (1,500-2,000) + glossary
    (600-900), about 3,000 tokens, then 3-5 retrieved fragments of 450-550
    tokens from the app's pool of 300, drawn by Zipf(1) popularity without
    replacement and kept in draw (relevance) order, then a 20-150-token
    question; outputs 100-400. Each app is its own cache namespace (tenant).
    The stable layer is always reusable; fragment prefixes only sometimes.
``multi-turn`` (8 workers, 100 sessions of 3-8 turns, about 550 requests)
    Chat sessions: turn k's prompt = a 1,500-token system prompt + every
    earlier user message (50-500) and assistant answer (100-600, the earlier
    turns' outputs) + the new user message, so each turn's prompt starts with
    the previous turn's prompt and answer. Sixteen sessions are open at a
    time; each arrival slot goes to a random open session, so turns are in
    order, sessions interleave and a session's think time averages about
    16 arrival gaps. Session affinity is what routers like KubeAI were built for.
``hot-prefix`` (8 workers, 800 requests)
    70 % of requests ask about one popular 20,000-token contract, the rest
    about 20 other documents of 8,000-20,000 tokens; a 300-token system
    prompt, 30-200-token questions, outputs 50-300. Tests whether affinity to
    a hot prefix is balanced against queueing (replicate the hot prefix,
    keep the cold documents elsewhere).
``unique`` (8 workers, 800 requests, no shared prefix)
    Unique 500-4,000-token prompts, outputs 50-400. Negative control: a
    prefix-aware router must do no worse than a load balancer here.
``llmd-customers`` (8 workers, 1,000 requests, 9,632 KV blocks per worker)
    llm-d's precise prefix-cache routing benchmark in shape: 150 customers,
    each with a 6,000-token context, 5 users per customer, each user with one
    fixed 1,200-token question (as inference-perf's ``shared_prefix`` data:
    a user's repeated requests are identical prompts), outputs 1,000 tokens.
    Users are visited in a new random order on every pass. Arrivals follow
    llm-d's rate ladder (a 15 req/s warm-up, then 3, 10, 15, ..., 60 req/s),
    every stage's share of the requests proportional to its rate x duration,
    Poisson within a stage (gamma with ``arrival="gamma"``); the whole run
    averages one request per second.
    The KV size makes the 150 resident contexts fill ~73 % of the 8 workers'
    KV cache, as the benchmark was sized. The prompt is a completion without
    roles, so ``first_user_offset`` is 0.
``gsp`` (8 workers, 64 x 16 = 1,024 requests)
    SGLang ``bench_serving --dataset-name generated-shared-prefix`` defaults:
    64 groups, one 2,048-token system prompt each, 16 questions of 128 tokens
    per group, outputs 256, fixed lengths, shuffled. ``requests`` adds or
    removes groups of 16.
``mooncake-conversation`` (16 workers, 12,031 requests, real times)
    Replay of the bundled Mooncake (Kimi) conversation trace, see
    :mod:`prefixrouter.sim.traces`; ``requests`` keeps the first n rows;
    ``arrival`` is ignored because the trace's times are real.
"""

from __future__ import annotations

import math
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from prefixrouter.core.types import CacheNamespace, PrefixClass, RequestId
from prefixrouter.sim.traces import bundled_mooncake_path, load_mooncake
from prefixrouter.sim.workload import (
    SIM_NAMESPACE,
    FloatArray,
    SimRequest,
    Workload,
    arrival_cv,
    make_arrivals,
    random_tokens,
    rate_ladder,
)

__all__ = ["SCENARIOS", "ScenarioSpec", "WorkloadBuilder", "get_scenario"]


class WorkloadBuilder(Protocol):
    """Builds a scenario's workload: ``build(seed, requests=None, arrival="poisson")``."""

    def __call__(
        self, seed: int, requests: int | None = None, arrival: str = "poisson"
    ) -> Workload: ...


@dataclass(frozen=True, slots=True)
class ScenarioSpec:
    """A named scenario.

    Attributes:
        name: Registry key (``prefixrouter simulate --scenario NAME``).
        summary: One line for ``prefixrouter simulate --list``.
        shared_prefix: False when no request shares a reusable prefix with another
            (a prefix-aware router cannot gain anything).
        build: ``build(seed, requests, arrival)`` -> :class:`Workload`.
    """

    name: str
    summary: str
    shared_prefix: bool
    build: WorkloadBuilder


# --------------------------------------------------------------------------- helpers


@dataclass(slots=True)
class _Draft:
    """A request before it has an id and an arrival time."""

    segments: tuple[array[int], ...]
    output_tokens: int
    prefix_class: PrefixClass
    group: str
    first_user_offset: int = 0
    namespace: CacheNamespace = SIM_NAMESPACE


def _streams(name: str, seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    """Independent (content, arrivals) generators for one scenario and seed."""
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    salt = zlib.crc32(name.encode("utf-8"))
    return np.random.default_rng([seed, salt, 0]), np.random.default_rng([seed, salt, 1])


def _count(requests: int | None, default: int) -> int:
    if requests is None:
        return default
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    return requests


def _uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    """A uniform integer in [lo, hi]."""
    return int(rng.integers(lo, hi + 1))


def _assemble(
    name: str,
    description: str,
    drafts: Sequence[_Draft],
    arrivals: FloatArray,
    *,
    workers: int,
    kv_blocks: int | None = None,
) -> Workload:
    """Give drafts (already in arrival order) their ids and times."""
    if len(arrivals) != len(drafts):
        raise AssertionError(f"{name}: {len(drafts)} drafts but {len(arrivals)} arrivals")
    requests = [
        SimRequest(
            request_id=RequestId(f"{name}-{i:05d}"),
            arrival=float(t),
            namespace=d.namespace,
            segments=d.segments,
            output_tokens=max(1, d.output_tokens),
            prefix_class=d.prefix_class,
            group=d.group,
            first_user_offset=d.first_user_offset,
        )
        for i, (d, t) in enumerate(zip(drafts, arrivals, strict=True))
    ]
    return Workload(
        name=name,
        description=description,
        requests=requests,
        fixed_times=False,
        default_workers=workers,
        default_kv_blocks=kv_blocks,
    )


def _apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` into integers proportional to ``weights`` (largest remainder)."""
    wsum = float(sum(weights))
    raw = [total * w / wsum for w in weights]
    counts = [math.floor(x) for x in raw]
    # Hand the leftover units to the largest fractional parts; ties go to the earlier stage.
    order = sorted(range(len(raw)), key=lambda i: (counts[i] - raw[i], i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


# --------------------------------------------------------------------------- doc-qa

DOC_QA_DOCS = 3
DOC_QA_DOC_TOKENS = 40_000
DOC_QA_PER_DOC = 200
DOC_QA_SYSTEM_TOKENS = 150
DOC_QA_QUESTION = (50, 200)
DOC_QA_OUTPUT = (100, 300)
DOC_QA_OVERLAP = 0.05  # fraction of a phase by which neighbouring phases overlap
DOC_QA_WORKERS = 4
# Two documents (2 x 40,000 / 16 = 5,000 blocks) plus ~1,000 blocks for the
# questions and answers of running requests.
DOC_QA_KV_BLOCKS = 6_000


def _build_doc_qa(seed: int, requests: int | None = None, arrival: str = "poisson") -> Workload:
    name = "doc-qa"
    content, timing = _streams(name, seed)
    n = _count(requests, DOC_QA_DOCS * DOC_QA_PER_DOC)
    system = random_tokens(content, DOC_QA_SYSTEM_TOKENS)
    docs = [random_tokens(content, DOC_QA_DOC_TOKENS) for _ in range(DOC_QA_DOCS)]
    per_doc = [n // DOC_QA_DOCS + (1 if k < n % DOC_QA_DOCS else 0) for k in range(DOC_QA_DOCS)]
    drafts: list[_Draft] = []
    keys: list[float] = []
    for k, doc in enumerate(docs):
        for _ in range(per_doc[k]):
            question = random_tokens(content, _uniform(content, *DOC_QA_QUESTION))
            drafts.append(
                _Draft(
                    segments=(system, doc, question),
                    output_tokens=_uniform(content, *DOC_QA_OUTPUT),
                    prefix_class=PrefixClass.DOCUMENT,
                    group=f"doc-{k + 1}",
                    first_user_offset=len(system),
                )
            )
            # Position in the run: phase k spans [k, k+1), widened by the overlap.
            keys.append(k + float(content.uniform(-DOC_QA_OVERLAP, 1.0 + DOC_QA_OVERLAP)))
    order = np.argsort(np.asarray(keys), kind="stable")
    return _assemble(
        name,
        f"{DOC_QA_DOCS} documents of {DOC_QA_DOC_TOKENS:,} tokens asked about in phases "
        f"({n} questions of {DOC_QA_QUESTION[0]}-{DOC_QA_QUESTION[1]} tokens); KV holds ~2 "
        f"documents per worker",
        [drafts[i] for i in order],
        make_arrivals(arrival, n, timing),
        workers=DOC_QA_WORKERS,
        kv_blocks=DOC_QA_KV_BLOCKS,
    )


# --------------------------------------------------------------------------- system-prompt

SYSTEM_PROMPT_TOKENS = 4_000
SYSTEM_PROMPT_USER = (100, 800)
SYSTEM_PROMPT_OUTPUT = (50, 400)
SYSTEM_PROMPT_REQUESTS = 800
SYSTEM_PROMPT_WORKERS = 8


def _build_system_prompt(
    seed: int, requests: int | None = None, arrival: str = "poisson"
) -> Workload:
    name = "system-prompt"
    content, timing = _streams(name, seed)
    n = _count(requests, SYSTEM_PROMPT_REQUESTS)
    system = random_tokens(content, SYSTEM_PROMPT_TOKENS)
    drafts = [
        _Draft(
            segments=(system, random_tokens(content, _uniform(content, *SYSTEM_PROMPT_USER))),
            output_tokens=_uniform(content, *SYSTEM_PROMPT_OUTPUT),
            prefix_class=PrefixClass.SYSTEM,
            group="system",
            first_user_offset=len(system),
        )
        for _ in range(n)
    ]
    return _assemble(
        name,
        f"one {SYSTEM_PROMPT_TOKENS:,}-token system prompt shared by {n} conversations, "
        f"unique {SYSTEM_PROMPT_USER[0]}-{SYSTEM_PROMPT_USER[1]}-token user messages",
        drafts,
        make_arrivals(arrival, n, timing),
        workers=SYSTEM_PROMPT_WORKERS,
    )


# --------------------------------------------------------------------------- templates

TEMPLATE_COUNT = 6
TEMPLATE_TOKENS = (2_000, 5_000)
TEMPLATE_CUSTOMER = (30, 120)
TEMPLATE_DATES = 30
TEMPLATE_DATE_TOKENS = 6
TEMPLATE_LANGUAGES = 6
TEMPLATE_LANGUAGE_TOKENS = 3
TEMPLATE_TASKS = 12
TEMPLATE_TASK = (20, 60)
TEMPLATE_OUTPUT = (100, 500)
TEMPLATE_REQUESTS = 800
TEMPLATE_WORKERS = 6
TIMESTAMP_FIXED_TOKENS = 3  # "Generated at:" - the same in every request
TIMESTAMP_CHANGING_TOKENS = 9  # date and time down to the second: new every request


def _build_templates(
    name: str, seed: int, requests: int | None, arrival: str, *, timestamp_first: bool
) -> Workload:
    # Both variants draw from the "templates" streams so that, for one seed, they
    # hold the same forms, fields and arrival times; only the timestamp differs.
    content, timing = _streams("templates", seed)
    n = _count(requests, TEMPLATE_REQUESTS)
    forms = [
        random_tokens(content, _uniform(content, *TEMPLATE_TOKENS)) for _ in range(TEMPLATE_COUNT)
    ]
    popularity = np.array([1.0 / (k + 1) for k in range(TEMPLATE_COUNT)])
    popularity /= popularity.sum()
    dates = [random_tokens(content, TEMPLATE_DATE_TOKENS) for _ in range(TEMPLATE_DATES)]
    languages = [
        random_tokens(content, TEMPLATE_LANGUAGE_TOKENS) for _ in range(TEMPLATE_LANGUAGES)
    ]
    tasks = [
        random_tokens(content, _uniform(content, *TEMPLATE_TASK)) for _ in range(TEMPLATE_TASKS)
    ]
    stamps = np.random.default_rng([seed, zlib.crc32(b"templates-timestamp")])
    stamp_head = random_tokens(stamps, TIMESTAMP_FIXED_TOKENS)
    drafts: list[_Draft] = []
    for _ in range(n):
        k = int(content.choice(TEMPLATE_COUNT, p=popularity))
        variable = (
            random_tokens(content, _uniform(content, *TEMPLATE_CUSTOMER)),
            dates[int(content.integers(TEMPLATE_DATES))],
            languages[int(content.integers(TEMPLATE_LANGUAGES))],
            tasks[int(content.integers(TEMPLATE_TASKS))],
        )
        output = _uniform(content, *TEMPLATE_OUTPUT)
        if timestamp_first:
            stamp = stamp_head + random_tokens(stamps, TIMESTAMP_CHANGING_TOKENS)
            segments: tuple[array[int], ...] = (stamp, forms[k], *variable)
            offset = len(stamp) + len(forms[k])
        else:
            segments = (forms[k], *variable)
            offset = len(forms[k])
        drafts.append(
            _Draft(
                segments=segments,
                output_tokens=output,
                # The form is the system part; the fields are the user's message.
                prefix_class=PrefixClass.SYSTEM,
                group=f"form-{k + 1}",
                first_user_offset=offset,
            )
        )
    where = "before" if timestamp_first else "after"
    return _assemble(
        name,
        f"{TEMPLATE_COUNT} forms of {TEMPLATE_TOKENS[0]:,}-{TEMPLATE_TOKENS[1]:,} tokens; "
        f"customer fields, date, language and task {where} the form"
        + ("; a per-request timestamp first: nothing shared" if timestamp_first else ""),
        drafts,
        make_arrivals(arrival, n, timing),
        workers=TEMPLATE_WORKERS,
    )


def _build_templates_good(
    seed: int, requests: int | None = None, arrival: str = "poisson"
) -> Workload:
    return _build_templates("templates", seed, requests, arrival, timestamp_first=False)


def _build_templates_bad(
    seed: int, requests: int | None = None, arrival: str = "poisson"
) -> Workload:
    return _build_templates("templates-bad", seed, requests, arrival, timestamp_first=True)


# --------------------------------------------------------------------------- rag

RAG_APPS = (0.4, 0.3, 0.2, 0.1)  # traffic share per application (tenant)
RAG_INSTRUCTIONS = (400, 600)
RAG_POLICY = (1_500, 2_000)
RAG_GLOSSARY = (600, 900)
RAG_POOL = 300
RAG_FRAGMENT = (450, 550)
RAG_ZIPF_S = 1.0
RAG_FRAGMENTS_PER_REQUEST = (3, 5)
RAG_QUESTION = (20, 150)
RAG_OUTPUT = (100, 400)
RAG_REQUESTS = 800
RAG_WORKERS = 8


def _build_rag(seed: int, requests: int | None = None, arrival: str = "poisson") -> Workload:
    name = "rag"
    content, timing = _streams(name, seed)
    n = _count(requests, RAG_REQUESTS)
    apps = []
    for a in range(len(RAG_APPS)):
        stable = (
            random_tokens(content, _uniform(content, *RAG_INSTRUCTIONS))
            + random_tokens(content, _uniform(content, *RAG_POLICY))
            + random_tokens(content, _uniform(content, *RAG_GLOSSARY))
        )
        pool = [random_tokens(content, _uniform(content, *RAG_FRAGMENT)) for _ in range(RAG_POOL)]
        namespace = CacheNamespace(model_revision=SIM_NAMESPACE.model_revision, tenant=f"app-{a}")
        apps.append((stable, pool, namespace))
    zipf = np.array([1.0 / (r + 1) ** RAG_ZIPF_S for r in range(RAG_POOL)])
    zipf /= zipf.sum()
    share = np.asarray(RAG_APPS) / sum(RAG_APPS)
    drafts: list[_Draft] = []
    for _ in range(n):
        a = int(content.choice(len(RAG_APPS), p=share))
        stable, pool, namespace = apps[a]
        picks = content.choice(
            RAG_POOL, size=_uniform(content, *RAG_FRAGMENTS_PER_REQUEST), replace=False, p=zipf
        )
        question = random_tokens(content, _uniform(content, *RAG_QUESTION))
        drafts.append(
            _Draft(
                segments=(stable, *(pool[int(i)] for i in picks), question),
                output_tokens=_uniform(content, *RAG_OUTPUT),
                prefix_class=PrefixClass.RAG,
                group=f"app-{a}",
                first_user_offset=len(stable),
                namespace=namespace,
            )
        )
    return _assemble(
        name,
        f"{len(RAG_APPS)} apps (tenants): ~3,000-token stable layer, "
        f"{RAG_FRAGMENTS_PER_REQUEST[0]}-{RAG_FRAGMENTS_PER_REQUEST[1]} fragments of ~500 tokens "
        f"from a Zipf pool of {RAG_POOL}, then the question",
        drafts,
        make_arrivals(arrival, n, timing),
        workers=RAG_WORKERS,
    )


# --------------------------------------------------------------------------- multi-turn

MULTI_TURN_SESSIONS = 100
MULTI_TURN_TURNS = (3, 8)
MULTI_TURN_SYSTEM_TOKENS = 1_500
MULTI_TURN_USER = (50, 500)
MULTI_TURN_ASSISTANT = (100, 600)
MULTI_TURN_OPEN_SESSIONS = 16
MULTI_TURN_WORKERS = 8


def _build_multi_turn(seed: int, requests: int | None = None, arrival: str = "poisson") -> Workload:
    name = "multi-turn"
    content, timing = _streams(name, seed)
    # Turn counts per session; with `requests`, add sessions until the count is
    # reached and shorten the last one so the total is exact.
    turns: list[int] = []
    if requests is None:
        turns = [_uniform(content, *MULTI_TURN_TURNS) for _ in range(MULTI_TURN_SESSIONS)]
    else:
        remaining = _count(requests, 0)
        while remaining > 0:
            turns.append(min(_uniform(content, *MULTI_TURN_TURNS), remaining))
            remaining -= turns[-1]
    n = sum(turns)
    system = random_tokens(content, MULTI_TURN_SYSTEM_TOKENS)
    history: list[tuple[array[int], ...]] = [(system,) for _ in turns]
    done = [0] * len(turns)
    open_sessions = list(range(min(MULTI_TURN_OPEN_SESSIONS, len(turns))))
    next_session = len(open_sessions)
    drafts: list[_Draft] = []
    for _ in range(n):
        j = int(content.integers(len(open_sessions)))
        s = open_sessions[j]
        user = random_tokens(content, _uniform(content, *MULTI_TURN_USER))
        answer = random_tokens(content, _uniform(content, *MULTI_TURN_ASSISTANT))
        prompt = (*history[s], user)
        drafts.append(
            _Draft(
                segments=prompt,
                output_tokens=len(answer),
                prefix_class=PrefixClass.SESSION,
                group=f"session-{s:03d}",
                first_user_offset=len(system),
            )
        )
        # The next turn's prompt is this prompt plus this answer: same array objects.
        history[s] = (*prompt, answer)
        done[s] += 1
        if done[s] == turns[s]:
            if next_session < len(turns):
                open_sessions[j] = next_session
                next_session += 1
            else:
                open_sessions.pop(j)
    return _assemble(
        name,
        f"{len(turns)} chat sessions of {MULTI_TURN_TURNS[0]}-{MULTI_TURN_TURNS[1]} turns "
        f"({MULTI_TURN_OPEN_SESSIONS} open at a time); history grows as a prefix",
        drafts,
        make_arrivals(arrival, n, timing),
        workers=MULTI_TURN_WORKERS,
    )


# --------------------------------------------------------------------------- hot-prefix

HOT_CONTRACT_TOKENS = 20_000
HOT_SHARE = 0.7
HOT_OTHER_DOCS = 20
HOT_OTHER_TOKENS = (8_000, 20_000)
HOT_SYSTEM_TOKENS = 300
HOT_QUESTION = (30, 200)
HOT_OUTPUT = (50, 300)
HOT_REQUESTS = 800
HOT_WORKERS = 8


def _build_hot_prefix(seed: int, requests: int | None = None, arrival: str = "poisson") -> Workload:
    name = "hot-prefix"
    content, timing = _streams(name, seed)
    n = _count(requests, HOT_REQUESTS)
    system = random_tokens(content, HOT_SYSTEM_TOKENS)
    contract = random_tokens(content, HOT_CONTRACT_TOKENS)
    others = [
        random_tokens(content, _uniform(content, *HOT_OTHER_TOKENS)) for _ in range(HOT_OTHER_DOCS)
    ]
    drafts: list[_Draft] = []
    for _ in range(n):
        if content.random() < HOT_SHARE:
            doc, group = contract, "contract"
        else:
            k = int(content.integers(HOT_OTHER_DOCS))
            doc, group = others[k], f"doc-{k + 1:02d}"
        drafts.append(
            _Draft(
                segments=(system, doc, random_tokens(content, _uniform(content, *HOT_QUESTION))),
                output_tokens=_uniform(content, *HOT_OUTPUT),
                prefix_class=PrefixClass.DOCUMENT,
                group=group,
                first_user_offset=len(system),
            )
        )
    return _assemble(
        name,
        f"{HOT_SHARE:.0%} of requests about one {HOT_CONTRACT_TOKENS:,}-token contract, "
        f"the rest about {HOT_OTHER_DOCS} documents of "
        f"{HOT_OTHER_TOKENS[0]:,}-{HOT_OTHER_TOKENS[1]:,} tokens",
        drafts,
        make_arrivals(arrival, n, timing),
        workers=HOT_WORKERS,
    )


# --------------------------------------------------------------------------- unique

UNIQUE_PROMPT = (500, 4_000)
UNIQUE_OUTPUT = (50, 400)
UNIQUE_REQUESTS = 800
UNIQUE_WORKERS = 8


def _build_unique(seed: int, requests: int | None = None, arrival: str = "poisson") -> Workload:
    name = "unique"
    content, timing = _streams(name, seed)
    n = _count(requests, UNIQUE_REQUESTS)
    drafts = [
        _Draft(
            segments=(random_tokens(content, _uniform(content, *UNIQUE_PROMPT)),),
            output_tokens=_uniform(content, *UNIQUE_OUTPUT),
            prefix_class=PrefixClass.UNKNOWN,
            group=f"unique-{i:05d}",
        )
        for i in range(n)
    ]
    return _assemble(
        name,
        f"{n} unique prompts of {UNIQUE_PROMPT[0]:,}-{UNIQUE_PROMPT[1]:,} tokens"
        " (negative control)",
        drafts,
        make_arrivals(arrival, n, timing),
        workers=UNIQUE_WORKERS,
    )


# --------------------------------------------------------------------------- llmd-customers

LLMD_GROUPS = 150
LLMD_USERS_PER_GROUP = 5
LLMD_CONTEXT_TOKENS = 6_000
LLMD_QUESTION_TOKENS = 1_200
LLMD_OUTPUT_TOKENS = 1_000
LLMD_REQUESTS = 1_000
LLMD_WORKERS = 8
# (rate req/s, duration s) of llm-d-benchmark's guide_precise-prefix-cache-routing_1
# inference-perf profile: a warm-up that seats the residents, then the ladder.
LLMD_STAGES: tuple[tuple[float, float], ...] = (
    (15, 50),
    (3, 20),
    (10, 20),
    (15, 20),
    (20, 38),
    (22, 34),
    (25, 30),
    (30, 25),
    (35, 21),
    (40, 38),
    (43, 36),
    (46, 33),
    (49, 30),
    (52, 29),
    (55, 27),
    (57, 26),
    (60, 25),
)
# Resident contexts (150 x 6,000 tokens) fill ~73 % of the 8 workers' KV cache.
LLMD_KV_BLOCKS = math.ceil(LLMD_GROUPS * LLMD_CONTEXT_TOKENS / 16 / LLMD_WORKERS / 0.73)


def _build_llmd_customers(
    seed: int, requests: int | None = None, arrival: str = "poisson"
) -> Workload:
    name = "llmd-customers"
    content, timing = _streams(name, seed)
    n = _count(requests, LLMD_REQUESTS)
    contexts = [random_tokens(content, LLMD_CONTEXT_TOKENS) for _ in range(LLMD_GROUPS)]
    # One fixed question per user: (customer, question); users of a customer are adjacent.
    users = [
        (g, random_tokens(content, LLMD_QUESTION_TOKENS))
        for g in range(LLMD_GROUPS)
        for _ in range(LLMD_USERS_PER_GROUP)
    ]
    drafts: list[_Draft] = []
    while len(drafts) < n:  # one pass = every user once, in a fresh random order
        for i in content.permutation(len(users))[: n - len(drafts)]:
            g, question = users[int(i)]
            drafts.append(
                _Draft(
                    segments=(contexts[g], question),
                    output_tokens=LLMD_OUTPUT_TOKENS,
                    prefix_class=PrefixClass.SYSTEM,
                    group=f"customer-{g:03d}",
                )
            )
    counts = _apportion(n, [rate * duration for rate, duration in LLMD_STAGES])
    arrivals = rate_ladder(
        counts, [rate for rate, _ in LLMD_STAGES], timing, cv=arrival_cv(arrival)
    )
    return _assemble(
        name,
        f"{LLMD_GROUPS} customers x {LLMD_USERS_PER_GROUP} users, "
        f"{LLMD_CONTEXT_TOKENS:,}-token contexts, {LLMD_QUESTION_TOKENS:,}-token questions, "
        f"{LLMD_OUTPUT_TOKENS:,}-token outputs, llm-d rate ladder (warm-up, then 3 -> 60)",
        drafts,
        arrivals,
        workers=LLMD_WORKERS,
        kv_blocks=LLMD_KV_BLOCKS,
    )


# --------------------------------------------------------------------------- gsp

GSP_GROUPS = 64
GSP_PROMPTS_PER_GROUP = 16
GSP_SYSTEM_TOKENS = 2_048
GSP_QUESTION_TOKENS = 128
GSP_OUTPUT_TOKENS = 256
GSP_WORKERS = 8


def _build_gsp(seed: int, requests: int | None = None, arrival: str = "poisson") -> Workload:
    name = "gsp"
    content, timing = _streams(name, seed)
    n = _count(requests, GSP_GROUPS * GSP_PROMPTS_PER_GROUP)
    groups = -(-n // GSP_PROMPTS_PER_GROUP)
    drafts: list[_Draft] = []
    for g in range(groups):
        system = random_tokens(content, GSP_SYSTEM_TOKENS)
        for _ in range(GSP_PROMPTS_PER_GROUP):
            drafts.append(
                _Draft(
                    segments=(system, random_tokens(content, GSP_QUESTION_TOKENS)),
                    output_tokens=GSP_OUTPUT_TOKENS,
                    prefix_class=PrefixClass.SYSTEM,
                    group=f"group-{g:02d}",
                )
            )
    order = content.permutation(len(drafts))[:n]  # bench_serving shuffles unless --gsp-ordered
    return _assemble(
        name,
        f"SGLang generated-shared-prefix: {groups} groups x {GSP_PROMPTS_PER_GROUP} prompts, "
        f"{GSP_SYSTEM_TOKENS:,}-token system prompts, {GSP_QUESTION_TOKENS}-token questions, "
        f"{GSP_OUTPUT_TOKENS}-token outputs, shuffled",
        [drafts[int(i)] for i in order],
        make_arrivals(arrival, n, timing),
        workers=GSP_WORKERS,
    )


# --------------------------------------------------------------------------- mooncake

MOONCAKE_WORKERS = 16


def _build_mooncake(seed: int, requests: int | None = None, arrival: str = "poisson") -> Workload:
    # `arrival` is validated for a uniform interface but not used: the times are real.
    make_arrivals(arrival, 0, np.random.default_rng(0))
    return load_mooncake(
        bundled_mooncake_path(),
        limit=None if requests is None else _count(requests, 0),
        seed=seed,
        name="mooncake-conversation",
        workers=MOONCAKE_WORKERS,
    )


# --------------------------------------------------------------------------- registry

SCENARIOS: dict[str, ScenarioSpec] = {
    spec.name: spec
    for spec in (
        ScenarioSpec(
            "doc-qa",
            "3 x 40k-token documents asked about in phases, KV holds ~2 docs (4 workers)",
            True,
            _build_doc_qa,
        ),
        ScenarioSpec(
            "system-prompt",
            "one 4k-token system prompt shared by all conversations (hot-spot risk)",
            True,
            _build_system_prompt,
        ),
        ScenarioSpec(
            "templates",
            "6 standard forms (2k-5k tokens); fields, date, language, task at the end",
            True,
            _build_templates_good,
        ),
        ScenarioSpec(
            "templates-bad",
            "the same forms with a timestamp before them: nothing shared (no router helps)",
            False,
            _build_templates_bad,
        ),
        ScenarioSpec(
            "rag",
            "stable ~3k-token layer per tenant + 3-5 Zipf-popular 500-token fragments",
            True,
            _build_rag,
        ),
        ScenarioSpec(
            "multi-turn",
            "100 interleaved chat sessions whose history grows as a prefix",
            True,
            _build_multi_turn,
        ),
        ScenarioSpec(
            "hot-prefix",
            "70% of traffic on one 20k-token contract, the rest on 20 other documents",
            True,
            _build_hot_prefix,
        ),
        ScenarioSpec(
            "unique",
            "unique 500-4k-token prompts, no shared prefix (negative control)",
            False,
            _build_unique,
        ),
        ScenarioSpec(
            "llmd-customers",
            "llm-d benchmark: 150 customers x 5 users, 6k contexts, rate ladder 3 -> 60",
            True,
            _build_llmd_customers,
        ),
        ScenarioSpec(
            "gsp",
            "SGLang generated-shared-prefix: 64 groups x 16 prompts, 2,048-token prefixes",
            True,
            _build_gsp,
        ),
        ScenarioSpec(
            "mooncake-conversation",
            "replay of the Mooncake (Kimi) conversation trace, real times (16 workers)",
            True,
            _build_mooncake,
        ),
    )
}


def get_scenario(name: str) -> ScenarioSpec:
    """The scenario called ``name``; ``KeyError`` listing the known names otherwise."""
    try:
        return SCENARIOS[name]
    except KeyError:
        known = ", ".join(SCENARIOS)
        raise KeyError(f"unknown scenario {name!r}; known scenarios: {known}") from None
