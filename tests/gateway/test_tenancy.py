"""Tenants from API keys or X-Tenant; cache sharing rules and cache_salt."""

from __future__ import annotations

import pytest

from prefixrouter.config import config_from_dict
from prefixrouter.gateway.errors import Unauthorized
from prefixrouter.gateway.tenancy import Tenancy


def _tenancy(**data: object) -> Tenancy:
    base: dict[str, object] = {
        "api_keys": {"k-acme": "acme", "k-globex": "globex"},
        "tenants": {
            "acme": {"share_cache": False},
            "vip": {"share_cache": False, "cache_salt": "S"},
        },
    }
    base.update(data)
    return Tenancy(config_from_dict(base))


def test_key_wins_over_header() -> None:
    t = _tenancy()
    assert t.resolve("Bearer k-acme", "globex", None).tenant == "acme"
    assert t.resolve("bearer k-globex", None, None).tenant == "globex"
    assert t.resolve("Bearer unknown", "globex", None).tenant == "globex"
    assert t.resolve(None, None, None).tenant == ""
    assert _tenancy(tenant_header=False).resolve(None, "globex", None).tenant == ""


def test_required_key() -> None:
    t = _tenancy(require_api_key=True)
    assert t.resolve("Bearer k-acme", None, None).tenant == "acme"
    for auth in (None, "Bearer nope", "Basic abc"):
        with pytest.raises(Unauthorized):
            t.resolve(auth, "acme", None)


def test_sharing_tenants_share_a_namespace_and_keep_the_clients_salt() -> None:
    t = _tenancy()
    g = t.resolve("Bearer k-globex", None, None)
    anon = t.resolve(None, None, None)
    assert g.namespace == anon.namespace == "" and g.cache_salt is None
    salted = t.resolve(None, None, "mine")
    assert salted.namespace == "salt:mine" and salted.cache_salt is None


def test_isolated_tenants_get_their_own_namespace_and_a_salt() -> None:
    t = _tenancy(salt_secret="s3cret")
    a = t.resolve("Bearer k-acme", None, None)
    assert a.namespace == "tenant:acme" and a.cache_salt and len(a.cache_salt) == 32
    # The client cannot pick the salt: its own is folded in, not used as is.
    a2 = t.resolve("Bearer k-acme", None, "x")
    assert a2.cache_salt not in (None, "x", a.cache_salt) and a2.namespace == "tenant:acme#x"
    # The salt depends on the secret.
    assert _tenancy(salt_secret="other").resolve("Bearer k-acme", None, None).cache_salt != (
        a.cache_salt
    )
    assert t.resolve(None, "vip", None).cache_salt == "S"


def test_default_rule_applies_to_unlisted_tenants() -> None:
    t = _tenancy(default_tenant={"share_cache": False})
    x = t.resolve(None, "newco", None)
    assert x.namespace == "tenant:newco" and x.cache_salt


def test_salts_vllm_would_refuse_are_replaced_by_a_derived_one() -> None:
    from prefixrouter.gateway.tenancy import vllm_accepts_salt

    cfg = config_from_dict(
        {"tenants": {"acme": {"share_cache": False, "cache_salt": "team/acme@corp"}}}
    )
    t = Tenancy(cfg)
    plain = t.resolve(None, "acme", None).cache_salt
    with_client = t.resolve(None, "acme", "x" * 200).cache_salt
    assert plain is not None and vllm_accepts_salt(plain)
    assert with_client is not None and vllm_accepts_salt(with_client)
    assert plain != with_client  # the client's salt still separates caches
    assert not vllm_accepts_salt("a" * 129) and not vllm_accepts_salt("a\\b")
