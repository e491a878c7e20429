"""Drift alarm: predicted cached tokens the engines stopped delivering, per prefix class.

The router predicts, per request, how many prompt tokens the chosen engine
will reuse; the engine reports how many it did. They part when the engine
sees other tokens than the router hashes: a hidden timestamp (a chat template
that writes today's date ahead of the prompt), a template change the
router's ``template_version`` does not know, a tokenizer mismatch. Then every
prediction of a class says warm and the engine answers cold, while the index,
which corrects each miss, keeps the damage per request small enough to
overlook.

**Samples.** Only requests the router predicted reuse for count: predicted
``P >= min_tokens``. The driver gives as ``P`` what the index's hash chain
claims the chosen worker holds, before the worker's trust is applied: the
index distrusts a worker after a couple of unexplained misses and then
predicts it cold, which agrees with the engine while the cause remains.
A sample is *divergent* when the engine delivered clearly less,
``P - A > max(min_tokens, rel_tolerance * P)``; else it *agrees*. (An
engine reusing more than predicted, warmed by traffic this router did not
see, is no drift.)

**Rule, with hysteresis**, per class:

* *fire* when the last ``window`` samples (at least ``min_samples`` of them)
  are at least ``fire_share`` divergent;
* once firing, *clear* after ``clear_after`` agreeing samples in a row (a
  divergent one restarts the count); the window then starts afresh, so the
  old divergent samples cannot fire it again at once.

One eviction miss now and then (the index corrects itself) never fills half
a window; a template that hides a timestamp fires within ``min_samples``
requests of the class that the router predicts warm.

:class:`DriftDetector` holds the state; :meth:`DriftDetector.observe`
returns a :class:`DriftChange` on the sample that fires or clears a class,
with that sample (the engine's reuse ended at token ``actual``: the first
divergent position, to a block). Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DriftParams:
    """Thresholds of the drift rule (module docstring).

    Attributes:
        min_tokens: Predictions below this are not samples; a shortfall must
            also exceed it to be divergent.
        rel_tolerance: A shortfall above this share of the prediction is divergent.
        window: Samples per class the firing rule looks at.
        min_samples: Samples needed before a class can fire.
        fire_share: Divergent share of the window that fires the alarm.
        clear_after: Agreeing samples in a row that clear it.
    """

    min_tokens: int = 64
    rel_tolerance: float = 0.5
    window: int = 10
    min_samples: int = 4
    fire_share: float = 0.5
    clear_after: int = 4

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_samples < 1 or self.clear_after < 1:
            raise ValueError("window, min_samples and clear_after must be at least 1")
        if self.min_samples > self.window:
            raise ValueError(f"min_samples ({self.min_samples}) exceeds window ({self.window})")
        if not 0.0 < self.fire_share <= 1.0 or not 0.0 <= self.rel_tolerance < 1.0:
            raise ValueError("fire_share must be in (0, 1] and rel_tolerance in [0, 1)")


@dataclass(frozen=True, slots=True)
class DriftChange:
    """A class's alarm fired or cleared, on the sample given.

    Attributes:
        prefix_class: The class.
        firing: True: fired; False: cleared.
        divergent: Divergent samples in the window when it changed.
        samples: Samples in the window.
        predicted: That sample's predicted cached tokens.
        actual: Its engine-reported cached tokens (where the engine's reuse ended).
    """

    prefix_class: str
    firing: bool
    divergent: int
    samples: int
    predicted: int
    actual: int


@dataclass(slots=True)
class _ClassState:
    window: deque[bool]
    firing: bool = False
    agreeing_run: int = 0


class DriftDetector:
    """Per prefix class: a window of samples and the alarm's state (module docstring)."""

    def __init__(self, params: DriftParams | None = None) -> None:
        self.params = params or DriftParams()
        self._classes: dict[str, _ClassState] = {}

    def divergent(self, predicted: int, actual: int) -> bool | None:
        """Whether one request's figures diverge; None when it is no sample."""
        p = self.params
        if predicted < p.min_tokens:
            return None
        return predicted - actual > max(p.min_tokens, p.rel_tolerance * predicted)

    def observe(self, prefix_class: str, predicted: int, actual: int) -> DriftChange | None:
        """One completed request: its predicted and engine-reported cached tokens.

        Returns:
            The change when this sample fires or clears the class, else None.
        """
        verdict = self.divergent(predicted, actual)
        if verdict is None:
            return None
        p = self.params
        st = self._classes.get(prefix_class)
        if st is None:
            st = self._classes[prefix_class] = _ClassState(deque(maxlen=p.window))
        st.window.append(verdict)
        st.agreeing_run = 0 if verdict else st.agreeing_run + 1
        n = len(st.window)
        bad = sum(st.window)
        if not st.firing:
            if n >= p.min_samples and bad >= p.fire_share * n:
                st.firing = True
                return DriftChange(prefix_class, True, bad, n, predicted, actual)
            return None
        if st.agreeing_run >= p.clear_after:
            st.firing = False
            st.agreeing_run = 0
            st.window.clear()
            return DriftChange(prefix_class, False, bad, n, predicted, actual)
        return None

    def firing(self, prefix_class: str) -> bool:
        """Whether ``prefix_class``'s alarm is firing."""
        st = self._classes.get(prefix_class)
        return st is not None and st.firing

    def states(self) -> dict[str, bool]:
        """Every class seen so far -> firing."""
        return {cls: st.firing for cls, st in sorted(self._classes.items())}
