"""Chained block hashes for the prefix cache.

Block i's hash = H(parent_hash_{i-1}, token_ids of block i, extra_keys_i); block 0's parent is a
fixed per-algorithm root. The tenant's effective salt is an extra key of block 0 only, and the chain
carries it into every later block (vLLM v1 ``hash_block_tokens`` semantics, salted like vLLM's
``cache_salt``).

Byte layout hashed by ``sha256`` and ``xxhash`` (all integers little-endian, fixed width, so the
encoding is unambiguous and identical across processes, machines and Python versions)::

    b"saltserve/block/v1"                      18 bytes, domain separator
    u8   len(parent_hash)                       32 (sha256) or 16 (xxhash)
    parent_hash                                 bytes
    u32  num_tokens                             tokens in this block (== block_size)
    u32  token_id * num_tokens                  each token id as u32
    u32  num_extra_keys
    for each extra key:  u32 len, bytes         extra keys are bytes (e.g. the 32-byte salt)

``sha256_cbor`` hashes the canonical CBOR encoding of ``[parent_hash, [token ids], [extra keys]]``
(RFC 8949 deterministic encoding, the encoding vLLM's ``sha256_cbor`` option uses).

Roots: ``ROOT = H_raw(b"saltserve/root/v1")`` for each algorithm, where ``H_raw`` is the bare digest.
Test vectors live in ``docs/prefix-caching.md`` and ``tests/engine/test_block_hash.py``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

BlockHash = bytes
HashFn = Callable[[BlockHash | None, Sequence[int], Sequence[bytes]], BlockHash]

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash")
_DOMAIN = b"saltserve/block/v1"
_ROOT_SEED = b"saltserve/root/v1"


def encode_block(parent_hash: bytes, token_ids: Sequence[int], extra_keys: Sequence[bytes]) -> bytes:
    """Encodes one block into the fixed byte layout described in the module docstring.

    Args:
        parent_hash: digest of the previous block (or the algorithm's root), 16 or 32 bytes.
        token_ids: the block's token ids, each in [0, 2**32).
        extra_keys: extra keys as bytes (the effective salt for block 0, empty otherwise).

    Returns:
        The encoded bytes.

    Raises:
        struct.error: a token id is negative or does not fit in u32.
    """
    n = len(token_ids)
    parts = [
        _DOMAIN,
        struct.pack("<B", len(parent_hash)),
        parent_hash,
        struct.pack(f"<I{n}I", n, *token_ids),
        struct.pack("<I", len(extra_keys)),
    ]
    for key in extra_keys:
        parts.append(struct.pack("<I", len(key)))
        parts.append(key)
    return b"".join(parts)


def _sha256_raw(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_raw(data: bytes) -> bytes:
    import xxhash  # optional fast path; imported lazily so the default needs only the stdlib

    return xxhash.xxh3_128_digest(data)


def root_hash(algo: str) -> BlockHash:
    """Returns the fixed parent of block 0 for ``algo``."""
    if algo == "xxhash":
        return _xxh3_raw(_ROOT_SEED)
    return _sha256_raw(_ROOT_SEED)


def get_hash_fn(algo: str) -> HashFn:
    """Returns ``hash_block(parent_hash | None, token_ids, extra_keys) -> bytes`` for ``algo``.

    Args:
        algo: one of ``HASH_ALGOS`` (vLLM's ``--prefix-caching-hash-algo`` values).

    Raises:
        ValueError: unknown algorithm.
    """
    if algo not in HASH_ALGOS:
        raise ValueError(f"unknown prefix caching hash algo {algo!r}; choose one of {HASH_ALGOS}")
    root = root_hash(algo)

    if algo == "sha256_cbor":
        import cbor2

        def hash_cbor(parent: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: Sequence[bytes]) -> BlockHash:
            payload = [parent if parent is not None else root, list(token_ids), list(extra_keys)]
            return _sha256_raw(cbor2.dumps(payload, canonical=True))

        return hash_cbor

    raw = _xxh3_raw if algo == "xxhash" else _sha256_raw

    def hash_block(parent: BlockHash | None, token_ids: Sequence[int],
                   extra_keys: Sequence[bytes]) -> BlockHash:
        return raw(encode_block(parent if parent is not None else root, token_ids, extra_keys))

    return hash_block


def hash_prompt_blocks(hash_fn: HashFn, token_ids: Sequence[int], block_size: int,
                       cache_salt: bytes | None, start: int = 0,
                       parent: BlockHash | None = None) -> list[BlockHash]:
    """Hashes the full blocks of ``token_ids`` from block index ``start`` on.

    Args:
        hash_fn: from ``get_hash_fn``.
        token_ids: all known tokens of the sequence (prompt + output).
        block_size: tokens per block.
        cache_salt: effective salt, mixed into block 0 only; None means the unsalted namespace.
        start: index of the first block to hash; ``parent`` must be block ``start - 1``'s hash.
        parent: hash of block ``start - 1`` (None for start == 0).

    Returns:
        Hashes of blocks ``start .. len(token_ids) // block_size - 1`` (partial block excluded).
    """
    hashes: list[BlockHash] = []
    for i in range(start, len(token_ids) // block_size):
        extra = (cache_salt,) if (i == 0 and cache_salt is not None) else ()
        parent = hash_fn(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes
