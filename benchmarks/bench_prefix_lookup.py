"""Prefix lookup micro-benchmark: hashing a prompt's block chain plus looking every block up in
the block pool's index, per block (target: at most 2 µs per block on 512 blocks).

A tenant's 512-block (8,192-token) prompt is cached in a ``BlockPool`` of 1,024 blocks; then
the same prompt under the same salt is hashed (``hash_prompt_blocks``, block 0 salted) and each
hash looked up (``BlockPool.get_cached_block``) until the first miss, the way
``KVCacheManager.get_computed_blocks`` does it, for each hash algorithm. Best of ``--repeat``
timings, in µs per block, with hashing and lookup also timed apart, and beside them the bare
digest of the same bytes (the floor any encoding in Python sits on; ``total / digest`` is the
machine-independent figure).

Usage: ``python benchmarks/bench_prefix_lookup.py [--blocks 512] [--repeat 50]``
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time

import cbor2
import xxhash

from engine.block_hash import HASH_ALGOS, encode_block, get_hash_fn, hash_prompt_blocks, root_hash
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


def hashed_bytes(algo: str, tokens: list[int], salt: bytes, hashes: list[bytes]) -> list[bytes]:
    """The exact message each block's digest is taken over, for timing the digest alone."""
    parents = [root_hash(algo)] + hashes[:-1]
    messages = []
    for i, parent in enumerate(parents):
        block = tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
        extra = [salt] if i == 0 else []
        if algo == "sha256_cbor":
            messages.append(cbor2.dumps([parent, block, extra], canonical=True))
        else:
            messages.append(encode_block(parent, block, extra))
    return messages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(49152) for _ in range(args.blocks * BLOCK_SIZE)]
    salt = bytes(32)
    print(f"{args.blocks} blocks of {BLOCK_SIZE} tokens, best of {args.repeat}")
    print(f"{'algo':10} {'hash µs/blk':>12} {'lookup µs/blk':>14} {'total µs/blk':>13} "
          f"{'digest µs/blk':>14} {'total/digest':>13}  target <= {TARGET_US}")
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
        messages = hashed_bytes(algo, tokens, salt, hashes)
        digest = xxhash.xxh3_128_digest if algo == "xxhash" else (
            lambda data: hashlib.sha256(data).digest())
        assert [digest(m) for m in messages] == hashes
        t_hash = best_of(args.repeat, lambda hash_fn=hash_fn: hash_prompt_blocks(
            hash_fn, tokens, BLOCK_SIZE, salt))
        t_lookup = best_of(args.repeat, lookup)
        t_both = best_of(args.repeat, lambda hash_fn=hash_fn, lookup=lookup: (
            hash_prompt_blocks(hash_fn, tokens, BLOCK_SIZE, salt), lookup()))
        t_digest = best_of(args.repeat, lambda digest=digest, messages=messages: [
            digest(m) for m in messages])
        per = [1e6 * t / args.blocks for t in (t_hash, t_lookup, t_both, t_digest)]
        print(f"{algo:10} {per[0]:12.2f} {per[1]:14.3f} {per[2]:13.2f} {per[3]:14.2f} "
              f"{per[2] / per[3]:12.2f}x  {'PASS' if per[2] <= TARGET_US else 'FAIL'}")


if __name__ == "__main__":
    main()
