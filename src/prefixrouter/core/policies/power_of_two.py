"""``power_of_two``: sample two candidates at random, take the less loaded one.

The cache-blind "power of two choices" baseline of PEERS.md (SGLang's
``power_of_two`` policy, also Ray Serve's default router): draw two distinct
candidates uniformly, send the request to the one with fewer in-flight
requests (ties: the first drawn). SGLang compares token load when its workers
report it; ``use_token_load=True`` does the same with the tokens the worker
still has to process (``pending_prefill_tokens + decode_tokens_remaining``).

Randomness without state: the two draws come from a ``random.Random`` seeded
with ``xxh3_64(request_id) XOR seed``, so ``select`` is pure and a decision can
be replayed from the request id alone (:func:`request_rng`, which the other
randomized baselines share). With one candidate there is nothing to sample.

``CandidateScore.score`` is each candidate's load; ``tier`` is ``sampled``
(``single`` with one candidate).

Parameters (defaults): ``seed`` 0, ``use_token_load`` False.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixrouter.core.policies.common import request_rng
from prefixrouter.core.policy import CandidateScore, Policy, RoutingContext, Selection, register
from prefixrouter.core.types import WorkerView


@dataclass(frozen=True, slots=True)
class PowerOfTwoParams:
    """Parameters of ``power_of_two``.

    Attributes:
        seed: XORed into each request's hash before seeding its random stream.
        use_token_load: Compare tokens still to process instead of in-flight requests.
    """

    seed: int = 0
    use_token_load: bool = False


@register
class PowerOfTwo(Policy):
    """The less loaded of two randomly drawn candidates."""

    name = "power_of_two"
    Params = PowerOfTwoParams
    params: PowerOfTwoParams

    def _load(self, w: WorkerView) -> int:
        if self.params.use_token_load:
            return w.pending_prefill_tokens + w.decode_tokens_remaining
        return w.in_flight

    def select(self, ctx: RoutingContext, candidates: Sequence[WorkerView]) -> Selection:
        scores = tuple(CandidateScore(w.worker_id, score=self._load(w)) for w in candidates)
        if len(candidates) == 1:
            return Selection(candidates[0].worker_id, "single", "only one candidate", 0, scores)
        rng = request_rng(ctx.request.request_id, self.params.seed)
        i, j = rng.sample(range(len(candidates)), 2)
        a, b = candidates[i], candidates[j]
        la, lb = self._load(a), self._load(b)
        chosen, other, lc, lo = (a, b, la, lb) if la <= lb else (b, a, lb, la)
        unit = "tokens" if self.params.use_token_load else "in flight"
        reason = (
            f"sampled {a.worker_id} and {b.worker_id}: {lc} {unit} <= {lo} on {other.worker_id}"
        )
        return Selection(chosen.worker_id, "sampled", reason, 0, scores)
