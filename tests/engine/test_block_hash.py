"""Test vectors and chaining rules for ``engine.block_hash``.

The vectors below are hard-coded and also re-derived here by an independent encoder (plain
``int.to_bytes`` + ``hashlib``, no ``struct``, no engine code) of the byte layout documented in
``engine/block_hash.py``, so a change to either the layout or the vectors fails loudly.
"""

from __future__ import annotations

import hashlib
import struct

import pytest
import xxhash

from engine.block_hash import (
    HASH_ALGOS,
    encode_block,
    get_hash_fn,
    hash_prompt_blocks,
    root_hash,
)

SALT = b"\x01" * 32
BLOCK0 = list(range(16))        # tokens 0..15
BLOCK1 = list(range(16, 32))    # tokens 16..31

# sha256 (default) vectors, hex digests.
SHA256_ROOT = "aece4c67eb73bf9786dda262707d7452bb7a61bc2e3b80ccb645b89a183c8b40"
SHA256_BLOCK0 = "798b3e26435e111857c4bdc44a1c7f53c58903844010d2a7a8aca5ca1b1e2569"
SHA256_BLOCK0_SALTED = "78a5eb00c4c14539b3e2c4293f01bc395ae9c026dd8818afee741b1dde82f9c4"
SHA256_BLOCK1 = "8566158a77f7f30dc4f9fe6a25814b95ef017b0eb7f166c5f07fbe373442e0d5"
SHA256_BLOCK1_SALTED = "a47fe2afb9e6c1054d9cdd541c72158faae07ad2ffc419e1a52130b0a49860bb"

# sha256_cbor vectors (same root as sha256).
CBOR_BLOCK0 = "8dbf1ff528428cf0b4522e4d30cf254d1c5d5f2b21fb5117c46af65d0a607038"
CBOR_BLOCK0_SALTED = "6fa35b4fab431886372c08cf0cd888dc5945a5f6c9cf4a9bc405a4b66c6c0a0f"
CBOR_BLOCK1 = "a1544085df9d4c590c3843403b999cb684c950fe745a53c733f95d2927db7ae8"

# xxhash (xxh3-128) vectors.
XXH_ROOT = "b33ce1cacfbf949dafdef55be4bb050d"
XXH_BLOCK0 = "f63ef98b2100e677ae9d8eaf0ee2d0a0"
XXH_BLOCK0_SALTED = "f591afe4b82741a92828a41782d63530"
XXH_BLOCK1 = "73c9b8cbc4faf99ca0bdb002c38e50f8"


# -- independent re-implementation of the documented layouts --------------------------------------
def _u32(x: int) -> bytes:
    return x.to_bytes(4, "little")


def _layout(parent: bytes, tokens: list[int], extra: list[bytes]) -> bytes:
    out = b"saltserve/block/v1" + bytes([len(parent)]) + parent + _u32(len(tokens))
    out += b"".join(_u32(t) for t in tokens) + _u32(len(extra))
    for key in extra:
        out += _u32(len(key)) + key
    return out


def _ref_sha256(parent: bytes, tokens: list[int], extra: list[bytes]) -> bytes:
    return hashlib.sha256(_layout(parent, tokens, extra)).digest()


def _ref_xxh(parent: bytes, tokens: list[int], extra: list[bytes]) -> bytes:
    return xxhash.xxh3_128(_layout(parent, tokens, extra)).digest()


def _cbor_head(major: int, n: int) -> bytes:
    """Shortest-form CBOR head (RFC 8949 section 4.2.1 deterministic encoding)."""
    if n < 24:
        return bytes([major << 5 | n])
    if n < 256:
        return bytes([major << 5 | 24, n])
    if n < 65536:
        return bytes([major << 5 | 25]) + n.to_bytes(2, "big")
    return bytes([major << 5 | 26]) + n.to_bytes(4, "big")


def _ref_cbor(parent: bytes, tokens: list[int], extra: list[bytes]) -> bytes:
    enc = _cbor_head(4, 3) + _cbor_head(2, len(parent)) + parent
    enc += _cbor_head(4, len(tokens)) + b"".join(_cbor_head(0, t) for t in tokens)
    enc += _cbor_head(4, len(extra)) + b"".join(_cbor_head(2, len(k)) + k for k in extra)
    return hashlib.sha256(enc).digest()


# -- sha256 ---------------------------------------------------------------------------------------
def test_sha256_root_vector() -> None:
    assert hashlib.sha256(b"saltserve/root/v1").hexdigest() == SHA256_ROOT
    assert root_hash("sha256").hex() == SHA256_ROOT
    assert root_hash("sha256_cbor").hex() == SHA256_ROOT


def test_encode_block_matches_documented_layout() -> None:
    root = bytes.fromhex(SHA256_ROOT)
    assert encode_block(root, BLOCK0, ()) == _layout(root, BLOCK0, [])
    assert encode_block(root, BLOCK0, (SALT,)) == _layout(root, BLOCK0, [SALT])
    # 18 domain + 1 len + 32 parent + 4 count + 16*4 tokens + 4 num keys + (4 + 32) salt
    assert len(encode_block(root, BLOCK0, (SALT,))) == 18 + 1 + 32 + 4 + 64 + 4 + 36


def test_sha256_block_vectors() -> None:
    h = get_hash_fn("sha256")
    root = bytes.fromhex(SHA256_ROOT)
    b0 = h(None, BLOCK0, ())
    b0s = h(None, BLOCK0, (SALT,))
    b1 = h(b0, BLOCK1, ())
    b1s = h(b0s, BLOCK1, ())
    # Independent re-derivation of every vector.
    assert _ref_sha256(root, BLOCK0, []).hex() == SHA256_BLOCK0
    assert _ref_sha256(root, BLOCK0, [SALT]).hex() == SHA256_BLOCK0_SALTED
    assert _ref_sha256(bytes.fromhex(SHA256_BLOCK0), BLOCK1, []).hex() == SHA256_BLOCK1
    assert _ref_sha256(bytes.fromhex(SHA256_BLOCK0_SALTED), BLOCK1, []).hex() \
        == SHA256_BLOCK1_SALTED
    # Engine output equals the vectors.
    assert b0.hex() == SHA256_BLOCK0
    assert b0s.hex() == SHA256_BLOCK0_SALTED
    assert b1.hex() == SHA256_BLOCK1
    assert b1s.hex() == SHA256_BLOCK1_SALTED
    # Explicit root parent is the same as None.
    assert h(root, BLOCK0, ()) == b0


def test_salt_changes_block0_and_is_carried_by_the_chain() -> None:
    h = get_hash_fn("sha256")
    assert h(None, BLOCK0, ()) != h(None, BLOCK0, (SALT,))
    assert h(None, BLOCK0, (SALT,)) != h(None, BLOCK0, (b"\x02" * 32,))
    # Block 1 carries no extra key; the salt still separates it through the parent.
    assert SHA256_BLOCK1 != SHA256_BLOCK1_SALTED


def test_chain_same_block1_tokens_different_block0() -> None:
    h = get_hash_fn("sha256")
    other0 = h(None, [t + 100 for t in BLOCK0], ())
    assert h(h(None, BLOCK0, ()), BLOCK1, ()) != h(other0, BLOCK1, ())


def test_extra_key_boundaries_are_unambiguous() -> None:
    h = get_hash_fn("sha256")
    assert h(None, BLOCK0, (b"ab", b"c")) != h(None, BLOCK0, (b"a", b"bc"))
    assert h(None, BLOCK0, (b"",)) != h(None, BLOCK0, ())


def test_token_ids_outside_u32_raise() -> None:
    h = get_hash_fn("sha256")
    with pytest.raises(struct.error):
        h(None, [-1] + BLOCK0[1:], ())
    with pytest.raises(struct.error):
        h(None, [2**32] + BLOCK0[1:], ())


# -- sha256_cbor and xxhash -----------------------------------------------------------------------
def test_sha256_cbor_vectors() -> None:
    h = get_hash_fn("sha256_cbor")
    root = bytes.fromhex(SHA256_ROOT)
    assert _ref_cbor(root, BLOCK0, []).hex() == CBOR_BLOCK0
    assert _ref_cbor(root, BLOCK0, [SALT]).hex() == CBOR_BLOCK0_SALTED
    assert _ref_cbor(bytes.fromhex(CBOR_BLOCK0), BLOCK1, []).hex() == CBOR_BLOCK1
    b0 = h(None, BLOCK0, ())
    assert b0.hex() == CBOR_BLOCK0
    assert h(None, BLOCK0, (SALT,)).hex() == CBOR_BLOCK0_SALTED
    assert h(b0, BLOCK1, ()).hex() == CBOR_BLOCK1
    assert h(None, BLOCK0, ()) == b0, "not stable across calls"
    assert CBOR_BLOCK0 not in (SHA256_BLOCK0, CBOR_BLOCK0_SALTED)


def test_xxhash_vectors() -> None:
    h = get_hash_fn("xxhash")
    root = root_hash("xxhash")
    assert root.hex() == XXH_ROOT
    assert xxhash.xxh3_128(b"saltserve/root/v1").hexdigest() == XXH_ROOT
    assert _ref_xxh(root, BLOCK0, []).hex() == XXH_BLOCK0
    assert _ref_xxh(root, BLOCK0, [SALT]).hex() == XXH_BLOCK0_SALTED
    assert _ref_xxh(bytes.fromhex(XXH_BLOCK0), BLOCK1, []).hex() == XXH_BLOCK1
    b0 = h(None, BLOCK0, ())
    assert len(b0) == 16
    assert b0.hex() == XXH_BLOCK0
    assert h(None, BLOCK0, (SALT,)).hex() == XXH_BLOCK0_SALTED
    assert h(b0, BLOCK1, ()).hex() == XXH_BLOCK1
    assert h(None, BLOCK0, (b"\x02" * 32,)).hex() not in (XXH_BLOCK0, XXH_BLOCK0_SALTED)


def test_unknown_algo_raises_value_error() -> None:
    assert HASH_ALGOS == ("sha256", "sha256_cbor", "xxhash")
    with pytest.raises(ValueError, match="md5"):
        get_hash_fn("md5")


# -- hash_prompt_blocks ---------------------------------------------------------------------------
@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_hash_prompt_blocks_skips_partial_block(algo: str) -> None:
    h = get_hash_fn(algo)
    tokens = list(range(55))
    hashes = hash_prompt_blocks(h, tokens, 16, None)
    assert len(hashes) == 3
    assert hashes[0] == h(None, tokens[0:16], ())
    assert hashes[1] == h(hashes[0], tokens[16:32], ())
    assert hashes[2] == h(hashes[1], tokens[32:48], ())
    salted = hash_prompt_blocks(h, tokens, 16, SALT)
    assert salted[0] == h(None, tokens[0:16], (SALT,))
    assert salted[2] == h(salted[1], tokens[32:48], ())
    assert not set(hashes) & set(salted), "salted and unsalted chains share a block hash"
    assert hash_prompt_blocks(h, tokens[:15], 16, SALT) == []


def test_hash_prompt_blocks_matches_vectors() -> None:
    h = get_hash_fn("sha256")
    assert [x.hex() for x in hash_prompt_blocks(h, BLOCK0 + BLOCK1, 16, None)] \
        == [SHA256_BLOCK0, SHA256_BLOCK1]
    assert [x.hex() for x in hash_prompt_blocks(h, BLOCK0 + BLOCK1 + [7], 16, SALT)] \
        == [SHA256_BLOCK0_SALTED, SHA256_BLOCK1_SALTED]


@pytest.mark.parametrize("salt", [None, SALT])
def test_hash_prompt_blocks_continuation(salt: bytes | None) -> None:
    h = get_hash_fn("sha256")
    tokens = [(7 * i) % 101 for i in range(100)]   # 6 full blocks + 4 tokens
    whole = hash_prompt_blocks(h, tokens, 16, salt)
    assert len(whole) == 6
    first = hash_prompt_blocks(h, tokens[:40], 16, salt)       # blocks 0, 1
    rest = hash_prompt_blocks(h, tokens, 16, salt, start=len(first), parent=first[-1])
    assert first + rest == whole
    # Continuing from block 0 only (salt must not be re-applied past block 0).
    rest1 = hash_prompt_blocks(h, tokens, 16, salt, start=1, parent=whole[0])
    assert [whole[0]] + rest1 == whole


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
@pytest.mark.parametrize("block_size", [1, 16, 24])
def test_whole_chain_path_equals_block_by_block(algo: str, block_size: int) -> None:
    """``hash_blocks`` (one pack for the whole chain) hashes the same bytes as ``HashFn`` per block,
    for ids needing all four bytes, salted or not, from any start block."""
    h = get_hash_fn(algo)
    assert hasattr(h, "hash_blocks")
    tokens = [(2**32 - 1) if i % 7 == 0 else (i * 40503) % 70000 for i in range(5 * block_size + block_size // 2)]
    for salt in (None, SALT):
        chain, parent = [], None
        for i in range(5):
            parent = h(parent, tokens[i * block_size:(i + 1) * block_size],
                       (salt,) if (i == 0 and salt is not None) else ())
            chain.append(parent)
        assert hash_prompt_blocks(h, tokens, block_size, salt) == chain
        for start in range(1, 6):
            assert hash_prompt_blocks(h, tokens, block_size, salt, start=start,
                                      parent=chain[start - 1]) == chain[start:]
    assert hash_prompt_blocks(h, tokens[:block_size - 1], block_size, SALT) == []


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_whole_chain_path_rejects_ids_outside_u32(bad: int) -> None:
    h = get_hash_fn("sha256")
    with pytest.raises(struct.error):
        hash_prompt_blocks(h, BLOCK0 + [bad] + BLOCK1[1:], 16, SALT)
    # A bad id in the trailing partial block is not hashed, so it is not an error here.
    assert len(hash_prompt_blocks(h, BLOCK0 + [bad], 16, SALT)) == 1
