"""The multi-replica deployment for real: two ``saltserve serve`` processes on the bundled model,
sharing PostgreSQL, Redis and a data dir, behind Debian's HAProxy with
``deploy/haproxy/haproxy.cfg`` (consistent hash of the Authorization header), on loopback.

Tenant affinity and its cache hits, a rotation or reset through one replica reaching the other,
kill -9 of a replica under load (only its in-flight requests fail, HAProxy moves its tenants, no
usage row of a completed response is lost) and a graceful drain on SIGTERM.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from serve_process import REPO_ROOT, ServerProcess, free_port, serve

from tenants.tokens import JWTConfig, issue_token, load_or_create_platform_key

HAPROXY = "/usr/sbin/haproxy"
REDIS_URL = "redis://127.0.0.1:6379/0"
MODEL = "SmolLM2-135M-Instruct"


def messages(tenant: str) -> list[dict]:
    """A prompt of several full 16-token blocks, its own per tenant."""
    return [{"role": "system", "content": f"You answer for {tenant}'s shipping desk, in one "
             "short sentence, about ports, ships and cargo schedules."},
            {"role": "user", "content": "Which is larger, Rotterdam or Hamburg?"}]


@dataclass
class Cluster:
    lb: str
    replicas: dict[str, ServerProcess]
    admin: dict[str, str]
    keys: dict[str, str] = field(default_factory=dict)  # tenant name -> API key
    ids: dict[str, str] = field(default_factory=dict)  # tenant name -> id
    homes: dict[str, str] = field(default_factory=dict)  # tenant name -> its replica
    start_replica: Callable[..., ServerProcess] | None = None

    def chat(self, tenant: str, max_tokens: int = 4, ignore_eos: bool = False) -> int:
        client = openai.OpenAI(base_url=self.lb + "/v1", api_key=self.keys[tenant],
                               max_retries=0, timeout=120)
        r = client.chat.completions.create(model=MODEL, messages=messages(tenant),
                                           max_tokens=max_tokens, temperature=0,
                                           extra_body={"ignore_eos": ignore_eos})
        return r.usage.prompt_tokens_details.cached_tokens

    def resident(self, replica: str, tenant: str) -> int:
        stats = httpx.get(self.replicas[replica].base + "/admin/cache", headers=self.admin,
                          timeout=10).json()
        return next((t["resident_blocks"] for t in stats["tenants"]
                     if t["tenant_id"] == self.ids[tenant]), 0)

    def in_flight(self, replica: str) -> int:
        """Requests running or waiting on ``replica`` (its Prometheus gauges)."""
        text = httpx.get(self.replicas[replica].base + "/metrics", headers=self.admin,
                         timeout=5).text
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                   if line.startswith(("saltserve:num_requests_running{",
                                       "saltserve:num_requests_waiting{")))

    def home(self, tenant: str) -> str:
        """The replica holding the tenant's cached blocks (exactly one)."""
        homes = [r for r in self.replicas if self.resident(r, tenant) > 0]
        assert len(homes) == 1, (tenant, homes)
        return homes[0]


def within(seconds: float, check) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"not within {seconds} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory) -> Iterator[Cluster]:
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    from tenants.db import make_engine

    if not Path(HAPROXY).exists():
        pytest.fail(f"{HAPROXY} is missing: `make install` installs Debian's haproxy")
    pg = os.environ.get("SALTSERVE_TEST_POSTGRES_URL",
                        "postgresql+psycopg://postgres@127.0.0.1:5432/test")
    schema = f"c_{secrets.token_hex(6)}"
    with make_engine(pg).begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    db = make_url(pg).update_query_dict({"options": f"-csearch_path={schema}"})
    data_dir = tmp_path_factory.mktemp("cluster")
    common = ["--database-url", db.render_as_string(hide_password=False), "--redis-url",
              REDIS_URL, "--drain-seconds", "2", "--log-format", "json"]
    os.environ["SALTSERVE_REDIS_NAMESPACE"] = f"test-{schema}"  # inherited by the replicas
    stack = ExitStack()
    replicas: dict[str, ServerProcess] = {}

    def start_replica(name: str, port: int | None = None) -> ServerProcess:
        proc = stack.enter_context(serve(model_dir, data_dir, "--replica-id", name, *common,
                                         port=port))
        replicas[name] = proc
        return proc

    try:
        start_replica("r1")  # first: converts nothing (model given), migrates, demo key
        start_replica("r2")
        lb_port = free_port()
        env = {**os.environ, "SALTSERVE_LB_BIND": f"127.0.0.1:{lb_port}",
               "SALTSERVE_REPLICA_1": replicas["r1"].base.removeprefix("http://"),
               "SALTSERVE_REPLICA_2": replicas["r2"].base.removeprefix("http://")}
        haproxy = subprocess.Popen([HAPROXY, "-db", "-f", "deploy/haproxy/haproxy.cfg"],
                                   cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        stack.callback(haproxy.wait, 10)
        stack.callback(haproxy.terminate)
        lb = f"http://127.0.0.1:{lb_port}"
        within(20, lambda: _ok(lb + "/health"))
        admin_jwt = issue_token(load_or_create_platform_key(data_dir), JWTConfig(),
                                subject="ops", role="admin", tenant_id=None, ttl_s=3600)
        c = Cluster(lb, replicas, {"Authorization": f"Bearer {admin_jwt}"},
                    start_replica=start_replica)
        add_tenants(c, 4)  # each test can run on its own
        yield c
    finally:
        stack.close()
        os.environ.pop("SALTSERVE_REDIS_NAMESPACE", None)
        with make_engine(pg).begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    for name, proc in replicas.items():
        assert "Traceback" not in proc.output, (name, proc.output[-3000:])


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def add_tenants(c: Cluster, n: int) -> None:
    """Creates tenants through r1 until both replicas are home to at least one, and at least
    ``n`` in all."""
    while True:
        name = f"t{len(c.keys)}"
        t = httpx.post(c.replicas["r1"].base + "/admin/tenants", headers=c.admin,
                       json={"name": name}).json()
        k = httpx.post(c.replicas["r1"].base + f"/admin/tenants/{t['id']}/keys",
                       headers=c.admin, json={}).json()
        c.keys[name], c.ids[name] = k["key"], t["id"]
        assert c.chat(name) == 0
        c.homes[name] = c.home(name)
        if len(c.keys) >= n and set(c.homes.values()) == {"r1", "r2"}:
            return
        assert len(c.keys) < 24, "every tenant hashed to one replica"


def test_each_tenant_sticks_to_one_replica_and_its_repeats_hit(cluster):
    for tenant in cluster.keys:
        home = cluster.home(tenant)
        assert cluster.chat(tenant) > 0 and cluster.chat(tenant) > 0  # repeats hit ...
        assert cluster.home(tenant) == home  # ... on the same replica


def test_a_second_authorization_header_cannot_steer_the_hash(cluster):
    tenant = next(iter(cluster.keys))
    headers = [("Authorization", f"Bearer {cluster.keys[tenant]}"),
               ("Authorization", "Bearer steer-me-elsewhere")]
    r = httpx.get(cluster.lb + "/v1/models", headers=headers)
    assert r.status_code == 400  # refused by HAProxy
    r = httpx.get(cluster.replicas["r1"].base + "/v1/models", headers=headers)
    assert r.status_code == 401  # and by the server itself


def test_a_rotation_through_r1_makes_the_next_request_on_r2_miss(cluster):
    on_r2 = [t for t, home in cluster.homes.items() if home == "r2"]
    tenant, other = on_r2[0], (on_r2[1:] or [None])[0]
    r = httpx.post(cluster.replicas["r1"].base + f"/admin/tenants/{cluster.ids[tenant]}"
                   "/rotate-salt", headers=cluster.admin)
    assert r.status_code == 200
    within(1.0, lambda: cluster.resident("r2", tenant) == 0)  # r2 dropped it, unasked
    assert cluster.chat(tenant) == 0  # through HAProxy to r2: a miss under the new salt
    assert cluster.chat(tenant) > 0
    if other is not None:  # r2's other tenants kept theirs
        assert cluster.chat(other) > 0


def test_a_reset_through_one_replica_empties_the_tenant_on_both(cluster):
    tenant = next(iter(cluster.keys))
    for replica in ("r1", "r2"):  # straight to each replica, past HAProxy: blocks on both
        client = openai.OpenAI(base_url=cluster.replicas[replica].base + "/v1",
                               api_key=cluster.keys[tenant], max_retries=0)
        client.chat.completions.create(model=MODEL, messages=messages(tenant), max_tokens=1)
    assert cluster.resident("r1", tenant) > 0 and cluster.resident("r2", tenant) > 0
    r = httpx.post(cluster.replicas["r2"].base + f"/admin/tenants/{cluster.ids[tenant]}"
                   "/cache/reset", headers=cluster.admin)
    assert r.status_code == 200
    within(1.0, lambda: cluster.resident("r1", tenant) == 0
           and cluster.resident("r2", tenant) == 0)


def test_a_tenant_at_its_rpm_limit_is_refused_whichever_replica_it_reaches(cluster):
    tenant = next(iter(cluster.keys))
    r = httpx.patch(cluster.replicas["r2"].base + f"/admin/tenants/{cluster.ids[tenant]}",
                    headers=cluster.admin, json={"rpm_limit": 2})
    assert r.status_code == 200
    try:
        key = {"Authorization": f"Bearer {cluster.keys[tenant]}"}
        for replica in ("r1", "r2"):  # one request on each replica, past HAProxy
            ok = httpx.get(cluster.replicas[replica].base + "/v1/usage", headers=key)
            assert ok.status_code == 200
        for replica in ("r1", "r2"):
            refused = httpx.get(cluster.replicas[replica].base + "/v1/usage", headers=key)
            assert refused.status_code == 429, (replica, refused.text)
        assert httpx.get(cluster.lb + "/v1/usage", headers=key).status_code == 429
    finally:
        httpx.patch(cluster.replicas["r1"].base + f"/admin/tenants/{cluster.ids[tenant]}",
                    headers=cluster.admin, json={"rpm_limit": None})


def test_sigterm_drains_a_replica_without_failing_a_request(cluster):
    """A rolling restart's step: SIGTERM makes r2 answer /health 503 for --drain-seconds while
    it keeps serving, HAProxy moves new requests to r1, r2's running request finishes, r2
    exits; restarted on its port, HAProxy brings it back."""
    on_r2 = [t for t, home in cluster.homes.items() if home == "r2"]
    results: list[str] = []

    def one(tenant: str, max_tokens: int, ignore_eos: bool = False) -> None:
        try:
            cluster.chat(tenant, max_tokens, ignore_eos)
            results.append("ok")
        except openai.OpenAIError as e:
            results.append(type(e).__name__)

    # 256 tokens: a few seconds of decode at this machine's fastest (48 can finish within a
    # second).
    long = threading.Thread(target=one, args=(on_r2[0], 256, True))
    long.start()
    r2 = cluster.replicas["r2"]
    within(30, lambda: cluster.in_flight("r2") >= 1)  # the long request runs on r2
    r2.process.send_signal(signal.SIGTERM)
    health = httpx.get(r2.base + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:  # new requests all through the drain and the stop
        one(on_r2[-1], 2)
    long.join(120)
    assert results and set(results) == {"ok"}, results
    # uvicorn re-raises the signal once its graceful shutdown is done.
    assert r2.process.wait(60) in (0, -signal.SIGTERM)
    cluster.replicas.pop("r2")
    cluster.start_replica("r2", port=r2.port)
    within(10, lambda: _served_by(cluster, on_r2[0], "r2"))


def _served_by(cluster: Cluster, tenant: str, replica: str) -> bool:
    """True once the tenant's next request through HAProxy lands on ``replica`` again."""
    before = cluster.resident(replica, tenant)
    cluster.chat(tenant)
    return cluster.resident(replica, tenant) > before or cluster.resident(replica, tenant) > 0


def test_kill_9_under_load_fails_only_that_replicas_in_flight_requests(cluster):
    on_r1 = [t for t, home in cluster.homes.items() if home == "r1"]
    on_r2 = [t for t, home in cluster.homes.items() if home == "r2"]
    results: list[tuple[str, str, str | None]] = []  # (tenant, "ok" | error, response id)
    lock = threading.Lock()

    def one(tenant: str) -> None:
        client = openai.OpenAI(base_url=cluster.lb + "/v1", api_key=cluster.keys[tenant],
                               max_retries=0, timeout=120)
        try:
            # 96 tokens whatever the model says (no early eos): still running at the kill.
            r = client.chat.completions.create(model=MODEL, messages=messages(tenant),
                                               max_tokens=96, temperature=0,
                                               extra_body={"ignore_eos": True})
            outcome = ("ok", r.id)
        except openai.OpenAIError as e:
            outcome = (type(e).__name__, None)
        with lock:
            results.append((tenant, *outcome))

    # Two tenants per replica where possible, two requests each. HAProxy's bounded load may
    # spill a burst onto the other replica, so what r2 held when it died is read from r2.
    threads = [threading.Thread(target=one, args=(t,)) for t in on_r1[:2] + on_r2[:2]
               for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.5)  # all admitted, most mid-generation
    r2 = cluster.replicas["r2"]
    in_flight = cluster.in_flight("r2")
    r2.process.kill()  # SIGKILL: no drain, no journal flush, no goodbye
    for t in threads:
        t.join(180)
    outcomes = [o for (_, o, _) in results]
    assert len(outcomes) == len(threads)  # nothing hangs
    failed = len(threads) - outcomes.count("ok")
    # Only what r2 held when it died failed (a request can finish between the count and the
    # kill, hence <=); the rest, on r1, completed.
    assert 1 <= failed <= in_flight, (in_flight, outcomes)
    assert set(outcomes) <= {"ok", "InternalServerError"}  # a 502 from HAProxy
    # r2's tenants are served by r1 from now on (HAProxy retries refused connections).
    for t in on_r2:
        cluster.chat(t)
    # Every completed response has its usage row, r2's included once r2 is back (its journal
    # on disk is stored at start).
    cluster.replicas.pop("r2")
    cluster.start_replica("r2", port=r2.port)
    done = {rid for (_, o, rid) in results if o == "ok"}
    assert done

    def stored() -> bool:
        rows = httpx.get(cluster.replicas["r1"].base + "/admin/usage", headers=cluster.admin,
                         params={"limit": 100_000}).json()["data"]
        return done <= {row["request_id"] for row in rows}

    within(10, stored)



def test_a_killed_replicas_tenant_finds_its_prefix_in_the_shared_tier(cluster):
    """The shared KV tier (Redis) is written through: a prefix r2 computed is in Redis while
    it is still in r2's pool. Kill -9 r2: HAProxy moves the tenant to r1, whose pool never
    saw it, and its first request there reports the whole prefix as cached."""
    on_r2 = [t for t, home in cluster.homes.items() if home == "r2"]
    tenant = on_r2[0]
    within(20, lambda: _served_by(cluster, tenant, "r2"))  # r2 is back in HAProxy's ring
    r = httpx.post(cluster.replicas["r1"].base + f"/admin/tenants/{cluster.ids[tenant]}"
                   "/cache/reset", headers=cluster.admin)  # nothing of it anywhere, Redis too
    assert r.status_code == 200
    within(1.0, lambda: cluster.resident("r1", tenant) == cluster.resident("r2", tenant) == 0)
    assert cluster.chat(tenant) == 0
    warm = cluster.chat(tenant)  # r2's pool hit: the prefix's full blocks
    assert warm > 0 and cluster.home(tenant) == "r2"
    r2 = cluster.replicas.pop("r2")
    r2.process.kill()  # SIGKILL: no shutdown, nothing saved on the way out
    r2.process.wait(30)
    assert cluster.chat(tenant) == warm  # on r1, loaded from Redis
    assert cluster.resident("r1", tenant) > 0
    metrics = httpx.get(cluster.replicas["r1"].base + "/metrics", headers=cluster.admin,
                        timeout=10).text
    loaded = [line for line in metrics.splitlines()
              if line.startswith('saltserve:kv_offload_loaded_blocks_total{') and 'tier="redis"'
              in line]
    assert loaded and float(loaded[0].rsplit(" ", 1)[1]) >= warm // 16
    cluster.start_replica("r2", port=r2.port)
    within(10, lambda: _served_by(cluster, tenant, "r2"))
