"""Prefix lookup micro-benchmark: hashing a prompt's block chain plus looking every block up in
the block pool's index, per block (target: at most 2 µs per block on 512 blocks, issue 14).

A tenant's 512-block (8,192-token) prompt is cached in a ``BlockPool`` of 1,024 blocks; then
the same prompt under the same salt is hashed (``hash_prompt_blocks``, block 0 salted) and each
hash looked up (``BlockPool.get_cached_block``) until the first miss, the way
``KVCacheManager.get_computed_blocks`` does it, for each hash algorithm. Best of ``--repeat``
timings, in µs per block, with hashing and lookup also timed apart.

Usage: ``python benchmarks/bench_prefix_lookup.py [--blocks 512] [--repeat 50]``
"""

from __future__ import annotations

import argparse
import random
import time

from engine.block_hash import HASH_ALGOS, get_hash_fn, hash_prompt_blocks
from engine.block_pool import BlockPool

BLOCK_SIZE = 16
TARGET_US = 2.0


def best_of(repeat: int, fn) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(49152) for _ in range(args.blocks * BLOCK_SIZE)]
    salt = bytes(32)
    print(f"{args.blocks} blocks of {BLOCK_SIZE} tokens, best of {args.repeat}")
    print(f"{'algo':10} {'hash µs/blk':>12} {'lookup µs/blk':>14} {'total µs/blk':>13}  target "
          f"<= {TARGET_US}")
    for algo in sorted(HASH_ALGOS):
        hash_fn = get_hash_fn(algo)
        hashes = hash_prompt_blocks(hash_fn, tokens, BLOCK_SIZE, salt)
        pool = BlockPool(2 * args.blocks)
        for block, block_hash in zip(pool.get_new_blocks(args.blocks, "t"), hashes,
                                     strict=True):
            pool.cache_full_block(block, block_hash, "t")

        def lookup(hashes=hashes, pool=pool) -> int:
            hits = 0
            for block_hash in hashes:
                if pool.get_cached_block(block_hash) is None:
                    break
                hits += 1
            return hits

        assert lookup() == args.blocks
        t_hash = best_of(args.repeat, lambda hash_fn=hash_fn: hash_prompt_blocks(
            hash_fn, tokens, BLOCK_SIZE, salt))
        t_lookup = best_of(args.repeat, lookup)
        t_both = best_of(args.repeat, lambda hash_fn=hash_fn, lookup=lookup: (
            hash_prompt_blocks(hash_fn, tokens, BLOCK_SIZE, salt), lookup()))
        per = [1e6 * t / args.blocks for t in (t_hash, t_lookup, t_both)]
        print(f"{algo:10} {per[0]:12.2f} {per[1]:14.3f} {per[2]:13.2f}  "
              f"{'PASS' if per[2] <= TARGET_US else 'FAIL'}")


if __name__ == "__main__":
    main()
