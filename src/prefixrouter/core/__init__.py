"""The pure routing core: hashing, prefix index, cost model, policies and the router.

Nothing in this package does I/O, reads a clock or uses asyncio: the gateway
and the simulator pass time in and drive the same :class:`Router` through one
:class:`Dispatcher`.
"""

from prefixrouter.core.cost import CostModel, CostParams, CostTerms
from prefixrouter.core.dispatch import Admission, Dispatcher, RoutingMode, prefix_room_blocks
from prefixrouter.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from prefixrouter.core.hashing import (
    BlockHasher,
    PromptBlocks,
    TokenEstimator,
    hash_text_blocks,
    hash_token_blocks,
)
from prefixrouter.core.index import IndexEntry, IndexParams, Placement, PrefixIndex, WorkerMatch
from prefixrouter.core.load import InflightLedger, WorkerLoad
from prefixrouter.core.policy import (
    CandidateScore,
    Outcome,
    Policy,
    RoutingContext,
    Selection,
    create_policy,
    policy_names,
    register,
)
from prefixrouter.core.router import Decision, Router, filter_workers
from prefixrouter.core.types import (
    BlockHash,
    CacheNamespace,
    EntrySource,
    PrefixClass,
    RequestId,
    RoutingRequest,
    SpeedProfile,
    WorkerId,
    WorkerView,
)

__all__ = [
    "Admission",
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "CacheNamespace",
    "CandidateScore",
    "CostModel",
    "CostParams",
    "CostTerms",
    "Decision",
    "Dispatcher",
    "EntrySource",
    "IndexEntry",
    "IndexParams",
    "InflightLedger",
    "KvEvent",
    "Outcome",
    "Placement",
    "Policy",
    "PrefixClass",
    "PrefixIndex",
    "PromptBlocks",
    "RequestId",
    "Router",
    "RoutingContext",
    "RoutingMode",
    "RoutingRequest",
    "Selection",
    "SpeedProfile",
    "TokenEstimator",
    "WorkerId",
    "WorkerLoad",
    "WorkerMatch",
    "WorkerView",
    "create_policy",
    "filter_workers",
    "hash_text_blocks",
    "hash_token_blocks",
    "policy_names",
    "prefix_room_blocks",
    "register",
]
