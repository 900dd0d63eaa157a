"""KV block pool with automatic prefix caching (pure Python, stdlib only).

The pool owns ``num_blocks`` physical KV blocks shared by all tenants. A block is either in use
(``ref_cnt > 0``, pinned by running requests) or free (``ref_cnt == 0``, in the LRU free queue). A
free block that still carries a ``block_hash`` stays hittable until it is popped for reuse, at which
point its hash is dropped (lazy eviction, as in vLLM v1's ``BlockPool``).

Free queue order (head is popped first)::

    head -> [unhashed blocks] [hashed blocks, least recently freed first] <- tail

A finished request frees its blocks tail block first, so the tail of a prompt is evicted before the
shared head of the prefix (vLLM v1 ``KVCacheManager.free``).

Fair cache share (DESIGN "Multi-tenant capacity"): each tenant with resident cached blocks has a
guaranteed share of the pool, ``num_blocks * weight / (sum of the weights of tenants with
resident blocks)``, raised to its ``min_cache_blocks`` and lowered to its ``max_cache_blocks``
(``engine.request.TenantShare``). When a cached block must be reused, it is the LRU free block of
the tenant furthest over its share: a tenant over its ``max_cache_blocks`` first, then the one
with the most resident blocks per unit of weight; a tenant at or under its ``min_cache_blocks``
is never chosen. The allocating tenant counts with the blocks it is taking: a tenant at its
share pays for its own growth from its own LRU blocks. When no tenant with a free cached block is over its share (always the case with
one tenant), it is the head of the free queue: exactly plain LRU. Each tenant's free cached
blocks are kept in their own LRU list and tenants in a lazy max-heap, so picking a victim costs
O(log tenants) per block, never a scan.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable

from engine.block_hash import BlockHash
from engine.request import TenantShare
from engine.stats import EXPLICIT_EVICTION_REASONS, BlockPoolStats

TenantId = str | None
_DEFAULT_SHARE = TenantShare()


class KVCacheBlock:
    """One physical KV block: ``block_size`` token slots in every layer's KV cache tensor."""

    __slots__ = ("block_hash", "block_id", "generation", "next_free", "owner", "prev_free",
                 "private", "ref_cnt", "salt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # Tenant id of the request that computed (and cached) this block; None when unhashed.
        self.owner: str | None = None
        # Hittable only by the siblings that computed it; unhashed when its last holder frees it.
        self.private = False
        # The effective salt and cache generation of the request that cached it (the key of
        # its offloaded copy, engine.kv_offload); None when unhashed.
        self.salt: bytes | None = None
        self.generation = 0
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:  # never prints the hash: it is derived from prompt tokens and salt
        return (f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"cached={self.block_hash is not None})")


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append, appendleft and remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels  # pragma: no mutate
        self._tail = KVCacheBlock(-1)  # pragma: no mutate
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def peek(self) -> KVCacheBlock | None:
        """The head block (next to be reused), or None when empty."""
        block = self._head.next_free
        return None if block is self._tail else block

    def popleft(self) -> KVCacheBlock:
        """Removes and returns the head block. Raises: IndexError when empty."""
        block = self._head.next_free
        if block is self._tail:
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
        # Fair share: each owner's free cached blocks in LRU order (a sub-sequence of the free
        # queue), owners' shares, the owners with resident blocks and their summed weight, and
        # a lazy max-heap of (-over-max class, -resident per weight, version, owner).
        self.evictable: dict[TenantId, OrderedDict[int, KVCacheBlock]] = {}
        self.shares: dict[TenantId, TenantShare] = {}
        self.resident_owners: set[TenantId] = set()
        self.resident_weight = 0
        self._num_capped = 0  # shares with a max_cache_blocks
        self._heap: list[tuple[int, float, int, TenantId]] = []
        self._versions = itertools.count()
        self._version: dict[TenantId, int] = {}  # owner -> version of its live heap entry
        self._dirty: set[TenantId] = set()  # owners whose heap entry is out of date

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
            block = self._pop_free_block(tenant, num_blocks)
            assert block.ref_cnt == 0, f"{block} in free queue with refs"
            block.ref_cnt = 1
            self.num_used_blocks += 1
            out.append(block)
        return out

    def _pop_free_block(self, tenant: TenantId, allocating: int) -> KVCacheBlock:
        """Takes the next free block to reuse: an unhashed one, else the LRU cached block of the
        owner furthest over its share, else the LRU cached block (plain LRU). ``tenant``
        counts with the ``allocating`` blocks it is taking now (they will hold its KV)."""
        head = self.free_block_queue.peek()  # not None: ``get_new_blocks`` counted them
        if head.block_hash is None:
            return self.free_block_queue.popleft()
        owner = self._furthest_over_share()
        # (A tenant with an evictable block is resident; alone, its LRU block is the head.)
        if len(self.resident_owners) > 1 and self.evictable.get(tenant) \
                and self._is_over_share(tenant, allocating) \
                and (owner is None
                     or self._density(tenant, allocating) > self._density(owner, 0)):
            owner = tenant  # the allocating tenant is (or is about to be) the furthest over
        over_share = owner is not None
        if not over_share:
            block = head
        else:
            block = next(iter(self.evictable[owner].values()))
        self.free_block_queue.remove(block)
        self._drop_hash(block, "capacity", tenant, over_share)
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Pins cache-hit blocks: ref_cnt += 1, leaving the free queue when it was 0."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                if block.block_hash is not None:
                    del self.evictable[block.owner][block.block_id]
                self.num_used_blocks += 1
            block.ref_cnt += 1

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash,
                         owner: str | None, private: bool = False,
                         salt: bytes | None = None, generation: int = 0) -> bool:
        """Makes ``block`` hittable under ``block_hash``; True when it did (False: caching
        is off, the block is cached already, or another block holds the hash).

        If another block already holds this hash (two requests computed the same block
        concurrently), the first stays cached and ``block`` stays unhashed. A ``private`` block
        (``EngineRequest.private_cache``) loses its hash as soon as no request holds it.
        """
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached_block_hash_to_block:
            return False
        assert block.ref_cnt > 0, "only blocks being computed are cached"
        block.block_hash = block_hash
        block.owner = owner
        block.private = private
        block.salt, block.generation = salt, generation
        self.cached_block_hash_to_block[block_hash] = block
        self.stats.record_cached(owner)
        self._resident_changed(owner)
        return True

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
                if block.private and block.block_hash is not None:
                    self._uncache_private(block)  # never stays cached: reused first
                if block.block_hash is not None:
                    self.free_block_queue.append(block)
                    self.evictable.setdefault(block.owner, OrderedDict())[block.block_id] = block
                else:
                    self.free_block_queue.appendleft(block)

    # -- eviction ------------------------------------------------------------------------------
    def evict_cached_blocks(self, predicate: Callable[[KVCacheBlock], bool] | None,
                            reason: str) -> int:
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
            free = block.ref_cnt == 0
            self._drop_hash(block, reason, None)
            if free:
                self.free_block_queue.remove(block)
                self.free_block_queue.appendleft(block)
        return len(victims)

    def drop_hashes(self, blocks: Iterable[KVCacheBlock], reason: str) -> int:
        """Drops the hash of each given block that has one (``evict_cached_blocks`` for a known
        list of blocks, e.g. those a failed step was writing). Returns blocks dropped."""
        targets = {id(b): b for b in blocks if b.block_hash is not None}
        return self.evict_cached_blocks(lambda b: id(b) in targets, reason) if targets else 0

    def reset_prefix_cache(self) -> int:
        """Drops every cached block (vLLM ``/reset_prefix_cache``). Returns blocks dropped."""
        return self.evict_cached_blocks(None, "reset")

    def _drop_hash(self, block: KVCacheBlock, reason: str, evicted_by: str | None,
                   over_share: bool = False) -> None:
        assert block.block_hash is not None
        if block.ref_cnt == 0:
            del self.evictable[block.owner][block.block_id]
        self.stats.record_eviction(block.owner, reason, evicted_by, over_share)
        if self.on_evict is not None:
            self.on_evict(block, reason, evicted_by)
        self._unhash(block)

    def uncache_unwritten(self, blocks: Iterable[KVCacheBlock]) -> int:
        """Drops the hash of each given block its holder alone holds (no eviction counted, no
        offload): blocks cached when their slots were allocated whose step never ran for them
        (a request preempted in the step that allocated them). Returns blocks dropped."""
        n = 0
        for block in blocks:
            if block.block_hash is not None and block.ref_cnt == 1:
                self._uncache_private(block)
                n += 1
        return n

    def _uncache_private(self, block: KVCacheBlock) -> None:
        """Drops a private block's hash when its last holder frees it (no eviction counted)."""
        self.stats.record_uncached(block.owner)
        self._unhash(block)

    def _unhash(self, block: KVCacheBlock) -> None:
        """Removes ``block`` from the cache map and clears its hash, owner and private flag
        (the stats were told by the caller)."""
        owner = block.owner
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        block.owner = None
        block.private = False
        block.salt, block.generation = None, 0
        self._resident_changed(owner)

    # -- fair cache share ----------------------------------------------------------------------
    def set_tenant_share(self, tenant: TenantId, share: TenantShare) -> None:
        """Sets a tenant's weight and cache bounds (from its latest request). O(log tenants)."""
        old = self.shares.get(tenant, _DEFAULT_SHARE)
        if share == old:
            return
        self.shares[tenant] = share
        self._num_capped += ((share.max_cache_blocks is not None)
                             - (old.max_cache_blocks is not None))
        if tenant in self.resident_owners:
            self.resident_weight += share.weight - old.weight
        self._dirty.add(tenant)

    def cache_share(self, tenant: TenantId) -> int:
        """The tenant's guaranteed share of the pool now, in blocks (see the module docstring);
        for a tenant without resident blocks, as if it had some."""
        share = self.shares.get(tenant, _DEFAULT_SHARE)
        blocks = self.num_blocks * share.weight // self._total_weight_with(tenant)
        if share.max_cache_blocks is not None:
            blocks = min(blocks, share.max_cache_blocks)
        if share.min_cache_blocks is not None:
            blocks = max(blocks, share.min_cache_blocks)
        return blocks

    def _resident_changed(self, tenant: TenantId) -> None:
        """After the tenant's resident count changed. O(1): the heap entry is refreshed
        lazily, at the next victim search."""
        resident = self.stats.resident_blocks[tenant] > 0
        if resident != (tenant in self.resident_owners):
            weight = self.shares.get(tenant, _DEFAULT_SHARE).weight
            if resident:
                self.resident_owners.add(tenant)
                self.resident_weight += weight
            else:
                self.resident_owners.remove(tenant)
                self.resident_weight -= weight
        self._dirty.add(tenant)

    def _refresh_heap(self) -> None:
        for tenant in self._dirty:  # (an owner without resident blocks sorts last: density 0)
            version = self._version[tenant] = next(self._versions)
            over_max, density = self._density(tenant, 0)
            heapq.heappush(self._heap, (-int(over_max), -density, version, tenant))
        self._dirty.clear()
        if len(self._heap) > 2 * len(self._version) + 64:  # drop stale entries, amortised
            self._heap = [e for e in self._heap if e[2] == self._version[e[3]]]
            heapq.heapify(self._heap)

    def _density(self, tenant: TenantId, extra: int) -> tuple[bool, float]:
        """(over its cap, resident blocks per unit of weight) with ``extra`` more blocks: the
        order of "furthest over"."""
        resident = self.stats.resident_blocks[tenant] + extra
        share = self.shares.get(tenant, _DEFAULT_SHARE)
        over_max = share.max_cache_blocks is not None and resident > share.max_cache_blocks
        return over_max, resident / share.weight

    def _is_over_share(self, tenant: TenantId, extra: int = 0) -> bool:
        """Whether ``tenant`` (with ``extra`` more blocks) is over its cache share."""
        resident = self.stats.resident_blocks[tenant] + extra
        share = self.shares.get(tenant, _DEFAULT_SHARE)
        if share.max_cache_blocks is not None and resident > share.max_cache_blocks:
            return True
        if share.min_cache_blocks is not None and resident <= share.min_cache_blocks:
            return False
        return resident * self._total_weight_with(tenant) > self.num_blocks * share.weight

    def _total_weight_with(self, tenant: TenantId) -> int:
        """The weights of the owners with cached blocks, ``tenant`` counted even if it has
        none yet (its share as soon as it caches a block)."""
        if tenant in self.resident_owners:
            return self.resident_weight
        return self.resident_weight + self.shares.get(tenant, _DEFAULT_SHARE).weight

    def _furthest_over_share(self) -> TenantId | None:
        """The owner with a free cached block that is furthest over its share, or None when no
        such owner is over its share. O(log tenants) amortised."""
        if len(self.resident_owners) <= 1 and not self._num_capped:
            return None  # one owner is never over its share (the whole pool): plain LRU
        if self._dirty:
            self._refresh_heap()
        heap, skipped, found = self._heap, [], None
        while heap:
            neg_over_max, neg_density, version, tenant = heap[0]
            if version != self._version.get(tenant):
                heapq.heappop(heap)  # stale
                continue
            if not neg_over_max and not (-neg_density * self.resident_weight > self.num_blocks):
                break  # the densest remaining owner is within its share: so is everyone after
            if self.evictable.get(tenant) and self._is_over_share(tenant):
                found = tenant
                break
            skipped.append(heapq.heappop(heap))  # all its blocks pinned, or under its minimum
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

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
            else:
                assert block.owner is None, f"{block} unhashed but owned"
                assert not block.private, f"{block} unhashed but private"
            if block.private:
                assert block.ref_cnt > 0, f"{block} private and free: it must have lost its hash"
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"{block} cache map key mismatch"
        # Each owner's LRU list holds exactly its free cached blocks, in free-queue order.
        position = {bid: i for i, bid in enumerate(free_ids)}
        for owner, lru in self.evictable.items():
            ids = list(lru)
            assert all(self.blocks[b].owner == owner and self.blocks[b].ref_cnt == 0
                       and self.blocks[b].block_hash is not None for b in ids), \
                f"owner LRU list of {owner!r} holds a block that is not its free cached block"
            assert [position[b] for b in ids] == sorted(position[b] for b in ids), \
                f"owner LRU list of {owner!r} out of free-queue order"
        assert sum(len(lru) for lru in self.evictable.values()) == sum(
            1 for b in free_ids if self.blocks[b].block_hash is not None), \
            "owner LRU lists miss a free cached block"
        assert self.resident_weight == sum(
            self.shares.get(o, _DEFAULT_SHARE).weight for o, n in resident.items() if n), \
            "resident weight drift"
        assert self.resident_owners == set(resident), "resident owner set drift"
        assert self._num_capped == sum(
            1 for s in self.shares.values() if s.max_cache_blocks is not None), "capped drift"
        # Unhashed free blocks sit before every hashed free block.
        seen_hashed = False
        for bid in free_ids:
            hashed = self.blocks[bid].block_hash is not None
            assert not (seen_hashed and not hashed), "unhashed free block behind a hashed one"
            seen_hashed = seen_hashed or hashed
