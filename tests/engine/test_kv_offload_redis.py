"""The shared tier in Redis (``engine.kv_offload.RedisStore``), against the Redis every
deployment runs: its fair budget across replicas, owners stored as opaque tags, a tenant's
prefix written by one engine and loaded by another (a replica move, bit for bit), and Redis
going away: every call misses or drops, nothing raises, serving goes on."""

from __future__ import annotations

import logging
import secrets
import time

import pytest
import redis

from engine.kv_offload import RedisStore

REDIS_URL = "redis://127.0.0.1:6379/0"
LAYOUT = b"model|float32|2x2x16x2x16"


@pytest.fixture
def store():
    namespace = f"test-{secrets.token_hex(6)}"
    s = RedisStore(REDIS_URL, 1_000, namespace, LAYOUT)
    yield s
    s.delete_all()
    client = redis.Redis.from_url(REDIS_URL)
    assert not list(client.scan_iter(f"{namespace}:kv:*:b:*"))  # every blob deleted
    for key in client.scan_iter(f"{namespace}:*"):
        client.delete(key)


def _key(owner: int, i: int) -> bytes:
    return bytes([owner, i]) * 16


def test_blobs_round_trip_under_opaque_owner_tags(store):
    assert store.put(_key(1, 0), b"x" * 100, "tenant-a") and _key(1, 0) in store
    assert store.get(_key(1, 0)) == b"x" * 100 and store.get(_key(1, 1)) is None
    assert store.query([_key(1, 0), _key(1, 1)]) == [True, False]
    client = redis.Redis.from_url(REDIS_URL)
    keys = b" ".join(client.scan_iter(store._prefix + "*"))
    assert b"tenant-a" not in keys and store.tag("tenant-a").encode() in keys
    assert store.usage().owner_bytes == {store.tag("tenant-a"): 100}
    # Another replica (another client, same namespace and layout) sees it; another layout not.
    other = RedisStore(REDIS_URL, 1_000, store._prefix.split(":kv:")[0], LAYOUT)
    assert _key(1, 0) not in other and other.query([_key(1, 0)]) == [True]
    assert _key(1, 0) in other and other.get(_key(1, 0)) == b"x" * 100
    elsewhere = RedisStore(REDIS_URL, 1_000, store._prefix.split(":kv:")[0], b"other")
    assert elsewhere.query([_key(1, 0)]) == [False]
    assert store.delete_owner("tenant-a") == 1 and other.get(_key(1, 0)) is None
    assert store.usage().used_bytes == 0 and store.usage().blobs == 0


def test_a_flooding_tenant_evicts_its_own_blobs_and_weights_count(store):
    for i in range(3):
        store.put(_key(1, i), b"a" * 100, "A")
    for i in range(50):  # B floods far past the 1,000-byte budget
        store.put(_key(2, i), b"b" * 100, "B")
    assert store.query([_key(1, i) for i in range(3)]) == [True] * 3
    u = store.usage()
    assert u.used_bytes == 1_000 and u.owner_bytes == {store.tag("A"): 300,
                                                       store.tag("B"): 700}
    assert store.evicted == 50 - 7
    assert store.put(_key(3, 0), b"c" * 2_000, "C") is False  # larger than the budget
    store.delete_all()
    store.set_share("A", 3)  # weight 3 against 1: A keeps three quarters (of 10 blobs, 8)
    for i in range(40):
        store.put(_key(1, i), b"a" * 100, "A")
        store.put(_key(2, i), b"b" * 100, "B")
    assert store.usage().owner_bytes == {store.tag("A"): 800, store.tag("B"): 200}


def test_floors_caps_and_shares_hold_across_replicas(store):
    """A cap (a fraction of the budget) wins over the weight and a floor is never taken while
    another owner can give, as in the local tiers; ``owner_share_bytes`` reports each owner's
    guaranteed bytes (its occupancy against its quota)."""
    store.capacity_bytes = 4_000
    store.set_share("A", 3, max_fraction=0.25)
    store.set_share("B", 1, min_fraction=0.5)
    for i in range(40):
        store.put(_key(1, i), b"a" * 100, "A")
        store.put(_key(2, i), b"b" * 100, "B")
    u = store.usage()
    assert u.owner_bytes == {store.tag("A"): 1_000, store.tag("B"): 3_000}
    # A's weight would give it 3,000 bytes; its cap gives it 1,000; B's floor is 2,000
    assert u.owner_share_bytes == {store.tag("A"): 1_000, store.tag("B"): 2_000}
    assert store.get(_key(2, 39)) == b"b" * 100 and store.get(_key(2, 0)) is None


def test_owner_tags_are_keyed_by_the_deployment_secret(store):
    namespace = store._prefix.split(":kv:")[0]
    key = secrets.token_bytes(32)
    one = RedisStore(REDIS_URL, 1_000, namespace, LAYOUT, owner_key=key)
    two = RedisStore(REDIS_URL, 1_000, namespace, LAYOUT, owner_key=key)
    assert one.tag("acme") == two.tag("acme") != store.tag("acme")  # replicas agree
    assert one.tag("acme") != RedisStore(REDIS_URL, 1_000, namespace, LAYOUT,
                                         owner_key=secrets.token_bytes(32)).tag("acme")


def test_a_blob_redis_evicted_itself_leaves_the_budget(store):
    """Under a maxmemory policy other than noeviction Redis may drop a blob: the next read
    misses and the tier's counters give its bytes back."""
    store.put(_key(1, 0), b"x" * 300, "A")
    store.put(_key(1, 1), b"y" * 200, "A")
    redis.Redis.from_url(REDIS_URL).delete(store._prefix + "b:" + _key(1, 0).hex())
    assert store.get(_key(1, 0)) is None
    u = store.usage()
    assert (u.used_bytes, u.blobs, u.owner_bytes) == (200, 1, {store.tag("A"): 200})


def test_a_deletion_while_redis_is_down_runs_once_it_is_back(store, monkeypatch):
    """A reset while the tier is unreachable: the tenant's blobs are deleted by the first
    write or read once Redis answers again, before that call (another tenant's blobs stay)."""
    store.put(_key(1, 0), b"a" * 100, "A")
    store.put(_key(2, 0), b"b" * 100, "B")
    script = store._scripts["delete_owners"]

    def down(*args, **kwargs):
        raise redis.ConnectionError("down")

    monkeypatch.setitem(store._scripts, "delete_owners", down)
    assert store.delete_owner("A") == 0 and not store.up
    monkeypatch.setitem(store._scripts, "delete_owners", script)
    assert store.put(_key(2, 1), b"b" * 100, "B") is False  # still within its retry wait
    assert store.usage().up is False
    store._down_until = 0.0  # the retry time has come
    assert store.put(_key(2, 1), b"b" * 100, "B")
    assert store.query([_key(1, 0), _key(2, 0), _key(2, 1)]) == [False, True, True]
    assert store.usage().owner_bytes == {store.tag("B"): 200}


def test_redis_going_away_is_a_miss_never_an_error(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.kv_offload.redis_store"):
        down = RedisStore("redis://127.0.0.1:1/0", 1_000, "test-down", LAYOUT,
                          retry_after_s=60)
        assert down.put(_key(1, 0), b"x" * 10, "A") is False
        assert down.get(_key(1, 0)) is None and down.query([_key(1, 0)]) == [False]
        assert down.delete_owner("A") == 0 and not down.up
        assert down.usage().up is False
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1
    assert down.errors == 1  # the first failure turned it off: no more connection attempts


# -- through two engines: a replica move ------------------------------------------------------
def test_a_prefix_written_by_one_engine_is_loaded_by_another(tmp_path):
    """Engine 1 (a replica) computes a tenant's prompt: the shared tier is write-through, so
    its blocks are in Redis as soon as the step that computed them is done, evicted or not
    (a replica killed now leaves them behind). Engine 2, on the same namespace with a pool
    that never saw them, loads the whole prefix and answers bit for bit as engine 1 does
    warm. Another tenant sending the same prompt gets nothing."""
    import torch
    from tiny_checkpoints import VOCAB, StubTokenizer, build_checkpoint

    from engine.config import EngineConfig
    from engine.llm import run_to_completion
    from engine.llm_engine import LLMEngine
    from engine.request import EngineRequest
    from engine.sampling_params import SamplingParams

    model_dir = build_checkpoint("llama", tmp_path / "model")
    namespace = f"test-{secrets.token_hex(6)}"

    def engine():
        return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                      max_model_len=256, num_gpu_blocks_override=16,
                                      kv_offload_size=0, kv_offload_redis_url=REDIS_URL,
                                      kv_offload_redis_size=64 << 20,
                                      kv_offload_redis_namespace=namespace),
                         tokenizer=StubTokenizer())

    def prompt(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(1, VOCAB, (150,), generator=g).tolist()

    def run(e, p, tag, tenant="A", salt=b"a" * 32):
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
        (out,) = run_to_completion(e, [EngineRequest(tag, tuple(p), params, tenant_id=tenant,
                                                     cache_salt=salt)])
        e.offloader.flush()
        return out.num_cached_tokens, out.token_ids, [lp.logprob for lp in out.logprobs]

    first = engine()
    down = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                  max_model_len=256, num_gpu_blocks_override=16,
                                  kv_offload_size=0, kv_offload_redis_url="redis://127.0.0.1:1/0",
                                  kv_offload_redis_namespace=namespace),
                     tokenizer=StubTokenizer())
    try:
        assert [t.name for t in first.offloader.tiers] == ["redis"]
        cold = run(first, prompt(0), "cold")
        assert first.offloader.stats.tiers["redis"].written == 9  # still in the pool, too
        # With Redis unreachable the same request is served the same; the tier is off.
        assert run(down, prompt(0), "down") == cold
        assert run(down, prompt(0), "down-again")[0] == 144  # its own pool still hits
        assert down.stats_snapshot().offload.tiers[0].up is False
        assert first.kv_cache_manager.block_pool.get_num_cached_blocks() >= 9
        _, *warm = run(first, prompt(0), "warm")
        second = engine()
        cached, *answer = run(second, prompt(0), "moved")
        assert cached == 144 and answer == warm
        assert second.offloader.stats.tiers["redis"].loaded == 9
        other, *_ = run(second, prompt(0), "other", tenant="B", salt=b"b" * 32)
        assert other == 0
        snap = second.stats_snapshot()
        (redis_tier,) = snap.offload.tiers
        assert redis_tier.name == "redis" and redis_tier.up and redis_tier.used_bytes > 0
        assert snap.tenants["A"].offload_bytes["redis"] > 0  # its tag, named again
        # A reset on one replica empties the tenant in the shared tier for both.
        tier = first.offloader.tiers[0]
        assert tier.tag("A") in tier.usage().owner_bytes
        second.evict_tenant_cache("A", "reset")
        second.offloader.flush()  # the deletion runs on the writer thread
        assert tier.tag("A") not in tier.usage().owner_bytes
    finally:
        first.offloader.drop_all()


def test_the_tier_comes_back_through_the_writer_never_through_a_lookup(store, monkeypatch):
    """Down after a failure: lookups (the engine thread) do not try Redis at all; the first
    write after ``retry_after_s`` does, and its success brings the tier back."""
    store._retry_after_s = 0.05
    real = store._scripts["put_index"]
    monkeypatch.setitem(store._scripts, "put_index", lambda **kw: (_ for _ in ()).throw(
        redis.ConnectionError("gone")))
    assert store.put(_key(1, 0), b"x" * 10, "A") is False and not store.up
    calls = []
    with monkeypatch.context() as m:
        m.setattr(store._redis, "pipeline", lambda **kw: calls.append(kw))
        assert store.query([_key(1, 0)]) == [False] and calls == []  # no attempt while down
        assert store.usage().up is False and calls == []
    monkeypatch.setitem(store._scripts, "put_index", real)
    assert store.put(_key(1, 0), b"x" * 10, "A") is False  # within retry_after_s: not tried
    time.sleep(0.06)
    assert store.put(_key(1, 0), b"x" * 10, "A") is True and store.up
