"""KV cache manager: prefix-cache lookup and slot allocation for requests (pure Python).

Follows vLLM v1's ``KVCacheManager``: the scheduler asks for the longest cached prefix of a waiting
request (``get_computed_blocks``), then for slots for the tokens it schedules (``allocate_slots``);
full blocks are hashed and cached as soon as their slots are allocated, and a finished or preempted
request's blocks are freed tail first.
"""

from __future__ import annotations

from engine.block_hash import HashFn, hash_prompt_blocks
from engine.block_pool import BlockPool, KVCacheBlock
from engine.faults import fire
from engine.kv_offload import KVOffloader, LoadJob
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block tables over a shared ``BlockPool``.

    Args:
        block_pool: the shared pool.
        block_size: tokens per block.
        hash_fn: from ``engine.block_hash.get_hash_fn``.
        enable_caching: global prefix-caching switch (``--enable-prefix-caching``).
    """

    def __init__(self, block_pool: BlockPool, block_size: int, hash_fn: HashFn,
                 enable_caching: bool = True, offloader: KVOffloader | None = None) -> None:
        self.block_pool = block_pool
        # The tier behind the pool (engine.kv_offload), or None.
        self.offloader = offloader
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Blocks cached in this step's allocations (written once the step runs), for the
        # offloader's write-through tiers; ``written_through`` hands them over.
        self._cached_this_step: list[tuple[KVCacheBlock, bytes]] = []
        # Number of a request's leading blocks already hashed + cached.
        self.num_cached_block: dict[str, int] = {}
        # A finished load's blocks, held until the end of the step being scheduled
        # (``release_pins``), so that the request's admission in that step finds them.
        self._pinned: dict[str, list[KVCacheBlock]] = {}

    def uses_prefix_cache(self, request: Request) -> bool:
        """True when ``request`` is looked up in and adds to the prefix cache (its tenant's, or
        its call's private one: ``EngineRequest.private_cache``)."""
        return self.enable_caching and (request.enable_prefix_caching or request.private_cache)

    def records_prefix_stats(self, request: Request) -> bool:
        """True when ``request``'s lookups count in the prefix-cache statistics (not for the
        private cache of a tenant with caching off)."""
        return self.enable_caching and request.enable_prefix_caching

    def update_block_hashes(self, request: Request) -> None:
        """Extends ``request.block_hashes`` to cover every full block of ``all_token_ids``."""
        if not self.uses_prefix_cache(request):
            return
        start = len(request.block_hashes)
        parent = request.block_hashes[-1] if start else None
        request.block_hashes.extend(hash_prompt_blocks(
            self.hash_fn, request.all_token_ids, self.block_size, request.cache_salt,
            start=start, parent=parent))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``request`` in the pool, walking from block 0 and stopping
        at the first miss.

        Last-token rule: at most ``floor((num_tokens - 1) / block_size)`` blocks are reused, so at
        least one token is computed and produces logits (vLLM v1).

        Returns:
            (hit blocks, number of hit tokens). Never modifies ref counts.
        """
        if not self.uses_prefix_cache(request) \
                or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed (vLLM v1)
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def num_tier_blocks(self, request: Request, num_hit_blocks: int, remote: bool = False
                        ) -> int:
        """Blocks of ``request``'s prefix past its ``num_hit_blocks`` pool hits that the
        offload tiers hold (``KVOffloader.lookup``; ``remote``: ask a remote tier too). 0
        without tiers, for a private cache, or for a request whose load already ran in this
        wait."""
        if self.offloader is None or request.private_cache or request.kv_load_tried \
                or not self.uses_prefix_cache(request) \
                or request.sampling_params.prompt_logprobs is not None:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.offloader.lookup(request.block_hashes[num_hit_blocks:max_blocks], remote)

    def start_load(self, request: Request, hit_blocks: list[KVCacheBlock], num_tier: int
                   ) -> bool:
        """Holds ``request``'s pool hits and allocates ``num_tier`` fresh blocks after them,
        then hands the tier's blocks to the offloader's loader thread (``finish_load`` ends
        it). Returns False, changing nothing, when the pool cannot spare the blocks."""
        num_evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_tier > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return False
        self.block_pool.touch(hit_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_tier, request.tenant_id)
        self.req_to_blocks[request.request_id] = [*hit_blocks, *new_blocks]
        first = len(hit_blocks)
        self.offloader.submit_load(LoadJob(
            request.request_id, request.tenant_id, request.cache_salt, request.cache_generation,
            request.block_hashes[first:first + num_tier], [b.block_id for b in new_blocks]))
        return True

    def finish_load(self, request: Request, job: LoadJob, cache: bool = True) -> int:
        """Caches the blocks ``job`` loaded (pool hits from now on) and releases the rest of
        what the request held for the load; its hits and loaded blocks stay held until
        ``release_pins``, so that its admission in this step finds them (the step's other
        allocations cannot evict them first). ``cache`` False (a reset during the load: the
        blocks are of the old generation) caches nothing. Returns the blocks cached."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        first = len(blocks) - len(job.block_ids)
        # (nothing after a rotation during the load: the request no longer caches)
        loaded = job.loaded if cache and self.uses_prefix_cache(request) else 0
        for i in range(first, first + loaded):
            self.block_pool.cache_full_block(blocks[i], request.block_hashes[i],
                                             request.tenant_id,
                                             salt=self._offload_salt(request),
                                             generation=request.cache_generation)
        keep = first + loaded
        self.block_pool.free_blocks(reversed(blocks[keep:]))
        if keep:
            self._pinned[request.request_id] = blocks[:keep]
        return loaded

    def release_pins(self) -> bool:
        """Releases the blocks ``finish_load`` held (the end of a step's scheduling, or a
        running request short of blocks). Returns whether any were held."""
        if not self._pinned:
            return False
        for blocks in self._pinned.values():
            self.block_pool.free_blocks(reversed(blocks))
        self._pinned.clear()
        return True

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None
                       ) -> list[KVCacheBlock] | None:
        """Reserves slots for ``num_new_tokens`` tokens after the computed ones.

        ``new_computed_blocks`` are the prefix hits from ``get_computed_blocks`` (waiting requests
        only); ``request.num_computed_tokens`` must already include them.

        Returns:
            The newly allocated blocks, or None when the pool cannot fit the request; in that case
            nothing changes (no ref counts, no free queue order, no request state) and the caller
            retries later or preempts.
        """
        fire("allocate", request.request_id)
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_total = request.num_computed_tokens + num_new_tokens
        num_required = cdiv(num_total, self.block_size)
        num_new = max(num_required - len(blocks) - len(new_computed_blocks), 0)
        # Hit blocks with ref_cnt 0 sit in the free queue; touching them removes them from it.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None

        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            if request.offload:  # hits cached by an "in_memory" request may now be offloaded
                for b in new_computed_blocks:
                    if b.salt is None and not b.private:
                        b.salt, b.generation = request.cache_salt, request.cache_generation
            blocks.extend(new_computed_blocks)
            self.num_cached_block[request.request_id] = len(blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new, request.tenant_id)
        blocks.extend(new_blocks)
        if self.uses_prefix_cache(request):
            # Cache every block that is full once this step's tokens are written. The KV of those
            # tokens is written before any attention reads it in the same forward pass, so a
            # request admitted later in the same step may already hit them.
            self.update_block_hashes(request)
            num_full = min(num_total // self.block_size, len(request.block_hashes))
            start = self.num_cached_block.get(request.request_id, 0)
            prompt_blocks = request.num_prompt_tokens // self.block_size
            for i in range(start, num_full):
                if not self.block_pool.cache_full_block(blocks[i], request.block_hashes[i],
                                                        request.tenant_id,
                                                        private=request.private_cache,
                                                        salt=self._offload_salt(request),
                                                        generation=request.cache_generation):
                    continue
                if i < prompt_blocks and not request.private_cache:
                    request.num_cache_write_tokens += self.block_size  # OpenAI's cache_write
                if self.offloader is not None and self.offloader.write_through:
                    self._cached_this_step.append((blocks[i], request.block_hashes[i]))
            self.num_cached_block[request.request_id] = max(start, num_full)
        return new_blocks

    @staticmethod
    def _offload_salt(request: Request) -> bytes | None:
        """The salt a block of ``request`` is cached with: the key of its offloaded copy, or
        None (never offloaded) for a request that keeps its prefix in memory."""
        return request.cache_salt if request.offload else None

    def step_done(self, ok: bool) -> None:
        """After a step: the blocks its allocations cached (and it wrote, if ``ok``) go to the
        offloader's write-through tiers, those still cached under the same hash (not a
        preempted request's, nor a reused one)."""
        cached, self._cached_this_step = self._cached_this_step, []
        if not ok:
            return
        for block, block_hash in cached:
            if block.block_hash == block_hash:
                self.offloader.on_cached(block)

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail block first (evicted before the shared head)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))
        pinned = self._pinned.pop(request.request_id, None)
        if pinned:
            self.block_pool.free_blocks(reversed(pinned))

    def uncache_uncomputed(self, request: Request) -> int:
        """Before a preemption or a scheduling failure frees ``request``'s blocks: the blocks
        past its computed tokens were cached when this step allocated them (full once the step
        writes them), but the step will not run for it now; no one may hit them, and no tier
        may take them. Returns blocks dropped."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        start = request.num_computed_tokens // self.block_size
        return self.block_pool.uncache_unwritten(blocks[start:])

    def drop_hashes_from(self, request: Request, num_computed_tokens: int) -> int:
        """Makes the request's blocks from the one holding token ``num_computed_tokens`` on
        unreachable in the prefix cache (reason ``"fault"``): their KV was being written by a
        step that failed. Returns the blocks dropped."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        start = num_computed_tokens // self.block_size
        dropped = self.block_pool.drop_hashes(blocks[start:], "fault")
        self.num_cached_block[request.request_id] = min(
            self.num_cached_block.get(request.request_id, 0), start)
        return dropped

    def num_addable_tokens(self, request: Request) -> int:
        """Tokens a running request can still add after its computed ones without anything
        being preempted: its own free slots plus every free block (tokens)."""
        num_blocks = len(self.req_to_blocks[request.request_id])
        num_slots = (num_blocks + self.block_pool.get_num_free_blocks()) * self.block_size
        return num_slots - request.num_computed_tokens

    def num_blocks_to_admit(self, request: Request, num_tokens: int) -> int:
        """Free blocks that admitting waiting ``request`` with up to ``num_tokens`` new tokens
        would take (its new blocks and its cache hits now in the free queue); ``allocate_slots``
        succeeds exactly when the pool has that many free."""
        hit_blocks, num_hit_tokens = self.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit_tokens, num_tokens)
        required = cdiv(num_hit_tokens + num_new, self.block_size) - len(hit_blocks)
        return max(required, 0) + sum(1 for b in hit_blocks if b.ref_cnt == 0)

    def num_blocks_freed_by(self, request: Request) -> int:
        """Blocks that freeing ``request`` returns to the free queue (those no other request
        holds)."""
        return sum(1 for b in self.req_to_blocks.get(request.request_id, ()) if b.ref_cnt == 1)

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks in the request's block table (0 when it has none)."""
        return len(self.req_to_blocks.get(request_id, ()))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def check_integrity(self) -> None:
        """Pool invariants plus: ref counts equal the number of block tables holding each block."""
        self.block_pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.block_pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), \
                f"{block}: ref_cnt != number of block tables holding it ({refs.get(block.block_id, 0)})"
