"""Two replicas in one process, sharing PostgreSQL and Redis (``app.cluster``): an eviction done
through one replica reaches the other within a second, and a replica that missed the broadcast
catches up on the tenant's next request. Each replica has its own engine (the fake model) and
KV cache, as separate processes would."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import pytest
from fake_engine import make_fake_llm_engine
from fastapi.testclient import TestClient

from app.cluster import ClusterConfig
from app.parts import build_parts
from app.server import create_app
from engine.async_engine import AsyncLLM
from tenants.crypto import SaltCipher, decode_master_key, generate_master_key
from tenants.db import make_engine, make_session_factory, run_migrations
from tenants.repository import TenantRepository
from tenants.tokens import JWTConfig, JWTVerifier, issue_token, load_or_create_platform_key

REDIS_URL = "redis://127.0.0.1:6379/0"
PROMPT_A = [777] + list(range(21000, 21064))  # 65 tokens: a repeat hits 4 blocks (64 tokens)
PROMPT_B = [778] + list(range(22000, 22064))

pytestmark = pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)


def _redis_unreachable() -> str | None:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
        return None
    except redis.RedisError as e:
        return f"Redis at {REDIS_URL} is unreachable ({type(e).__name__})"


@dataclass
class Replica:
    client: TestClient
    admin: dict[str, str]

    def cached(self, key: str, prompt: list[int]) -> int:
        r = self.client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": "SmolLM2-135M-Instruct", "prompt": prompt,
                                   "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def evicted(self, tenant_id: str, reason: str) -> int:
        stats = self.client.get("/admin/cache", headers=self.admin).json()
        return next((t["evictions"].get(reason, 0) for t in stats["tenants"]
                     if t["tenant_id"] == tenant_id), 0)

    def resident(self, tenant_id: str) -> int:
        stats = self.client.get("/admin/cache", headers=self.admin).json()
        return next((t["resident_blocks"] for t in stats["tenants"]
                     if t["tenant_id"] == tenant_id), 0)


@dataclass
class Cluster:
    start: Callable[..., Replica]
    a: str
    b: str
    key_a: str
    key_b: str
    namespace: str
    database_url: str
    master_key: str
    platform_key: object


@pytest.fixture
def cluster(database_url, model_dir, tokenizer, tmp_path) -> Iterator[Cluster]:
    """``start(name, redis=True)`` runs a replica over the shared database (tenants a and b,
    one key each); replicas with ``redis`` share a fresh Redis namespace."""
    reason = _redis_unreachable()
    if reason is not None:
        pytest.fail(reason)  # Redis runs on every machine this suite runs on
    run_migrations(make_engine(database_url))
    master = generate_master_key()

    def new_repo() -> TenantRepository:
        return TenantRepository(make_session_factory(make_engine(database_url)),
                                SaltCipher(decode_master_key(master)))

    repo = new_repo()
    a, b = repo.tenants.create("tenant-a"), repo.tenants.create("tenant-b")
    key_a, key_b = repo.keys.create(a.id)[0], repo.keys.create(b.id)[0]
    platform = load_or_create_platform_key(tmp_path)
    verifier = JWTVerifier(JWTConfig(), platform.public_key())
    admin = {"Authorization": "Bearer " + issue_token(platform, JWTConfig(), subject="ops",
                                                      role="admin", tenant_id=None, ttl_s=600)}
    namespace = f"test-{uuid.uuid4().hex}"

    with ExitStack() as stack:
        def start(name: str, redis: bool = True) -> Replica:
            core = make_fake_llm_engine(model_dir, tokenizer, max_model_len=512,
                                        num_gpu_blocks_override=64)
            app = create_app(build_parts(
                AsyncLLM(core), new_repo(), jwt_verifier=verifier,
                usage_journal_dir=tmp_path / name,
                cluster=ClusterConfig(REDIS_URL if redis else None, namespace, name)))
            client = stack.enter_context(TestClient(app, raise_server_exceptions=False))
            deadline = time.time() + 5
            while redis and not app.state.parts.listener.subscribed.is_set():
                assert time.time() < deadline, "the replica never subscribed"
                time.sleep(0.02)
            return Replica(client, admin)

        yield Cluster(start, a.id, b.id, key_a, key_b, namespace, database_url, master,
                      platform)


def within(seconds: float, check: Callable[[], bool]) -> float:
    """Polls ``check`` until it holds; returns the seconds it took. Fails after ``seconds``."""
    start = time.perf_counter()
    while not check():
        assert time.perf_counter() - start < seconds, f"not within {seconds} s"
        time.sleep(0.02)
    return time.perf_counter() - start


def warm(replica: Replica, key: str, prompt: list[int]) -> None:
    replica.cached(key, prompt)
    assert replica.cached(key, prompt) == 64  # the replica's own repeat hits


def test_a_rotation_through_one_replica_empties_the_other_within_a_second(cluster):
    r1, r2 = cluster.start("r1"), cluster.start("r2")
    warm(r2, cluster.key_a, PROMPT_A)
    warm(r2, cluster.key_b, PROMPT_B)
    assert r2.resident(cluster.a) >= 4
    r = r1.client.post(f"/admin/tenants/{cluster.a}/rotate-salt", headers=r1.admin)
    assert r.status_code == 200 and r.json()["salt_version"] == 2
    within(1.0, lambda: r2.resident(cluster.a) == 0)  # no request on r2 needed
    assert r2.resident(cluster.b) >= 4  # another tenant's blocks stay
    assert r2.cached(cluster.key_a, PROMPT_A) == 0  # A misses under its new salt on r2 ...
    assert r2.cached(cluster.key_a, PROMPT_A) == 64  # ... and caches again (evicted once)
    assert r2.cached(cluster.key_b, PROMPT_B) == 64


def test_tenant_and_global_resets_reach_every_replica(cluster):
    r1, r2 = cluster.start("r1"), cluster.start("r2")
    for replica in (r1, r2):
        warm(replica, cluster.key_a, PROMPT_A)
        warm(replica, cluster.key_b, PROMPT_B)
    r = r1.client.post(f"/admin/tenants/{cluster.a}/cache/reset", headers=r1.admin)
    assert r.status_code == 200 and r.json()["blocks_dropped"] >= 4
    within(1.0, lambda: r2.resident(cluster.a) == 0)
    assert r1.resident(cluster.a) == 0 and r2.resident(cluster.b) >= 4
    r = r2.client.post("/admin/cache/reset", headers=r2.admin)  # the other way round
    assert r.status_code == 200
    within(1.0, lambda: r1.resident(cluster.b) == 0)
    # Each replica evicted once: its next repeats hit again (no second, spurious eviction
    # when a request meets the new cache epoch).
    for replica in (r1, r2):
        assert replica.cached(cluster.key_b, PROMPT_B) == 0
        assert replica.cached(cluster.key_b, PROMPT_B) == 64


def test_a_replica_that_missed_the_broadcast_catches_up_on_the_next_request(cluster):
    r1, lonely = cluster.start("r1"), cluster.start("r2", redis=False)  # hears nothing
    warm(lonely, cluster.key_a, PROMPT_A)
    warm(lonely, cluster.key_b, PROMPT_B)
    r1.client.post(f"/admin/tenants/{cluster.a}/cache/reset", headers=r1.admin)
    time.sleep(0.3)
    assert lonely.resident(cluster.a) >= 4  # the message never came ...
    assert lonely.cached(cluster.key_a, PROMPT_A) == 0  # ... the next request catches up
    assert lonely.cached(cluster.key_a, PROMPT_A) == 64
    r1.client.post(f"/admin/tenants/{cluster.a}/rotate-salt", headers=r1.admin)
    assert lonely.resident(cluster.a) >= 4 and lonely.evicted(cluster.a, "salt_rotation") == 0
    assert lonely.cached(cluster.key_a, PROMPT_A) == 0
    # The miss alone would hold from the new salt; the old blocks were released too.
    assert lonely.evicted(cluster.a, "salt_rotation") >= 4
    assert lonely.cached(cluster.key_a, PROMPT_A) == 64
    assert lonely.cached(cluster.key_b, PROMPT_B) == 64  # B untouched throughout


def test_disable_limits_and_revocations_reach_every_replica_at_once(cluster):
    r1, r2 = cluster.start("r1"), cluster.start("r2")
    assert r2.cached(cluster.key_a, PROMPT_A) == 0
    r1.client.patch(f"/admin/tenants/{cluster.a}", headers=r1.admin, json={"disabled": True})
    r = r2.client.get("/v1/models", headers={"Authorization": f"Bearer {cluster.key_a}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_disabled"
    r1.client.patch(f"/admin/tenants/{cluster.a}", headers=r1.admin, json={"disabled": False})
    key = r1.client.post(f"/admin/tenants/{cluster.a}/keys", headers=r1.admin, json={}).json()
    assert r2.client.get("/v1/models", headers={"Authorization": f"Bearer {key['key']}"}
                         ).status_code == 200
    r1.client.post(f"/admin/keys/{key['id']}/revoke", headers=r1.admin)
    assert r2.client.get("/v1/models", headers={"Authorization": f"Bearer {key['key']}"}
                         ).status_code == 401
    # A platform token revoked through r1 is refused by r2 from its next request on.
    from tenants.tokens import token_jti

    support = issue_token(cluster.platform_key, JWTConfig(), subject="support", role="admin",
                          tenant_id=None, ttl_s=600)
    bearer = {"Authorization": f"Bearer {support}"}
    assert r2.client.get("/admin/tenants", headers=bearer).status_code == 200
    r1.client.post("/admin/tokens/revoke", headers=r1.admin, json={"jti": token_jti(support)})
    assert r2.client.get("/admin/tenants", headers=bearer).status_code == 401


def test_junk_on_the_channel_does_not_stop_a_replica_listening(cluster):
    import redis

    r1, r2 = cluster.start("r1"), cluster.start("r2")
    warm(r2, cluster.key_a, PROMPT_A)
    hostile = redis.Redis.from_url(REDIS_URL)
    channel = ClusterConfig(REDIS_URL, cluster.namespace).channel
    for junk in (b"not json", b"[]", b'{"tenant_id": "x"}', b'{"tenant_id": 5}', b"\xff\xfe",
                 # Forged events: well-formed, but nothing changed in the database. An event
                 # is only a hint, so they neither flush a cache nor pin a generation.
                 json.dumps({"origin": "evil", "tenant_id": cluster.a}).encode(),
                 json.dumps({"origin": "evil", "tenant_id": None}).encode()):
        hostile.publish(channel, junk)
    time.sleep(0.3)
    assert r2.resident(cluster.a) >= 4  # still cached: the forgeries changed nothing
    assert r2.cached(cluster.key_a, PROMPT_A) == 64
    r1.client.post(f"/admin/tenants/{cluster.a}/cache/reset", headers=r1.admin)
    within(1.0, lambda: r2.resident(cluster.a) == 0)  # the real one still works
    assert r2.client.get("/health").status_code == 200


def test_a_tenant_at_its_rpm_limit_is_refused_whichever_replica_it_reaches(cluster):
    r1, r2 = cluster.start("r1"), cluster.start("r2")
    r = r1.client.patch(f"/admin/tenants/{cluster.b}", headers=r1.admin,
                        json={"rpm_limit": 3, "max_concurrent": 2})
    assert r.status_code == 200
    headers = {"Authorization": f"Bearer {cluster.key_b}"}
    for replica in (r1, r2, r1):
        assert replica.client.get("/v1/usage", headers=headers).status_code == 200
    for replica in (r2, r1):  # the fourth request, wherever it lands
        refused = replica.client.get("/v1/usage", headers=headers)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    # The other tenant is not limited by B's window.
    assert r2.cached(cluster.key_a, PROMPT_A) == 0


def test_a_rotation_from_the_cli_reaches_running_replicas_at_once(cluster, tmp_path):
    from click.testing import CliRunner

    from app.cli.main import main

    r1 = cluster.start("r1")
    warm(r1, cluster.key_a, PROMPT_A)
    env = {"SALTSERVE_MASTER_KEY": cluster.master_key, "SALTSERVE_REDIS_URL": REDIS_URL,
           "SALTSERVE_REDIS_NAMESPACE": cluster.namespace}
    r = CliRunner(env=env).invoke(main, ["tenants", "rotate-salt", "tenant-a", "--data-dir",
                                         str(tmp_path / "cli"), "--database-url",
                                         cluster.database_url])
    assert r.exit_code == 0, r.output
    assert "salt_version=2 (replicas told: 1)" in r.output
    within(1.0, lambda: r1.resident(cluster.a) == 0)
    assert r1.cached(cluster.key_a, PROMPT_A) == 0
