"""The rollout plan: groups by class, a deterministic share by key, and pools."""

from __future__ import annotations

import pytest

from prefixrouter.core.rollout import BASELINE_GROUP, PREFIX_GROUP, RolloutPlan


def test_classes_in_the_plan_are_routed_by_prefix_the_rest_by_the_baseline() -> None:
    plan = RolloutPlan(frozenset({"document"}))
    assert plan.group("document", "k") == PREFIX_GROUP
    assert plan.group("session", "k") == BASELINE_GROUP
    assert plan.group("unknown") == BASELINE_GROUP
    assert not plan.needs_key


def test_a_share_is_deterministic_per_key_and_close_to_its_size() -> None:
    plan = RolloutPlan(share=0.25, seed=7)
    assert plan.needs_key
    keys = [f"{i:016x}" for i in range(4000)]
    groups = [plan.group("unknown", k) for k in keys]
    assert groups == [plan.group("unknown", k) for k in keys]  # the same key, the same group
    share = groups.count(PREFIX_GROUP) / len(keys)
    assert 0.22 < share < 0.28, share
    # Another seed draws another share of the same size.
    other = RolloutPlan(share=0.25, seed=8)
    assert [other.group("unknown", k) for k in keys] != groups
    # The ends of the range need no key.
    assert RolloutPlan(share=1.0).group("rag") == PREFIX_GROUP
    assert RolloutPlan(share=0.0).group("rag", "x") == BASELINE_GROUP
    with pytest.raises(ValueError):
        RolloutPlan(share=1.5)


def test_each_group_may_be_confined_to_a_pool() -> None:
    plan = RolloutPlan(frozenset({"rag"}), prefix_pool="canary", baseline_pool=None)
    assert plan.pool(PREFIX_GROUP) == "canary"
    assert plan.pool(BASELINE_GROUP) is None
