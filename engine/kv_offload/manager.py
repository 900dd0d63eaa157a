"""The tiers behind the block pool: cached blocks are sealed and written to every tier off the
engine step; a later request whose prefix runs past the pool's hits finds the rest in a tier
and waits in a loading state while a loader thread brings it back into fresh pool blocks, bit
for bit.

Write (SGLang HiCache's ``--hicache-write-policy``; ``--kv-offload-write-policy``): a
write-through tier takes a block as soon as the step that computed it is done
(``on_cached``); a write-back tier when the pool reuses the cached block (eviction reason
``capacity``: ``on_evict``). The shared tier is always write-through, so a replica killed with
a tenant's prefix in its pool leaves it to the replica that serves the tenant next; the local
tiers are write-through by default (the next round of a working set larger than the pool then
finds every block already written, measured in docs/benchmarks.md). A block's KV (every layer,
K and V) is copied out of the cache on the engine thread (the step about to run may overwrite
it) and handed to a writer thread, which seals it for its tenant (``engine.kv_offload.cipher``)
and writes it to each tier that does not hold it yet; an evicted block no tier holds yet (a
write that was dropped) is queued then too. A full queue drops the write (counted): the step
never waits for a tier. Private blocks, blocks of a failed step and blocks dropped by a reset
or a rotation are never written. A clean shutdown also writes the cached blocks still in the
pool (``save_pool``), so a restart finds them.

Lookup: ``lookup`` counts the leading block hashes some tier holds: local indexes first (no
I/O), then, where asked (``remote=True``, at admission only), one round trip to a remote tier
for the blocks past the local prefix (another replica may have written them).

Load (vLLM's offloading connector and SGLang's HiCache do the same): the scheduler allocates
fresh blocks and ``submit_load`` hands the job to the loader thread; the request waits
(``WAITING_FOR_KV_LOAD``) while the steps of other requests run. The loader reads each blob
from the first tier that opens it, checks it (``BlockCipher.open``: a tampered, truncated,
swapped or older-generation blob is a miss, counted, logged at most once a minute, and deleted
from that tier) and copies it into its block; it stops at the first block no tier gives. The
scheduler collects finished jobs (``poll_loads``) at the start of a step.

A reset or salt rotation of a tenant deletes its blobs from every tier (unreachable at once:
the key derivation changes with the generation, and the blobs are deleted too).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.kv_offload.cipher import BlockCipher
from engine.kv_offload.tier import OffloadTier, ThrottledWarning
from engine.stats import LOAD_SECONDS_BUCKETS

logger = logging.getLogger(__name__)

# Blocks copied out and waiting for the writer thread, at most (bounded by bytes: 512 MiB is
# 700 blocks of the bundled model in fp32). Evictions come in bursts (a long prompt admitted
# evicts a hundred blocks in one step) that a writer sharing 2 cores with the step drains
# between them.
_WRITE_QUEUE_BYTES = 512 << 20


class BlockIO(Protocol):
    """Copies one block's KV out of and into the cache (``ModelRunner``)."""

    def read_block(self, block_id: int) -> bytes: ...

    def write_block(self, block_id: int, data: bytes) -> None: ...


@dataclass
class TierStats:
    """One tier's counters (monotonic; blocks unless named bytes)."""

    written: int = 0
    written_bytes: int = 0
    write_failed: int = 0
    loaded: int = 0
    loaded_bytes: int = 0
    load_failed: int = 0  # stored but unopenable: tampered, truncated, another generation
    dropped: int = 0  # blobs deleted by a reset, rotation or disable (the tier's count)


@dataclass
class OffloadStats:
    """Counters of the offloader (monotonic, blocks unless named)."""

    write_dropped: int = 0  # the writer's queue was full
    loaded: int = 0
    loaded_bytes: int = 0
    load_missing: int = 0  # runs that stopped on a block no tier gave
    load_jobs: int = 0
    load_seconds: float = 0.0
    load_seconds_buckets: list[int] = field(
        default_factory=lambda: [0] * (len(LOAD_SECONDS_BUCKETS) + 1))
    tiers: dict[str, TierStats] = field(default_factory=dict)


@dataclass
class LoadJob:
    """Blocks one request loads: ``hashes[i]`` into block ``block_ids[i]``; the loader sets
    ``loaded`` (leading blocks loaded) and ``done``."""

    request_id: str
    tenant: str | None
    salt: bytes | None
    generation: int
    hashes: Sequence[bytes]
    block_ids: Sequence[int]
    loaded: int = 0
    done: bool = False


class KVOffloader:
    """The tiers behind the pool, in lookup order (the nearest first).

    Args:
        tiers: e.g. ``[DiskStore, RedisStore]``.
        cipher: seals and opens this model's blocks.
        io: the cache's block copies.
    """

    def __init__(self, tiers: Sequence[OffloadTier], cipher: BlockCipher, io: BlockIO) -> None:
        if not tiers:
            raise ValueError("at least one tier")
        self.tiers, self.cipher, self.io = list(tiers), cipher, io
        self.stats = OffloadStats(tiers={t.name: TierStats() for t in self.tiers})
        self._queue: queue.Queue = queue.Queue(
            maxsize=max(16, _WRITE_QUEUE_BYTES // max(cipher.block_bytes, 1)))
        self._loads: queue.Queue = queue.Queue()
        self._done: deque[LoadJob] = deque()
        self._load_done = threading.Event()
        self._warn = ThrottledWarning(logger, "KV offload: ")
        # (hash, generation, write-through) of the writes queued and not yet taken by the
        # writer: one copy of a block at a time (set.add/discard are atomic under the GIL)
        self._queued: set[tuple[bytes, int, bool]] = set()
        self.tenants: set[str | None] = set()  # tenants seen (to name owners in reports)
        self._shares: dict[str | None, tuple] = {}
        self._threads = [threading.Thread(target=loop, name=name, daemon=True) for loop, name in
                         ((self._write_loop, "kv-offload-writer"),
                          (self._load_loop, "kv-offload-loader"))]
        for t in self._threads:
            t.start()

    @property
    def write_through(self) -> bool:
        """Whether a tier takes blocks as soon as a step writes them (``on_cached``)."""
        return any(t.write_through for t in self.tiers)

    @property
    def store(self) -> OffloadTier:
        """The nearest tier."""
        return self.tiers[0]

    def set_tenant_share(self, tenant: str | None, share, num_pool_blocks: int) -> None:
        """Applies a ``TenantShare`` to every tier: its weight, and its cache floor and cap as
        the same fraction of each tier's budget as of the pool's ``num_pool_blocks``."""
        key = (share.weight, share.min_cache_blocks, share.max_cache_blocks)
        if self._shares.get(tenant) == key:
            return
        self._shares[tenant] = key
        self.tenants.add(tenant)
        low, high = (None if n is None else n / num_pool_blocks
                     for n in (share.min_cache_blocks, share.max_cache_blocks))
        for tier in self.tiers:
            tier.set_share(tenant if tenant is not None else "", share.weight, low, high)

    def by_tenant(self, tier: OffloadTier, *maps: dict[str, int]
                  ) -> list[tuple[dict[str, int], int]]:
        """``TierUsage`` owner maps (``owner_bytes``, ``owner_share_bytes``) by tenant id
        ("" for none): a tier's tags are matched with the tenants this process has seen.
        Returns, per map, (by tenant id, the sum over tags no tenant seen here matches: blobs
        found at start whose tenant has not been served since, or another replica's
        tenants)."""
        tag = getattr(tier, "tag", None)
        if tag is None:
            return [(dict(owners), 0) for owners in maps]
        names = {tag(t if t is not None else ""): (t if t is not None else "")
                 for t in list(self.tenants)}
        out = []
        for owners in maps:
            named, unknown = {}, 0
            for o, n in owners.items():
                if o in names:
                    named[names[o]] = n
                else:
                    unknown += n
            out.append((named, unknown))
        return out

    # -- write --------------------------------------------------------------------------------
    def _holds(self, block_hash: bytes) -> bool:
        return all(block_hash in t for t in self.tiers)

    def on_evict(self, block, reason: str, evicted_by: str | None) -> None:
        """``BlockPool`` eviction listener: a cached block leaving the pool for capacity that
        some tier lacks (a write-back tier; a write-through one whose write was dropped) is
        copied out and queued."""
        if reason != "capacity" or block.private or block.salt is None \
                or self._holds(block.block_hash):
            return
        self._enqueue(block, through=False)

    def on_cached(self, block) -> None:
        """A block a step just wrote (its hash cached at allocation) is queued for the
        write-through tiers."""
        if block.private or block.salt is None \
                or all(block.block_hash in t for t in self.tiers if t.write_through):
            return
        self._enqueue(block, through=True)

    def _enqueue(self, block, through: bool) -> None:
        """Copies the block out and queues it, unless a write of it (the same hash and cache
        generation) is queued already."""
        key = (block.block_hash, block.generation, through)
        if key in self._queued:
            return
        self._queued.add(key)  # (before the put: the writer may take it at once)
        try:
            self._queue.put_nowait(self._item(block, through))
        except queue.Full:
            self._queued.discard(key)
            self.stats.write_dropped += 1
        except BaseException:
            self._queued.discard(key)
            raise

    def _item(self, block, through: bool = False) -> tuple:
        return (block.block_hash, block.owner, block.salt, block.generation,
                self.io.read_block(block.block_id), through)

    def save_pool(self, blocks: Iterable) -> int:
        """Queues every cached block of ``blocks`` not in every tier yet (a clean shutdown:
        blocks still in the pool then survive the restart), waiting for room in the queue;
        returns how many. Call with the engine stopped (nothing writes the cache meanwhile)."""
        n = 0
        for block in blocks:
            if block.block_hash is None or block.private or block.salt is None \
                    or self._holds(block.block_hash):
                continue
            self._queue.put(self._item(block))
            n += 1
        return n

    def _write_loop(self) -> None:
        # (At the lowest CPU priority this thread lags the evictions on a busy 2-core machine
        # and the queue drops a third of the writes: measured, so it runs at normal priority.)
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if item[0] == "drop":
                    self._drop_job(*item[1:])
                    continue
                block_hash, owner, salt, generation, data, through = item
                self._queued.discard((block_hash, generation, through))
                blob = self.cipher.seal(salt, generation, block_hash, data)
                self.tenants.add(owner)
                for tier in self.tiers:
                    if block_hash in tier or (through and not tier.write_through):
                        continue
                    s = self.stats.tiers[tier.name]
                    if tier.put(block_hash, blob, owner if owner is not None else ""):
                        s.written += 1
                        s.written_bytes += len(blob)
                    else:
                        s.write_failed += 1
            except Exception as e:  # noqa: BLE001 - a bad write must not stop the writer
                self.stats.write_dropped += 1
                logger.warning("KV offload: a write failed (%s)", type(e).__name__)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Waits until every queued write is done (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._loads.put(None)
        for t in self._threads:
            t.join(timeout=5)

    # -- lookup -------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes], remote: bool = False) -> int:
        """How many of ``hashes``, from the first, some tier holds: local indexes (no I/O),
        then with ``remote`` one query to each remote tier for the blocks past them."""
        found = [any(h in t for t in self.tiers) for h in hashes]
        n = found.index(False) if False in found else len(found)
        if remote and n < len(hashes):
            for tier in self.tiers:
                if tier.local:
                    continue
                for i, present in enumerate(tier.query(hashes[n:]), n):
                    found[i] = found[i] or present
            n = found.index(False) if False in found else len(found)
        return n

    # -- load ---------------------------------------------------------------------------------
    def submit_load(self, job: LoadJob) -> None:
        """Queues ``job`` for the loader thread; ``poll_loads`` returns it once done. The
        caller keeps ``job.block_ids`` allocated (and unread) until then."""
        self._loads.put(job)

    def poll_loads(self) -> list[LoadJob]:
        """The jobs finished since the last call."""
        done = []
        while self._done:
            done.append(self._done.popleft())
        if not self._done:
            self._load_done.clear()
            if self._done:  # finished between the two lines above
                self._load_done.set()
        return done

    def wait_loads(self, timeout: float) -> None:
        """Returns when a job has finished since the last ``poll_loads``, or after
        ``timeout`` seconds (the engine waits here when only loads are in flight)."""
        self._load_done.wait(timeout)

    def _load_loop(self) -> None:
        while True:
            job = self._loads.get()
            if job is None:
                return
            try:
                self.load(job)
            except Exception as e:  # noqa: BLE001 - a failed load is a miss, never a crash
                logger.warning("KV offload: a load failed (%s); the request computes it",
                               type(e).__name__)
            job.done = True
            self._done.append(job)
            self._load_done.set()

    def load(self, job: LoadJob) -> int:
        """Loads ``job`` in order on the calling thread; sets and returns ``job.loaded`` (it
        stops at the first block no tier gives, which is counted)."""
        start = time.perf_counter()
        self.tenants.add(job.tenant)
        for tier in self.tiers:
            tier.prefetch(job.hashes)
        for block_hash, block_id in zip(job.hashes, job.block_ids, strict=True):
            data = self._read(block_hash, job.salt, job.generation)
            if data is None:
                self.stats.load_missing += 1
                break
            self.io.write_block(block_id, data)
            job.loaded += 1
        seconds = time.perf_counter() - start
        s = self.stats
        s.loaded += job.loaded
        s.loaded_bytes += job.loaded * self.cipher.block_bytes
        s.load_jobs += 1
        s.load_seconds += seconds
        s.load_seconds_buckets[next((i for i, b in enumerate(LOAD_SECONDS_BUCKETS)
                                     if seconds <= b), len(LOAD_SECONDS_BUCKETS))] += 1
        return job.loaded

    def _read(self, block_hash: bytes, salt: bytes | None, generation: int) -> bytes | None:
        """The block from the first tier that holds it and opens, or None."""
        if salt is None:
            return None
        for tier in self.tiers:
            blob = tier.get(block_hash)
            if blob is None:
                continue
            data = self.cipher.open(salt, generation, block_hash, blob)
            s = self.stats.tiers[tier.name]
            if data is None:  # stored but unopenable: never tried again
                s.load_failed += 1
                tier.delete(block_hash)
                self._warn(f"a block in the {tier.name} tier failed authentication; it is "
                           "computed")
                continue
            s.loaded += 1
            s.loaded_bytes += len(data)
            return data
        return None

    def drop_tenant(self, tenant: str | None) -> int:
        """Drops the tenant's blobs from every tier (a reset or salt rotation): gone from the
        local indexes at once (and unreadable anywhere: their key moved with the generation),
        deleted from disk and Redis by the writer thread after the writes queued before.
        Returns how many the local tiers held."""
        return self._drop(tenant if tenant is not None else "")

    def drop_all(self) -> int:
        """``drop_tenant`` for every tenant (the global reset)."""
        return self._drop(None)

    def _drop(self, owner: str | None) -> int:
        forgotten = [t.forget_owner(owner) if t.local else None for t in self.tiers]
        self._queue.put(("drop", owner, forgotten))
        return sum(len(keys) for keys in forgotten if keys is not None)

    def _drop_job(self, owner: str | None, forgotten: list) -> None:
        """The writer thread's part of ``_drop``: the stored blobs go, and any the writes
        queued before the drop added meanwhile."""
        for tier, keys in zip(self.tiers, forgotten, strict=True):
            n = 0
            if keys is not None:
                tier.drop_blobs(keys)
                n = len(keys)
            n += tier.delete_all() if owner is None else tier.delete_owner(owner)
            self.stats.tiers[tier.name].dropped += n
