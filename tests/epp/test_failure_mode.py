"""The picker killed: Envoy's ``failure_mode_allow`` decides, as Envoy documents it.

Two Envoys on the shipped bootstrap in front of one picker and two engines:
one with ``failure_mode_allow: false`` (the bootstrap's setting, the
InferencePool's ``FailClose``), and two with ``true`` (``FailOpen``), one per
body mode. While the picker runs all route through it. Once it is killed
(``SIGKILL``, as a crash), the fail-closed Envoy answers the bootstrap's
``status_on_error`` (503, where Envoy's default is 500) with an OpenAI-shaped
JSON body (its ``local_reply_config``); the fail-open ones carry on without it, where
Envoy can: the request has no picked endpoint, so the bootstrap's second
route sends it to the pool by Envoy's own round robin, and Envoy counts it
in ``ext_proc.failure_mode_allowed``. With ``FULL_DUPLEX_STREAMED`` bodies
Envoy fails open only until the first body chunk was streamed to the
processor (envoyproxy/envoy#41276: it keeps no copy of the chunks), so there
a request with a body still gets the error and only one without a body goes on.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from prefixrouter.harness.processes import Fleet, kill_process
from tests.epp.fleet import (
    chat_body,
    client,
    envoy_stat,
    post,
    start_engines,
    start_picker,
    start_proxy,
    wait_up,
    write_config,
)

FAIL_OPEN = "ext_proc.failure_mode_allowed"


def test_failure_mode_allow_as_envoy_documents_it(tmp_path: Path) -> None:
    async def body() -> None:
        with Fleet() as fleet:
            engines = start_engines(fleet, 2)
            picker = start_picker(fleet, write_config(tmp_path / "epp.yaml", engines))
            closed = start_proxy(fleet, picker, engines, tmp_path, name="closed")
            buffered = start_proxy(
                fleet,
                picker,
                engines,
                tmp_path,
                failure_mode_allow=True,
                name="open-buffered",
                body_mode="BUFFERED",
            )
            duplex = start_proxy(
                fleet, picker, engines, tmp_path, failure_mode_allow=True, name="open-duplex"
            )
            envoys = (closed, buffered, duplex)
            await wait_up(fleet, [*engines, picker.server], envoys)
            names = {e.name for e in engines}
            async with client() as s:
                for envoy in envoys:
                    routed = await post(s, envoy.url, chat_body("while the picker runs"))
                    assert routed.status == 200 and routed.worker in names
                kill_process(picker.server.process)

                # Fail closed: a 503 in the OpenAI shape (was an empty 500), nothing forwarded.
                refused = await post(s, closed.url, chat_body("after the crash"))
                assert refused.status == 503 and refused.worker is None
                assert refused.body["error"]["code"] == "endpoint_picker_unavailable"

                # Fail open, buffered body: on without the picker, by the pool's round robin.
                served = [await post(s, buffered.url, chat_body(f"after {i}")) for i in range(2)]
                assert [(a.status, a.worker) for a in served] == [(200, None)] * 2
                assert all(a.text for a in served)
                assert await envoy_stat(buffered.admin_url, FAIL_OPEN) >= 2

                # Fail open, full-duplex body: Envoy fails open only until the first body
                # chunk went to the processor (it keeps no copy of the chunks it streamed),
                # so a request with a body is refused; one without a body goes on.
                lost = await post(s, duplex.url, chat_body("a body after the crash"))
                assert lost.status == 503
                async with s.get(duplex.url + "/v1/models") as r:
                    assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny"
                assert await envoy_stat(duplex.admin_url, FAIL_OPEN) >= 1
                assert await envoy_stat(closed.admin_url, FAIL_OPEN) == 0

    asyncio.run(asyncio.wait_for(body(), 90))
