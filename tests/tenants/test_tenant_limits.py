"""Per-tenant limits on the tenant record: update, audit, exposure through auth."""

from __future__ import annotations

import pytest

from tenants.repository import UNCHANGED, TenantRepository
from tenants.tenant_store import MAX_LIMIT


def test_limits_default_to_unlimited_and_reach_auth_context(repo: TenantRepository) -> None:
    t = repo.tenants.create("limited")
    assert (t.rpm_limit, t.tpm_limit, t.max_concurrent) == (None, None, None)
    token, _ = repo.keys.create(t.id)
    ctx = repo.authenticator.authenticate_api_key(token)
    assert (ctx.quota.rpm_limit, ctx.quota.tpm_limit, ctx.quota.max_concurrent) == (None, None, None)

    info = repo.tenants.update(t.id, rpm_limit=60, tpm_limit=10_000, max_concurrent=2)
    assert (info.rpm_limit, info.tpm_limit, info.max_concurrent) == (60, 10_000, 2)
    ctx = repo.authenticator.authenticate_api_key(token)
    assert (ctx.quota.rpm_limit, ctx.quota.tpm_limit, ctx.quota.max_concurrent) == (60, 10_000, 2)
    ctx = repo.authenticator.context_for_tenant(t.id)
    assert (ctx.quota.rpm_limit, ctx.quota.tpm_limit, ctx.quota.max_concurrent) == (60, 10_000, 2)
    assert repo.tenants.get(t.id).tpm_limit == 10_000


def test_unchanged_keeps_and_none_clears(repo: TenantRepository) -> None:
    t = repo.tenants.create("limited")
    repo.tenants.update(t.id, rpm_limit=5, tpm_limit=100, max_concurrent=1)
    info = repo.tenants.update(t.id, disabled=False)  # limits default to UNCHANGED
    assert (info.rpm_limit, info.tpm_limit, info.max_concurrent) == (5, 100, 1)
    info = repo.tenants.update(t.id, tpm_limit=None, rpm_limit=UNCHANGED)
    assert (info.rpm_limit, info.tpm_limit, info.max_concurrent) == (5, None, 1)


def test_limit_changes_are_audited(repo: TenantRepository) -> None:
    t = repo.tenants.create("limited")
    repo.tenants.update(t.id, rpm_limit=7, actor="admin:ops")
    entry = repo.usage.list_audit(t.id, limit=1)[0]
    assert (entry.actor, entry.action) == ("admin:ops", "tenant.update")
    assert entry.detail == "rpm_limit=7"
    repo.tenants.update(t.id, rpm_limit=7)  # no change, no audit row
    assert repo.usage.list_audit(t.id, limit=1)[0].id == entry.id


@pytest.mark.parametrize("bad", [0, -1, 1.5, "10", True, 2**31, 2**63])
def test_bad_limit_values_are_refused(repo: TenantRepository, bad) -> None:
    t = repo.tenants.create("limited")
    with pytest.raises(ValueError, match="rpm_limit"):
        repo.tenants.update(t.id, rpm_limit=bad)
    assert repo.tenants.get(t.id).rpm_limit is None


def test_limits_and_bounds_take_the_ends_of_their_range(repo: TenantRepository) -> None:
    t = repo.tenants.create("limited")
    info = repo.tenants.update(t.id, rpm_limit=1, tpm_limit=MAX_LIMIT, max_concurrent=MAX_LIMIT,
                              weight=1000, min_cache_blocks=0, max_cache_blocks=MAX_LIMIT)
    assert (info.rpm_limit, info.tpm_limit, info.max_concurrent, info.weight,
            info.min_cache_blocks, info.max_cache_blocks) == (1, MAX_LIMIT, MAX_LIMIT, 1000, 0,
                                                             MAX_LIMIT)
    assert repo.tenants.get(t.id) == info  # stored and read back (a 32-bit column holds it)
    for bad in (-1, MAX_LIMIT + 1, False):
        with pytest.raises(ValueError, match="max_cache_blocks"):
            repo.tenants.update(t.id, max_cache_blocks=bad)
    with pytest.raises(ValueError, match="weight"):
        repo.tenants.update(t.id, weight=1001)
    assert repo.tenants.get(t.id) == info


@pytest.mark.parametrize("flag", ["disabled", "enable_prefix_caching"])
@pytest.mark.parametrize("bad", ["yes", "false", 1, 0])
def test_flags_must_be_real_booleans(repo: TenantRepository, flag, bad) -> None:
    t = repo.tenants.create("flags")
    with pytest.raises(ValueError, match=flag):
        repo.tenants.update(t.id, **{flag: bad})
    assert repo.tenants.get(t.id) == t
