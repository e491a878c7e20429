"""The cache-pressure scenario: more documents than one engine's KV holds, questions interleaved.

What it tests: when the fleet's KV can hold every document once but no single
engine can hold them all, a router must *partition* the documents over the
engines (each document on one engine, the engines' shares balanced) instead
of copying them around, or every question pays a cold prefill. The oracle
(:mod:`prefixrouter.bench.oracle`) is that partition, computed in advance.

Sizing (:func:`size_pressure`), from what the bench knows of the engines
(simulated engines: their ``--kv-blocks`` and block size; vLLM: the
``num_gpu_blocks`` and ``block_size`` it reports), so the workload stays a
pressure workload on any cache size:

* per engine, ``C = kv_blocks x block_size`` tokens of KV;
* ``D = DOCS_PER_ENGINE x engines`` documents whose lengths are the mean
  ``FILL x C / DOCS_PER_ENGINE`` times a seeded factor in ``1 +- SPREAD``,
  renormalized so they total ``FILL x engines x C``: more than one engine
  holds (``FILL x engines > 1`` for any fleet of two or more) and, pinned
  :data:`DOCS_PER_ENGINE` to an engine, within ``MAX_FILL`` of each engine's
  KV, the rest left for running requests' questions and answers (if the
  oracle's pinning does not fit, every length shrinks by 5% until it does);
* questions per document proportional to a seeded popularity in
  :data:`POPULARITY`, at least one each, ``requests`` in all, in one seeded
  random order (every document is asked about throughout the run);
* prompt = a short system line and the document (the system message: one
  per document) + a unique question (the user message); outputs
  :data:`OUTPUT` tokens; Poisson arrivals.

:func:`pressure_workload` builds it as a simulator workload (token ids,
unit-rate arrivals); :func:`prefixrouter.bench.workload.build_bench_workload`
turns it into text at the bench's rate and sets the engines' speed for the
load, as for every other scenario.
"""

from __future__ import annotations

import math
import random
from array import array
from dataclasses import dataclass

import numpy as np

from prefixrouter.bench.oracle import PIN_FILL, pin_documents
from prefixrouter.core.types import PrefixClass, RequestId
from prefixrouter.errors import ConfigError
from prefixrouter.sim.workload import (
    SIM_NAMESPACE,
    SimRequest,
    Workload,
    poisson_arrivals,
    random_tokens,
)

NAME = "cache-pressure"
DOCS_PER_ENGINE = 2
FILL = 0.7
"""Mean share of an engine's KV its pinned documents take."""
MAX_FILL = PIN_FILL
"""Most of an engine's KV the oracle's documents may take."""
SPREAD = 0.25
POPULARITY = (0.5, 1.5)
SYSTEM_TOKENS = 60
QUESTION = (30, 120)
OUTPUT = (16, 48)
KV_BLOCKS = 3000
"""Simulated engines' KV per engine at ``--scale 1`` (16-token blocks: 48,000 tokens)."""


@dataclass(frozen=True, slots=True)
class PressureSizing:
    """The scenario's shape for one fleet.

    Attributes:
        engines: Engines in the fleet.
        kv_blocks: KV blocks per engine.
        block_size: Tokens per block.
        doc_tokens: Each document's length.
        questions: Questions about each document.
        pins: The oracle's engine for each document (by index).
    """

    engines: int
    kv_blocks: int
    block_size: int
    doc_tokens: tuple[int, ...]
    questions: tuple[int, ...]
    pins: tuple[int, ...]

    @property
    def capacity_tokens(self) -> int:
        """One engine's KV, in tokens."""
        return self.kv_blocks * self.block_size

    @property
    def per_engine_tokens(self) -> list[int]:
        """Document tokens each engine holds under the oracle's pinning."""
        out = [0] * self.engines
        for tokens, e in zip(self.doc_tokens, self.pins, strict=True):
            out[e] += tokens
        return out

    def describe(self) -> str:
        c = self.capacity_tokens
        total = sum(self.doc_tokens)
        return (
            f"{len(self.doc_tokens)} documents of {min(self.doc_tokens):,}-"
            f"{max(self.doc_tokens):,} tokens ({total:,} in all = {total / c:.2f}x one "
            f"engine's {c:,}-token KV, {total / (c * self.engines):.0%} of the fleet's), "
            f"{sum(self.questions)} questions interleaved"
        )


def _apportion(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights``, each at least 1 (largest remainder)."""
    n = len(weights)
    rest = total - n
    s = sum(weights)
    raw = [rest * w / s for w in weights]
    out = [1 + math.floor(x) for x in raw]
    order = sorted(range(n), key=lambda i: (-(raw[i] - math.floor(raw[i])), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


def size_pressure(
    engines: int, kv_blocks: int, block_size: int, requests: int, seed: int = 0
) -> PressureSizing:
    """The documents and questions for a fleet (module doc).

    Raises:
        ConfigError: Fewer than two engines, fewer requests than documents,
            or a KV too small to hold a document.
    """
    if engines < 2:
        raise ConfigError(f"{NAME}: needs at least 2 engines (one engine has no choice), got "
                          f"{engines}")  # fmt: skip
    docs = DOCS_PER_ENGINE * engines
    if requests < docs:
        raise ConfigError(f"{NAME}: needs at least {docs} requests (one per document)")
    capacity = kv_blocks * block_size
    rng = random.Random(f"{NAME}-{seed}")
    factors = [rng.uniform(1 - SPREAD, 1 + SPREAD) for _ in range(docs)]
    popularity = [rng.uniform(*POPULARITY) for _ in range(docs)]
    questions = _apportion(requests, popularity)
    target = FILL * engines * capacity
    lengths = [target * f / sum(factors) for f in factors]
    for _ in range(100):  # bounded: each pass shrinks every document by 5%
        tokens = [int(x) for x in lengths]
        if min(tokens) < 2 * block_size:
            break
        names = [f"doc-{i + 1}" for i in range(docs)]
        weights = {d: (t, q) for d, t, q in zip(names, tokens, questions, strict=True)}
        pins = pin_documents(weights, engines, int(MAX_FILL * capacity))
        sizing = PressureSizing(
            engines, kv_blocks, block_size, tuple(tokens), tuple(questions),
            tuple(pins[d] for d in names),
        )  # fmt: skip
        if max(sizing.per_engine_tokens) <= MAX_FILL * capacity:
            return sizing
        lengths = [x * 0.95 for x in lengths]
    raise ConfigError(
        f"{NAME}: {kv_blocks} KV blocks of {block_size} tokens are too small for documents"
    )


def pressure_workload(sizing: PressureSizing, seed: int = 0, scale: float = 1.0) -> Workload:
    """The scenario as a simulator workload (unit-rate Poisson arrivals; module doc).

    ``scale`` shortens questions and outputs as the bench's ``--scale`` does
    for other scenarios; the documents are sized from the KV already.
    """
    content = np.random.default_rng([seed, 0x9E55, 0])
    timing = np.random.default_rng([seed, 0x9E55, 1])
    system = random_tokens(content, SYSTEM_TOKENS)
    docs = [random_tokens(content, n) for n in sizing.doc_tokens]
    order = [k for k, q in enumerate(sizing.questions) for _ in range(q)]
    random.Random(f"{NAME}-order-{seed}").shuffle(order)
    arrivals = poisson_arrivals(len(order), timing)

    def n(lo_hi: tuple[int, int]) -> int:
        return max(1, round(int(content.integers(lo_hi[0], lo_hi[1] + 1)) * scale))

    requests = []
    for i, (k, t) in enumerate(zip(order, arrivals, strict=True)):
        question: array[int] = random_tokens(content, n(QUESTION))
        requests.append(
            SimRequest(
                request_id=RequestId(f"{NAME}-{i:05d}"),
                arrival=float(t),
                namespace=SIM_NAMESPACE,
                segments=(system, docs[k], question),
                output_tokens=n(OUTPUT),
                prefix_class=PrefixClass.DOCUMENT,
                group=f"doc-{k + 1}",
                first_user_offset=len(system) + len(docs[k]),
            )
        )
    return Workload(
        name=NAME,
        description=sizing.describe(),
        requests=requests,
        default_workers=sizing.engines,
        default_kv_blocks=sizing.kv_blocks,
        block_size=sizing.block_size,
    )
