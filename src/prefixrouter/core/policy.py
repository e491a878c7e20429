"""The policy plug-in interface, the routing context and the registry.

A policy is one class in one file under :mod:`prefixrouter.core.policies`:

* a frozen ``Params`` dataclass holding its parameters and their defaults;
* ``select(ctx, candidates)`` returning a :class:`Selection`: pure, it must not
  change any state, so a decision can be replayed and explained;
* optional hooks with no-op defaults (``on_routed``, ``on_completed``,
  ``on_rejected``, ``on_worker_removed``) where a policy keeps state of its
  own (a round-robin cursor, a peer's character tree);
* one line to register it: the ``@register`` decorator.

A policy has one name. A name it had before stays accepted as a deprecated
alias (:data:`ALIASES`): :func:`create_policy` resolves it silently (the core
does no I/O), and the edges that read names from users (the gateway's
configuration, the command line) resolve it with :func:`canonical_policy_name`
and say so with :func:`alias_note`.

The router computes what every policy may need once per request into the
:class:`RoutingContext` (the prompt's block hashes and the index match per
worker: "match once, score many") and filters candidates before any policy
sees them (permission before latency).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from prefixrouter.core.cost import CostModel, CostTerms
from prefixrouter.core.hashing import PromptBlocks
from prefixrouter.core.index import PrefixIndex, WorkerMatch
from prefixrouter.core.types import RoutingRequest, WorkerId, WorkerView
from prefixrouter.errors import ConfigError, UnknownNameError


@dataclass(slots=True)
class RoutingContext:
    """Everything computed once per request, read by filters and policies.

    Attributes:
        request: The request.
        blocks: Its chained block hashes.
        matches: worker -> longest held prefix (from the shared index).
        now: Decision time (driver's clock).
        prefix_key: Hex id of the request's leading prefix (for demand and logs).
        cost: The router's (calibrated) cost model, for policies that predict TTFT.
        index: The shared prefix index, read-only (how full each worker's cache is).
        output_tokens: Tokens the request is expected to decode: its
            ``max_tokens`` scaled by the fill its prefix's answers showed, or
            without a cap what such answers decoded
            (:class:`~prefixrouter.core.output.OutputEstimate`). Read it, not
            ``request.max_tokens``, wherever the output length matters.
        replica_salt: The router replica's tie-break salt (``Router(replica_salt=)``;
            0, one router, keeps the deterministic order).
    """

    request: RoutingRequest
    blocks: PromptBlocks
    matches: dict[WorkerId, WorkerMatch]
    now: float
    prefix_key: str
    cost: CostModel
    index: PrefixIndex
    output_tokens: int
    replica_salt: int = 0


@dataclass(slots=True)
class Outcome:
    """What the engine reported for a finished request.

    Attributes:
        actual_cached_tokens: ``usage.prompt_tokens_details.cached_tokens``.
        ttft_s: Observed time to first token, if measured.
        ok: False when the request failed or was cancelled.
        output_tokens: ``usage.completion_tokens`` (0: not reported); teaches
            the router what answers decode (:class:`~prefixrouter.core.output.OutputEstimate`).
    """

    actual_cached_tokens: int
    ttft_s: float | None = None
    ok: bool = True
    output_tokens: int = 0


@dataclass(slots=True)
class CandidateScore:
    """One candidate as a policy saw it (read-only; not frozen, for speed).

    Attributes:
        worker_id: The worker.
        matched_tokens: Prefix tokens it holds (per the index, before trust).
        confidence: Trust in that match, in [0, 1].
        terms: The cost model's terms, for policies that use it.
        score: The policy's own figure (lower is better for cost-based ones).
    """

    worker_id: WorkerId
    matched_tokens: int = 0
    confidence: float = 0.0
    terms: CostTerms | None = None
    score: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record, times in milliseconds."""
        out: dict[str, Any] = {
            "worker": self.worker_id,
            "matched_tokens": self.matched_tokens,
            "confidence": round(self.confidence, 4),
            "score": round(self.score, 6),
        }
        if self.terms is not None:
            t = self.terms
            out.update(
                predicted_ttft_ms=round(t.ttft_s * 1e3, 3),
                queue_wait_ms=round(t.queue_wait_s * 1e3, 3),
                prefill_ms=round(t.prefill_s * 1e3, 3),
                decode_impact_ms=round(t.decode_impact_s * 1e3, 3),
                memory_risk_ms=round(t.memory_risk_s * 1e3, 3),
                memory_risk_freed_ms=round(t.memory_risk_freed_s * 1e3, 3),
                decode_ms=round(t.decode_s * 1e3, 3),
                eviction_ms=round(t.eviction_s * 1e3, 3),
            )
        return out


@dataclass(slots=True)
class Selection:
    """A policy's answer.

    Attributes:
        worker_id: The chosen worker.
        tier: ``exact`` | ``partial`` | ``cold`` | ``cold_pool`` (ours), or the
            policy's own label.
        reason: One human-readable sentence.
        predicted_cached_tokens: Tokens the policy expects the engine to reuse.
        candidates: Per-candidate figures, in candidate order.
        warm_abandoned: A warm candidate existed but was left because its wait made it
            too slow (beyond the warm margin, or past a maximum wait where one is set).
        warm_up: A worker the policy wants the prefix copied to by a prefill-only
            request of the router's own (:meth:`Dispatcher.warm_up`), while this
            request goes to ``worker_id``; None for none.
    """

    worker_id: WorkerId
    tier: str
    reason: str
    predicted_cached_tokens: int = 0
    candidates: tuple[CandidateScore, ...] = ()
    warm_abandoned: bool = False
    warm_up: WorkerId | None = None


class Policy:
    """Base class of routing policies. Subclasses set ``name`` and ``Params``."""

    name: ClassVar[str] = ""
    Params: ClassVar[type[Any]]

    def __init__(self, params: Any = None) -> None:
        self.params = params if params is not None else self.Params()

    def select(self, ctx: RoutingContext, candidates: Sequence[WorkerView]) -> Selection:
        """Choose one of ``candidates`` (never empty, sorted by worker id). Pure."""
        raise NotImplementedError

    def on_routed(self, ctx: RoutingContext, worker: WorkerId) -> None:
        """The request of ``ctx`` was sent to ``worker``."""

    def on_first_token(self, ctx: RoutingContext, worker: WorkerId) -> None:
        """``worker`` sent the first token of the request of ``ctx``: its prefill is done."""

    def on_completed(self, ctx: RoutingContext, worker: WorkerId, outcome: Outcome) -> None:
        """The request of ``ctx`` finished on ``worker``."""

    def on_rejected(self, ctx: RoutingContext, worker: WorkerId) -> None:
        """The engine did no prefill for the request of ``ctx`` (see ``Router.on_rejected``).

        Undo what :meth:`on_routed` recorded for it where that makes sense.
        The default reports a failed completion, so a policy that only pairs
        ``on_routed`` with ``on_completed`` stays balanced.
        """
        self.on_completed(ctx, worker, Outcome(0, None, ok=False))

    def on_worker_removed(self, worker: WorkerId) -> None:
        """``worker`` left the fleet."""

    def admit_warm_up(self, worker: WorkerId, prefill_s: float, now: float) -> bool:
        """Whether the prefill-only copy to ``worker`` that this policy's decision
        asked for (``Selection.warm_up``) goes out now; ``prefill_s`` is its
        predicted prefill there. A yes is spent (``Dispatcher.warm_up`` asks once,
        right before it admits the copy). The default: always.
        """
        return True


P = TypeVar("P", bound=type[Policy])

POLICIES: dict[str, type[Policy]] = {}

DEFAULT_POLICY = "prefix_aware"
"""The policy a router, the gateway and the simulator use unless told otherwise."""

ALIASES: dict[str, str] = {"prefixrouter": "prefix_aware"}
"""Deprecated policy names -> the registered name each stands for."""


def register(cls: P) -> P:
    """Class decorator: make a policy available by its ``name``."""
    if not cls.name:
        raise TypeError(f"{cls.__qualname__} has no name")
    if cls.name in POLICIES and POLICIES[cls.name] is not cls:
        raise TypeError(f"policy name {cls.name!r} registered twice")
    POLICIES[cls.name] = cls
    return cls


class ParamError(ConfigError):
    """A bad policy parameter (:func:`params_from_mapping`).

    The message is ``WHERE: PROBLEM``, as for any :class:`ConfigError`.

    Attributes:
        path: The parameter's keys from the top of the parameters
            (``("short", "bogus")``), so a configuration file can name its line.
        problem: What is wrong, without the ``WHERE:`` prefix.
    """

    def __init__(self, where: str, problem: str, path: tuple[str, ...]) -> None:
        super().__init__(f"{where}: {problem}")
        self.problem = problem
        self.path = path


def params_from_mapping(
    params_cls: type[Any], raw: Mapping[str, Any], where: str, base: Any = None
) -> Any:
    """Build a params dataclass from raw values, naming any bad field.

    Nested dataclass fields accept mappings that override only the keys they
    name. Values must have the type of the default (``int`` -> ``float`` allowed).

    Args:
        params_cls: The params dataclass.
        raw: Field name -> value.
        where: Prefix for error messages (e.g. ``policy prefix_aware``).
        base: The instance whose values are the defaults (``params_cls()`` if None).

    Raises:
        ParamError: An unknown key or a value of the wrong type, with its key path.
    """
    fields = {f.name: f for f in dataclasses.fields(params_cls)}
    defaults = base if base is not None else params_cls()
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ParamError(where, f"unknown field {key!r}; known: {known}", (str(key),))
        default = getattr(defaults, key)
        if dataclasses.is_dataclass(default) and isinstance(value, Mapping):
            try:
                values[key] = params_from_mapping(type(default), value, f"{where}.{key}", default)
            except ParamError as exc:
                exc.path = (key, *exc.path)
                raise
        elif default is None or (isinstance(default, bool) and isinstance(value, bool)):
            values[key] = value
        elif (
            isinstance(default, float)
            and isinstance(value, int | float)
            and not isinstance(value, bool)
        ):
            values[key] = float(value)
        elif (
            isinstance(default, int) and isinstance(value, int) and not isinstance(value, bool)
        ) or (isinstance(default, str) and isinstance(value, str)):
            values[key] = value
        else:
            problem = f"field {key!r} must be {type(default).__name__}, got {value!r}"
            raise ParamError(where, problem, (key,))
    return dataclasses.replace(defaults, **values)


def canonical_policy_name(name: str) -> str:
    """The registered name ``name`` stands for: a deprecated alias's target, else ``name``."""
    return ALIASES.get(name, name)


def alias_note(name: str) -> str | None:
    """One line for the user when ``name`` is a deprecated alias; None for any other name."""
    target = ALIASES.get(name)
    if target is None:
        return None
    return f"policy name {name!r} is deprecated, use {target!r} (same policy)"


def create_policy(name: str, raw_params: Mapping[str, Any] | None = None) -> Policy:
    """Instantiate a registered policy with its defaults overridden by ``raw_params``.

    ``name`` may be a deprecated alias (:data:`ALIASES`); the policy built is
    the one it stands for, under its registered name.
    """
    _load_builtin_policies()
    name = canonical_policy_name(name)
    cls = POLICIES.get(name)
    if cls is None:
        raise UnknownNameError("policy", name, list(POLICIES))
    params = params_from_mapping(cls.Params, raw_params or {}, f"policy {name}")
    return cls(params)


def policy_names() -> list[str]:
    """Names of every registered policy, ours first, then alphabetical (no aliases)."""
    _load_builtin_policies()
    return sorted(POLICIES, key=lambda n: (n != DEFAULT_POLICY, n))


def _load_builtin_policies() -> None:
    # Importing the package runs each module's @register line.
    import prefixrouter.core.policies  # noqa: F401


@dataclass(frozen=True, slots=True)
class NoParams:
    """Params of a policy without parameters."""
