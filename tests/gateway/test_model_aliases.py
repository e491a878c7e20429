"""Model aliases (vLLM's ``--served-model-name a b``) share one cache namespace.

An engine serving one model under two names shares every prefix block between
requests for either name; a router that keyed the cache by the requested name
predicted a cold prefill for the second name on the worker that held the
prefix, and sent it elsewhere.
"""

from __future__ import annotations

from prefixrouter.core.types import WorkerId
from prefixrouter.gateway.workers import alias_classes
from tests.gateway.fakes import FakeEngine
from tests.gateway.helpers import gateway_env, run

DOC = "The quick brown fox jumps over the lazy dog. " * 80


def test_alias_classes_join_the_names_one_worker_lists_and_those_sharing_a_name() -> None:
    classes = alias_classes(
        [frozenset({"llama", "gpt-4"}), frozenset({"llama"}), frozenset({"qwen", "x"})]
    )
    assert classes == {"llama": "gpt-4", "gpt-4": "gpt-4", "qwen": "qwen", "x": "qwen"}
    # Joined through a name two workers share: one class, its first name.
    chain = alias_classes([frozenset({"b", "c"}), frozenset({"c", "d"}), frozenset({"a", "d"})])
    assert set(chain.values()) == {"a"}
    assert alias_classes([]) == {}


def test_a_prefix_sent_under_one_alias_is_warm_under_the_other() -> None:
    async def body() -> None:
        engines = [FakeEngine(aliases=("gpt-4",)), FakeEngine(aliases=("gpt-4",))]
        async with gateway_env(engines=engines) as env:
            reg = env.state.registry
            assert reg.cache_model("gpt-4") == reg.cache_model("tiny") == "gpt-4"
            first = await env.chat(DOC + " Question 1?")
            assert first.status == 200
            holder = first.headers["X-Prefixrouter-Worker"]
            again = await env.chat(DOC + " Question 2?", model="gpt-4")
            assert again.status == 200
            # Routed to the holder, predicted warm, and the engine's reuse agrees.
            assert again.headers["X-Prefixrouter-Worker"] == holder
            (_, record) = await env.decisions(2)  # oldest first
            assert record["decision"]["tier"] != "cold", record["decision"]
            assert record["predicted_cached_tokens"] > 0
            assert record["actual_cached_tokens"] > 0
            assert record["model"] == "gpt-4"  # the name asked for, still
            # A name no worker lists goes by its own.
            assert reg.cache_model("nope") == "nope"
            assert WorkerId(holder) in reg.workers

    run(body)


def test_names_without_a_shared_root_stay_apart() -> None:
    """A server that lists several models without roots (configured here, so
    never listed) may serve different models: their prefixes must not mix."""

    async def body() -> None:
        engines = [FakeEngine(aliases=("gpt-4",))]
        options = [{"models": ["tiny", "gpt-4"]}]
        async with gateway_env(engines=engines, worker_options=options) as env:
            reg = env.state.registry
            assert reg.workers[WorkerId("w0")].models == {"tiny", "gpt-4"}
            assert reg.cache_model("gpt-4") == "gpt-4" and reg.cache_model("tiny") == "tiny"

    run(body)
