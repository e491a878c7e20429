"""Routing policies, one module each; importing this package registers them all.

Ours: ``prefixrouter`` (:mod:`.prefix_aware`). Cache-blind baselines:
``round_robin``, ``least_loaded``. The peers' policies (PEERS.md) live beside them.
"""

from prefixrouter.core.policies import least_loaded, prefix_aware, round_robin

__all__ = ["least_loaded", "prefix_aware", "round_robin"]
