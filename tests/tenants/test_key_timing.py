"""An unknown key id and a known id with a wrong secret take the same time to reject."""

from __future__ import annotations

import statistics
import time

import pytest

from tenants.errors import InvalidToken
from tenants.repository import TenantRepository


def test_unknown_and_wrong_secret_keys_are_rejected_in_the_same_time(repo: TenantRepository):
    tenant = repo.tenants.create("timing")
    key, info = repo.keys.create(tenant.id)
    secret = key.split("-", 2)[2]
    wrong_secret = f"ss-{info.id}-" + ("A" if secret[0] != "A" else "B") + secret[1:]
    unknown_id = "ss-000000000000-" + secret

    def reject(token: str) -> float:
        t0 = time.perf_counter()
        with pytest.raises(InvalidToken):
            repo.authenticator.authenticate_api_key(token)
        return time.perf_counter() - t0

    for token in (wrong_secret, unknown_id):  # warm caches and connections
        reject(token)
    wrong, unknown = [], []
    for _ in range(80):  # interleaved, so machine noise hits both alike
        wrong.append(reject(wrong_secret))
        unknown.append(reject(unknown_id))
    ratio = statistics.median(wrong) / statistics.median(unknown)
    # Same code path length: one indexed lookup + one constant-time compare (dummy when unknown).
    assert 0.5 < ratio < 2.0, ratio
