"""The tier behind the block pool: cached blocks the pool evicts are sealed and written to the
disk tier off the engine step; a later request whose prefix runs past the pool's hits finds the
rest there and loads it into fresh pool blocks, bit for bit.

Write: when the pool reuses a cached block (eviction reason ``capacity``), its KV is copied out
of the cache at once (the step about to run overwrites it) and handed to a writer thread, which
seals it for its tenant (``engine.kv_offload.cipher``) and writes it (``DiskStore``). A full
queue drops the write (counted): the step never waits for the disk. Private blocks, blocks of a
failed step and blocks dropped by a reset or a rotation are never written. A clean shutdown
also writes the cached blocks still in the pool (``save_pool``), so a restart finds them.

Load: ``lookup`` counts the leading block hashes the tier holds (its in-memory index: no I/O,
so the scheduler can plan with it); ``load`` reads, opens and copies them into the blocks
allocated for them before the step that reads them, and stops at the first blob that is
missing, fails authentication or has the wrong size (a miss, counted and logged at most once a
minute; the request computes the rest). Loads run on the engine thread, in the step that admits
the request.

A reset or salt rotation of a tenant deletes its blobs from the index (unreachable at once) and
from disk.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.kv_offload.cipher import BlockCipher
from engine.kv_offload.disk import DiskStore

logger = logging.getLogger(__name__)

_WRITE_QUEUE_BLOCKS = 256
_WARN_EVERY_S = 60.0


class BlockIO(Protocol):
    """Copies one block's KV out of and into the cache (``ModelRunner``)."""

    def read_block(self, block_id: int) -> bytes: ...

    def write_block(self, block_id: int, data: bytes) -> None: ...


@dataclass
class OffloadStats:
    """Counters of the tier (monotonic, blocks unless named bytes)."""

    written: int = 0
    written_bytes: int = 0
    write_dropped: int = 0  # the writer's queue was full, or the write failed
    loaded: int = 0
    loaded_bytes: int = 0
    load_failed: int = 0  # missing, tampered, truncated or another tenant's
    load_seconds: float = 0.0


class KVOffloader:
    """One tier (local disk) behind the pool.

    Args:
        store: the disk tier.
        cipher: seals and opens this model's blocks.
        io: the cache's block copies.
    """

    def __init__(self, store: DiskStore, cipher: BlockCipher, io: BlockIO) -> None:
        self.store, self.cipher, self.io = store, cipher, io
        self.stats = OffloadStats()
        self._queue: queue.Queue = queue.Queue(maxsize=_WRITE_QUEUE_BLOCKS)
        self._last_warning = 0.0
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload-writer",
                                        daemon=True)
        self._writer.start()

    # -- write --------------------------------------------------------------------------------
    def on_evict(self, block, reason: str, evicted_by: str | None) -> None:
        """``BlockPool`` eviction listener: a cached block leaving the pool for capacity is
        copied out and queued for the disk tier."""
        if reason != "capacity" or block.private or block.salt is None:
            return
        if block.block_hash in self.store:
            return
        try:
            item = (block.block_hash, block.owner, block.salt, block.generation,
                    self.io.read_block(block.block_id))
            self._queue.put_nowait(item)
        except queue.Full:
            self.stats.write_dropped += 1

    def save_pool(self, blocks: Iterable) -> int:
        """Queues every cached block of ``blocks`` not on disk yet (a clean shutdown: blocks
        still in the pool then survive the restart), waiting for room in the queue; returns how
        many. Call with the engine stopped (nothing writes the cache meanwhile)."""
        n = 0
        for block in blocks:
            if block.block_hash is None or block.private or block.salt is None \
                    or block.block_hash in self.store:
                continue
            self._queue.put((block.block_hash, block.owner, block.salt, block.generation,
                             self.io.read_block(block.block_id)))
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
                block_hash, owner, salt, generation, data = item
                blob = self.cipher.seal(salt, generation, block_hash, data)
                if self.store.put(block_hash, blob, owner if owner is not None else ""):
                    self.stats.written += 1
                    self.stats.written_bytes += len(blob)
                else:
                    self.stats.write_dropped += 1
            except Exception as e:  # noqa: BLE001 - a bad write must not stop the writer
                self.stats.write_dropped += 1
                logger.warning("KV disk tier: a write failed (%s)", type(e).__name__)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Waits until every queued write is done (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=5)

    # -- load ---------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first, the tier holds (index only, no I/O)."""
        n = 0
        for h in hashes:
            if h not in self.store:
                break
            n += 1
        return n

    def load(self, tenant: str | None, salt: bytes | None, generation: int,
             hashes: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Loads ``hashes[i]`` into block ``block_ids[i]`` in order; returns how many loaded
        (stops at the first miss, which is counted)."""
        start = time.perf_counter()
        n = 0
        for block_hash, block_id in zip(hashes, block_ids, strict=True):
            blob = self.store.get(block_hash)
            data = None if blob is None or salt is None else self.cipher.open(
                salt, generation, block_hash, blob)
            if data is None:
                self.stats.load_failed += 1
                if blob is not None:  # stored but unopenable: never loaded again
                    self.store.delete(block_hash)
                self._warn("a block failed authentication or was missing; it is computed")
                break
            self.io.write_block(block_id, data)
            self.store.claim(block_hash, tenant if tenant is not None else "")
            n += 1
        self.stats.loaded += n
        self.stats.loaded_bytes += n * self.cipher.block_bytes
        self.stats.load_seconds += time.perf_counter() - start
        return n

    def drop_tenant(self, tenant: str | None) -> int:
        """Deletes the tenant's blobs (a reset or salt rotation); returns how many."""
        self.flush()  # a queued write of the old generation lands before the delete
        return self.store.delete_owner(tenant if tenant is not None else "")

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            logger.warning("KV disk tier: %s", message)
