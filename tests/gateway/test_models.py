"""``GET /v1/models`` and ``/v1/models/{model}`` through the OpenAI SDK, as a client sees them."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.fakes import FakeEngine
from tests.gateway.helpers import gateway_env, run


def test_the_sdk_lists_and_retrieves_the_served_models() -> None:
    async def main() -> None:
        engines = [FakeEngine(model="tiny"), FakeEngine(model="org/big-1")]
        async with gateway_env(engines=engines) as env:
            base = str(env.client.make_url("/v1"))
            async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as sdk:
                listed = sorted(m.id for m in (await sdk.models.list()).data)
                assert listed == ["org/big-1", "tiny"]
                for name in listed:  # the same object /v1/models lists, slashes and all
                    got = await sdk.models.retrieve(name)
                    assert (got.id, got.object) == (name, "model")
                    assert got.model_dump() == next(
                        m.model_dump() for m in (await sdk.models.list()).data if m.id == name
                    )
                with pytest.raises(openai.NotFoundError) as info:
                    await sdk.models.retrieve("nope")
            assert info.value.status_code == 404
            assert info.value.code == "model_not_found" and info.value.param == "model"
            assert info.value.body == {
                "message": "The model `nope` does not exist.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }

    run(main)
