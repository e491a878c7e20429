"""Tenants from API keys (X-Tenant only when trusted); cache sharing rules and cache_salt."""

from __future__ import annotations

import pytest

from prefixrouter.gateway.config import config_from_dict
from prefixrouter.gateway.errors import Forbidden, Unauthorized
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


def test_the_tenant_comes_from_the_key_and_the_header_is_not_trusted_by_default() -> None:
    t = _tenancy()
    assert t.resolve("Bearer k-acme", "globex", None).tenant == "acme"
    assert t.resolve("bearer k-globex", None, None).tenant == "globex"
    assert t.resolve("BEARER k-globex", None, None).tenant == "globex"
    assert t.resolve(None, None, None).tenant == ""
    # Issue 12: a client without a key claimed alice's tenant (and cache) with the header.
    for header in ("acme", "globex", "vip", "newco"):
        scope = t.resolve(None, header, None)
        assert (scope.tenant, scope.namespace, scope.cache_salt) == ("", "", None)


def test_an_unknown_key_is_refused_whenever_keys_are_configured() -> None:
    t = _tenancy()
    for auth in ("Bearer unknown", "bearer k-acmex", "Bearer  k-acme2"):
        with pytest.raises(Unauthorized, match="incorrect API key"):
            t.resolve(auth, "acme", None)
    # No keys configured: a client's key (OpenAI SDKs always send one) identifies nobody.
    keyless = Tenancy(config_from_dict({}))
    assert keyless.resolve("Bearer sk-anything", None, None).tenant == ""


def test_a_trusted_header_never_selects_a_tenant_with_keys_or_its_own_cache() -> None:
    t = _tenancy(trust_tenant_header=True, tenants={"solo": {"share_cache": False}})
    assert t.resolve(None, " team-b ", None).tenant == "team-b"  # shares: allowed
    assert t.resolve("Bearer k-acme", "team-b", None).tenant == "acme"  # the key wins
    for claimed in ("acme", "globex", "solo"):  # has keys / has keys / keeps its cache apart
        with pytest.raises(Forbidden, match=f"tenant '{claimed}'.*API key") as err:
            t.resolve(None, claimed, None)
        assert err.value.status == 403 and err.value.param == "X-Tenant"
    isolated_default = _tenancy(trust_tenant_header=True, default_tenant={"share_cache": False})
    with pytest.raises(Forbidden):
        isolated_default.resolve(None, "newco", None)


def test_the_clients_salt_enters_the_namespace_only_as_a_digest() -> None:
    t = _tenancy(salt_secret="s3cret")
    shared = t.resolve(None, None, "my-private-salt")
    isolated = t.resolve("Bearer k-acme", None, "my-private-salt")
    for ns in (shared.namespace, isolated.namespace):
        assert "my-private-salt" not in ns
    assert shared.namespace.startswith("salt:") and isolated.namespace.startswith("tenant:acme#")
    assert t.resolve(None, None, "other").namespace != shared.namespace
    # KV events carry the salt the engine got: they find the requests' namespace.
    assert shared.cache_salt is not None and "my-private-salt" not in shared.cache_salt
    assert t.namespace_of_salt(shared.cache_salt) == shared.namespace
    assert t.namespace_of_salt(isolated.cache_salt) == isolated.namespace


def test_a_client_cannot_send_a_no_share_tenants_salt_to_the_engine() -> None:
    """acme's salt is derivable from its name while salt_secret is empty: a
    client that sends it as its own cache_salt must not reach acme's cache."""
    t = _tenancy()
    acme_salt = t.resolve("Bearer k-acme", None, None).cache_salt
    assert acme_salt is not None
    for auth in (None, "Bearer k-globex"):  # anonymous, and a sharing tenant
        scope = t.resolve(auth, None, acme_salt)
        assert scope.cache_salt is not None and scope.cache_salt != acme_salt
        assert scope.namespace != "tenant:acme"


def test_a_client_salt_cannot_make_one_explicit_tenant_salt_into_another() -> None:
    """eps (salt "team") sending cache_salt "prod" must not get zeta's "team:prod"."""
    t = _tenancy(
        api_keys={"k-eps": "eps", "k-zeta": "zeta"},
        tenants={
            "eps": {"share_cache": False, "cache_salt": "team"},
            "zeta": {"share_cache": False, "cache_salt": "team:prod"},
        },
    )
    zeta = t.resolve("Bearer k-zeta", None, None)
    eps = t.resolve("Bearer k-eps", None, "prod")
    assert zeta.cache_salt == "team:prod"
    assert eps.cache_salt is not None and eps.cache_salt.startswith("team:")
    assert eps.cache_salt != zeta.cache_salt and "prod" not in eps.cache_salt
    # KV events with each salt still find their own tenant's namespace.
    assert t.namespace_of_salt(zeta.cache_salt) == "tenant:zeta"
    assert t.namespace_of_salt(eps.cache_salt) == eps.namespace != zeta.namespace


def test_required_key() -> None:
    t = _tenancy(require_api_key=True)
    assert t.resolve("Bearer k-acme", None, None).tenant == "acme"
    for auth in (None, "Bearer nope", "Basic abc"):
        with pytest.raises(Unauthorized):
            t.resolve(auth, "acme", None)


def test_sharing_tenants_share_a_namespace_and_keep_their_salts_apart() -> None:
    t = _tenancy()
    g = t.resolve("Bearer k-globex", None, None)
    anon = t.resolve(None, None, None)
    assert g.namespace == anon.namespace == "" and g.cache_salt is None
    salted = t.resolve(None, None, "mine")
    # Its own salt, as a digest: apart from unsalted requests, same for the same salt.
    assert salted.namespace.startswith("salt:") and salted.cache_salt not in (None, "mine")
    assert t.resolve("Bearer k-globex", None, "mine").cache_salt == salted.cache_salt


def test_isolated_tenants_get_their_own_namespace_and_a_salt() -> None:
    t = _tenancy(salt_secret="s3cret")
    a = t.resolve("Bearer k-acme", None, None)
    assert a.namespace == "tenant:acme" and a.cache_salt and len(a.cache_salt) == 32
    # The client cannot pick the salt: its own is folded in, not used as is.
    a2 = t.resolve("Bearer k-acme", None, "x")
    assert a2.cache_salt not in (None, "x", a.cache_salt)
    assert a2.namespace.startswith("tenant:acme#") and a2.namespace != a.namespace
    # The salt depends on the secret.
    assert _tenancy(salt_secret="other").resolve("Bearer k-acme", None, None).cache_salt != (
        a.cache_salt
    )
    vip = _tenancy(api_keys={"k-vip": "vip"})
    assert vip.resolve("Bearer k-vip", None, None).cache_salt == "S"


def test_default_rule_applies_to_unlisted_tenants() -> None:
    t = _tenancy(default_tenant={"share_cache": False}, api_keys={"k-newco": "newco"})
    x = t.resolve("Bearer k-newco", None, None)
    assert x.namespace == "tenant:newco" and x.cache_salt


def test_salts_vllm_would_refuse_are_replaced_by_a_derived_one() -> None:
    from prefixrouter.gateway.tenancy import vllm_accepts_salt

    cfg = config_from_dict(
        {
            "tenants": {"acme": {"share_cache": False, "cache_salt": "team/acme@corp"}},
            "api_keys": {"k": "acme"},
        }
    )
    t = Tenancy(cfg)
    plain = t.resolve("Bearer k", None, None).cache_salt
    with_client = t.resolve("Bearer k", None, "x" * 200).cache_salt
    assert plain is not None and vllm_accepts_salt(plain)
    assert with_client is not None and vllm_accepts_salt(with_client)
    assert plain != with_client  # the client's salt still separates caches
    assert not vllm_accepts_salt("a" * 129) and not vllm_accepts_salt("a\\b")


def test_the_overflow_label_is_no_tenant_a_header_or_the_configuration_may_name() -> None:
    """A tenant named ``_other`` would merge with the metrics' overflow series."""
    from prefixrouter.errors import ConfigError
    from prefixrouter.gateway.config import OTHER_TENANTS
    from prefixrouter.gateway.errors import BadRequest

    t = _tenancy(trust_tenant_header=True, api_keys={})
    assert t.resolve(None, "team-a", None).tenant == "team-a"
    with pytest.raises(BadRequest, match="reserved"):
        t.resolve(None, OTHER_TENANTS, None)
    with pytest.raises(ConfigError, match=r"tenants: .*'_other' is reserved"):
        config_from_dict({"tenants": {OTHER_TENANTS: {"share_cache": True}}})
    with pytest.raises(ConfigError, match=r"api_keys: .*'_other' is reserved"):
        config_from_dict({"api_keys": {"k": OTHER_TENANTS}})
