"""How many tokens a request will decode, learned from the engines' answers.

A client's ``max_tokens`` is a cap, not a forecast: chat clients send 1,024,
2,048 or 4,096 whatever the answer, and the engine stops at the end of the
answer long before. Every figure the router derives from the output length
reads it: the output class (short answers follow the cache, long generations
spread by decode load), the decode term of the score, the KV a request will
hold, the hot-prefix rule's demand (rate times engine time per request). Taken
at a cap of 2,048 for answers of 100-500 tokens, the simulator's multi-turn
mean TTFT was 68-80 % higher and hot-prefix's 156-166 % (``prefixrouter
simulate --client-max-tokens``, ``benchmarks/decision_quality_notes.md``):
every request looked like a long generation, and every prefix hot.

:class:`OutputEstimate` learns the **fill**: the share of ``max_tokens`` that
answers decode, ``min(1, completion_tokens / max_tokens)``, per prefix (the
request's prefix key: a form, a document's questions, an assistant's system
prompt answer alike) and over all answers. A request is expected to decode::

    expected = max(1, round(max_tokens * fill))

with the prefix's fill once one of its answers came back, else the global
one. Before the first answer no fill is known, and the first seconds of
traffic are where a cap taken at its word does most harm (a whole first
wave routed as long generations: templates' p99 +72 % at a cap of 2,048, on
cold prefills made at the start); the expected output is then ``max_tokens``
but at most ``first_guess_tokens`` (512, below ``long_output_tokens``). Where
clients send the answer's real length, as every benchmark of this project
does, the fill is 1 and nothing changes past the first answer. A fill is the
router's one running mean (:mod:`prefixrouter.core.running_mean`, as
characters per token are): the first answer sets it, the first ``window``
count equally, later ones move it by ``1/window``. Prefixes are kept in
insertion order up to ``max_prefixes``; the oldest goes first. A request
without a cap (``max_tokens`` 0) is expected to decode the mean that earlier
uncapped answers decoded, in tokens, per prefix and overall
(:class:`OutputEstimate`).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixrouter.core.running_mean import fold

DEFAULT_WINDOW = 32
"""Answers an exponential mean of fill roughly remembers."""
DEFAULT_MAX_PREFIXES = 65_536
"""Prefixes whose fill is kept (oldest dropped first)."""
DEFAULT_FIRST_GUESS_TOKENS = 512
"""The most a request is expected to decode before any answer came back: about
the 90th percentile of chat answers in the public traces (Azure LLM inference
2023, conversation: 424 tokens; Mooncake's conversation trace: 597)."""


@dataclass(slots=True)
class _Mean:
    """A running mean (:func:`~prefixrouter.core.running_mean.fold`) and its count."""

    value: float = 0.0  # replaced by the first sample
    seen: int = 0  # answers folded in, at most the window

    def add(self, sample: float, window: int) -> None:
        self.value, self.seen = fold(self.value, self.seen, sample, window)


class _Learned:
    """Running means per prefix key (insertion order, bounded) and over all answers."""

    __slots__ = ("by_prefix", "overall")

    def __init__(self) -> None:
        self.overall = _Mean()
        self.by_prefix: dict[str, _Mean] = {}

    def get(self, prefix_key: str) -> float | None:
        """The prefix's mean, else the overall one; None before any answer."""
        if self.overall.seen == 0:
            return None
        own = self.by_prefix.get(prefix_key)
        return own.value if own is not None else self.overall.value

    def add(self, sample: float, prefix_key: str, window: int, max_prefixes: int) -> None:
        self.overall.add(sample, window)
        by_prefix = self.by_prefix
        own = by_prefix.get(prefix_key)
        if own is None:
            if len(by_prefix) >= max_prefixes:
                del by_prefix[next(iter(by_prefix))]  # the oldest prefix
            own = by_prefix[prefix_key] = _Mean()
        own.add(sample, window)


class OutputEstimate:
    """Expected decode length per request, from the answers seen so far.

    ``max_tokens`` 0 is a request that set no cap (the engine's own limit, the
    context, applies): its expected output is the mean that earlier uncapped
    answers decoded, per prefix and overall, in tokens. A fill of some
    nominal cap would not do: the default 256 the gateway took for it before
    read every longer answer as a full 256 (a 2,000-token generation was
    never a long one), and one shared with capped clients' fills would
    scale a 2,048 cap's fill to a context-sized cap.
    """

    def __init__(
        self,
        window: int = DEFAULT_WINDOW,
        max_prefixes: int = DEFAULT_MAX_PREFIXES,
        first_guess_tokens: int = DEFAULT_FIRST_GUESS_TOKENS,
    ) -> None:
        if first_guess_tokens < 1:
            raise ValueError(f"first_guess_tokens must be at least 1, got {first_guess_tokens}")
        if window < 1:
            raise ValueError(f"window must be at least 1 answer, got {window}")
        if max_prefixes < 1:
            raise ValueError(f"max_prefixes must be at least 1, got {max_prefixes}")
        self.window = window
        self.first_guess_tokens = first_guess_tokens
        self.max_prefixes = max_prefixes
        self._fill = _Learned()  # capped requests: the share of the cap
        self._uncapped = _Learned()  # requests without a cap: tokens

    def expected(self, max_tokens: int, prefix_key: str) -> int:
        """Tokens a request with this cap (0: none) and prefix is expected to decode (>= 1)."""
        if max_tokens <= 0:
            tokens = self._uncapped.get(prefix_key)
            return self.first_guess_tokens if tokens is None else max(1, round(tokens))
        fill = self._fill.get(prefix_key)
        if fill is None:
            return min(max_tokens, self.first_guess_tokens)
        if fill >= 1.0:
            return max_tokens
        return max(1, round(max_tokens * fill))

    def observe(self, max_tokens: int, output_tokens: int, prefix_key: str) -> None:
        """An answer decoded ``output_tokens`` under a cap of ``max_tokens`` (0: none)."""
        if output_tokens <= 0:
            return  # no answer: nothing learned
        if max_tokens <= 0:
            self._uncapped.add(output_tokens, prefix_key, self.window, self.max_prefixes)
            return
        sample = min(1.0, output_tokens / max_tokens)
        self._fill.add(sample, prefix_key, self.window, self.max_prefixes)
