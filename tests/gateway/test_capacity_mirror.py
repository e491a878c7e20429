"""The gateway mirrors each engine's KV room with the simulator's formula (the dispatcher's)."""

from __future__ import annotations

from prefixrouter.core import CacheNamespace, Outcome, RequestId, RoutingRequest, prefix_room_blocks
from prefixrouter.gateway.config import config_from_dict
from prefixrouter.gateway.state import build_state


def test_the_registry_mirrors_with_the_dispatchers_formula_and_fresh_ledger_figures() -> None:
    cfg = config_from_dict(
        {"workers": [{"url": "http://127.0.0.1:9", "id": "w0", "kv_capacity_blocks": 1000}]}
    )
    st = build_state(cfg)  # text mode: index blocks of 256 characters
    dispatch, registry = st.dispatch, st.registry
    w = registry.workers[next(iter(registry.workers))]
    w.view.kv_used_blocks = 500
    routed = RoutingRequest(RequestId("r"), CacheNamespace("m"), text="x" * 40_000)
    adm = dispatch.admit(routed, registry.views(), 0.0)
    dispatch.first_token(adm, 0.0)  # a stream's prompt past its first token: cached prefix blocks
    queued = dispatch.admit(
        RoutingRequest(RequestId("q"), CacheNamespace("m"), text="y" * 40_000),
        registry.views(),
        0.0,
    )
    registry._mirror_capacity(w)
    unit = dispatch.index_block_tokens()
    assert unit == 64.0
    expected = prefix_room_blocks(dispatch.fill(w.view, 0.0), unit)
    # 10,000 tokens decoding (625 blocks) leave none of the 500 used as other
    assert dispatch.index_capacity(w.id) == expected == 1000 * 16 // 64
    dispatch.complete(adm, Outcome(0, 0.1), 1.0)
    registry._mirror_capacity(w)
    # the prompt sent and not decoding yet (prefilling, as far as the gateway
    # can tell) still accounts for the 500 in use
    assert dispatch.index_capacity(w.id) == 1000 * 16 // 64
    dispatch.reject(queued, 1.0)  # nothing in flight: the 500 used are other
    registry._mirror_capacity(w)
    assert dispatch.index_capacity(w.id) == 500 * 16 // 64
