"""An engine killed behind Envoy: the picker stops sending requests to it after Envoy's first 503.

Envoy answers a request for an endpoint it cannot reach with its own 503
(plain text: "upstream connect error"). Before, the picker kept picking the
dead engine (it held the request's document, and nothing told the picker)
until its next scheduled health check: about a second of 503s, several
requests in a row. The picker now takes Envoy's 503 as the worker
unreachable: out of routing until a check passes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from prefixrouter.harness.processes import Fleet, kill_process
from tests.epp.fleet import (
    chat_body,
    client,
    post,
    start_engines,
    start_picker,
    start_proxy,
    wait_up,
    write_config,
)


def test_after_envoys_first_503_for_a_dead_engine_requests_go_to_the_other(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        with Fleet() as fleet:
            engines = start_engines(fleet, 2)
            cfg = write_config(tmp_path / "epp.yaml", engines)
            picker = start_picker(fleet, cfg)
            envoy = start_proxy(fleet, picker, engines, tmp_path)
            await wait_up(fleet, [*engines, picker.server], [envoy])
            doc = "A document the picker will keep on one engine. " * 400
            async with client() as s:
                for _ in range(300):  # until the picker's first checks found both engines up
                    async with s.get(picker.http + "/health") as r:
                        if (await r.json())["healthy_workers"] == 2:
                            break
                    await asyncio.sleep(0.05)
                first = await post(s, envoy.url, chat_body(doc + "Q0?"))
                assert first.status == 200 and first.worker is not None
                holder = next(e for e in engines if e.name == first.worker)
                kill_process(holder.process)
                fleet.servers.remove(holder)
                statuses: list[int] = []
                seen: list[tuple[int, str | None, str]] = []
                for i in range(1, 6):  # the document's next questions, one after another
                    answer = await post(s, envoy.url, chat_body(doc + f"Q{i}?"))
                    statuses.append(answer.status)
                    seen.append((answer.status, answer.worker, answer.text[:80]))
            assert statuses.count(503) <= 1, seen
            assert statuses[-4:] == [200] * 4, seen

    asyncio.run(asyncio.wait_for(body(), 120))
