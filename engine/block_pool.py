"""KV block pool with automatic prefix caching (pure Python, stdlib only).

The pool owns ``num_blocks`` physical KV blocks shared by all tenants. A block is either in use
(``ref_cnt > 0``, pinned by running requests) or free (``ref_cnt == 0``, in the LRU free queue). A
free block that still carries a ``block_hash`` stays hittable until it is popped for reuse, at which
point its hash is dropped (lazy eviction, as in vLLM v1's ``BlockPool``).

Free queue order (head is popped first)::

    head -> [unhashed blocks] [hashed blocks, least recently freed first] <- tail

A finished request frees its blocks tail block first, so the tail of a prompt is evicted before the
shared head of the prefix (vLLM v1 ``KVCacheManager.free``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.block_hash import BlockHash
from engine.stats import EXPLICIT_EVICTION_REASONS, BlockPoolStats


class KVCacheBlock:
    """One physical KV block: ``block_size`` token slots in every layer's KV cache tensor."""

    __slots__ = ("block_hash", "block_id", "next_free", "owner", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # Tenant id of the request that computed (and cached) this block; None when unhashed.
        self.owner: str | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:  # never prints the hash: it is derived from prompt tokens and salt
        return (f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"cached={self.block_hash is not None})")


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append, appendleft and remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Removes and returns the head block. Raises: IndexError when empty."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block not in queue"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Inserts at the tail (evicted last)."""
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Inserts at the head (reused first)."""
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock | None, block: KVCacheBlock) -> None:
        assert prev is not None and prev.next_free is not None
        assert block.prev_free is None and block.next_free is None, "block already queued"
        block.prev_free, block.next_free = prev, prev.next_free
        prev.next_free.prev_free = block
        prev.next_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids from head (next to be reused) to tail. O(n); for tests and checks."""
        ids = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


EvictionListener = Callable[[KVCacheBlock, str, "str | None"], None]


class BlockPool:
    """Fixed pool of KV blocks + the block-hash -> block prefix cache.

    Args:
        num_blocks: physical blocks (all usable; there is no reserved null block).
        enable_caching: when False, nothing is ever hashed or looked up.
        on_evict: optional ``(block, reason, evicted_by_tenant)`` callback fired when a cached block
            loses its hash ("capacity" when popped for reuse, "salt_rotation" or "reset" when
            dropped on purpose).

    Accounting: ``stats`` (``engine.stats.BlockPoolStats``) counts every eviction by owner,
    reason and evicting tenant and every owner's resident cached blocks; ``num_used_blocks`` counts
    blocks with ``ref_cnt > 0``, kept independently of the free queue (``check_integrity``).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 on_evict: EvictionListener | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.on_evict = on_evict
        self.stats = BlockPoolStats()
        self.num_used_blocks = 0

    # -- queries -------------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Free blocks, including cached ones that are evictable (vLLM semantics)."""
        return self.free_block_queue.num_free_blocks

    def get_num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)

    def get_usage(self) -> float:
        """Fraction of blocks pinned by running requests, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """Returns the cached block for ``block_hash`` or None. Never modifies ref counts."""
        return self.cached_block_hash_to_block.get(block_hash)

    # -- allocation ----------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int, tenant: str | None = None) -> list[KVCacheBlock]:
        """Pops ``num_blocks`` from the head of the free queue with ref_cnt 1.

        Popped blocks that still carry a hash are evicted from the cache (reason "capacity").

        Args:
            num_blocks: blocks to allocate.
            tenant: tenant whose allocation causes any eviction (for accounting only).

        Raises:
            ValueError: fewer than ``num_blocks`` free blocks (callers check first).
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot allocate {num_blocks} blocks; "
                             f"{self.get_num_free_blocks()} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                self._drop_hash(block, "capacity", tenant)
            assert block.ref_cnt == 0, f"{block} in free queue with refs"
            block.ref_cnt = 1
            self.num_used_blocks += 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Pins cache-hit blocks: ref_cnt += 1, leaving the free queue when it was 0."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                self.num_used_blocks += 1
            block.ref_cnt += 1

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash,
                         owner: str | None) -> None:
        """Makes ``block`` hittable under ``block_hash``.

        If another block already holds this hash (two requests computed the same block
        concurrently), the first stays cached and ``block`` stays unhashed.
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        block.owner = owner
        self.cached_block_hash_to_block[block_hash] = block
        self.stats.record_cached(owner)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Unpins blocks in the given order (callers pass a request's blocks tail first).

        Blocks reaching ref_cnt 0 join the free queue: hashed ones at the tail (LRU, evicted last),
        unhashed ones at the head (reused first).
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.num_used_blocks -= 1
                if block.block_hash is not None:
                    self.free_block_queue.append(block)
                else:
                    self.free_block_queue.appendleft(block)

    # -- eviction ------------------------------------------------------------------------------
    def evict_cached_blocks(self, predicate: Callable[[KVCacheBlock], bool] | None = None,
                            reason: str = "reset") -> int:
        """Drops the hash of every cached block matching ``predicate`` (all when None).

        Dropped blocks become unreachable at once. Free ones move to the head of the free queue
        (reused first); blocks pinned by running requests keep their data and refs, so in-flight
        requests finish unharmed, and return to the head when freed. Each dropped block counts as
        one eviction of its owner for ``reason``.

        Args:
            predicate: selects blocks (e.g. ``lambda b: b.owner == tenant_id``); None = all.
            reason: ``"reset"`` or ``"salt_rotation"``.

        Returns:
            Number of cached blocks dropped.

        Raises:
            ValueError: unknown ``reason``.
        """
        if reason not in EXPLICIT_EVICTION_REASONS:
            raise ValueError(f"eviction reason must be one of {EXPLICIT_EVICTION_REASONS}, "
                             f"got {reason!r}")
        victims = [b for b in self.cached_block_hash_to_block.values()
                   if predicate is None or predicate(b)]
        for block in victims:
            self._drop_hash(block, reason, None)
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                self.free_block_queue.appendleft(block)
        return len(victims)

    def reset_prefix_cache(self) -> int:
        """Drops every cached block (vLLM ``/reset_prefix_cache``). Returns blocks dropped."""
        return self.evict_cached_blocks(None, "reset")

    def _drop_hash(self, block: KVCacheBlock, reason: str, evicted_by: str | None) -> None:
        assert block.block_hash is not None
        del self.cached_block_hash_to_block[block.block_hash]
        self.stats.record_eviction(block.owner, reason, evicted_by)
        if self.on_evict is not None:
            self.on_evict(block, reason, evicted_by)
        block.block_hash = None
        block.owner = None

    # -- invariants ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Asserts the pool's invariants; O(num_blocks). Raises AssertionError with a message."""
        free_ids = self.free_block_queue.block_ids()
        assert len(free_ids) == len(set(free_ids)), "block queued twice"
        assert len(free_ids) == self.free_block_queue.num_free_blocks, "free count drift"
        free_set = set(free_ids)
        assert self.num_used_blocks == sum(1 for b in self.blocks if b.ref_cnt > 0), \
            "used-block count drift"
        assert self.num_used_blocks + len(free_ids) == self.num_blocks, "free + used != total"
        resident: dict[str | None, int] = {}
        for block in self.cached_block_hash_to_block.values():
            resident[block.owner] = resident.get(block.owner, 0) + 1
        assert {o: n for o, n in self.stats.resident_blocks.items() if n} == resident, \
            "resident-block accounting disagrees with the cache map"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"{block} negative ref_cnt"
            assert (block.ref_cnt == 0) == (block.block_id in free_set), \
                f"{block}: free-queue membership disagrees with ref_cnt"
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, \
                    f"{block} hashed but not in the cache map"
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"{block} cache map key mismatch"
        # Unhashed free blocks sit before every hashed free block.
        seen_hashed = False
        for bid in free_ids:
            hashed = self.blocks[bid].block_hash is not None
            assert not (seen_hashed and not hashed), "unhashed free block behind a hashed one"
            seen_hashed = seen_hashed or hashed
