"""Replay of public request traces (Mooncake format).

A Mooncake trace (kvcache-ai/Mooncake, FAST'25) is JSON Lines, one request per
line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}

* ``timestamp``: arrival in milliseconds. The replay counts time from the trace's
  first (smallest) timestamp, so a trace stamped with epoch times replays as
  the same trace stamped from 0 (:func:`load_mooncake`).
* ``input_length`` / ``output_length``: prompt and output tokens.
* ``hash_ids``: one id per 512-token block of the prompt; block ``i``'s id stands
  for the whole prefix ``[0, 512*(i+1))``, so equal ids at the same position mean
  identical prefixes up to there. ``len(hash_ids) == ceil(input_length / 512)``;
  the last block holds ``input_length - 512*(len(hash_ids)-1)`` tokens.

No text is released, so :func:`load_mooncake` makes up token ids: each hash id
expands into 512 pseudo-random ids that depend only on ``(seed, hash id,
position)`` (a counter-based SplitMix64 hash, vectorized with numpy), so
equal ids give equal tokens and different ids differ (a collision would need 16
equal tokens out of 32,000). Every distinct hash id becomes one ``array('I')``
object shared by all requests that carry it; a partial last block is a prefix
of that id's block, shared as well. The bundled conversation trace (12,031
requests, 182,790 distinct blocks) loads in 1-3 s on two cores into ~365 MB of
token arrays, instead of ~580 MB if every request held its own copy; ``limit``
shrinks both in proportion.

Interpretation choices (the trace doesn't say):

* Every request of the conversation trace starts with block 0: a shared system
  prompt. The first user message is taken to start at token 512
  (``first_user_offset``; 0 for single-block prompts), so KubeAI-style routing
  keys on the conversation's first block.
* ``group`` is the id of the second block (``conv-<id>``), a proxy for the
  conversation, since turns of one conversation share their first blocks.
* Output length 0 becomes 1 (a request produces at least its first token).

Bad input raises :class:`TraceFormatError` naming the file, the 1-based line and
the field, e.g. ``trace.jsonl:17: field 'hash_ids': expected a list of integers``.
"""

from __future__ import annotations

import itertools
import math
import os
from array import array
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt
import orjson

from prefixrouter.core.types import PrefixClass, RequestId
from prefixrouter.errors import gunzip_if_gzip
from prefixrouter.sim.workload import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_VOCAB,
    SIM_NAMESPACE,
    SimRequest,
    Workload,
)

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "TraceFormatError",
    "bundled_mooncake_path",
    "count_requests",
    "load_mooncake",
]

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per Mooncake ``hash_ids`` block."""

MAX_SPAN_S = 2.0**53 / 1e6
"""The longest replay (first to last arrival, in seconds after ``rate_scale``) that
keeps microsecond times: a float's 53 bits of integer microseconds, about 285
years. Past it, times lose microsecond precision, and far past it (1e15 s) a
millisecond of prefill added to an arrival vanishes: every TTFT would read 0."""

_BUNDLED = "data/conversation_trace.jsonl.gz"
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_EXPAND_CHUNK = 4096  # hash ids expanded per numpy pass: bounds temporary memory (~16 MB)

TraceSource = str | os.PathLike[str] | Traversable | IO[bytes] | IO[str]


class TraceFormatError(ValueError):
    """A trace file is unreadable or a line breaks the format (file, line and field named)."""


def trace_request_id(name: str, line: int) -> RequestId:
    """The id of the request on 1-based ``line`` of a trace loaded as workload ``name``."""
    return RequestId(f"{name}-{line:05d}")


def trace_line(request_id: str) -> int | None:
    """The trace line of a request :func:`load_mooncake` made (None: not such an id)."""
    _, _, digits = request_id.rpartition("-")
    return int(digits) if digits.isdigit() else None


def bundled_mooncake_path() -> Traversable:
    """The Mooncake conversation trace shipped with the package (gzip JSON Lines)."""
    return resources.files("prefixrouter.sim").joinpath(_BUNDLED)


def load_mooncake(
    path_or_file: TraceSource,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    limit: int | None = None,
    start: int = 0,
    rate_scale: float = 1.0,
    seed: int = 0,
    name: str | None = None,
    workers: int = 16,
) -> Workload:
    """Load a Mooncake-format trace (``.jsonl`` or ``.jsonl.gz``) as a fixed-time workload.

    Args:
        path_or_file: A path, an :mod:`importlib.resources` file, or an open file
            (bytes or text); gzip is recognized by its magic bytes.
        block_size: The simulated engine's KV block size (not the trace's 512).
        limit: Keep only the first ``limit`` requests of the file (after ``start``).
        start: Skip the first ``start`` requests: the rest replay as a trace
            of their own (a window of the trace).
        rate_scale: Replay speed: arrival = (timestamp - first) / 1000 / rate_scale,
            where ``first`` is the smallest timestamp kept, so ``rate_scale > 1``
            compresses the trace (higher load) and the first request arrives at 0.
        seed: Seeds the made-up token ids (the sharing structure never changes).
        name: Workload name and request-id prefix (default: the file's stem).
        workers: ``default_workers`` of the workload (the paper's cluster has 16).

    Raises:
        TraceFormatError: The file is not valid JSON Lines / gzip, or a line
            misses a field, has a wrong type or inconsistent lengths, or its
            timestamps span more than :data:`MAX_SPAN_S` of replay time.
        ValueError: A bad argument (``limit < 1``, ``start < 0``, ``rate_scale <= 0``, ...).
        OSError: The file cannot be read.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if not (rate_scale > 0 and math.isfinite(rate_scale)):
        raise ValueError(f"rate_scale must be a positive finite number, got {rate_scale}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")

    label, data = _read(path_or_file)
    rows = _parse(label, data, limit, start)
    if not rows:
        raise TraceFormatError(f"{label}: no requests in the trace")
    scale = 1.0 / (1000.0 * rate_scale)
    origin = _origin(label, rows, scale)
    blocks = _expand_blocks(rows, seed)

    wl_name = name or _stem(label)
    requests: list[SimRequest] = []
    for lineno, ts, input_length, output_length, ids in rows:
        last = input_length - MOONCAKE_BLOCK_TOKENS * (len(ids) - 1)
        segments = [blocks[h] for h in ids[:-1]]
        segments.append(blocks.partial(ids[-1], last))
        requests.append(
            SimRequest(
                request_id=trace_request_id(wl_name, lineno),
                # Exact for integer ms (Python ints): only the span must fit a float.
                arrival=float(ts - origin) * scale,
                namespace=SIM_NAMESPACE,
                segments=tuple(segments),
                output_tokens=max(1, output_length),
                prefix_class=PrefixClass.SESSION,
                group=f"conv-{ids[1] if len(ids) > 1 else ids[0]}",
                first_user_offset=MOONCAKE_BLOCK_TOKENS if len(ids) > 1 else 0,
            )
        )
    # Traces are sorted by timestamp; sort anyway (stable) so a shuffled file still replays.
    if any(a.arrival > b.arrival for a, b in itertools.pairwise(requests)):
        requests.sort(key=lambda r: r.arrival)
    return Workload(
        name=wl_name,
        description=(
            f"Mooncake-format trace replay of {_basename(label)}: {len(requests)} requests, "
            f"rate scale {rate_scale:g}, 512-token prefix blocks expanded to token ids"
        ),
        requests=requests,
        fixed_times=True,
        default_workers=workers,
        default_kv_blocks=None,
        block_size=block_size,
    )


# --------------------------------------------------------------------------- reading


def _read(src: TraceSource) -> tuple[str, bytes]:
    """(label for messages, decompressed bytes)."""
    raw: bytes
    # A missing or unreadable file raises the usual OSError (it names the path).
    if isinstance(src, str | os.PathLike):
        label = os.fspath(src)
        raw = Path(label).read_bytes()
    elif isinstance(src, Traversable):
        label = str(src)
        raw = src.read_bytes()
    else:
        label = str(getattr(src, "name", "<trace>"))
        content = src.read()
        raw = content.encode("utf-8") if isinstance(content, str) else content
    try:
        return label, gunzip_if_gzip(raw)
    except ValueError as exc:  # a damaged gzip file
        raise TraceFormatError(f"{label}: {exc}") from exc


# line, timestamp ms (as written: an int stays exact), input, output, hash_ids
_Row = tuple[int, int | float, int, int, list[int]]


def count_requests(path_or_file: TraceSource) -> int:
    """How many requests (non-blank lines) a Mooncake-format trace holds, none parsed."""
    return sum(1 for line in _read(path_or_file)[1].split(b"\n") if line.strip())


def _parse(label: str, data: bytes, limit: int | None, start: int = 0) -> list[_Row]:
    rows: list[_Row] = []
    skip = start
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        if skip:
            skip -= 1
            continue
        where = f"{label}:{lineno}"
        try:
            obj: Any = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise TraceFormatError(f"{where}: invalid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        rows.append(_check_row(where, lineno, obj))
        if limit is not None and len(rows) >= limit:
            break
    return rows


def _field(where: str, obj: dict[str, Any], key: str) -> Any:
    if key not in obj:
        raise TraceFormatError(f"{where}: missing field {key!r}")
    return obj[key]


def _check_row(where: str, lineno: int, obj: dict[str, Any]) -> _Row:
    ts = _field(where, obj, "timestamp")
    if type(ts) not in (int, float) or not math.isfinite(ts) or ts < 0:
        raise TraceFormatError(
            f"{where}: field 'timestamp': expected a non-negative number of ms, got {ts!r}"
        )
    n_in = _field(where, obj, "input_length")
    if type(n_in) is not int or n_in < 1:
        raise TraceFormatError(
            f"{where}: field 'input_length': expected a positive integer, got {n_in!r}"
        )
    n_out = _field(where, obj, "output_length")
    if type(n_out) is not int or n_out < 0:
        raise TraceFormatError(
            f"{where}: field 'output_length': expected a non-negative integer, got {n_out!r}"
        )
    ids = _field(where, obj, "hash_ids")
    # `type(...) is int` rejects bools, which are ints to isinstance.
    if type(ids) is not list or not all(type(h) is int and 0 <= h < 2**63 for h in ids):
        raise TraceFormatError(
            f"{where}: field 'hash_ids': expected a list of integers (0 <= id < 2**63)"
        )
    expected = -(-n_in // MOONCAKE_BLOCK_TOKENS)
    if len(ids) != expected:
        raise TraceFormatError(
            f"{where}: field 'hash_ids': expected {expected} block ids for input_length "
            f"{n_in} (ceil({n_in}/{MOONCAKE_BLOCK_TOKENS})), got {len(ids)}"
        )
    return lineno, ts, n_in, n_out, ids


def _origin(label: str, rows: list[_Row], scale: float) -> int | float:
    """The smallest timestamp of ``rows``: the replay's time 0.

    The smallest, not the first line's: a trace need not be sorted. Refuses a
    trace whose span, times ``scale`` (ms to replay seconds), passes
    :data:`MAX_SPAN_S`, naming the line of its last timestamp.

    Raises:
        TraceFormatError: The span is too long.
    """
    first = min(rows, key=lambda r: r[1])
    last = max(rows, key=lambda r: r[1])
    span_s = float(last[1] - first[1]) * scale
    if span_s > MAX_SPAN_S:
        raise TraceFormatError(
            f"{label}:{last[0]}: field 'timestamp': {last[1]!r} ms is {span_s:.3g} s of "
            f"replay after the first arrival (line {first[0]}); more than {MAX_SPAN_S:.3g} s "
            f"(2**53 microseconds) loses microsecond precision"
        )
    return first[1]


# --------------------------------------------------------------------------- expansion


class _Blocks:
    """Token arrays per hash id: one shared object per id (and per partial length)."""

    __slots__ = ("_full", "_partial")

    def __init__(self, full: dict[int, array[int]]) -> None:
        self._full = full
        self._partial: dict[tuple[int, int], array[int]] = {}

    def __getitem__(self, hash_id: int) -> array[int]:
        return self._full[hash_id]

    def partial(self, hash_id: int, length: int) -> array[int]:
        """The first ``length`` tokens of ``hash_id``'s block, cached."""
        block = self._full[hash_id]
        if length == len(block):
            return block
        key = (hash_id, length)
        cached = self._partial.get(key)
        if cached is None:
            cached = self._partial[key] = block[:length]
        return cached


def _expand_blocks(rows: list[_Row], seed: int) -> _Blocks:
    """Token arrays for every hash id of ``rows``, each only as long as any use needs."""
    need: dict[int, int] = {}
    for _, _, n_in, _, ids in rows:
        for h in ids[:-1]:
            need[h] = MOONCAKE_BLOCK_TOKENS
        last = n_in - MOONCAKE_BLOCK_TOKENS * (len(ids) - 1)
        if need.get(ids[-1], 0) < last:
            need[ids[-1]] = last
    key = _splitmix64_int(seed)
    ids = list(need)
    full: dict[int, array[int]] = {}
    pos = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.uint64)
    row_bytes = MOONCAKE_BLOCK_TOKENS * 4
    for start in range(0, len(ids), _EXPAND_CHUNK):
        chunk = ids[start : start + _EXPAND_CHUNK]
        tokens = _block_tokens(np.array(chunk, dtype=np.uint64), pos, key)
        buf = memoryview(tokens.tobytes())
        for r, h in enumerate(chunk):
            block: array[int] = array("I")
            offset = r * row_bytes
            block.frombytes(buf[offset : offset + need[h] * 4])
            full[h] = block
    return _Blocks(full)


def _block_tokens(
    ids: npt.NDArray[np.uint64], pos: npt.NDArray[np.uint64], key: int
) -> npt.NDArray[np.uint32]:
    """Token ids for (hash id, position) pairs: SplitMix64 of a per-pair counter.

    Counter-based, so a block's tokens don't depend on which other ids the
    trace (or ``limit``) contains. uint64 arithmetic wraps modulo 2**64 by design.
    """
    z = ids[:, None] * np.uint64(MOONCAKE_BLOCK_TOKENS) + pos[None, :]
    # In-place steps: the chunk is millions of elements, temporaries cost more than math.
    z *= np.uint64(_GOLDEN)
    z += np.uint64(key)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    # Map to [0, vocab) with a multiply-shift of the top 32 bits (Lemire), which is
    # unbiased enough here and several times faster than a 64-bit modulo.
    z >>= np.uint64(32)
    z *= np.uint64(DEFAULT_VOCAB)
    z >>= np.uint64(32)
    return z.astype(np.uint32)


def _splitmix64_int(x: int) -> int:
    """SplitMix64 of one Python int (the per-seed key)."""
    z = (x * _GOLDEN + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _basename(label: str) -> str:
    return label.replace("\\", "/").rsplit("/", 1)[-1]


def _stem(label: str) -> str:
    base = _basename(label)
    for suffix in (".gz", ".jsonl", ".json"):
        base = base.removesuffix(suffix)
    return base or "trace"
