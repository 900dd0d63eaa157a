"""Per-tenant limits on the tenant record: update, audit, exposure through auth."""

from __future__ import annotations

import pytest

from tenants.repository import UNCHANGED, TenantRepository


def test_limits_default_to_unlimited_and_reach_auth_context(repo: TenantRepository) -> None:
    t = repo.create_tenant("limited")
    assert (t.rpm_limit, t.tpm_limit, t.max_concurrent) == (None, None, None)
    token, _ = repo.create_api_key(t.id)
    ctx = repo.authenticate_api_key(token)
    assert (ctx.rpm_limit, ctx.tpm_limit, ctx.max_concurrent) == (None, None, None)

    info = repo.update_tenant(t.id, rpm_limit=60, tpm_limit=10_000, max_concurrent=2)
    assert (info.rpm_limit, info.tpm_limit, info.max_concurrent) == (60, 10_000, 2)
    ctx = repo.authenticate_api_key(token)
    assert (ctx.rpm_limit, ctx.tpm_limit, ctx.max_concurrent) == (60, 10_000, 2)
    ctx = repo.get_auth_context(t.id)
    assert (ctx.rpm_limit, ctx.tpm_limit, ctx.max_concurrent) == (60, 10_000, 2)
    assert repo.get_tenant(t.id).tpm_limit == 10_000


def test_unchanged_keeps_and_none_clears(repo: TenantRepository) -> None:
    t = repo.create_tenant("limited")
    repo.update_tenant(t.id, rpm_limit=5, tpm_limit=100, max_concurrent=1)
    info = repo.update_tenant(t.id, disabled=False)  # limits default to UNCHANGED
    assert (info.rpm_limit, info.tpm_limit, info.max_concurrent) == (5, 100, 1)
    info = repo.update_tenant(t.id, tpm_limit=None, rpm_limit=UNCHANGED)
    assert (info.rpm_limit, info.tpm_limit, info.max_concurrent) == (5, None, 1)


def test_limit_changes_are_audited(repo: TenantRepository) -> None:
    t = repo.create_tenant("limited")
    repo.update_tenant(t.id, rpm_limit=7, actor="admin:ops")
    entry = repo.list_audit(t.id, limit=1)[0]
    assert (entry.actor, entry.action) == ("admin:ops", "tenant.update")
    assert entry.detail == "rpm_limit=7"
    repo.update_tenant(t.id, rpm_limit=7)  # no change, no audit row
    assert repo.list_audit(t.id, limit=1)[0].id == entry.id


@pytest.mark.parametrize("bad", [0, -1, 1.5, "10", True])
def test_bad_limit_values_are_refused(repo: TenantRepository, bad) -> None:
    t = repo.create_tenant("limited")
    with pytest.raises(ValueError, match="rpm_limit"):
        repo.update_tenant(t.id, rpm_limit=bad)
    assert repo.get_tenant(t.id).rpm_limit is None
