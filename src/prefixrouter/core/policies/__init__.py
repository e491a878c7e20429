"""Routing policies, one module each; importing this package registers them all.

Ours: ``prefix_aware`` (:mod:`.prefix_aware`, a package with a module per
step). Cache-blind baselines: ``round_robin``, ``least_loaded``. The peers'
policies (PEERS.md) live beside them.
"""

from prefixrouter.core.policies import (
    aibrix_prefix,
    dynamo_cost,
    kubeai_chwbl,
    least_loaded,
    llmd_weighted,
    power_of_two,
    preble_e2,
    prefix_aware,
    ray_prefix_affinity,
    round_robin,
    sglang_cache_aware,
    vllm_prefixaware,
)

__all__ = [
    "aibrix_prefix",
    "dynamo_cost",
    "kubeai_chwbl",
    "least_loaded",
    "llmd_weighted",
    "power_of_two",
    "preble_e2",
    "prefix_aware",
    "ray_prefix_affinity",
    "round_robin",
    "sglang_cache_aware",
    "vllm_prefixaware",
]
