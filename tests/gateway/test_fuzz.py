"""schemathesis fuzzes a live gateway from its own ``GET /openapi.json``.

Real processes: two simulated engines behind ``python -m prefixrouter.gateway``
(its output kept in a file). The document the gateway serves is loaded as
schemathesis would load it; for every operation, valid (positive) and
invalid (negative) requests are generated, :data:`EXAMPLES` of each, seeded,
and sent. Every answer must hold:

* no 5xx the gateway causes: a 5xx passes only as an OpenAI error whose
  ``type`` says it came from upstream (``upstream_error``, an engine's own
  failure) or that no worker could serve (``service_unavailable``); a 500
  ``internal_error`` (a gateway bug) never does;
* no traceback in any body, nor in the gateway's log at the end;
* every error (a status the operation does not document) is OpenAI-shaped:
  ``error.message`` and ``error.type`` strings, ``error.param`` and
  ``error.code`` present (string or null);
* schemathesis's response-schema and content-type conformance checks.

Positive chat and completion bodies name the model the engines serve (the
document allows any string, and another name is only ever a 404): that is
what makes them reach the engines. Failures are collected, not raised at the
first, so one run reports all of them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import CheckFunction
from schemathesis.core.result import Err
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from tests.gateway.live import LiveGateway, live_gateway

ADMIN_KEY = "fuzz-admin-key"
EXAMPLES = int(os.environ.get("PREFIXROUTER_FUZZ_EXAMPLES", "30"))
"""Generated requests per operation and mode (12 operations, 2 modes): 425 in about 15 s.

A longer hunt: ``PREFIXROUTER_FUZZ_EXAMPLES=500`` (and ``PREFIXROUTER_FUZZ_RANDOM=1``
for a fresh seed instead of the fixed one)."""
DERANDOMIZE = not os.environ.get("PREFIXROUTER_FUZZ_RANDOM")
UPSTREAM_TYPES = frozenset({"upstream_error", "service_unavailable"})
TRACEBACK = "Traceback (most recent call last)"
ANY_STRING_PATHS = frozenset({"/v1/models/{model}"})
"""Operations whose only input is a path segment any string may fill (a model id): no
negative case exists, and positive ones name the served model (:func:`_served_models`)."""
CHECKS: list[CheckFunction] = [response_schema_conformance, content_type_conformance]


@dataclass
class Totals:
    examples: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    by_operation: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    tmp = tmp_path_factory.mktemp("fuzz")
    config = {
        "server": {"admin_api_key": ADMIN_KEY},
        "health": {"timeout_s": 0.5, "backoff_initial_s": 0.1, "backoff_max_s": 0.5},
        "overload": {"max_in_flight": 32},
        "access_log": {"path": str(tmp / "access.jsonl"), "flush_interval_s": 0.2},
    }
    # Worker ids no generated path parameter will hit: DELETE must not empty the fleet.
    ids = ("engine-alpha-7f3e", "engine-beta-91c2")
    with live_gateway(
        tmp, config, engine_args=("--time-scale", "200", "--max-model-len", "512"), ids=ids
    ) as gw:
        yield gw


def _document(url: str) -> dict[str, Any]:
    resp = requests.get(url + "/openapi.json", timeout=10)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("application/json")
    doc: dict[str, Any] = resp.json()
    assert doc["openapi"].startswith("3.1")
    return doc


def _served_models(doc: dict[str, Any]) -> dict[str, Any]:
    """The document for positive cases: bodies name the served model (module docstring)."""
    doc = orjson.loads(orjson.dumps(doc))
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        doc["components"]["schemas"][name]["properties"]["model"] = {"enum": ["tiny"]}
    doc["components"]["parameters"]["model_id"]["schema"] = {"enum": ["tiny"]}
    return doc


def _problems(case: Any, resp: Any, documented: set[str]) -> list[str]:
    """What is wrong with one answer (module docstring); empty when nothing is."""
    out: list[str] = []
    text = resp.text
    status = resp.status_code
    if TRACEBACK in text:
        out.append("traceback in the body")
    if status >= 400 and str(status) not in documented:
        try:
            err = resp.json()["error"]
            assert isinstance(err["message"], str) and isinstance(err["type"], str)
            assert isinstance(err["code"], str | None) and isinstance(err["param"], str | None)
        except (ValueError, KeyError, TypeError, AssertionError):
            out.append(f"{status} error not OpenAI-shaped: {text[:200]!r}")
            return out
        if status >= 500 and err["type"] not in UPSTREAM_TYPES:
            out.append(f"{status} caused by the gateway: {text[:300]!r}")
    try:
        case.validate_response(resp, checks=CHECKS)
    except AssertionError as exc:  # schemathesis's failure group
        out.append(f"conformance: {str(exc)[:300]}")
    return out


def _fuzz(url: str, doc: dict[str, Any], mode: GenerationMode, totals: Totals) -> None:
    schema = schemathesis.openapi.from_dict(doc)
    for result in schema.get_all_operations():
        if isinstance(result, Err):  # an operation the schema does not define validly
            raise result.err()
        op = result.ok()
        if op.path == "/dashboard/events":
            continue  # a stream that never ends (tests/dashboard reads it)
        has_input = op.body or op.query or op.headers or op.path_parameters
        if mode is GenerationMode.NEGATIVE and (not has_input or op.path in ANY_STRING_PATHS):
            continue  # nothing to make invalid
        _fuzz_operation(url, op, mode, totals)


def _fuzz_operation(url: str, op: Any, mode: GenerationMode, totals: Totals) -> None:
    """:data:`EXAMPLES` requests of one operation in one mode."""
    admin = op.path.startswith(("/admin", "/dashboard/"))
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"} if admin else {}
    documented = {k for k in op.definition.raw.get("responses", {}) if k != "default"}
    name = f"{op.method.upper()} {op.path}"

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=DERANDOMIZE,  # seeded: the same requests every run
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def send(case: Any) -> None:
        resp = case.call(base_url=url, headers=headers, timeout=30)
        totals.examples += 1
        totals.by_operation[name] = totals.by_operation.get(name, 0) + 1
        totals.by_status[resp.status_code] = totals.by_status.get(resp.status_code, 0) + 1
        for problem in _problems(case, resp, documented):
            body = case.body if not isinstance(case.body, bytes) else case.body[:200]
            totals.failures.append(
                f"{name} [{mode.value}] -> {resp.status_code}: {problem}; "
                f"sent {str(body)[:200]} headers {case.headers} "
                f"query {case.query} path {case.path_parameters}"
            )

    send()


def test_fuzzed_gateway_answers_every_request_cleanly(gateway: LiveGateway) -> None:
    t0 = time.monotonic()
    doc = _document(gateway.url)
    totals = Totals()
    _fuzz(gateway.url, _served_models(doc), GenerationMode.POSITIVE, totals)
    _fuzz(gateway.url, doc, GenerationMode.NEGATIVE, totals)
    elapsed = time.monotonic() - t0
    print(
        f"\nfuzz: {totals.examples} examples in {elapsed:.1f} s, "
        f"{len(totals.failures)} failures; statuses {dict(sorted(totals.by_status.items()))}; "
        f"per operation {totals.by_operation}"
    )
    assert not totals.failures, "\n".join(totals.failures[:30])
    assert totals.by_status.get(200, 0) > 20  # positive cases reached the engines
    assert totals.examples > 300
    log = gateway.log_text()
    assert TRACEBACK not in log, log[-3000:]
