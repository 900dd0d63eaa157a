"""Offloaded KV blocks are tenant data: each is sealed with AES-256-GCM under a key only the
tenant's salt can give.

- Key: HKDF-SHA256 (RFC 5869) of the effective salt the block was hashed with (the tenant's
  salt at its salt version, and any ``cache_salt``), with the tenant's cache generation (salt
  version and cache epoch, opaque here) and the layout in ``info``: a rotation or a reset gives
  another key, so a blob of an older generation can no longer be opened by anyone.
- Associated data: the block's chained hash (its storage key) and the KV layout, so a blob
  cannot be replayed under another hash, another tenant (another key), or another model's
  cache layout.
- Blob: ``nonce (12 bytes, random) || ciphertext || tag (16 bytes)``; ``open`` returns None for
  anything that fails authentication or has the wrong size (never raises on bad data).

The ``cryptography`` package's AESGCM and HKDF do the work (NIST SP 800-38D; RFC 5869).
"""

from __future__ import annotations

import os
import struct
from functools import lru_cache

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD = NONCE_BYTES + TAG_BYTES
_INFO = b"saltserve/kv-offload/v1"
_AAD = b"saltserve/kv-block/v1"


@lru_cache(maxsize=4096)
def _aead(salt: bytes, generation: int, layout: bytes) -> AESGCM:
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
               info=_INFO + struct.pack("<Q", generation) + layout).derive(salt)
    return AESGCM(key)


class BlockCipher:
    """Seals and opens one KV layout's blocks.

    Args:
        layout: what a block's bytes mean (model, dtype, shape); part of every key and of the
            associated data.
        block_bytes: the plaintext size of one block.
    """

    def __init__(self, layout: bytes, block_bytes: int) -> None:
        self.layout, self.block_bytes = layout, block_bytes
        self.blob_bytes = block_bytes + OVERHEAD

    def seal(self, salt: bytes, generation: int, block_hash: bytes, data: bytes) -> bytes:
        """The blob of ``data`` (``block_bytes``) for ``block_hash``.

        Raises:
            ValueError: ``data`` of another size, or an empty salt.
        """
        if len(data) != self.block_bytes or not salt:
            raise ValueError("a block of the wrong size, or no salt")
        nonce = os.urandom(NONCE_BYTES)
        return nonce + _aead(salt, generation, self.layout).encrypt(
            nonce, data, _AAD + self.layout + block_hash)

    def open(self, salt: bytes, generation: int, block_hash: bytes, blob: bytes
             ) -> bytes | None:
        """The block ``blob`` holds for ``block_hash``, or None: wrong size, tampered, another
        hash, tenant, generation or layout."""
        if len(blob) != self.blob_bytes or not salt:
            return None
        try:
            return _aead(salt, generation, self.layout).decrypt(
                blob[:NONCE_BYTES], blob[NONCE_BYTES:], _AAD + self.layout + block_hash)
        except InvalidTag:
            return None
