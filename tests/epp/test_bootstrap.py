"""The shipped Envoy bootstrap: valid for Envoy, and naming what the picker speaks."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from prefixrouter.epp import protocol
from prefixrouter.epp.envoy import BOOTSTRAP, envoy_binary, load_bootstrap, render

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
    hcm = data["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = {f["name"]: f["typed_config"] for f in hcm["typed_config"]["http_filters"]}
    mode = filters["envoy.filters.http.ext_proc"]["processing_mode"]
    assert mode["request_body_mode"] == mode["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    removed = filters["envoy.filters.http.header_mutation"]["mutations"]["request_mutations"]
    assert {m["remove"] for m in removed} == {protocol.DESTINATION, protocol.SERVED}


@pytest.mark.parametrize("mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
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
    hcm = data["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    cfg = hcm["typed_config"]
    ext_proc = {f["name"]: f["typed_config"] for f in cfg["http_filters"]}[
        "envoy.filters.http.ext_proc"
    ]
    assert ext_proc["message_timeout"] == cfg["stream_idle_timeout"] == "45s"  # was 1000s
    assert ext_proc["status_on_error"] == {"code": 503}
    assert "response.code_details" in ext_proc["response_attributes"]
    buffered = render(1, 2, 3, [], body_mode="BUFFERED")
    chain = buffered["static_resources"]["listeners"][0]["filter_chains"][0]
    filters = {
        f["name"]: f["typed_config"] for f in chain["filters"][0]["typed_config"]["http_filters"]
    }
    mode = filters["envoy.filters.http.ext_proc"]["processing_mode"]
    assert (mode["request_body_mode"], mode["response_body_mode"]) == ("BUFFERED", "STREAMED")


def test_an_unknown_body_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="STREAMED"):
        render(1, 2, 3, [], body_mode="STREAMED")
