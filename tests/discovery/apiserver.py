"""A Kubernetes API server on loopback that replays recorded objects and watch events.

There is no cluster here, so the discovery tests point kubernetes-asyncio at
this aiohttp server through a kubeconfig file. It answers the requests the
watcher makes as the real API server does (the shapes of the recordings in
``recordings/`` are the API's own):

* ``GET .../endpointslices``, ``GET /api/v1/namespaces/NS/pods``: a list
  (``EndpointSliceList``/``PodList``, items without ``kind``, the list's
  ``metadata.resourceVersion``), filtered by ``labelSelector`` (equality
  terms: ``k=v``, ``k==v``, ``k!=v``);
* the same with ``?watch=true&resourceVersion=RV``: HTTP 200 and a chunked
  stream of JSON lines ``{"type", "object"}`` (objects with ``kind`` and
  ``apiVersion``): first the recorded history after RV, then live events as
  the test emits them, until ``timeoutSeconds`` or :meth:`drop_watches`. A
  version older than the compacted history gets the API's answer to that:
  one ``ERROR`` event holding a ``Status`` of code 410 (``Expired``);
* ``GET .../inferencepools/NAME``: the recorded pool, or a 404 ``Status``;
* every request needs ``Authorization: Bearer TOKEN`` (else a 401 ``Status``);
  a resource in :attr:`FakeApiServer.forbidden` gets RBAC's 403 ``Status``,
  whose message names the verb, resource and API group that are missing.

Some failures are the test's to switch on: :attr:`FakeApiServer.watch_lags`
answers every watch with the 410 ``ERROR`` event (an API server whose watch
cache lags behind its list keeps doing that for a while), and
:attr:`FakeApiServer.proxy_error` answers every list and watch with what a
load balancer in front of the API sends when the API is down (an HTML page,
not a ``Status``). :meth:`update_pool` and :meth:`delete_pool` edit the pool
as ``kubectl`` would (a new ``resourceVersion`` and ``generation``).

The test drives it: :meth:`emit` applies one recorded event (stored, added to
the history, streamed to matching watches); :meth:`pause_watches`,
:meth:`drop_watches`, :meth:`compact` and :meth:`resume_watches` make the
410 case (events happen while no watch is open, and the history that would
have carried them is gone).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

RECORDINGS = Path(__file__).parent / "recordings"
RECORDED_PORT = 8000
"""The engines' port in the recordings (a real vLLM pod's); tests rewrite it."""

KINDS = {
    "endpointslices": ("EndpointSlice", "discovery.k8s.io/v1"),
    "pods": ("Pod", "v1"),
}


def load_recording(name: str, port: int) -> dict[str, Any]:
    """A recording from ``recordings/NAME.json`` with the engines' port set to ``port``.

    The recordings were written with a pod's port 8000; here the engines
    listen where the test could bind, so every ``port``, ``containerPort`` and
    ``targetPorts`` number of 8000 becomes ``port``.
    """
    data = json.loads((RECORDINGS / f"{name}.json").read_text(encoding="utf-8"))

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: port
                if k in ("port", "containerPort", "number") and v == RECORDED_PORT
                else walk(v)
                for k, v in node.items()
            }
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    out: dict[str, Any] = walk(data)
    return out


def matches(labels: dict[str, str], selector: str) -> bool:
    """Whether ``labels`` satisfy an equality-based label selector."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
            continue
        key, _, value = term.replace("==", "=").partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A ``v1.Status`` as the API server sends it."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _version(obj: dict[str, Any]) -> int:
    return int(obj["metadata"]["resourceVersion"])


@dataclass(eq=False)
class _Watch:
    resource: str
    namespace: str
    selector: str
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)


class FakeApiServer:
    """The API server's list, watch and get, over recorded objects (module docstring).

    Args:
        token: The bearer token every request must carry.
    """

    def __init__(self, token: str) -> None:
        self.token = token
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.pools: dict[tuple[str, str], dict[str, Any]] = {}
        self.history: list[tuple[str, dict[str, Any]]] = []
        self.version = 0
        self.compacted = 0
        self.requests: list[dict[str, str]] = []
        """Query of every list/watch request, with ``resource``."""
        self.expired_answers = 0
        self.forbidden: set[str] = set()
        """Resources (``pods``, ``inferencepools``, ...) the token may not read."""
        self.watch_lags = False
        """Every watch answers 410 Gone, whatever its version."""
        self.proxy_error: tuple[int, str, str] | None = None
        """(status, content type, body) of a proxy's answer to every list and watch."""
        self.account = "system:serviceaccount:llm:prefixrouter-epp"
        """The user RBAC names in a 403."""
        self._watches: set[_Watch] = set()
        self._open = asyncio.Event()
        self._open.set()
        self.app = web.Application()
        r = self.app.router
        r.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", self._endpointslices)
        r.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        r.add_get(
            "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}",
            self._pool,
        )

    # ------------------------------------------------------------ the test's side

    def load(self, resource: str, listing: dict[str, Any]) -> None:
        """Store a recorded list (``EndpointSliceList``/``PodList``) as the current state."""
        for item in listing["items"]:
            meta = item["metadata"]
            self.objects[(resource, meta["namespace"], meta["name"])] = item
        self.version = max(self.version, int(listing["metadata"]["resourceVersion"]))

    def add_pool(self, pool: dict[str, Any]) -> None:
        """Store a recorded InferencePool."""
        meta = pool["metadata"]
        self.pools[(meta["namespace"], meta["name"])] = pool

    def update_pool(self, pool: dict[str, Any]) -> None:
        """Replace the pool as an edit does: a new ``resourceVersion``, ``generation`` + 1."""
        meta = pool["metadata"]
        self.version += 1
        meta["resourceVersion"] = str(self.version)
        meta["generation"] = int(meta.get("generation") or 0) + 1
        self.pools[(meta["namespace"], meta["name"])] = pool

    def delete_pool(self, namespace: str, name: str) -> None:
        """Delete the pool (reads now get the API's 404)."""
        self.version += 1
        del self.pools[(namespace, name)]

    def emit(self, resource: str, event: dict[str, Any]) -> None:
        """Apply one recorded watch event and stream it to the matching watches."""
        obj = event["object"]
        version = _version(obj)
        assert version > self.version, "a recording's versions only grow"
        self.version = version
        meta = obj["metadata"]
        key = (resource, meta["namespace"], meta["name"])
        if event["type"] == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        self.history.append((resource, event))
        for w in list(self._watches):
            if self._selected(w, resource, obj):
                w.queue.put_nowait(event)

    def pause_watches(self) -> None:
        """New watch requests wait (as if the client could not reach us) until resumed."""
        self._open.clear()

    def resume_watches(self) -> None:
        """Answer watch requests again."""
        self._open.set()

    def drop_watches(self) -> None:
        """End every open watch stream (the server closes the connection's response)."""
        for w in list(self._watches):
            w.queue.put_nowait(None)

    def compact(self) -> None:
        """Forget the history: a watch from any older version now gets 410 Gone."""
        self.history.clear()
        self.compacted = self.version

    def watch_count(self) -> int:
        """Watch streams open now."""
        return len(self._watches)

    def count(self, resource: str, watch: bool) -> int:
        """Requests seen for ``resource``, watches or lists."""
        return sum(1 for q in self.requests if q["resource"] == resource and _is_watch(q) == watch)

    # ------------------------------------------------------------ the API's side

    def _authorized(self, request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {self.token}"

    def _refusal(
        self, request: web.Request, resource: str, group: str, name: str | None
    ) -> web.Response | None:
        """The API's 401 or 403 for this request, if it gets one (authn before authz)."""
        if not self._authorized(request):
            return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        if resource not in self.forbidden:
            return None
        namespace = request.match_info["ns"]
        verb = "get" if name else ("watch" if _is_watch(dict(request.query)) else "list")
        what = f"{resource}.{group}" if group else resource
        subject = f'{what} "{name}"' if name else what
        msg = (
            f'{subject} is forbidden: User "{self.account}" cannot {verb} resource '
            f'"{resource}" in API group "{group}" in the namespace "{namespace}"'
        )
        return web.json_response(status(403, "Forbidden", msg), status=403)

    @staticmethod
    def _selected(w: _Watch, resource: str, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        return (
            resource == w.resource
            and meta["namespace"] == w.namespace
            and matches(meta.get("labels") or {}, w.selector)
        )

    def _items(self, resource: str, namespace: str, selector: str) -> Iterator[dict[str, Any]]:
        for (res, ns, _), obj in sorted(self.objects.items()):
            labels = obj["metadata"].get("labels") or {}
            if res == resource and ns == namespace and matches(labels, selector):
                item = copy.deepcopy(obj)
                item.pop("kind", None)  # list items carry no kind or apiVersion
                item.pop("apiVersion", None)
                yield item

    async def _endpointslices(self, request: web.Request) -> web.StreamResponse:
        return await self._collection(request, "endpointslices")

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        return await self._collection(request, "pods")

    async def _collection(self, request: web.Request, resource: str) -> web.StreamResponse:
        if self.proxy_error is not None:  # the proxy answers; the API never sees it
            code, content_type, text = self.proxy_error
            return web.Response(status=code, text=text, content_type=content_type)
        group = "discovery.k8s.io" if resource == "endpointslices" else ""
        refusal = self._refusal(request, resource, group, None)
        if refusal is not None:
            return refusal
        query = dict(request.query)
        self.requests.append({**query, "resource": resource})
        namespace = request.match_info["ns"]
        selector = query.get("labelSelector", "")
        kind, api_version = KINDS[resource]
        if not _is_watch(query):
            body = {
                "kind": f"{kind}List",
                "apiVersion": api_version,
                "metadata": {"resourceVersion": str(self.version)},
                "items": list(self._items(resource, namespace, selector)),
            }
            return web.json_response(body)
        await self._open.wait()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        since = int(query.get("resourceVersion") or self.version)
        if since < self.compacted or self.watch_lags:
            self.expired_answers += 1
            oldest = max(self.compacted, since + 1)
            gone = status(410, "Expired", f"too old resource version: {since} ({oldest})")
            await resp.write(orjson.dumps({"type": "ERROR", "object": gone}) + b"\n")
            await resp.write_eof()
            return resp
        w = _Watch(resource, namespace, selector)
        for res, event in self.history:
            if _version(event["object"]) > since and self._selected(w, res, event["object"]):
                w.queue.put_nowait(event)
        self._watches.add(w)
        try:
            async with asyncio.timeout(float(query.get("timeoutSeconds") or 3600)):
                while (queued := await w.queue.get()) is not None:
                    obj = {"kind": kind, "apiVersion": api_version, **queued["object"]}
                    await resp.write(orjson.dumps({"type": queued["type"], "object": obj}) + b"\n")
        except TimeoutError:
            pass  # the server ends a watch after timeoutSeconds
        finally:
            self._watches.discard(w)
        await resp.write_eof()
        return resp

    async def _pool(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        refusal = self._refusal(request, "inferencepools", "inference.networking.k8s.io", name)
        if refusal is not None:
            return refusal
        self.requests.append({"resource": "inferencepools", "name": name})
        pool = self.pools.get((ns, name))
        if pool is None:
            msg = f'inferencepools.inference.networking.k8s.io "{name}" not found'
            return web.json_response(status(404, "NotFound", msg), status=404)
        return web.json_response(pool)


def _is_watch(query: dict[str, str]) -> bool:
    return query.get("watch", "").lower() in ("true", "1")


def kubeconfig(
    path: Path,
    server: str,
    token: str | None,
    namespace: str,
    *,
    token_file: Path | None = None,
    exec_command: list[str] | None = None,
) -> Path:
    """Write a kubeconfig for ``server``; return its path.

    The user's credentials, as kubectl's users have them: a bearer ``token``,
    a ``tokenFile`` that something else rotates, or an ``exec`` plugin
    (``client.authentication.k8s.io/v1``, as ``aws eks get-token`` and
    ``gke-gcloud-auth-plugin`` are configured) that prints an ``ExecCredential``.
    """
    user: dict[str, Any] = {}
    if token is not None:
        user["token"] = token
    if token_file is not None:
        user["tokenFile"] = str(token_file)
    if exec_command is not None:
        user["exec"] = {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": exec_command[0],
            "args": exec_command[1:],
            "interactiveMode": "Never",
        }
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "recorded", "cluster": {"server": server}}],
        "users": [{"name": "epp", "user": user}],
        "contexts": [
            {
                "name": "recorded",
                "context": {"cluster": "recorded", "user": "epp", "namespace": namespace},
            }
        ],
        "current-context": "recorded",
    }
    path.write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
    return path
