"""Who is asking, and may their requests share KV cache with others'?

The tenant comes from the API key: ``Authorization: Bearer KEY`` (any case of
``Bearer``) looked up in ``api_keys``.

* Once any key is configured (or ``require_api_key`` is on), an unknown key
  is a 401: a typo or a guess never falls back to another identity.
* A request without a key is anonymous (tenant ``""``), or a 401 with
  ``require_api_key``.
* The ``X-Tenant`` header counts only with ``trust_tenant_header`` (a gateway
  behind an authenticating proxy that sets it), only for requests without a
  key, and never for a tenant that has API keys or does not share its cache:
  naming one is a 403. Without that rule any client could claim such a tenant
  and read its cache (a warm route, and a timing probe of its prompts).

Each tenant has a sharing rule (``tenants.NAME.share_cache``, else
``default_tenant``):

* sharing: the namespace's tenant field is empty, so identical prompts of
  sharing tenants hit the same warm workers. A client-supplied ``cache_salt``
  reaches vLLM as its digest (below), which also enters the namespace
  (different salts never share a cache in vLLM, so the router must not
  predict that they do). Never the salt itself: a client that chose the
  engine's salt could pick a no-share tenant's, which anyone can derive from
  the tenant's name while ``salt_secret`` is empty;
* not sharing: the namespace carries the tenant (so the router never predicts
  a warm route across tenants) and vLLM workers get a ``cache_salt`` that
  overrides the client's: ``HMAC-SHA256(salt_secret, tenant [NUL client salt])``
  or the rule's explicit salt (``SALT:DIGEST`` with a client's salt, its
  digest below). Overriding matters: a client that could choose the salt
  could pick another tenant's and probe its cache by timing.

A client's salt enters the namespace and the engine's request as a digest
(``HMAC(salt_secret, "client-salt" NUL salt)``, 32 hex digits, a different
input from any tenant's salt), never as itself: the namespace key is written
to the decision log, and a salt is a secret of the client's.

Resolved scopes are memoized per (key, header tenant, client salt), so the hot
path pays one dict lookup. Refusals are not memoized.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from prefixrouter.gateway.config import OTHER_TENANTS, RESERVED_WHY, GatewayConfig
from prefixrouter.gateway.errors import BadRequest, Forbidden, Unauthorized

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


def bearer_token(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header (``Bearer`` in any case), else None."""
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip() or None
    return None


class Tenancy:
    """Resolves tenants and their cache scope from the configuration."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self._secret = config.salt_secret.encode("utf-8")
        # Tenants the header may never select: a key proves them, or they keep
        # their cache apart (checked again per request for unlisted tenants).
        self._keyed = frozenset(config.api_keys.values())
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
            Unauthorized: An unknown key while keys are configured, or no key
                with ``require_api_key``.
            Forbidden: A trusted ``X-Tenant`` names a tenant that has keys or
                does not share its cache.
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

    def check_key(self, authorization: str | None) -> None:
        """Refuse a request whose key cannot pass :meth:`resolve`, from the header alone.

        Raises:
            Unauthorized: An unknown key while keys are configured, or no key
                with ``require_api_key``.
        """
        cfg = self.config
        if not cfg.api_keys and not cfg.require_api_key:
            return
        key = bearer_token(authorization)
        if key is None:
            if cfg.require_api_key:
                raise Unauthorized("missing API key", code="invalid_api_key")
        elif key not in cfg.api_keys:
            raise Unauthorized("incorrect API key provided", code="invalid_api_key")

    def tenant_of(self, authorization: str | None, tenant_header: str | None) -> str:
        """The tenant a request's headers name ("" anonymous), from the headers alone.

        Raises:
            Unauthorized: As :meth:`check_key`.
            Forbidden: A trusted ``X-Tenant`` names a tenant that has keys or
                does not share its cache.
            BadRequest: ``X-Tenant`` is not printable UTF-8.
        """
        self.check_key(authorization)
        key = bearer_token(authorization)
        if key:
            # With no keys configured a client's key (OpenAI SDKs always send
            # one) identifies nobody, and the request is anonymous.
            return self.config.api_keys.get(key, "")
        return self._header_tenant(tenant_header) if self.config.trust_tenant_header else ""

    def namespace_of_salt(self, salt: str | None) -> str:
        """The namespace tenant field of requests an engine saw with ``salt``.

        A salt this gateway set maps back to its tenant's namespace; the
        engine salts of sharing clients are digests already, whose namespace
        is ``salt:<digest>``.
        """
        if not salt:
            return ""
        ns = self._salt_namespaces.get(salt)
        return ns if ns is not None else "salt:" + salt

    def _digest(self, client_salt: str) -> str:
        """What of a client's salt enters the namespace (and so the decision log)."""
        mac = hmac.new(self._secret, b"client-salt\0" + client_salt.encode(), hashlib.sha256)
        return mac.hexdigest()[:32]

    def _header_tenant(self, tenant_header: str | None) -> str:
        """The tenant a trusted ``X-Tenant`` names ("" without one).

        Raises:
            Forbidden: It names a tenant that has keys or does not share its cache.
        """
        tenant = tenant_header.strip() if tenant_header else ""
        if not tenant.isprintable() or tenant != tenant.encode("utf-8", "ignore").decode():
            raise BadRequest(
                "X-Tenant must be printable UTF-8", code="invalid_tenant", param="X-Tenant"
            )
        if tenant == OTHER_TENANTS:  # its series would merge with the overflow's
            raise BadRequest(
                f"X-Tenant {OTHER_TENANTS!r} is reserved ({RESERVED_WHY})",
                code="invalid_tenant",
                param="X-Tenant",
            )
        if tenant and (tenant in self._keyed or not self.config.tenant_rule(tenant).share_cache):
            raise Forbidden(
                f"tenant {tenant!r} cannot be selected with X-Tenant; use its API key",
                code="tenant_header_refused",
                param="X-Tenant",
            )
        return tenant

    def _resolve(
        self, authorization: str | None, tenant_header: str | None, client_salt: str | None
    ) -> TenantScope:
        cfg = self.config
        tenant = self.tenant_of(authorization, tenant_header)
        rule = cfg.tenant_rule(tenant)
        salt_ns = self._digest(client_salt) if client_salt else ""
        if rule.share_cache:
            if not client_salt:
                return TenantScope(tenant, "", None)
            # The engine gets the digest, never the client's salt itself: a
            # client that chose the engine's salt could pick a no-share
            # tenant's (derivable from its name) and share, or time, its cache.
            return TenantScope(tenant, f"salt:{salt_ns}", salt_ns)
        namespace = f"tenant:{tenant}" + (f"#{salt_ns}" if client_salt else "")
        salt = rule.cache_salt
        if salt is not None and client_salt:
            # The client's digest, not its salt: with the salt itself, tenant
            # "eps" (salt "team") sending "prod" would reach tenant "zeta"'s
            # cache if zeta's salt were "team:prod".
            salt = f"{salt}:{salt_ns}"
        if salt is None or not vllm_accepts_salt(salt):
            # Derived (or made acceptable): vLLM refuses salts over 128
            # characters or with '@', '/', '\\' or NUL in them with a 400.
            msg = (salt or tenant) + ("\0" + client_salt if client_salt and salt is None else "")
            salt = hmac.new(self._secret, msg.encode("utf-8"), hashlib.sha256).hexdigest()[:32]
        return TenantScope(tenant, namespace, salt)
