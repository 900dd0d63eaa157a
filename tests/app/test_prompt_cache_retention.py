"""OpenAI's ``prompt_cache_retention`` and ``cache_write_tokens`` on the fake model (a server
without an offload tier): what a call may ask, the tenant's default and maximum set through the
admin API, the refusals (400 naming the field, nothing reaches the engine), and the usage
fields: a first call writes its prompt's full blocks to the cache, its repeat reads them."""

from __future__ import annotations

import pytest

from app.errors import APIError
from app.services.completions import prompt_cache_retention
from tenants.records import TenantQuota

PROMPT = "The harbour master logs every ship that enters the port before noon, " * 3


def admin(env, method: str, path: str, **kw):
    return env.client.request(method, path, headers=env.headers(env.admin_token), **kw)


def _stored(env, request_id: str):
    return env.usage_row(env.tenant_b, request_id)


@pytest.mark.parametrize(("requested", "default", "ceiling", "has_tier", "expected"), [
    (None, None, None, True, "24h"),              # the usual default with a tier
    (None, None, None, False, "in_memory"),       # no tier: nothing else there is
    (None, "in_memory", None, True, "in_memory"),  # the tenant's default
    (None, None, "in_memory", True, "in_memory"),  # capped by its maximum
    ("in_memory", None, None, True, "in_memory"),
    ("24h", "in_memory", None, True, "24h"),       # a call may ask more than the default
])
def test_the_retention_a_call_gets(requested, default, ceiling, has_tier, expected):
    quota = TenantQuota(prompt_cache_retention=default, max_prompt_cache_retention=ceiling)
    assert prompt_cache_retention(requested, quota, has_tier) == expected


def test_asking_more_than_the_tenants_maximum_or_a_tier_the_server_lacks_is_a_400():
    with pytest.raises(APIError, match="above this tenant's maximum") as e:
        prompt_cache_retention("24h", TenantQuota(max_prompt_cache_retention="in_memory"), True)
    assert e.value.status == 400 and e.value.param == "prompt_cache_retention"
    with pytest.raises(APIError, match="needs an offload tier"):
        prompt_cache_retention("24h", TenantQuota(), False)


def test_through_the_api_without_a_tier(app_env):
    env = app_env
    body = {"model": env.model, "prompt": PROMPT, "max_tokens": 2}
    r = env.client.post("/v1/completions", json={**body, "prompt_cache_retention": "24h"},
                        headers=env.headers(env.key_b))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_cache_retention" and "offload tier" in err["message"]
    r = env.client.post("/v1/completions", json={**body, "prompt_cache_retention": "forever"},
                        headers=env.headers(env.key_b))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_retention"
    # A first call writes its prompt's full blocks; the repeat reads them and writes none.
    first = env.client.post("/v1/completions", json={**body, "prompt_cache_retention":
                                                     "in_memory"},
                            headers=env.headers(env.key_b)).json()
    again = env.client.post("/v1/completions", json=body, headers=env.headers(env.key_b)).json()
    details = first["usage"]["prompt_tokens_details"], again["usage"]["prompt_tokens_details"]
    written = details[0]["cache_write_tokens"]
    assert written > 0 and written % 16 == 0 and details[0]["cached_tokens"] == 0
    assert details[1] == {"cached_tokens": written, "cache_write_tokens": 0}
    row = _stored(env, first["id"])
    assert (row.cache_write_tokens, row.cached_tokens, row.tier_cached_tokens) == (written, 0, 0)
    assert _stored(env, again["id"]).cached_tokens == written


def test_the_operator_sets_a_tenants_default_and_maximum(app_env):
    env = app_env
    path = f"/admin/tenants/{env.tenant_b}"
    try:
        r = admin(env, "PATCH", path, json={"prompt_cache_retention": "in_memory",
                                            "max_prompt_cache_retention": "in_memory"})
        assert r.status_code == 200, r.text
        assert (r.json()["prompt_cache_retention"], r.json()["max_prompt_cache_retention"]) \
            == ("in_memory", "in_memory")
        before = admin(env, "GET", path).json()
        for bad in ({"prompt_cache_retention": "1h"}, {"prompt_cache_retention": "24h"}):
            r = admin(env, "PATCH", path, json=bad)  # unknown; above the maximum
            assert r.status_code == 400, r.text
            assert admin(env, "GET", path).json() == before
    finally:
        r = admin(env, "PATCH", path, json={"prompt_cache_retention": None,
                                            "max_prompt_cache_retention": None})
        assert r.status_code == 200 and r.json()["max_prompt_cache_retention"] is None
