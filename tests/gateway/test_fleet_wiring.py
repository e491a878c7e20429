"""Fleet controls in one process: configuration errors, bad headers, the share, pools, the log line.

Fake engines (``tests/gateway/fakes.py``) and an in-process gateway; the live
behaviour over real processes is ``test_fleet_controls.py``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from prefixrouter.errors import ConfigError
from prefixrouter.gateway.config import config_from_dict
from prefixrouter.gateway.fleet import divergent_position
from tests.admin_client import ADMIN_HEADERS
from tests.gateway.helpers import gateway_env, run

DOC = "The committee reviewed the budget line by line and approved it. " * 80


@pytest.mark.parametrize(
    ("section", "value", "expected"),
    [
        ("rollout", {"classes": ["docs"]}, "rollout.classes: unknown prefix class 'docs'"),
        ("rollout", {"baseline_policy": "nope"}, "rollout.baseline_policy: unknown policy"),
        ("rollout", {"share": 1.5}, "rollout.share: Input should be less than or equal to 1"),
        ("affinity", {"header": "X Session"}, "affinity.header: must be a header name"),
        ("drift", {"window": 3, "min_samples": 5}, "drift: min_samples (5) exceeds window (3)"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(
    section: str, value: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({section: value}, "gw.yaml")
    assert expected in str(err.value), str(err.value)


def test_a_session_id_too_long_is_a_400_naming_the_header() -> None:
    async def main() -> None:
        async with gateway_env(2) as env:
            r = await env.chat("hi", headers={"X-Session-ID": "s" * 257})
            assert r.status == 400
            err = (await r.json())["error"]
            assert err["param"] == "X-Session-ID" and "at most 256" in err["message"]
            assert (await env.chat("hi", headers={"X-Session-ID": "s" * 256})).status == 200

    run(main)


def test_a_share_keeps_each_document_in_one_group_and_each_group_in_its_pool() -> None:
    rollout = {"enabled": True, "share": 0.5, "seed": 3, "baseline_pool": "old"}
    pools = [{"pool": "old"}, {"pool": "new"}, {"pool": "new"}]

    async def main() -> None:
        async with gateway_env(3, {"rollout": rollout}, worker_options=pools) as env:
            policies: dict[int, set[str]] = {}
            for rnd in range(3):
                for doc in range(8):
                    r = await env.chat(f"Document {doc}: {DOC}\nQuestion {rnd}?")
                    assert r.status == 200
                    rid = r.headers["X-Request-Id"]
                    worker = r.headers["X-Prefixrouter-Worker"]
                    rec = {d["request_id"]: d for d in await env.decisions()}[rid]
                    policies.setdefault(doc, set()).add(rec["policy"])
                    if rec["policy"] == "round_robin":
                        assert worker == "w0"  # the baseline's pool
            assert all(len(p) == 1 for p in policies.values()), policies
            groups = [p.pop() for p in policies.values()]
            assert "round_robin" in groups and "prefix_aware" in groups, groups

    run(main)


def test_the_divergent_position_names_a_volatile_field_the_prompt_shows() -> None:
    async def main() -> None:
        async with gateway_env(1) as env:
            st = env.state
            scope = partial(st.tenancy.resolve, None, None)
            body = {
                "model": "tiny",
                "messages": [
                    {"role": "system", "content": "Run at 2026-12-01T17:20:05Z. " + DOC},
                    {"role": "user", "content": "Why?"},
                ],
            }
            built = st.builder.build(body, b"", "chat", scope, None)
            line = divergent_position(built, 0, 1400)
            assert line.startswith("token 0 (char ~0 of ")
            assert "a volatile timestamp at char" in line and "2026-12-01T17:20:05Z" in line
            tokens = {"model": "tiny", "prompt": list(range(100))}
            built = st.builder.build(tokens, b"", "completions", scope, None)
            assert "no text to scan" in divergent_position(built, 32, 100)

    run(main)


def test_the_series_are_exported_from_the_start() -> None:
    async def main() -> None:
        overrides = {"rollout": {"enabled": True, "classes": ["rag"]}}
        async with gateway_env(1, overrides) as env:
            text = await (await env.client.get("/metrics", headers=ADMIN_HEADERS)).text()
            for line in (
                'prefixrouter_affinity_total{result="overloaded"} 0.0',
                'prefixrouter_rollout_input_tokens_total{group="baseline",kind="cached"} 0.0',
                'prefixrouter_drift_alarm{prefix_class="document"} 0.0',
                'prefixrouter_fleet_controls{control="rollout"} 1.0',
            ):
                assert line in text, line

    run(main)
