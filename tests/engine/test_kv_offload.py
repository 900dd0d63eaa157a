"""The disk offload tier behind the block pool (``engine.kv_offload``): blobs sealed per tenant
(a tampered, truncated, swapped or another generation's blob never opens), files 0600 under
hash names, a byte budget a flooding tenant pays from its own blobs, and, through the engine on
a tiny random checkpoint with a pool too small for the working set: prefixes the pool evicted
come back from disk bit for bit (greedy tokens and logprobs identical to the tier off), after a
restart too, never across tenants, and a bad blob is a miss the request computes."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time

import pytest
import torch
from tiny_checkpoints import VOCAB, StubTokenizer, build_checkpoint

from engine.config import EngineConfig
from engine.kv_offload import BlockCipher, DiskStore, MemoryStore
from engine.llm import run_to_completion
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest, RequestStatus
from engine.sampling_params import SamplingParams

SALT_A, SALT_B = b"a" * 32, b"b" * 32
H1, H2 = bytes(range(32)), bytes(range(1, 33))


# -- the cipher -------------------------------------------------------------------------------
def test_a_blob_opens_only_with_its_salt_generation_hash_and_layout():
    cipher = BlockCipher(b"model|float32|2x2x16x2x16", 64)
    data = os.urandom(64)
    blob = cipher.seal(SALT_A, 3, H1, data)
    assert len(blob) == cipher.blob_bytes == 64 + 28 and data not in blob
    assert cipher.open(SALT_A, 3, H1, blob) == data
    assert cipher.seal(SALT_A, 3, H1, data) != blob  # a fresh nonce every time
    assert cipher.open(SALT_B, 3, H1, blob) is None  # another tenant
    assert cipher.open(SALT_A, 4, H1, blob) is None  # after a reset or rotation
    assert cipher.open(SALT_A, 3, H2, blob) is None  # replayed under another hash
    assert BlockCipher(b"other", 64).open(SALT_A, 3, H1, blob) is None  # another layout
    assert cipher.open(SALT_A, 3, H1, blob[:-1]) is None  # truncated
    for i in (0, 20, len(blob) - 1):  # any byte flipped: nonce, ciphertext, tag
        bad = bytearray(blob)
        bad[i] ^= 1
        assert cipher.open(SALT_A, 3, H1, bytes(bad)) is None
    with pytest.raises(ValueError):
        cipher.seal(SALT_A, 3, H1, data[:-1])


def held(store, owner: str) -> int:
    """``owner``'s bytes in a local tier (the disk tier stores a tag of it)."""
    return store.owner_bytes().get(store.tag(owner) if hasattr(store, "tag") else owner, 0)


# -- the disk store ---------------------------------------------------------------------------
def test_files_are_private_grouped_by_a_keyed_tag_and_found_again_with_their_owner(tmp_path):
    key = os.urandom(32)
    store = DiskStore(tmp_path / "tier", 10_000, owner_key=key)
    assert store.put(H1, b"x" * 100, "tenant-a") and store.put(H2, b"y" * 50, "tenant-b")
    tag = store.tag("tenant-a")
    assert len(tag) == 24 and tag != store.tag("tenant-b")
    assert tag != DiskStore(tmp_path / "other", 1, owner_key=os.urandom(32)).tag("tenant-a")
    path = tmp_path / "tier" / tag / (H1.hex() + ".kv")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "tier").stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert "tenant-a" not in "".join(str(p) for p in (tmp_path / "tier").rglob("*"))
    assert store.get(H1) == b"x" * 100 and store.get(bytes(32)) is None
    (path.parent / "junk.kv.tmp").write_bytes(b"half a write")  # a write cut short
    old = tmp_path / "tier" / "ab"  # a blob of the earlier layout (<hash[:2]>/<hash>.kv)
    old.mkdir()
    (old / (b"\xab".hex() * 32 + ".kv")).write_bytes(b"z" * 10)
    again = DiskStore(tmp_path / "tier", 10_000, owner_key=key)
    assert H1 in again and again.get(H1) == b"x" * 100 and len(again) == 2
    assert not (path.parent / "junk.kv.tmp").exists() and not old.exists()
    # every blob keeps its owner across the restart: its tenant's reset deletes it at once
    assert again.owner_bytes() == {tag: 100, again.tag("tenant-b"): 50}
    assert again.delete_owner("tenant-a") == 1 and not path.exists() and H2 in again


def _direct_works(path) -> bool:
    """Whether the file system under ``path`` takes O_DIRECT opens."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = path / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 100_003])
def test_a_blob_written_past_the_page_cache_reads_back_whole_and_exact(tmp_path, size):
    if not _direct_works(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    store = DiskStore(tmp_path, 1 << 20, owner_key=os.urandom(32))
    blob = os.urandom(size)
    assert store.put(H1, blob, "t") and store._direct  # padded to 4 KiB, then cut to size
    path = tmp_path / store.tag("t") / (H1.hex() + ".kv")
    assert path.stat().st_size == size and store.get(H1) == blob
    assert store.put(H2, blob[::-1], "t") and store.get(H2) == blob[::-1]  # buffer reused
    # a larger blob first, then this one: the pad holds zeros, not the earlier blob's bytes
    assert store.put(b"\x03" * 32, b"\xff" * (size + 8192), "u") and store.put(b"\x04" * 32, blob, "t")
    pad = -(-size // 4096) * 4096
    assert store._local.buf[size:pad] == bytes(pad - size)
    assert DiskStore(tmp_path, 1 << 20, owner_key=store._tag_key).get(H1) == blob


def test_a_file_system_without_o_direct_falls_back_to_the_page_cache(tmp_path, monkeypatch,
                                                                    caplog):
    direct = getattr(os, "O_DIRECT", 0)
    real = os.open
    refused = []

    def open_(path, flags, mode=0o777):
        if direct and flags & direct:  # as tmpfs on older kernels, and other file systems do
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, mode)

    monkeypatch.setattr("engine.kv_offload.disk.os.open", open_)
    store = DiskStore(tmp_path, 1 << 20, owner_key=os.urandom(32))
    with caplog.at_level(logging.INFO, "engine.kv_offload.disk"):
        assert store.put(H1, b"a" * 5000, "t") and store.put(H2, b"b" * 7, "t")
    assert not store._direct and store.write_errors == 0 and len(refused) == bool(direct)
    assert store.get(H1) == b"a" * 5000 and store.get(H2) == b"b" * 7
    assert sum("O_DIRECT" in r.getMessage() for r in caplog.records) == bool(direct)


def test_prefetch_asks_the_kernel_for_the_files_it_holds_only(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, 1 << 20, owner_key=os.urandom(32))
    store.put(H1, b"x" * 10, "t")
    store.put(H2, b"y" * 10, "u")
    hinted = []
    real = os.posix_fadvise

    def fadvise(fd, offset, length, advice):
        hinted.append((os.readlink(f"/proc/self/fd/{fd}"), advice))
        return real(fd, offset, length, advice)

    monkeypatch.setattr("engine.kv_offload.disk.os.posix_fadvise", fadvise)
    store.prefetch([H2, bytes(32), H1])
    assert hinted == [(str(tmp_path / store.tag("u") / (H2.hex() + ".kv")),
                       os.POSIX_FADV_WILLNEED),
                      (str(tmp_path / store.tag("t") / (H1.hex() + ".kv")),
                       os.POSIX_FADV_WILLNEED)]
    assert store.get(H1) == b"x" * 10 and store.get(H2) == b"y" * 10


def test_without_a_deployment_key_the_tier_keeps_its_own(tmp_path):
    store = DiskStore(tmp_path, 1_000)
    key_file = tmp_path / "owner.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(key_file.read_bytes()) == 32
    assert DiskStore(tmp_path, 1_000).tag("A") == store.tag("A")  # the same after a restart


def test_a_flooding_tenant_evicts_its_own_blobs(tmp_path):
    store = DiskStore(tmp_path, 1_000)
    keys_a = [bytes([1, i]) * 16 for i in range(3)]
    for k in keys_a:
        store.put(k, b"a" * 100, "A")
    for i in range(50):  # B floods unique blobs far past the budget
        store.put(bytes([2, i]) * 16, b"b" * 100, "B")
    assert all(k in store for k in keys_a)
    assert store.used_bytes <= 1_000 and held(store, "A") == 300
    assert store.evicted == 50 + 3 - 10
    assert store.delete_owner("B") == 7 and store.owner_bytes() == {store.tag("A"): 300}


# -- through the engine -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_checkpoint("llama", tmp_path_factory.mktemp("tier-model"))


def _engine(model_dir, tier_dir=None, **overrides):
    """A 16-block pool (256 tokens): one 150-token request fills most of it. ``overrides``:
    more ``EngineConfig`` fields."""
    return LLMEngine(EngineConfig(**{
        "model": str(model_dir), "device": "cpu", "dtype": "float32", "max_model_len": 256,
        "num_gpu_blocks_override": 16, "kv_offload_size": 64 << 20 if tier_dir else 0,
        "kv_offload_dir": str(tier_dir) if tier_dir else None, **overrides}),
        tokenizer=StubTokenizer())


def _prompt(seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (150,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT = _prompt(0)
FULL = 144  # the prompt's 9 full blocks (the last-token rule leaves the rest computed)


def _run(engine, prompts, tenant="A", salt=SALT_A, generation=0, tag="r"):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    out = run_to_completion(engine, [
        EngineRequest(f"{tag}{i}", tuple(p), params, tenant_id=tenant, cache_salt=salt,
                      cache_generation=generation) for i, p in enumerate(prompts)])
    if engine.offloader is not None:
        engine.offloader.flush()
    return out


def _evict(engine, tenant="A", salt=SALT_A, tag="evict"):
    """Three other prompts, one at a time: every block of earlier prompts leaves the pool."""
    for i in range(3):
        _run(engine, [_prompt(100 + i)], tenant, salt, tag=f"{tag}{i}")


def _tokens(outputs):
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outputs]


@pytest.fixture(scope="module")
def reference(model_dir):
    """(cold, warm) answers without a tier: the prompt computed whole, then again with its
    144 tokens hit in the pool (a warm answer's last 6 tokens are computed in another shape,
    so its logprobs may differ from the cold ones in the last bits; the tier's must not differ
    from the pool's at all)."""
    plain = _engine(model_dir)
    cold = _tokens(_run(plain, [PROMPT]))
    warm = _run(plain, [PROMPT], tag="warm")
    assert warm[0].num_cached_tokens == FULL
    _evict(plain)
    assert _run(plain, [PROMPT], tag="again")[0].num_cached_tokens == 0  # no tier: cold
    return cold, _tokens(warm)


def test_evicted_prefixes_come_back_from_disk_bit_for_bit(model_dir, tmp_path, reference):
    cold, warm = reference
    tier = tmp_path / "tier"
    engine = _engine(model_dir, tier)
    assert _tokens(_run(engine, [PROMPT])) == cold
    _evict(engine)
    assert engine.offloader.stats.tiers["disk"].written >= 9
    again = _run(engine, [PROMPT], tag="again")
    assert again[0].num_cached_tokens == FULL and _tokens(again) == warm
    assert engine.offloader.stats.loaded == 9 and engine.offloader.stats.load_missing == 0
    assert engine.offloader.stats.tiers["disk"].load_failed == 0
    engine.kv_cache_manager.check_integrity()
    # Observed: the tenant's tier hits and bytes, the tier's totals, in Prometheus too.
    snap = engine.stats_snapshot()
    assert snap.tenants["A"].prefix_cache_tier_hits == FULL
    (disk,) = snap.offload.tiers
    assert disk.name == "disk" and snap.tenants["A"].offload_bytes == {"disk": disk.used_bytes}
    assert disk.used_bytes > 0 and disk.loaded_blocks == 9 and disk.load_failed == 0
    assert snap.offload.load_jobs == 1 and sum(snap.offload.load_seconds_buckets) == 1
    from prometheus_client import CollectorRegistry, generate_latest

    from app.metrics import EngineCollector

    collector, registry = EngineCollector("m"), CollectorRegistry()
    collector.snapshot = snap
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'saltserve:prefix_cache_tier_hits_total{model_name="m",tenant="A"} 144.0' in text
    assert 'saltserve:kv_offload_loaded_blocks_total{model_name="m",tier="disk"} 9.0' in text
    assert ('saltserve:prompt_tokens_by_source_total{model_name="m",source="tier_hit",'
            'tenant="A"} 144.0') in text
    assert 'saltserve:kv_offload_load_seconds_count{model_name="m"} 1.0' in text

    # A restart finds the tier again: the first request on the prefix hits all of it.
    _evict(engine, tag="evict-more")
    engine.offloader.close()
    restarted = _engine(model_dir, tier)
    assert len(restarted.offloader.store) >= 9
    out = _run(restarted, [PROMPT], tag="restart")
    assert out[0].num_cached_tokens == FULL and _tokens(out) == warm


def test_another_tenant_never_loads_a_tenants_blocks(model_dir, tmp_path, reference):
    cold, warm = reference
    engine = _engine(model_dir, tmp_path / "tier")
    assert _tokens(_run(engine, [PROMPT])) == cold
    _evict(engine)  # A's prompt now only on disk
    # B sends A's very prompt with its own salt: no hit anywhere; its own repeat hits.
    b = _run(engine, [PROMPT], tenant="B", salt=SALT_B, tag="b")
    assert b[0].num_cached_tokens == 0 and _tokens(b) == cold
    _evict(engine, "B", SALT_B, tag="b-evict")
    b_again = _run(engine, [PROMPT], tenant="B", salt=SALT_B, tag="b-again")
    assert b_again[0].num_cached_tokens == FULL and _tokens(b_again) == warm
    # A's own prefix still comes back from disk.
    _evict(engine, tag="a-evict")
    a_again = _run(engine, [PROMPT], tag="a-again")
    assert a_again[0].num_cached_tokens == FULL and _tokens(a_again) == warm


def test_blobs_of_another_weights_dtype_never_load(model_dir, tmp_path):
    """The same model served in another dtype (or quantization) computes other KV for the same
    tokens: its engine on the same tier directory misses every blob written before (they fail
    authentication and are deleted), and computes its own."""
    engine = _engine(model_dir, tmp_path / "tier")
    _run(engine, [PROMPT])
    engine.offloader.close()
    bf16 = _engine(model_dir, tmp_path / "tier", dtype="bfloat16")
    assert len(bf16.offloader.store) == 9  # found at start, under the same hashes
    out = _run(bf16, [PROMPT], tag="bf16")
    assert out[0].num_cached_tokens == 0
    assert bf16.offloader.stats.tiers["disk"].load_failed == 1  # the first: the load stops


def test_a_bad_blob_is_a_miss_and_a_new_generation_reads_nothing(model_dir, tmp_path,
                                                                 reference):
    cold, _ = reference
    tier = tmp_path / "tier"
    engine = _engine(model_dir, tier)
    assert _tokens(_run(engine, [PROMPT])) == cold
    _evict(engine)
    files = sorted(tier.rglob("*.kv"))
    assert files
    for f in files:  # tamper with every blob
        data = bytearray(f.read_bytes())
        data[40] ^= 0xFF
        f.write_bytes(bytes(data))
    out = _run(engine, [PROMPT], tag="tampered")
    assert out[0].num_cached_tokens == 0 and _tokens(out) == cold
    assert engine.offloader.stats.tiers["disk"].load_failed == 1
    engine.kv_cache_manager.check_integrity()
    # A reset deletes the tenant's blobs.
    _evict(engine, tag="evict2")
    assert held(engine.offloader.store, "A") > 0
    engine.evict_tenant_cache("A", "reset")
    assert held(engine.offloader.store, "A") == 0  # unreachable at once
    engine.offloader.flush()  # and its files gone once the writer thread got to them
    assert len(list(tier.rglob("*.kv"))) == len(engine.offloader.store) == 0
    # Blobs of generation 0 never open under generation 1 (a reset or rotation elsewhere).
    _run(engine, [PROMPT], tag="gen0")
    _evict(engine, tag="evict3")
    newer = _run(engine, [PROMPT], generation=1, tag="gen1")
    assert newer[0].num_cached_tokens == 0 and _tokens(newer) == cold


def test_a_tenant_flooding_unique_prompts_leaves_anothers_offloaded_prefix(model_dir, tmp_path):
    """A tier of 40 blocks' bytes; B floods 12 unique prompts (over 100 blocks) after A's one
    prompt, whose 9 blocks are on disk as soon as computed (write-through). The flood pushes
    A's tail out of the pool (the pool's fair share keeps A's head) and B's blobs fill the tier
    and evict only B's own: A's blobs stay, and A's prefix comes back whole, its head from the
    pool and its tail from disk."""
    engine = _engine(model_dir, tmp_path / "tier")
    store, block_blob = engine.offloader.store, engine.offloader.cipher.blob_bytes
    store.capacity_bytes = 40 * block_blob
    _run(engine, [PROMPT])
    _run(engine, [_prompt(500)], tenant="B", salt=SALT_B, tag="flood0")
    a_bytes = held(store, "A")
    assert a_bytes == 9 * block_blob
    for i in range(1, 12):
        _run(engine, [_prompt(500 + i)], tenant="B", salt=SALT_B, tag=f"flood{i}")
    assert store.used_bytes <= store.capacity_bytes and store.evicted > 0
    assert held(store, "A") == a_bytes  # the flood evicted B's blobs only
    loaded = engine.offloader.stats.loaded
    again = _run(engine, [PROMPT], tag="a-again")
    assert again[0].num_cached_tokens == FULL
    tail = engine.offloader.stats.loaded - loaded
    assert 0 < tail < 9
    engine.kv_cache_manager.check_integrity()


# -- loading off the step -----------------------------------------------------------------
class _Gate:
    """Holds every tier read until ``open()``: a load in flight for as long as a test wants."""

    def __init__(self, tier):
        self.tier, self.event, self.reads = tier, threading.Event(), 0
        self._get, tier.get = tier.get, self.get

    def get(self, key):
        self.reads += 1
        assert self.event.wait(30), "the gate was never opened"
        return self._get(key)

    def open(self):
        self.event.set()


def test_a_request_waits_for_its_load_while_other_requests_run(model_dir, tmp_path, reference):
    """The loader thread brings the prefix back while the engine steps other requests: the
    loading request is ``WAITING_FOR_KV_LOAD``, another tenant's request is admitted and
    decodes meanwhile, and the loaded request then hits its whole prefix, bit for bit."""
    _, warm = reference
    engine = _engine(model_dir, tmp_path / "tier")
    _run(engine, [PROMPT])
    _evict(engine)
    gate = _Gate(engine.offloader.store)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    engine.add_request(EngineRequest("loads", tuple(PROMPT), params, tenant_id="A",
                                     cache_salt=SALT_A))
    engine.add_request(EngineRequest("other", tuple(_prompt(7)[:40]), params, tenant_id="B",
                                     cache_salt=SALT_B))
    got: dict[str, list] = {"loads": [], "other": []}

    def step():
        for o in engine.step():
            got[o.request_id].extend(zip(o.new_token_ids, o.new_logprobs, strict=True))

    for _ in range(8):  # B prefills and decodes while A's load is held
        step()
    req = engine.scheduler.requests["loads"]
    assert req.status == RequestStatus.WAITING_FOR_KV_LOAD and gate.reads == 1
    assert len(got["other"]) == 4 and not got["loads"]
    snap = engine.stats_snapshot()
    assert snap.offload.loads_in_flight == 1 and snap.num_requests_waiting == 1
    gate.open()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        step()
    assert req.num_cached_tokens == FULL and req.num_tier_tokens == FULL
    assert ([t for t, _ in got["loads"]], [lp.logprob for _, lp in got["loads"]]) == warm[0]
    engine.kv_cache_manager.check_integrity()


def test_an_aborted_load_frees_its_blocks_only_when_the_loader_is_done(model_dir, tmp_path):
    engine = _engine(model_dir, tmp_path / "tier")
    _run(engine, [PROMPT])
    _evict(engine)
    gate = _Gate(engine.offloader.store)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest("gone", tuple(PROMPT), params, tenant_id="A",
                                     cache_salt=SALT_A))
    engine.step()
    assert engine.scheduler.requests["gone"].status == RequestStatus.WAITING_FOR_KV_LOAD
    free_before = engine.block_pool.get_num_free_blocks()
    engine.abort_request(["gone"])
    # The loader still writes into the request's blocks: none goes back to the pool yet, and
    # the engine keeps stepping until it is done.
    assert engine.block_pool.get_num_free_blocks() == free_before
    assert engine.has_unfinished_requests() and "gone" not in engine.scheduler.requests
    with pytest.raises(ValueError, match="duplicate request id"):  # its blocks are still held
        engine.add_request(EngineRequest("gone", tuple(PROMPT), params, tenant_id="A",
                                         cache_salt=SALT_A))
    gate.open()
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        engine.step()
    assert engine.block_pool.get_num_free_blocks() == engine.cache_info.num_blocks
    engine.kv_cache_manager.check_integrity()
    # What it loaded stays cached: the next request on the prompt hits it in the pool.
    again = _run(engine, [PROMPT], tag="again")
    assert again[0].num_cached_tokens == FULL


def test_a_reset_during_a_load_leaves_nothing_of_the_old_generation(model_dir, tmp_path,
                                                                     reference):
    """A tenant's reset while its load is in flight: the loaded blocks (the old generation)
    are not cached, and the request computes its prefix (the same tokens)."""
    cold, _ = reference
    engine = _engine(model_dir, tmp_path / "tier")
    _run(engine, [PROMPT])
    _evict(engine)
    io, copied, gate = engine.offloader.io, [], threading.Event()

    class HeldCopy:  # the loader has read a block and holds its copy into the cache
        read_block = io.read_block

        @staticmethod
        def write_block(block_id, data):
            copied.append(block_id)
            assert gate.wait(30)
            io.write_block(block_id, data)

    engine.offloader.io = HeldCopy
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    engine.add_request(EngineRequest("loads", tuple(PROMPT), params, tenant_id="A",
                                     cache_salt=SALT_A))
    engine.step()
    req = engine.scheduler.requests["loads"]
    deadline = time.monotonic() + 30
    while not copied:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert req.status == RequestStatus.WAITING_FOR_KV_LOAD
    engine.evict_tenant_cache("A", "reset")
    gate.set()
    tokens = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens.extend(o.new_token_ids)
    assert req.num_cached_tokens == 0 and req.num_tier_tokens == 0 and tokens == cold[0][0]
    engine.kv_cache_manager.check_integrity()


def test_loads_in_flight_take_seats(model_dir, tmp_path):
    """A request waiting for its load counts against ``max_num_seqs``: with one seat, a load
    in flight keeps another request waiting (it would hold pool blocks too)."""
    engine = _engine(model_dir, tmp_path / "tier", max_num_seqs=1)
    _run(engine, [PROMPT])
    _evict(engine)
    gate = _Gate(engine.offloader.store)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest("loads", tuple(PROMPT), params, tenant_id="A",
                                     cache_salt=SALT_A))
    engine.add_request(EngineRequest("next", tuple(_prompt(9)[:20]), params, tenant_id="B",
                                     cache_salt=SALT_B))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.requests["loads"].status == RequestStatus.WAITING_FOR_KV_LOAD
    assert engine.scheduler.requests["next"].status == RequestStatus.WAITING
    gate.open()
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        engine.step()
    engine.kv_cache_manager.check_integrity()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_the_write_policy_decides_when_a_block_reaches_the_disk(model_dir, tmp_path, policy):
    """write_through: a prompt's blocks are on disk once its steps ran, while still in the
    pool; write_back: only once the pool evicts them. Either way the next round hits."""
    engine = _engine(model_dir, tmp_path / "tier", kv_offload_write_policy=policy)
    _run(engine, [PROMPT])
    blob = engine.offloader.cipher.blob_bytes
    assert held(engine.offloader.store, "A") == (9 * blob if policy == "write_through" else 0)
    _evict(engine, "B", SALT_B)
    # write_back: the blocks the pool evicted (its fair share keeps A's head)
    kept = sum(b.owner == "A" for b in engine.block_pool.cached_block_hash_to_block.values())
    assert 0 < kept < 9
    assert held(engine.offloader.store, "A") == (9 if policy == "write_through" else 9 - kept) \
        * blob
    assert _run(engine, [PROMPT], tag="again")[0].num_cached_tokens == FULL


# -- faults of the store --------------------------------------------------------------------
def test_a_full_disk_lowers_the_budget_and_serving_goes_on(model_dir, tmp_path, reference,
                                                           monkeypatch, caplog):
    cold, _ = reference
    engine = _engine(model_dir, tmp_path / "tier")

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("engine.kv_offload.disk.os.write", full)
    with caplog.at_level(logging.WARNING, logger="engine.kv_offload.disk"):
        _run(engine, [PROMPT])
        _evict(engine)
    store = engine.offloader.store
    # The first write hit the full disk; the budget is now what it held (nothing), so the
    # tier refuses the rest without touching the disk.
    assert store.write_errors == 1 and len(store) == 0 and store.capacity_bytes == 0
    assert engine.offloader.stats.tiers["disk"].write_failed >= 9
    assert sum("ENOSPC" in r.getMessage() for r in caplog.records) == 1  # once a minute
    assert not list((tmp_path / "tier").rglob("*.tmp"))
    out = _run(engine, [PROMPT], tag="after")  # computed, not failed
    assert out[0].num_cached_tokens == 0 and _tokens(out) == cold
    engine.kv_cache_manager.check_integrity()


def test_a_weighted_tenant_keeps_its_share_of_a_tier(tmp_path):
    store = DiskStore(tmp_path, 4_000)
    store.set_share("A", 3)
    for i in range(40):  # A and B alternate, far past the budget
        store.put(bytes([1, i]) * 16, b"a" * 100, "A")
        store.put(bytes([2, i]) * 16, b"b" * 100, "B")
    assert (held(store, "A"), held(store, "B")) == (3_000, 1_000)
    capped = MemoryStore(4_000)  # a cap (a fraction of the budget) wins over the weight
    capped.set_share("A", 3, max_fraction=0.25)
    capped.set_share("B", 1, min_fraction=0.5)
    for i in range(40):
        capped.put(bytes([1, i]) * 16, b"a" * 100, "A")
        capped.put(bytes([2, i]) * 16, b"b" * 100, "B")
    assert capped.owner_bytes() == {"A": 1_000, "B": 3_000}
    assert capped.get(bytes([2, 39]) * 16) == b"b" * 100 and capped.get(bytes([2, 0]) * 16) \
        is None


def test_an_in_memory_request_leaves_nothing_in_the_tier(model_dir, tmp_path):
    """OpenAI's ``prompt_cache_retention: "in_memory"`` (``EngineRequest.offload`` False): its
    blocks are never written to a tier, evicted or not; the same prefix sent by a "24h" call
    of the tenant (a hit on those blocks) may go there from then on."""
    engine = _engine(model_dir, tmp_path / "tier")
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def run(tag, offload):
        run_to_completion(engine, [EngineRequest(tag, tuple(PROMPT), params, tenant_id="A",
                                                 cache_salt=SALT_A, offload=offload)])
        engine.offloader.flush()

    store = engine.offloader.store
    run("memory", offload=False)
    _evict(engine, "B", SALT_B)  # B's prompts push A's blocks out of the pool
    assert held(store, "A") == 0 and held(store, "B") > 0
    run("memory-again", offload=False)  # a pool miss, computed again, still not written
    _evict(engine, "B", SALT_B, tag="evict-again")
    assert held(store, "A") == 0
    run("24h", offload=True)  # a "24h" call (hits included): its blocks may go to the tier
    _evict(engine, "B", SALT_B, tag="evict-more")
    # A's 9 blocks: those evicted are on disk now, and the head its cache share kept in the
    # pool carries the key it will be written under.
    pool = engine.block_pool.cached_block_hash_to_block.values()
    kept = [b for b in pool if b.owner == "A"]
    assert all(b.salt == SALT_A for b in kept)
    assert held(store, "A") == (9 - len(kept)) * engine.offloader.cipher.blob_bytes > 0


def test_the_tiers_metrics_give_evictions_by_reason_and_each_tenants_share(model_dir, tmp_path):
    """Through ``stats_snapshot`` and the Prometheus collector: a tenant's bytes in the tier
    beside the bytes its fair share guarantees (weights 3, 1 and 1 split the budget 3:1:1),
    and blobs gone by reason (a reset; a blob failing authentication)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from app.metrics import EngineCollector
    from engine.request import TenantShare

    engine = _engine(model_dir, tmp_path / "tier")
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for tenant, salt, weight in (("A", SALT_A, 3), ("B", SALT_B, 1)):
        run_to_completion(engine, [EngineRequest(
            f"w-{tenant}", tuple(PROMPT), params, tenant_id=tenant, cache_salt=salt,
            tenant_share=TenantShare(weight))])
    _evict(engine, "C", b"c" * 32)  # A's and B's tails leave the pool
    store, blob = engine.offloader.store, engine.offloader.cipher.blob_bytes

    def scrape(name, **labels):
        collector = EngineCollector("m")
        collector.snapshot = engine.stats_snapshot()
        registry = CollectorRegistry()
        registry.register(collector)
        want = {"model_name": "m", "tier": "disk", **labels}
        return next(s.value for fam in text_string_to_metric_families(
            generate_latest(registry).decode()) for s in fam.samples
            if s.name == "saltserve:" + name and s.labels == want)

    def share(tenant):
        return scrape("kv_offload_tenant_share_bytes", tenant=tenant)

    assert (share("A"), share("B"), share("C")) == (
        store.capacity_bytes * 3 // 5, store.capacity_bytes // 5, store.capacity_bytes // 5)
    assert scrape("kv_offload_tenant_bytes", tenant="B") == 9 * blob
    for f in (tmp_path / "tier" / store.tag("B")).glob("*.kv"):
        f.write_bytes(f.read_bytes()[:-1])  # B's blobs truncated
    _run(engine, [PROMPT], tenant="B", salt=SALT_B, tag="b-again")
    engine.evict_tenant_cache("A", "reset")
    engine.offloader.flush()
    assert {reason: scrape("kv_offload_evicted_blobs_total", reason=reason)
            for reason in ("capacity", "reset", "invalid")} == {
        "capacity": 0, "reset": 9, "invalid": 1}
    assert share("B") == share("C") == store.capacity_bytes // 2  # A's blobs are gone


def test_a_queued_write_of_the_old_generation_does_not_stand_for_the_new_one():
    """A reset keeps the salt (so the block hashes) and moves the generation: while the
    writer still holds an old-generation copy of a block, the new generation's copy is queued
    too (a queued write stands only for the same hash and generation)."""
    from types import SimpleNamespace

    from engine.kv_offload import KVOffloader

    store, gate = MemoryStore(1 << 20, write_through=True), threading.Event()
    put = store.put
    store.put = lambda *a: gate.wait(30) and put(*a)
    io = SimpleNamespace(read_block=lambda block_id: bytes([block_id]) * 64)
    off = KVOffloader([store], BlockCipher(b"layout", 64), io)

    def block(h, generation, block_id):
        return SimpleNamespace(block_hash=h, owner="A", salt=SALT_A, generation=generation,
                               block_id=block_id, private=False)

    try:
        off.on_cached(block(H1, 0, 1))  # the writer takes it and waits in put
        deadline = time.monotonic() + 10
        while off._queue.qsize():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        off.on_cached(block(H2, 0, 2))
        off.on_cached(block(H2, 0, 2))  # the same write again: not queued twice
        off.on_cached(block(H2, 1, 3))  # after a reset: queued
        assert off._queue.qsize() == 2
    finally:
        gate.set()
        off.close()
    assert H2 in store
