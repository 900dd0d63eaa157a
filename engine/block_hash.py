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

import array
import functools
import hashlib
import struct
import sys
from collections.abc import Callable, Sequence

BlockHash = bytes
HashFn = Callable[[BlockHash | None, Sequence[int], Sequence[bytes]], BlockHash]

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash")
_DOMAIN = b"saltserve/block/v1"
_ROOT_SEED = b"saltserve/root/v1"


@functools.lru_cache(maxsize=64)
def _head_struct(parent_len: int, num_tokens: int) -> struct.Struct:
    """The packer of the layout's fixed part up to ``num_extra_keys`` (compiled once a shape)."""
    return struct.Struct(f"<{len(_DOMAIN)}sB{parent_len}sI{num_tokens}II")


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
    head = _head_struct(len(parent_hash), n).pack(
        _DOMAIN, len(parent_hash), parent_hash, n, *token_ids, len(extra_keys))
    if not extra_keys:
        return head
    parts = [head]
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

    if algo == "xxhash":
        import xxhash  # optional fast path; imported lazily so the default needs only the stdlib

        return _FixedLayoutHasher(xxhash.xxh3_128_digest, root)
    return _FixedLayoutHasher(lambda data: hashlib.sha256(data).digest(), root)


class _FixedLayoutHasher:
    """``HashFn`` of the fixed byte layout (``sha256``, ``xxhash``), plus ``hash_blocks``: a
    whole chain at once, which packs every token id in one call and reuses the layout's constant
    parts, about 1.5x faster a block than calling the ``HashFn`` per block (same bytes hashed)."""

    def __init__(self, digest: Callable[[bytes], bytes], root: BlockHash) -> None:
        self._digest = digest
        self._root = root
        self._head = _DOMAIN + bytes((len(root),))  # every parent is a digest of root's length

    def __call__(self, parent: BlockHash | None, token_ids: Sequence[int],
                 extra_keys: Sequence[bytes]) -> BlockHash:
        return self._digest(encode_block(parent if parent is not None else self._root,
                                         token_ids, extra_keys))

    def hash_blocks(self, token_ids: Sequence[int], block_size: int, cache_salt: bytes | None,
                    start: int, parent: BlockHash | None) -> list[BlockHash]:
        """``hash_prompt_blocks`` for this algorithm; same arguments, result and errors."""
        num_blocks = len(token_ids) // block_size
        if num_blocks <= start:
            return []
        packed = array.array("I")
        if packed.itemsize != 4:  # not on any platform torch supports; keep the layout exact
            return _hash_blocks_one_by_one(self, token_ids, block_size, cache_salt, start, parent)
        try:
            packed.extend(token_ids[start * block_size:num_blocks * block_size])
        except OverflowError as e:
            raise struct.error(f"token id does not fit in u32: {e}") from None
        if sys.byteorder != "little":
            packed.byteswap()
        tokens = packed.tobytes()
        digest, head = self._digest, self._head
        count = struct.pack("<I", block_size)
        no_extra_keys = struct.pack("<I", 0)
        width = 4 * block_size
        parent = parent if parent is not None else self._root
        hashes: list[BlockHash] = []
        first = 0
        if start == 0 and cache_salt is not None:
            parent = digest(b"".join((head, parent, count, tokens[:width],
                                      struct.pack("<II", 1, len(cache_salt)), cache_salt)))
            hashes.append(parent)
            first = width
        for offset in range(first, len(tokens), width):
            parent = digest(b"".join((head, parent, count, tokens[offset:offset + width],
                                      no_extra_keys)))
            hashes.append(parent)
        return hashes


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

    Raises:
        struct.error: a token id is negative or does not fit in u32 (``sha256``, ``xxhash``).
    """
    hash_blocks = getattr(hash_fn, "hash_blocks", None)
    if hash_blocks is not None:
        return hash_blocks(token_ids, block_size, cache_salt, start, parent)
    return _hash_blocks_one_by_one(hash_fn, token_ids, block_size, cache_salt, start, parent)


def _hash_blocks_one_by_one(hash_fn: HashFn, token_ids: Sequence[int], block_size: int,
                            cache_salt: bytes | None, start: int,
                            parent: BlockHash | None) -> list[BlockHash]:
    hashes: list[BlockHash] = []
    for i in range(start, len(token_ids) // block_size):
        extra = (cache_salt,) if (i == 0 and cache_salt is not None) else ()
        parent = hash_fn(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes
