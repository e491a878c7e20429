"""Kubernetes objects -> the engines they name (pure: no I/O, no client library).

An engine is a :class:`Target`: a stable id (the pod's name), an address, a
port and whether it is ready for traffic. Two sources name them:

* **EndpointSlices** (``discovery.k8s.io/v1``) of a Service, the objects
  kube-proxy and every gateway's EDS read. A slice lists ``endpoints`` (the
  first of each one's ``addresses`` is the one to use, per the API; their
  ``targetRef`` names the pod) and ``ports`` shared by all its endpoints.
  ``conditions.ready`` says whether the endpoint may get new traffic; a nil
  ``ready`` means ready (the API's rule), and a terminating pod shows
  ``ready: false`` (``serving`` may stay true while it finishes its
  requests). Slices of ``addressType: FQDN`` are skipped: the engines are
  reached by IP. One Service has several slices, and during a resync an
  endpoint may be in two of them for a moment: the union is taken per id,
  ready if any copy says so.
* **Pods** matching a label selector (the selector of an ``InferencePool``),
  by the rule the EndpointSlice controller applies to a Service's pods
  (``ShouldPodBeInEndpoints`` with terminating pods kept, then
  ``IsPodReady``), so a pool's pods become workers as a Service's endpoints
  would:

  - a pod in a terminal ``status.phase`` (``Succeeded``: completed, or
    ``Failed``: evicted, OOM-killed with ``restartPolicy: Never``, ...) names
    no target. It keeps its ``podIP`` in the API until someone deletes it
    (evicted pods of a Deployment stay until the cluster's terminated-pod
    garbage collection, thousands of pods later), but its containers are gone
    and the network has given the address back: a new pod may get it, and a
    worker for the dead pod would hold the new pod's KV-event address;
  - a pod without ``status.podIP`` (not scheduled or not started yet) names
    no target;
  - any other pod names one, ready when its phase is ``Running``, its
    ``Ready`` condition is ``True`` and it is not being deleted
    (``metadata.deletionTimestamp``). A terminating pod stays a target, not
    ready, so its worker takes no new requests but is drained when the pod
    goes, not cut off at once (as a slice keeps it, ``serving`` while it
    finishes). A ``Pending`` pod with an IP (its init containers run) is a
    target that is not ready yet.

:class:`TargetIndex` holds the last listed state per object (a list replaces
it, a watch event patches one object) and answers the union. The watcher
(:mod:`prefixrouter.discovery.kubernetes`) feeds it; the gateway turns its
answer into workers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

ObjectKind = Literal["EndpointSlice", "Pod"]

Obj = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Target:
    """One engine a Kubernetes object names.

    Attributes:
        id: The pod's name (from the endpoint's ``targetRef`` or the pod's
            metadata); ``ADDRESS:PORT`` for an endpoint without a pod.
        address: Its IP address (IPv4 or IPv6).
        port: The engines' port.
        ready: Whether it may get new requests.
    """

    id: str
    address: str
    port: int
    ready: bool

    @property
    def host(self) -> str:
        """The address as a URL's host (IPv6 in brackets)."""
        return f"[{self.address}]" if ":" in self.address else self.address


def _name(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    return str(meta.get("name") or "")


def slice_port(obj: Obj, port: int | None) -> int | None:
    """The engines' port in an EndpointSlice: ``port`` if given, else the slice's only port.

    A slice with several ports and no configured one names no port (None): a
    guess could send requests to a metrics or side port.
    """
    if port is not None:
        return port
    ports = [p.get("port") for p in obj.get("ports") or () if isinstance(p, Mapping)]
    numbers = [p for p in ports if isinstance(p, int)]
    return numbers[0] if len(numbers) == 1 else None


def endpoint_slice_targets(obj: Obj, port: int | None) -> list[Target]:
    """The targets of one EndpointSlice (see the module docstring)."""
    if obj.get("addressType", "IPv4") not in ("IPv4", "IPv6"):
        return []
    number = slice_port(obj, port)
    if number is None:
        return []
    out: list[Target] = []
    for ep in obj.get("endpoints") or ():
        addresses = ep.get("addresses") or ()
        if not addresses:
            continue
        address = str(addresses[0])
        conditions = ep.get("conditions") or {}
        ready = conditions.get("ready")
        ref = ep.get("targetRef") or {}
        name = ref.get("name") if ref.get("kind", "Pod") == "Pod" else None
        out.append(
            Target(
                id=str(name) if name else f"{address}:{number}",
                address=address,
                port=number,
                ready=ready is None or bool(ready),
            )
        )
    return out


TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
"""Pod phases after which no container runs again (``podutil.IsPodTerminal``)."""


def pod_targets(obj: Obj, port: int | None) -> list[Target]:
    """The target of one pod: none when terminal, without an IP or a port (module docstring)."""
    status = obj.get("status") or {}
    address = status.get("podIP")
    phase = status.get("phase")
    if not address or port is None or phase in TERMINAL_PHASES:
        return []
    meta = obj.get("metadata") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )
    # Readiness means something only while the pod runs: in any other phase
    # (Pending, or Unknown once its node stops reporting) it is not ready,
    # whatever its Ready condition last said.
    ready = ready and phase == "Running" and not meta.get("deletionTimestamp")
    name = _name(obj) or f"{address}:{port}"
    return [Target(id=name, address=str(address), port=port, ready=ready)]


def selector_of_pool(pool: Obj) -> tuple[str, int | None]:
    """An ``InferencePool``'s (``inference.networking.k8s.io/v1``) pod selector and port.

    ``spec.selector.matchLabels`` becomes a label selector (``k=v,k2=v2``,
    sorted), ``spec.targetPorts[0].number`` the port.

    Raises:
        ValueError: The pool has no ``matchLabels``.
    """
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    if not labels:
        raise ValueError(f"InferencePool {_name(pool)!r} has no spec.selector.matchLabels")
    selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    ports = spec.get("targetPorts") or ()
    number = ports[0].get("number") if ports and isinstance(ports[0], Mapping) else None
    return selector, number if isinstance(number, int) else None


class TargetIndex:
    """The listed objects of one kind, by name, and the targets they add up to.

    Args:
        kind: ``EndpointSlice`` or ``Pod``.
        port: The configured port (None: each slice's own; pods need one).
    """

    def __init__(self, kind: ObjectKind, port: int | None) -> None:
        self.kind: ObjectKind = kind
        self.port = port
        self._objects: dict[str, list[Target]] = {}

    def _targets_of(self, obj: Obj) -> list[Target]:
        if self.kind == "EndpointSlice":
            return endpoint_slice_targets(obj, self.port)
        return pod_targets(obj, self.port)

    def replace(self, items: Iterable[Obj]) -> None:
        """A fresh list: forget every object, keep these."""
        self._objects = {_name(o): self._targets_of(o) for o in items}

    def apply(self, event_type: str, obj: Obj) -> bool:
        """One watch event (``ADDED``, ``MODIFIED``, ``DELETED``); others are ignored.

        Returns:
            Whether it was one of the three.
        """
        name = _name(obj)
        if event_type in ("ADDED", "MODIFIED"):
            self._objects[name] = self._targets_of(obj)
        elif event_type == "DELETED":
            self._objects.pop(name, None)
        else:
            return False
        return True

    def targets(self) -> dict[str, Target]:
        """Id -> target over every object; an id in several objects is ready if any says so."""
        out: dict[str, Target] = {}
        for targets in self._objects.values():
            for t in targets:
                seen = out.get(t.id)
                if seen is None or (t.ready and not seen.ready):
                    out[t.id] = t
        return out
