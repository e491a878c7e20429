"""Properties every peer baseline has: registered, pure ``select``, forgets removed workers."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import replace

import pytest

from prefixrouter.core import Router, WorkerId, WorkerView, create_policy, policy_names
from prefixrouter.core.policy import POLICIES
from tests.core.conftest import request, tokens, workers

BASELINES = [
    "power_of_two",
    "sglang_cache_aware",
    "vllm_prefixaware",
    "kubeai_chwbl",
    "llmd_weighted",
    "dynamo_cost",
    "preble_e2",
    "ray_prefix_affinity",
    "aibrix_prefix",
]
DOOMED = WorkerId("doomed-worker")


def fleet() -> list[WorkerView]:
    return [WorkerView(DOOMED), *workers(3)[1:]]


def history(r: Router, ws: list[WorkerView], forced: WorkerId | None = None) -> None:
    """A few requests sharing a document, routed (optionally all to ``forced``)."""
    doc = tokens(1, 1_000)
    for i in range(4):
        d = r.route(request(f"h{i}", doc + tokens(10 + i, 200)), ws, float(i))
        r.on_routed(replace(d, worker_id=forced) if forced else d, float(i))


@pytest.mark.parametrize("name", BASELINES)
def test_registered_with_frozen_slots_params(name: str) -> None:
    assert name in policy_names() and POLICIES[name].name == name
    policy = create_policy(name, {})
    assert policy.name == name
    params = policy.params
    assert dataclasses.is_dataclass(params) and hasattr(type(params), "__slots__")
    field = dataclasses.fields(params)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(params, field, getattr(params, field))


@pytest.mark.parametrize("name", BASELINES)
def test_select_is_pure_until_on_routed(name: str) -> None:
    r = Router(name)
    ws = workers(3)
    history(r, ws)
    q = request("q", tokens(1, 1_000) + tokens(99, 300))
    before = pickle.dumps(r.policy)
    first = r.route(q, ws, 10.0)
    second = r.route(q, ws, 10.0)
    assert first.to_dict() == second.to_dict()
    assert pickle.dumps(r.policy) == before
    assert first.reason and first.tier
    assert [c.worker_id for c in first.candidates] == ["w0", "w1", "w2"]
    chosen = first.chosen
    assert chosen is not None and chosen.matched_tokens == first.predicted_cached_tokens


@pytest.mark.parametrize("name", BASELINES)
def test_on_worker_removed_forgets_the_worker(name: str) -> None:
    used = Router(name)
    history(used, fleet(), forced=DOOMED)
    used.remove_worker(DOOMED)
    assert b"doomed-worker" not in pickle.dumps(used.policy)
    survivors = workers(3)[1:]
    q = request("q", tokens(1, 1_000) + tokens(99, 300))
    fresh = Router(name)
    assert used.route(q, survivors, 10.0).to_dict() == fresh.route(q, survivors, 10.0).to_dict()
