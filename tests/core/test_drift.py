"""The drift detector: samples, firing, hysteresis on clearing, per class."""

from __future__ import annotations

import pytest

from prefixrouter.core.drift import DriftChange, DriftDetector, DriftParams

WARM = 1000


def feed(det: DriftDetector, cls: str, pairs: list[tuple[int, int]]) -> list[DriftChange]:
    out = []
    for predicted, actual in pairs:
        change = det.observe(cls, predicted, actual)
        if change is not None:
            out.append(change)
    return out


def test_samples_are_predictions_of_reuse_and_shortfalls_past_the_tolerance() -> None:
    det = DriftDetector(DriftParams(min_tokens=64, rel_tolerance=0.5))
    assert det.divergent(10, 0) is None  # predicted cold: no sample
    assert det.divergent(WARM, 0) is True
    assert det.divergent(WARM, 600) is False  # within half of the prediction
    assert det.divergent(WARM, 400) is True
    assert det.divergent(100, 0) is True and det.divergent(100, 40) is False  # min_tokens
    assert det.divergent(WARM, 5000) is False  # more reuse than predicted is no drift


def test_it_fires_once_on_a_divergent_window_and_clears_after_a_run_of_agreement() -> None:
    det = DriftDetector(DriftParams(window=10, min_samples=4, fire_share=0.5, clear_after=4))
    # Three divergent samples: fewer than min_samples, no alarm yet.
    assert feed(det, "document", [(WARM, 0)] * 3) == []
    assert not det.firing("document")
    (fired,) = feed(det, "document", [(WARM, 0)] * 6)  # one change only, then it stays
    assert (fired.firing, fired.divergent, fired.samples, fired.actual) == (True, 4, 4, 0)
    assert det.firing("document") and det.states() == {"document": True}
    # Agreement must last clear_after in a row: a divergent sample restarts the count.
    assert feed(det, "document", [(WARM, WARM)] * 3 + [(WARM, 0)] + [(WARM, WARM)] * 3) == []
    assert det.firing("document")
    (cleared,) = feed(det, "document", [(WARM, WARM)])
    assert cleared.firing is False and not det.firing("document")
    # The window started afresh: the old divergent samples do not fire it again.
    assert feed(det, "document", [(WARM, WARM)] * 3 + [(WARM, 0)]) == []
    # Predictions of no reuse never count, either way.
    assert feed(det, "document", [(0, 0)] * 20) == [] and not det.firing("document")


def test_classes_are_watched_apart_and_occasional_misses_do_not_fire() -> None:
    det = DriftDetector()
    # One eviction miss in five: 2 of 10 divergent, under half.
    pattern = [(WARM, WARM)] * 4 + [(WARM, 0)]
    assert feed(det, "session", pattern * 6) == []
    changes = feed(det, "rag", [(WARM, 0)] * 4)
    assert [c.prefix_class for c in changes] == ["rag"]
    assert det.states() == {"rag": True, "session": False}


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        DriftParams(window=3, min_samples=4)
    with pytest.raises(ValueError):
        DriftParams(fire_share=0.0)
    with pytest.raises(ValueError):
        DriftParams(clear_after=0)
