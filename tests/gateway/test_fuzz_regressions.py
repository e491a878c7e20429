"""What the fuzzer (``test_fuzz.py``) found, each answered as it must be now."""

from __future__ import annotations

import pytest

from tests.gateway.helpers import gateway_env, run


@pytest.mark.parametrize("limit", ["²", "٣", "1²", "-1", "x"])
def test_decisions_limit_that_is_not_ascii_digits_is_a_400(limit: str) -> None:
    """``"²".isdigit()`` is true and ``int("²")`` raises: it was a 500 with a traceback."""

    async def main() -> None:
        async with gateway_env(1) as env:
            r = await env.admin("GET", "/admin/decisions", params={"limit": limit})
            assert r.status == 400
            err = (await r.json())["error"]
            assert err["param"] == "limit" and err["type"] == "invalid_request_error"

    run(main)
