"""Engine KV-cache events, in the router's own hash space.

vLLM and SGLang publish ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
(see ../shared/REAL_ENGINES.md). Their block ids are the engine's own hashes;
the engine adapter recomputes the router's chain from the events' token ids and
translates, so by the time an event reaches :meth:`PrefixIndex.apply` its hashes
are :data:`BlockHash` values of this package. The simulator's engine uses the
router's hashes directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixrouter.core.types import BlockHash, WorkerId


@dataclass(frozen=True, slots=True)
class BlockStored:
    """The worker now holds these blocks (a prefix chain, in order)."""

    worker_id: WorkerId
    block_hashes: Sequence[BlockHash]
    parent_hash: BlockHash | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The worker evicted these blocks."""

    worker_id: WorkerId
    block_hashes: Sequence[BlockHash]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The worker dropped its whole cache (reset or restart)."""

    worker_id: WorkerId


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
