"""Simulator scenarios as live text traffic, and the engine speed that puts a fleet at a load.

The scenarios of :mod:`prefixrouter.sim.scenarios` are token-id workloads whose
shared prefixes are shared array objects. A live benchmark needs text that real
routers (ours, sglang-router, vllm-router) can read, so each distinct segment
becomes text once and every request that holds the segment holds that text:

* **lengths**: every segment and output length is multiplied by ``scale`` (0.5
  halves a 40,000-token document), so a run fits a small machine; a scenario's
  KV size per engine is scaled the same way, so caches stay under the pressure
  the scenario was designed for;
* **text**: a segment of ``n`` tokens becomes about ``n`` tokens of pronounceable
  words (:func:`prefixrouter.harness.texts.syllable_words`; words per token
  measured once with the project's tokenizer), seeded by the segment's order
  of first appearance, so the same seed gives the same bytes;
* **messages**: the segments before the scenario's ``first_user_offset`` form the
  system message; the rest is one user message (joined by blank lines), except in
  sessions (``multi-turn``), whose history alternates user and assistant
  messages, so each turn's prompt starts with the previous turn's prompt and answer;
* **timing**: arrivals are the scenario's own (Poisson unless it says otherwise)
  at ``rate`` requests per second of wall time.

The engines' time scale is then chosen so that this wall rate is ``load`` of
the fleet's capacity (:func:`~prefixrouter.sim.runner.capacity_rps`: every
reusable prefix computed once), i.e. ``time_scale = rate / (load x capacity)``;
or the time scale is given and the load follows.

``cache-pressure`` is the bench's own scenario (:mod:`prefixrouter.bench.pressure`):
it is sized from the engines' KV (``kv_blocks``, else its own default times
``scale``) instead of being cut by ``scale``.

**Fit.** A request longer than an engine's KV cache is refused by every
engine (HTTP 400), so a run of such requests measures nothing. Before any
engine starts, :func:`check_live_fits` refuses the workload with one line
naming the request, its length, the cache and the option that sized it: on
the planned token counts first (the simulator's own test,
:func:`prefixrouter.sim.runner.check_fits`), then on the text itself for the
requests planned near the limit (the text comes within a few percent of its
planned tokens, the chat template adds a few: those are tokenized as the
engines tokenize them, with the same rule as the engines' 400).
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from prefixrouter.bench import pressure
from prefixrouter.core.types import PrefixClass
from prefixrouter.errors import ConfigError
from prefixrouter.harness.replay import ReplayRequest
from prefixrouter.harness.texts import syllable_words
from prefixrouter.sim.profiles import EngineProfile
from prefixrouter.sim.runner import RequestTooLarge, capacity_rps, check_fits
from prefixrouter.sim.scenarios import SCENARIOS, get_scenario
from prefixrouter.sim.workload import SimRequest, Workload
from prefixrouter.simulated_engine.config import DEFAULT_MAX_MODEL_LEN, default_max_model_len
from prefixrouter.simulated_engine.protocol import length_error
from prefixrouter.tokenization import Tokenizer, render_chat

DEFAULT_SCENARIOS = ("doc-qa", "system-prompt", "multi-turn", "unique")
CALIBRATION_WORDS = 4000
TEXT_SLACK = 1.25
TEXT_SLACK_TOKENS = 64
"""A request planned within this of the KV cache (times, plus tokens) is tokenized
to check that it fits: its text may run longer than planned (by up to a fifth on
short prompts, ``tests/bench/test_workload.py``), and the chat template adds a few."""


def live_scenarios() -> list[str]:
    """Scenario names that can run live (trace replays with real times cannot)."""
    return [*(name for name in SCENARIOS if name != "mooncake-conversation"), pressure.NAME]


@dataclass(frozen=True, slots=True)
class BenchWorkload:
    """One scenario ready to replay.

    Attributes:
        scenario: Scenario name.
        description: What the scenario models (its own words, before scaling).
        shared_prefix: False when no request shares a reusable prefix.
        requests: Chat requests with their send offsets (wall seconds).
        rate: Offered requests per second (wall).
        load: Offered load as a fraction of the fleet's capacity.
        time_scale: Engine time compression that gives that load.
        kv_blocks: KV blocks per engine (None: the profile's).
        block_size: Tokens per KV block of the engines.
    """

    scenario: str
    description: str
    shared_prefix: bool
    requests: list[ReplayRequest]
    rate: float
    load: float
    time_scale: float
    kv_blocks: int | None
    block_size: int = 16


class SegmentText:
    """Text for token-id segments: one text per distinct segment object."""

    def __init__(self, tokenizer: Tokenizer, seed: int) -> None:
        sample = syllable_words(random.Random(f"calibrate-{seed}"), CALIBRATION_WORDS)
        self.tokens_per_word = len(tokenizer.encode(sample)) / CALIBRATION_WORDS
        self.seed = seed
        self._texts: dict[int, str] = {}
        self._held: list[array[int]] = []  # keeps ids unique while texts are made

    def __call__(self, segment: array[int]) -> str:
        text = self._texts.get(id(segment))
        if text is None:
            n = max(1, round(len(segment) / self.tokens_per_word))
            rng = random.Random(f"{self.seed}-{len(self._held)}")
            text = self._texts[id(segment)] = syllable_words(rng, n)
            self._held.append(segment)
        return text


def chat_messages(req: SimRequest, text: SegmentText) -> list[dict[str, str]]:
    """The OpenAI chat messages of one scenario request (module doc)."""
    k = req.system_segments
    messages: list[dict[str, str]] = []
    if k:
        system = "\n\n".join(text(s) for s in req.segments[:k])
        messages.append({"role": "system", "content": system})
    rest = req.segments[k:]
    if req.prefix_class == PrefixClass.SESSION:
        for i, s in enumerate(rest):
            messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text(s)})
    else:
        messages.append({"role": "user", "content": "\n\n".join(text(s) for s in rest)})
    return messages


def request_body(messages: Sequence[dict[str, str]], max_tokens: int, model: str) -> dict[str, Any]:
    """A streaming chat request with a fixed output length and usage in the last chunk."""
    return {
        "model": model,
        "messages": list(messages),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def text_requests(
    timed: Workload, tokenizer: Tokenizer, seed: int = 0, model: str = "tiny"
) -> list[ReplayRequest]:
    """A timed simulator workload as streaming chat requests (module doc: text, messages)."""
    text = SegmentText(tokenizer, seed)
    return [
        ReplayRequest(
            r.arrival,
            timed.name,
            r.group,
            request_body(chat_messages(r, text), r.output_tokens, model),
        )
        for r in timed.requests
    ]


def build_bench_workload(
    scenario: str,
    *,
    requests: int,
    rate: float,
    scale: float,
    workers: int,
    profile: EngineProfile,
    tokenizer: Tokenizer,
    load: float = 0.8,
    time_scale: float | None = None,
    seed: int = 0,
    model: str = "tiny",
    kv_blocks: int | None = None,
) -> BenchWorkload:
    """``scenario`` as text requests at ``rate``, and the engine speed for ``load``.

    ``kv_blocks`` overrides the scenario's KV per engine (``cache-pressure``
    is then sized from it).

    Raises:
        ConfigError: Unknown or non-live scenario, or a bad number.
    """
    if scenario not in live_scenarios():
        raise ConfigError(
            f"unknown scenario {scenario!r}; live scenarios: {', '.join(live_scenarios())}"
        )
    for name, value in (("rate", rate), ("load", load), ("requests", requests)):
        if not value > 0:
            raise ConfigError(f"{name}: must be positive, got {value}")
    if kv_blocks is not None and kv_blocks < 1:
        raise ConfigError(f"kv_blocks: must be positive, got {kv_blocks}")
    if scenario == pressure.NAME:
        blocks = kv_blocks or math.ceil(pressure.KV_BLOCKS * scale)
        sizing = pressure.size_pressure(workers, blocks, profile.block_size, requests, seed)
        base = scaled = pressure.pressure_workload(sizing, seed, scale)
        shared = True
    else:
        spec = get_scenario(scenario)
        base = spec.build(seed, requests)
        try:
            scaled = base.lengths_scaled(scale)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if kv_blocks is not None:
            scaled = replace(scaled, default_kv_blocks=kv_blocks)
        shared = spec.shared_prefix
    capacity = capacity_rps(scaled, profile, workers)
    if time_scale is None:
        time_scale = rate / (load * capacity)
    else:
        load = rate / (time_scale * capacity)
    reqs = text_requests(scaled.scaled(rate), tokenizer, seed, model)
    where = (
        f"--kv-blocks {kv_blocks}" if kv_blocks is not None
        else f"the scenario's KV cache at --scale {scale:g}" if scaled.default_kv_blocks
        else f"--profile {profile.name}"
    )  # fmt: skip
    check_live_fits(scenario, scaled, reqs, profile, tokenizer, where)
    return BenchWorkload(
        scenario=scenario,
        description=base.description,
        shared_prefix=shared,
        requests=reqs,
        rate=rate,
        load=load,
        time_scale=time_scale,
        kv_blocks=scaled.default_kv_blocks,
        block_size=profile.block_size,
    )


def engine_limit(blocks: int, block_size: int) -> int:
    """The longest request a bench engine takes: its ``max_model_len`` as the simulated
    engine sets it (:func:`~prefixrouter.simulated_engine.config.default_max_model_len`)."""
    return default_max_model_len(blocks, block_size)


def engine_refuses(req: ReplayRequest, tokenizer: Tokenizer, limit: int) -> tuple[int, int] | None:
    """``(prompt, output)`` tokens of a chat request an engine of ``limit`` tokens refuses, or None.

    The prompt is counted as the engines count it (the chat template, then the
    tokenizer); the rule is theirs (:func:`~prefixrouter.simulated_engine.protocol.length_error`,
    vLLM's 400).
    """
    text = render_chat(req.body["messages"], None, add_generation_prompt=True)
    prompt = len(tokenizer.encode(text))
    output = int(req.body.get("max_tokens") or 0)
    return (prompt, output) if length_error(prompt, output, limit) is not None else None


def fit_error(
    scenario: str, where: str, index: int, prompt: int, output: int, blocks: int, block_size: int
) -> ConfigError:
    """The one line that refuses request ``index`` of ``scenario``: too long for the KV cache.

    ``where`` names what sized the cache (``--kv-blocks 64``); unless it is
    that option, the line ends by naming it.
    """
    if engine_limit(blocks, block_size) < blocks * block_size:  # the context, not the KV
        return ConfigError(
            f"{scenario}: request {index} needs {prompt + output:,} tokens ({prompt:,} "
            f"prompt + {output:,} output), more than an engine's context takes "
            f"({DEFAULT_MAX_MODEL_LEN:,})"
        )
    hint = "" if where.startswith("--kv-blocks") else "; give more with --kv-blocks"
    return ConfigError(
        f"{scenario}: {where}: request {index} needs {prompt + output:,} tokens ({prompt:,} "
        f"prompt + {output:,} output), more than an engine's KV cache holds "
        f"({blocks * block_size:,}: {blocks:,} blocks of {block_size}){hint}"
    )


def check_requests_fit(
    scenario: str,
    requests: Sequence[ReplayRequest],
    tokenizer: Tokenizer,
    blocks: int,
    block_size: int,
    where: str,
) -> None:
    """Refuse ``requests`` if one is too long for an engine of ``blocks`` KV blocks.

    Every request is tokenized (:func:`engine_refuses`): for workloads with no
    planned token counts (the demo's).

    Raises:
        ConfigError: The first such request (:func:`fit_error`).
    """
    for i, req in enumerate(requests):
        refused = engine_refuses(req, tokenizer, engine_limit(blocks, block_size))
        if refused is not None:
            raise fit_error(scenario, where, i, *refused, blocks, block_size)


def check_live_fits(
    scenario: str,
    planned: Workload,
    requests: Sequence[ReplayRequest],
    profile: EngineProfile,
    tokenizer: Tokenizer,
    where: str,
) -> None:
    """Refuse a workload with a request no engine's KV cache can hold (module doc: fit).

    The planned counts decide first, as the simulator decides
    (:func:`~prefixrouter.sim.runner.check_fits`); then the requests planned
    near the limit (:data:`TEXT_SLACK`) are tokenized, the others cannot
    cross it.

    Args:
        scenario: Its name, for the message.
        planned: The token-count workload ``requests`` were made from, in the same order.
        requests: The chat requests the engines will get.
        profile: The engines' profile (block size; KV size when ``planned`` has none).
        tokenizer: The engines' tokenizer.
        where: What sized the cache, for the message (``--kv-blocks 1000``).

    Raises:
        ConfigError: One line (:func:`fit_error`): the first request that
            does not fit, its length, the cache, and what to change.
    """
    blocks = planned.default_kv_blocks or profile.kv_blocks
    bs = profile.block_size
    try:
        check_fits(planned, profile, blocks)
    except RequestTooLarge as exc:
        big = exc.request
        index = next(i for i, r in enumerate(planned.requests) if r is big)
        raise fit_error(
            scenario, where, index, big.prompt_tokens, big.output_tokens, blocks, bs
        ) from None
    limit = engine_limit(blocks, bs)
    for i, (plan, req) in enumerate(zip(planned.requests, requests, strict=True)):
        if (plan.prompt_tokens + plan.output_tokens) * TEXT_SLACK + TEXT_SLACK_TOKENS < limit:
            continue  # far enough below the limit, whatever its text's length
        refused = engine_refuses(req, tokenizer, limit)
        if refused is not None:
            raise fit_error(scenario, where, i, *refused, blocks, bs)


def warmup_requests(
    n: int, *, tokens: int, tokenizer: Tokenizer, seed: int = 0, model: str = "tiny"
) -> list[ReplayRequest]:
    """``n`` unique prompts of about ``tokens`` tokens, one output token, all due at once.

    Every router gets the same warm-up before its measured run, so a router that
    learns from traffic (our gateway calibrates its cost model and its characters
    per token) is measured in its steady state, as it would be in production;
    the engines' caches are emptied after it.
    """
    text = SegmentText(tokenizer, seed + 1_000_003)
    out = []
    for i in range(n):
        prompt = text(array("I", bytes(4 * tokens)))  # a fresh segment: new words each time
        body = request_body([{"role": "user", "content": f"{i}: {prompt}"}], 1, model)
        out.append(ReplayRequest(0.0, "warmup", f"warmup-{i}", body))
    return out
