"""The shipped Envoy bootstrap: valid for Envoy, and naming what the picker speaks."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from prefixrouter.epp import protocol
from prefixrouter.epp.envoy import (
    BODY_MODES,
    BOOTSTRAP,
    EXT_PROC_FILTER,
    envoy_binary,
    hcm,
    http_filter,
    load_bootstrap,
    render,
    routes,
)
from prefixrouter.gateway.config import OverloadConfig

DEPLOYED = Path(__file__).parents[2] / "deploy" / "envoy" / "envoy.yaml"


def test_the_package_carries_the_deployed_file() -> None:
    assert BOOTSTRAP.read_bytes() == DEPLOYED.read_bytes()


def test_it_names_the_protocols_header_and_health_service() -> None:
    data = load_bootstrap()
    clusters = {c["name"]: c for c in data["static_resources"]["clusters"]}
    dst = clusters["original_destination_cluster"]
    assert dst["type"] == "ORIGINAL_DST"
    assert dst["original_dst_lb_config"]["http_header_name"] == protocol.DESTINATION
    health = clusters["ext_proc"]["health_checks"][0]["grpc_health_check"]
    assert health["service_name"] == protocol.EXT_PROC_SERVICE
    mode = http_filter(hcm(data), EXT_PROC_FILTER)["processing_mode"]
    assert mode["request_body_mode"] == mode["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    mutation = http_filter(hcm(data), "envoy.filters.http.header_mutation")
    removed = mutation["mutations"]["request_mutations"]
    assert {m["remove"] for m in removed} == {protocol.DESTINATION, protocol.SERVED}


@pytest.mark.parametrize("mode", BODY_MODES)
def test_envoy_accepts_the_file_and_every_rendering(tmp_path: Path, mode: str) -> None:
    rendered = tmp_path / "envoy.yaml"
    boot = render(18081, 19002, 19000, [("127.0.0.1", 18000)], body_mode=mode)
    rendered.write_text(yaml.safe_dump(boot))
    for path in (DEPLOYED, rendered):
        out = subprocess.run(
            [envoy_binary(), "--mode", "validate", "-c", str(path), "-l", "error"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_bounded_fail_closed_and_streamed_responses() -> None:
    """The picker's answers are bounded; errors are 503; a BUFFERED request's response streams."""
    data = load_bootstrap()
    manager = hcm(data)
    ext_proc = http_filter(manager, EXT_PROC_FILTER)
    # Past the overload queue's longest wait (was 1000 s): a queued request's pick comes in time.
    queue_wait_s = OverloadConfig.model_fields["max_wait_s"].default
    assert ext_proc["message_timeout"] == manager["stream_idle_timeout"]  # raised together
    for bound in (ext_proc["message_timeout"], manager["stream_idle_timeout"]):
        assert bound.endswith("s") and int(bound[:-1]) > queue_wait_s, bound
    assert ext_proc["status_on_error"] == {"code": 503}
    assert "response.code_details" in ext_proc["response_attributes"]
    buffered = render(1, 2, 3, [], body_mode="BUFFERED")
    mode = http_filter(hcm(buffered), EXT_PROC_FILTER)["processing_mode"]
    assert (mode["request_body_mode"], mode["response_body_mode"]) == ("BUFFERED", "STREAMED")


def test_no_route_serves_an_unpicked_request_when_failing_closed() -> None:
    """Fail closed: a request without a pick is the bootstrap's 503, never the pool's."""
    closed = routes(render(1, 2, 3, [("127.0.0.1", 4)]))
    assert [r["route"]["cluster"] for r in closed if "route" in r] == [
        "original_destination_cluster"
    ]
    assert closed[-1]["direct_response"]["status"] == 503
    opened = routes(render(1, 2, 3, [("127.0.0.1", 4)], failure_mode_allow=True))
    assert opened[-1]["route"]["cluster"] == "inference_pool"


def test_an_unknown_body_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="STREAMED"):
        render(1, 2, 3, [], body_mode="STREAMED")
