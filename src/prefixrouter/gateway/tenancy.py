"""Who is asking, and may their requests share KV cache with others'?

The tenant comes from the API key (``Authorization: Bearer KEY`` looked up in
``api_keys``) and, only when the key maps to no tenant and ``tenant_header``
is on, from an ``X-Tenant`` header. A key-derived tenant always wins, so a
client cannot claim another tenant's cache with a header.

Each tenant has a sharing rule (``tenants.NAME.share_cache``, else
``default_tenant``):

* sharing: the namespace's tenant field is empty, so identical prompts of
  sharing tenants hit the same warm workers. A client-supplied ``cache_salt``
  is passed through and folded into the namespace (different salts never
  share a cache in vLLM, so the router must not predict that they do);
* not sharing: the namespace carries the tenant (so the router never predicts
  a warm route across tenants) and vLLM workers get a ``cache_salt`` that
  overrides the client's: ``HMAC-SHA256(salt_secret, tenant [NUL client salt])``
  or the rule's explicit salt. Overriding matters: a client that could choose
  the salt could pick another tenant's and probe its cache by timing.

Resolved scopes are memoized per (key, header tenant, client salt), so the hot
path pays one dict lookup.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from prefixrouter.config import GatewayConfig
from prefixrouter.gateway.errors import Unauthorized

_MEMO_MAX = 10_000


@dataclass(frozen=True, slots=True)
class TenantScope:
    """A request's tenant and what that means for caching.

    Attributes:
        tenant: The tenant ("" when anonymous).
        namespace: The cache namespace's tenant field ("" = shared).
        cache_salt: Salt to set on vLLM workers (None = leave the body alone).
    """

    tenant: str
    namespace: str
    cache_salt: str | None


_VLLM_SALT_FORBIDDEN = frozenset("@/\\\0")


def vllm_accepts_salt(salt: str) -> bool:
    """Whether vLLM takes ``salt``: at most 128 characters, none of ``@ / \\`` or NUL."""
    return 0 < len(salt) <= 128 and not _VLLM_SALT_FORBIDDEN.intersection(salt)


class Tenancy:
    """Resolves tenants and their cache scope from the configuration."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self._secret = config.salt_secret.encode("utf-8")
        self._memo: dict[tuple[str | None, str | None, str | None], TenantScope] = {}
        # Salt sent to engines -> the namespace's tenant field, so KV events
        # (which carry the salt) land in the namespace the requests hash in.
        self._salt_namespaces: dict[str, str] = {}

    def resolve(
        self, authorization: str | None, tenant_header: str | None, client_salt: str | None
    ) -> TenantScope:
        """The scope of one request.

        Args:
            authorization: The ``Authorization`` header, if any.
            tenant_header: The ``X-Tenant`` header, if any.
            client_salt: The body's ``cache_salt``, if a string.

        Raises:
            Unauthorized: ``require_api_key`` is set and the key is missing or unknown.
        """
        memo_key = (authorization, tenant_header, client_salt)
        scope = self._memo.get(memo_key)
        if scope is not None:
            return scope
        scope = self._resolve(authorization, tenant_header, client_salt)
        if len(self._memo) >= _MEMO_MAX:
            self._memo.clear()
            self._salt_namespaces.clear()
        self._memo[memo_key] = scope
        if scope.cache_salt is not None:
            self._salt_namespaces[scope.cache_salt] = scope.namespace
        return scope

    def namespace_of_salt(self, salt: str | None) -> str:
        """The namespace tenant field of requests an engine saw with ``salt``.

        A salt this gateway set maps back to its tenant; any other salt is a
        client's own, passed through, whose namespace is ``salt:<salt>``.
        """
        if not salt:
            return ""
        return self._salt_namespaces.get(salt, f"salt:{salt}")

    def _resolve(
        self, authorization: str | None, tenant_header: str | None, client_salt: str | None
    ) -> TenantScope:
        cfg = self.config
        key = None
        if authorization and authorization[:7].lower() == "bearer ":
            key = authorization[7:].strip()
        tenant = cfg.api_keys.get(key) if key else None
        if tenant is None:
            if cfg.require_api_key:
                raise Unauthorized(
                    "missing API key" if not key else "incorrect API key provided",
                    code="invalid_api_key",
                )
            tenant = tenant_header.strip() if (cfg.tenant_header and tenant_header) else ""
        rule = cfg.tenant_rule(tenant)
        if rule.share_cache:
            namespace = f"salt:{client_salt}" if client_salt else ""
            return TenantScope(tenant, namespace, None)
        namespace = f"tenant:{tenant}" + (f"#{client_salt}" if client_salt else "")
        salt = rule.cache_salt
        if salt is not None and client_salt:
            salt = f"{salt}:{client_salt}"
        if salt is None or not vllm_accepts_salt(salt):
            # Derived (or made acceptable): vLLM refuses salts over 128
            # characters or with '@', '/', '\\' or NUL in them with a 400.
            msg = (salt or tenant) + ("\0" + client_salt if client_salt and salt is None else "")
            salt = hmac.new(self._secret, msg.encode("utf-8"), hashlib.sha256).hexdigest()[:32]
        return TenantScope(tenant, namespace, salt)
