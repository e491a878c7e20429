"""Named engine profiles: how fast a simulated engine runs and how much KV it holds.

Every figure is derived from a model's shape and the hardware's data sheet with
the helper functions below, so the numbers in this docstring and the values the
simulator uses come from one place. The router's cost model uses the same
:class:`~prefixrouter.core.types.SpeedProfile` form, so a router that knows a
worker's profile predicts the simulated engine exactly (up to queueing).

Derivation (``P`` parameters, ``L`` layers, ``d`` hidden size, ``h_kv`` KV heads,
``d_h`` head dim, ``D`` devices in the tensor-parallel group):

* **FLOPs per token** (weights): ``2 P`` (one multiply-add per parameter).
* **Attention FLOPs per (new token, attended token) pair**: ``4 L d`` — per layer
  ``2 d`` for ``q·k`` over all heads and ``2 d`` for ``p·v`` (Llama 3 has
  ``n_heads x d_h = d``). A prefill of ``n`` tokens after ``c`` cached ones
  attends ``c + n/2`` tokens per new token on average (causal mask).
* **Prefill** is compute bound: ``prefill_s_per_token = 2P / (D x peak x MFU)``
  and ``prefill_s_per_token_context = 4Ld / (D x peak x MFU)``; peak is the dense
  bf16 rate of an H100 SXM, **989.4 TFLOP/s**.
* **Decode** is bandwidth bound: each step reads the weights once
  (``2P`` bytes in bf16) and every sequence's KV
  (``kv_bytes_per_token = 2 (K and V) x L x h_kv x d_h x 2 bytes``) from HBM at
  **3.35 TB/s** per H100 times an efficiency. Hence
  ``decode_step_s = 2P / (D x BW x eff) + step overhead`` and
  ``decode_s_per_context_token = kv_bytes_per_token / (D x BW x eff)``. Each
  sequence also costs its ``2P`` FLOPs: ``decode_s_per_seq = 2P / (D x peak x
  decode MFU)``. Adding the compute and the memory terms (rather than taking the
  larger) is conservative at large batch, where the two overlap.
* **KV capacity**: ``(D x HBM x gpu_memory_utilization - 2P - D x reserved) /
  kv_bytes_per_token`` tokens, in blocks of ``block_size`` (16) tokens.
  ``reserved`` covers activations of a full chunk, CUDA graphs and NCCL buffers.

Profiles (numbers rounded; the exact values come from the code):

``llama3-8b-h100`` — Llama-3-8B (P = 8.03e9, L = 32, d = 4096, h_kv = 8,
d_h = 128) on one H100 SXM 80 GiB, prefill MFU 0.5, decode bandwidth efficiency
0.7, decode MFU 0.5, 2 ms step overhead, 4 GB reserved:

* 2P = 16.06 GFLOP/token -> 16.06e9 / (989.4e12 x 0.5) = **32.5 us/token**;
  4Ld = 524,288 FLOP/pair -> **1.06 ns/pair**. Prefill of 10,000 tokens:
  2 ms + 0.325 s + 1e4 x 5e3 x 1.06 ns = **~0.38 s**.
* weights 16.06 GB / (3.35e12 x 0.7) = 6.85 ms, + 2 ms = **8.85 ms/step**;
  KV 2 x 32 x 8 x 128 x 2 = **131,072 B/token** (128 KiB) -> **55.9 ns/context
  token**; per sequence **32.5 us**. A step of batch 32 at 2k context each
  (65,536 tokens): 8.85 + 1.04 + 3.66 = **~13.6 ms**.
* KV: 80 GiB x 0.9 = 77.3 GB - 16.06 GB weights - 4 GB = 57.2 GB / 131,072 B =
  ~436,800 tokens = **27,298 blocks**.
* Scheduler: max_num_seqs 256, max_num_batched_tokens 8192 (vLLM v1's default
  for the API server on large GPUs).

``llama3-70b-8xh100`` — Llama-3-70B (P = 70.55e9, L = 80, d = 8192, h_kv = 8,
d_h = 128), tensor parallel over 8 H100 SXM; MFU 0.4 and bandwidth efficiency
0.6 (all-reduces cost), decode MFU 0.4, 4 ms step overhead (160 all-reduces a
step), 5 GB reserved per GPU:

* 141.1 GFLOP/token / (8 x 989.4e12 x 0.4) = **44.6 us/token**; 4Ld = 2,621,440
  FLOP/pair -> **0.83 ns/pair**; 10,000 tokens: **~0.49 s**.
* weights 141.1 GB / (8 x 3.35e12 x 0.6) = 8.77 ms, + 4 ms = **12.8 ms/step**;
  KV 2 x 80 x 8 x 128 x 2 = **327,680 B/token** -> **20.4 ns/context token**;
  batch 32 at 2k: 12.8 + 1.43 + 1.34 = **~15.5 ms**.
* KV: 8 x 77.3 GB - 141.1 GB - 40 GB = 437.4 GB / 327,680 B = ~1.33 M tokens
  = **83,422 blocks**. Scheduler as above.

``tiny-cpu`` — a toy 25 M-parameter model (L = 4, d = 512, h_kv = 4, d_h = 64)
on a CPU (1 TFLOP/s, 50 GB/s, MFU 0.5, bandwidth efficiency 0.5, 1 ms overhead)
with an explicit KV space of 16 MiB, as vLLM's CPU backend takes it
(``VLLM_CPU_KVCACHE_SPACE``): 50 MFLOP/token -> **100 us/token**; 4Ld = 8,192
FLOP/pair -> 16.4 ns/pair (a 1,000-token prompt in ~0.11 s); decode: weights
50 MB / (50e9 x 0.5) = 2 ms, + 1 ms = **3 ms/step**; KV 2 x 4 x 4 x 64 x 2 =
4,096 B/token -> 4,096 tokens = **256 blocks**; max_num_seqs 8, 256 batched
tokens. Small enough that tests and live demos see eviction, chunking and
queueing within seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixrouter.core.types import SpeedProfile

H100_SXM_BF16_FLOPS = 989.4e12
"""Dense bf16 tensor-core peak of one H100 SXM, FLOP/s."""
H100_SXM_HBM_BYTES_PER_S = 3.35e12
"""HBM3 bandwidth of one H100 SXM, bytes/s."""
H100_HBM_BYTES = 80 * 2**30
"""HBM capacity of one H100 80 GB (80 GiB), bytes."""

BYTES_PER_PARAM = 2.0  # bf16 weights
BYTES_PER_KV_ELEMENT = 2  # bf16 KV cache


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a decoder-only transformer, as far as cost goes.

    Attributes:
        name: Model name.
        params: Parameter count.
        layers: Transformer layers.
        hidden: Hidden size ``d`` (= query heads x head dim).
        kv_heads: Key/value heads (GQA).
        head_dim: Dimension of one head.
    """

    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class Deployment:
    """A model on hardware, with the efficiencies this module assumes.

    Attributes:
        model: The model.
        devices: Accelerators in the tensor-parallel group.
        peak_flops: Dense bf16 FLOP/s of one device.
        bandwidth: Memory bandwidth of one device, bytes/s.
        memory_bytes: Memory of one device, bytes.
        prefill_mfu: Fraction of peak FLOP/s reached by prefill.
        decode_bw_eff: Fraction of peak bandwidth reached by decode.
        decode_mfu: Fraction of peak FLOP/s reached by a decode step's matmuls.
        step_overhead_s: Fixed cost of one engine step (scheduling, launches, sampling).
        memory_utilization: Share of device memory the engine may use (vLLM 0.9).
        reserved_bytes: Per device: activations, CUDA graphs, communication buffers.
        kv_bytes_limit: If set, the KV space directly (vLLM CPU backend style).
    """

    model: ModelSpec
    devices: int
    peak_flops: float
    bandwidth: float
    memory_bytes: float
    prefill_mfu: float
    decode_bw_eff: float
    decode_mfu: float
    step_overhead_s: float
    memory_utilization: float = 0.9
    reserved_bytes: float = 4e9
    kv_bytes_limit: float | None = None


def flops_per_token(model: ModelSpec) -> float:
    """Weight FLOPs to process one token: one multiply-add per parameter."""
    return 2.0 * model.params


def attention_flops_per_pair(model: ModelSpec) -> float:
    """FLOPs for one (query token, attended token) pair: ``q·k`` and ``p·v``, all layers."""
    return 4.0 * model.layers * model.hidden


def kv_bytes_per_token(model: ModelSpec) -> int:
    """Bytes of KV cache one token occupies: K and V, every layer and KV head."""
    return 2 * model.layers * model.kv_heads * model.head_dim * BYTES_PER_KV_ELEMENT


def weight_bytes(model: ModelSpec) -> float:
    """Bytes of the model's weights."""
    return BYTES_PER_PARAM * model.params


def derive_speed(dep: Deployment, chunk_tokens: int) -> SpeedProfile:
    """The :class:`SpeedProfile` that follows from a deployment (see module docstring).

    Args:
        dep: Model, hardware and efficiencies.
        chunk_tokens: The engine's chunked-prefill token budget per step.

    Returns:
        The timing profile.
    """
    m = dep.model
    prefill_flops = dep.devices * dep.peak_flops * dep.prefill_mfu
    decode_flops = dep.devices * dep.peak_flops * dep.decode_mfu
    decode_bw = dep.devices * dep.bandwidth * dep.decode_bw_eff
    return SpeedProfile(
        prefill_overhead_s=dep.step_overhead_s,
        prefill_s_per_token=flops_per_token(m) / prefill_flops,
        prefill_s_per_token_context=attention_flops_per_pair(m) / prefill_flops,
        decode_step_s=weight_bytes(m) / decode_bw + dep.step_overhead_s,
        decode_s_per_seq=flops_per_token(m) / decode_flops,
        decode_s_per_context_token=kv_bytes_per_token(m) / decode_bw,
        chunk_tokens=chunk_tokens,
    )


def kv_capacity_blocks(dep: Deployment, block_size: int) -> int:
    """KV blocks left after weights and reserved memory (see module docstring)."""
    if dep.kv_bytes_limit is not None:
        free = dep.kv_bytes_limit
    else:
        usable = dep.devices * dep.memory_bytes * dep.memory_utilization
        free = usable - weight_bytes(dep.model) - dep.devices * dep.reserved_bytes
    tokens = free / kv_bytes_per_token(dep.model)
    if tokens < block_size:
        raise ValueError(f"{dep.model.name}: no memory left for KV cache")
    return math.floor(tokens / block_size)


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """Everything the engine model needs to know about one kind of worker.

    Attributes:
        name: Registry key.
        description: One line for reports.
        speed: Timing profile (shared with the router's cost model).
        kv_blocks: KV cache capacity in blocks.
        block_size: Tokens per KV block.
        max_num_seqs: Most sequences running at once.
        max_batched_tokens: Token budget of one step (decodes + prefill chunks).
        deployment: Where the figures came from, if derived.
    """

    name: str
    description: str
    speed: SpeedProfile
    kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    deployment: Deployment | None = None

    def __post_init__(self) -> None:
        if self.kv_blocks <= 0 or self.block_size <= 0:
            raise ValueError(f"profile {self.name}: kv_blocks and block_size must be positive")
        if self.max_num_seqs <= 0 or self.max_batched_tokens < self.max_num_seqs:
            # vLLM enforces the same: a full decode batch must fit in one step's budget.
            raise ValueError(f"profile {self.name}: need 0 < max_num_seqs <= max_batched_tokens")


def make_profile(
    name: str,
    description: str,
    dep: Deployment,
    *,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_batched_tokens: int = 8192,
) -> EngineProfile:
    """Build an :class:`EngineProfile` whose speed and KV size follow from ``dep``."""
    return EngineProfile(
        name=name,
        description=description,
        speed=derive_speed(dep, max_batched_tokens),
        kv_blocks=kv_capacity_blocks(dep, block_size),
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens,
        deployment=dep,
    )


LLAMA3_8B = ModelSpec("Llama-3-8B", 8.03e9, layers=32, hidden=4096, kv_heads=8, head_dim=128)
LLAMA3_70B = ModelSpec("Llama-3-70B", 70.55e9, layers=80, hidden=8192, kv_heads=8, head_dim=128)
TOY_25M = ModelSpec("toy-25M", 25e6, layers=4, hidden=512, kv_heads=4, head_dim=64)

PROFILES: dict[str, EngineProfile] = {
    p.name: p
    for p in (
        make_profile(
            "llama3-8b-h100",
            "Llama-3-8B bf16 on one H100 SXM 80GB",
            Deployment(
                LLAMA3_8B,
                devices=1,
                peak_flops=H100_SXM_BF16_FLOPS,
                bandwidth=H100_SXM_HBM_BYTES_PER_S,
                memory_bytes=H100_HBM_BYTES,
                prefill_mfu=0.5,
                decode_bw_eff=0.7,
                decode_mfu=0.5,
                step_overhead_s=0.002,
                reserved_bytes=4e9,
            ),
        ),
        make_profile(
            "llama3-70b-8xh100",
            "Llama-3-70B bf16, tensor parallel over 8 H100 SXM 80GB",
            Deployment(
                LLAMA3_70B,
                devices=8,
                peak_flops=H100_SXM_BF16_FLOPS,
                bandwidth=H100_SXM_HBM_BYTES_PER_S,
                memory_bytes=H100_HBM_BYTES,
                prefill_mfu=0.4,
                decode_bw_eff=0.6,
                decode_mfu=0.4,
                step_overhead_s=0.004,
                reserved_bytes=5e9,
            ),
        ),
        make_profile(
            "tiny-cpu",
            "toy 25M-parameter model on a CPU with 16 MiB of KV (tests, live demos)",
            Deployment(
                TOY_25M,
                devices=1,
                peak_flops=1e12,
                bandwidth=50e9,
                memory_bytes=8 * 2**30,
                prefill_mfu=0.5,
                decode_bw_eff=0.5,
                decode_mfu=0.5,
                step_overhead_s=0.001,
                kv_bytes_limit=16 * 2**20,
            ),
            max_num_seqs=8,
            max_batched_tokens=256,
        ),
    )
}
"""The built-in profiles by name."""


def get_profile(name: str) -> EngineProfile:
    """The built-in profile called ``name``.

    Raises:
        KeyError: If there is none; the message lists the known names.
    """
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise KeyError(f"unknown engine profile {name!r}; known: {known}") from None
