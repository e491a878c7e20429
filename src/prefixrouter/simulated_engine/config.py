"""Configuration of one simulated engine server, validated on construction.

The engine server serves one model name from one :class:`EngineModel`. Its KV
size and speed come from a named profile (``prefixrouter profiles``); the
block size and the number of KV blocks can be overridden, as vLLM's
``--block-size`` and ``--num-gpu-blocks-override`` do.

Changing only the block size keeps the KV *memory* of the profile, as vLLM
would: ``kv_blocks = profile.kv_blocks * profile.block_size // block_size``.
``max_model_len`` defaults to :data:`DEFAULT_MAX_MODEL_LEN` (131,072 tokens,
Llama 3.1's context) or the whole KV cache (``kv_blocks x block_size``) when
that is smaller, and may not exceed the KV cache (vLLM refuses to start when
one request of ``max_model_len`` tokens cannot fit either).

The default profile is :data:`DEFAULT_PROFILE`, ``llama3-8b-h100``: what a
newcomer's ``prefixrouter engine`` serves without options is a long-context
model whose KV cache holds about 436,000 tokens, so the seed's 30,000-token
documents fit a dozen times over. The tests and the live checks that want
eviction, queueing and chunking within seconds ask for ``tiny-cpu`` (4,096
tokens of KV) by name. A request too long for the engine gets vLLM's 400 with
one more sentence that names the options that admit it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from prefixrouter.errors import ConfigError
from prefixrouter.real_engines.kv_events import ZMQ_SCHEMES
from prefixrouter.sim.profiles import EngineProfile, get_profile

DEFAULT_PROFILE = "llama3-8b-h100"
"""The profile ``prefixrouter engine`` serves when none is named."""
DEFAULT_MAX_MODEL_LEN = 131_072
"""The longest request when ``max_model_len`` is not given (capped by the KV cache)."""


def default_max_model_len(kv_blocks: int, block_size: int) -> int:
    """The ``max_model_len`` of an engine started without one: :data:`DEFAULT_MAX_MODEL_LEN`,
    or the whole KV cache (``kv_blocks x block_size`` tokens) when that is smaller, since
    one request must fit the cache."""
    return min(DEFAULT_MAX_MODEL_LEN, kv_blocks * block_size)


@dataclass(frozen=True, slots=True)
class EngineServerConfig:
    """What one ``prefixrouter engine`` process serves.

    Attributes:
        model: Served model name (``/v1/models``; requests naming another get 404).
        profile: Engine profile name (speed, KV size, scheduler limits).
        kv_blocks: KV cache size in blocks (default: the profile's, rescaled to
            ``block_size``).
        block_size: Tokens per KV block (default: the profile's).
        time_scale: Speed-up of simulated time: 10 runs ten times faster than
            the profile says (TTFTs are a tenth).
        max_model_len: Longest prompt + output accepted (default:
            :data:`DEFAULT_MAX_MODEL_LEN` or the KV cache, the smaller).
        default_max_tokens: Output length when a request gives no ``max_tokens``.
        answer_tokens: Where every answer ends on its own, as at a model's end
            of sequence: a request decodes ``min(max_tokens, answer_tokens)``
            tokens (``finish_reason`` ``stop`` when fewer than ``max_tokens``).
            None: every request decodes its whole ``max_tokens``.
        engine_id: Value of the ``engine`` label on every metric.
        tokenizer: Tokenizer file or folder (default: the project's own).
        kv_events_endpoint: Publish KV events like vLLM to this ZMQ address
            (None: no events); see :mod:`prefixrouter.simulated_engine.kv_publisher`.
        kv_events_topic: The events' topic (default ``kv@<engine_id>``).
        kv_replay_endpoint: Bind a replay socket (vLLM's ``replay_endpoint``) here
            that answers missed KV-event batches (None: no replay).
        served_log: Append one line per served-request event to this file
            (:mod:`prefixrouter.simulated_engine.faults`; None: no log).
        fault_injection: Serve ``/admin/faults`` (switch faults on mid-run).
    """

    model: str = "tiny"
    profile: str = DEFAULT_PROFILE
    kv_blocks: int | None = None
    block_size: int | None = None
    time_scale: float = 1.0
    max_model_len: int | None = None
    default_max_tokens: int = 16
    answer_tokens: int | None = None
    engine_id: str = "0"
    tokenizer: str | None = None
    kv_events_endpoint: str | None = None
    kv_events_topic: str | None = None
    kv_replay_endpoint: str | None = None
    served_log: str | None = None
    fault_injection: bool = False

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model: must be a non-empty name")
        if not self.time_scale > 0:
            raise ConfigError(f"time_scale: must be positive, got {self.time_scale}")
        for name in ("kv_blocks", "block_size", "max_model_len", "answer_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}: must be at least 1, got {value}")
        ep = self.kv_events_endpoint
        if ep is not None and not ep.startswith(ZMQ_SCHEMES):
            raise ConfigError(f"kv_events_endpoint: must be a ZMQ address, got {ep!r}")
        rep = self.kv_replay_endpoint
        if rep is not None and (ep is None or not rep.startswith(ZMQ_SCHEMES)):
            raise ConfigError(
                f"kv_replay_endpoint: must be a ZMQ address, with kv_events_endpoint, got {rep!r}"
            )
        if self.default_max_tokens < 1:
            raise ConfigError(
                f"default_max_tokens: must be at least 1, got {self.default_max_tokens}"
            )
        try:
            prof = self.engine_profile()
        except (KeyError, ValueError) as exc:
            msg = exc.args[0] if isinstance(exc, KeyError) else str(exc)
            raise ConfigError(f"profile: {msg}") from None
        capacity = prof.kv_blocks * prof.block_size
        if self.max_model_len is not None and self.max_model_len > capacity:
            raise ConfigError(
                f"max_model_len: {self.max_model_len} tokens exceed the KV cache "
                f"({prof.kv_blocks} blocks of {prof.block_size} = {capacity} tokens)"
            )

    def engine_profile(self) -> EngineProfile:
        """The profile with the block size and KV size overrides applied."""
        base = get_profile(self.profile)
        block = self.block_size or base.block_size
        if self.kv_blocks is not None:
            blocks = self.kv_blocks
        else:
            blocks = base.kv_blocks * base.block_size // block
        if blocks == base.kv_blocks and block == base.block_size:
            return base
        return dataclasses.replace(base, kv_blocks=blocks, block_size=block)

    @property
    def effective_max_model_len(self) -> int:
        """``max_model_len``, or :data:`DEFAULT_MAX_MODEL_LEN` capped by the KV cache."""
        if self.max_model_len is not None:
            return self.max_model_len
        prof = self.engine_profile()
        return default_max_model_len(prof.kv_blocks, prof.block_size)

    def length_hint(self) -> str:
        """The sentence a too-long request's 400 ends with: the options that admit it."""
        prof = self.engine_profile()
        kv = prof.kv_blocks * prof.block_size
        accepts = self.effective_max_model_len
        head = f"This simulated engine (profile {prof.name}) accepts {accepts:,} tokens:"
        if accepts < kv:
            return f"{head} start it with --max-model-len up to {kv:,} (its KV cache)."
        if prof.name != DEFAULT_PROFILE:
            return (
                f"{head} start it with more --kv-blocks, or without --profile "
                f"({DEFAULT_PROFILE}: {DEFAULT_MAX_MODEL_LEN:,} tokens)."
            )
        return f"{head} start it with more --kv-blocks and --max-model-len."
