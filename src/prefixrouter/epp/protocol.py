"""The endpoint picker protocol over Envoy's ext_proc: names, and the messages we build and read.

From the Gateway API Inference Extension's endpoint-picker protocol:

* the pick goes back as the request header :data:`DESTINATION` and in the
  dynamic metadata namespace :data:`LB_NAMESPACE` (``envoy.lb``) under the
  same key. The protocol allows a comma-separated list (the primary, then
  fallbacks for a data plane that retries down it) in either. The header
  holds the primary alone: the data plane that routes on the header,
  Envoy's ``ORIGINAL_DST`` cluster (the extension's reference bootstrap and
  ours), cannot parse a list: it rejects the whole value (``no healthy
  upstream``, counted as ``original_dst_host_invalid``). The metadata holds
  the list (:func:`destination_metadata`), for a data plane that reads it
  (Envoy's ``override_host`` load-balancing policy reads ``envoy.lb`` /
  ``x-gateway-destination-endpoint`` and retries down the list). Without
  fallbacks both hold the same single endpoint; with them the first entry
  of the list is the header's value (the protocol asks for the same value in
  both: its first entry is, which is all a one-endpoint data plane reads);
* the data plane may restrict the pick to a subset: filter metadata
  :data:`SUBSET_NAMESPACE` (``envoy.lb.subset_hint``), key :data:`SUBSET`, a
  list of ``IP:PORT``; an empty or wholly ineligible subset is a 503;
* the data plane reports the endpoint that served in the response's
  metadata context (``envoy.lb``, key :data:`SERVED`). Envoy has no setting
  that writes that key itself, so the shipped bootstrap also asks ext_proc
  for the ``upstream.address`` attribute with the response headers
  (:func:`served_endpoint` reads either);
* no ready endpoint: an ImmediateResponse 503; shedding: 429.

Messages come from the ``xds-protos`` package (``envoy.service.ext_proc.v3``).
Header values are read from ``raw_value`` (what Envoy sends) or ``value``,
and written as ``raw_value``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
EXT_PROC_ATTRIBUTES = "envoy.filters.http.ext_proc"
"""The key under which Envoy's ext_proc filter sends the attributes it was asked for."""
UPSTREAM_ADDRESS = "upstream.address"
CODE_DETAILS = "response.code_details"
"""Why Envoy answered as it did (``via_upstream``, ``no_healthy_upstream``,
``upstream_reset_before_response_started{remote_connection_failure,...}``)."""
DIALLED_AND_FAILED = "upstream_reset_before_response_started"
"""The code details' prefix of an answer Envoy made after it dialled the endpoint and failed."""

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
"""The gRPC health service names the picker answers (the overall one, the probes, ext_proc)."""

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED

Headers = dict[str, str]


def read_headers(headers: pb.HttpHeaders) -> Headers:
    """An ext_proc header map as a dict of lower-case names (the last value of a repeated one)."""
    out: Headers = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def header_mutation(values: Mapping[str, str]) -> pb.HeaderMutation:
    """Set (overwrite) each header."""
    return pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for k, v in values.items()
        ]
    )


def destination_metadata(endpoints: str) -> struct_pb2.Struct:
    """``{"envoy.lb": {"x-gateway-destination-endpoint": endpoints}}`` (one, or a list)."""
    md = struct_pb2.Struct()
    md.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = endpoints
    return md


def immediate(status: int, body: bytes, headers: Mapping[str, str]) -> pb.ProcessingResponse:
    """An ImmediateResponse: Envoy answers the client with it and forwards nothing."""
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=header_mutation(headers),
            body=body,
            details="prefixrouter_epp",
        )
    )


def subset_hint(request: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints the data plane allows (None: no restriction)."""
    md = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in md:
        return None
    fields = md[SUBSET_NAMESPACE].fields
    if SUBSET not in fields:
        return None
    value = fields[SUBSET]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values if v.string_value]
    if value.HasField("string_value"):  # tolerate "a,b" as one string
        return [p.strip() for p in value.string_value.split(",") if p.strip()]
    return []


def _attribute(request: pb.ProcessingRequest, key: str) -> str | None:
    """One of the attributes Envoy sent with the message (None: it sent no such one)."""
    attrs = request.attributes
    if EXT_PROC_ATTRIBUTES in attrs:
        fields = attrs[EXT_PROC_ATTRIBUTES].fields
        if key in fields:
            value: str = fields[key].string_value
            return value
    return None


def served_endpoint(request: pb.ProcessingRequest) -> str | None:
    """The endpoint that served (protocol metadata, else Envoy's ``upstream.address``)."""
    md = request.metadata_context.filter_metadata
    if LB_NAMESPACE in md and SERVED in md[LB_NAMESPACE].fields:
        return md[LB_NAMESPACE].fields[SERVED].string_value or None
    return _attribute(request, UPSTREAM_ADDRESS) or None


def code_details(request: pb.ProcessingRequest) -> str | None:
    """Envoy's ``response.code_details`` attribute (None: the data plane did not send it)."""
    return _attribute(request, CODE_DETAILS)


def endpoint_text(host: str, port: int) -> str:
    """``IP:PORT`` (``[IPv6]:PORT``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def join_endpoints(endpoints: Iterable[str]) -> str:
    return ",".join(endpoints)
