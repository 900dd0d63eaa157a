"""tenants/crypto.py: master key file handling and salt encryption at rest."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

import pytest

from tenants.crypto import (
    SaltCipher,
    decode_master_key,
    generate_master_key,
    load_or_create_master_key,
)
from tenants.errors import SaltDecryptionError
from tenants.salts import new_salt


def test_master_key_file_created_0600_and_reused(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    key = load_or_create_master_key(data_dir, None)
    path = data_dir / "master.key"
    assert len(key) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_master_key(data_dir, None) == key
    assert load_or_create_master_key(data_dir, "") == key  # empty env value = unset
    assert [p.name for p in data_dir.iterdir()] == ["master.key"]  # no temp files left


def test_master_key_file_is_0600_under_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        load_or_create_master_key(tmp_path, None)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "master.key").stat().st_mode) == 0o600


def test_env_master_key_wins(tmp_path: Path) -> None:
    file_key = load_or_create_master_key(tmp_path, None)
    env_text = generate_master_key()
    env_key = load_or_create_master_key(tmp_path, env_text)
    assert env_key == base64.urlsafe_b64decode(env_text)
    assert env_key != file_key


def test_fernet_generated_key_is_accepted(tmp_path: Path) -> None:
    from cryptography.fernet import Fernet

    text = Fernet.generate_key().decode()
    assert load_or_create_master_key(tmp_path, text) == base64.urlsafe_b64decode(text)


@pytest.mark.parametrize("bad", ["not base64!!", base64.urlsafe_b64encode(b"short").decode()])
def test_invalid_master_key_raises_without_echo(bad: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="URL-safe base64 of 32 bytes") as info:
        load_or_create_master_key(tmp_path, bad)
    assert bad not in str(info.value)
    with pytest.raises(ValueError):
        decode_master_key(bad)


def test_corrupt_key_file_raises(tmp_path: Path) -> None:
    (tmp_path / "master.key").write_text("garbage")
    (tmp_path / "master.key").chmod(0o600)  # private, so the content is what fails
    with pytest.raises(ValueError, match="invalid master key file"):
        load_or_create_master_key(tmp_path, None)


def test_cipher_round_trip_and_fresh_nonce(cipher: SaltCipher) -> None:
    salt = new_salt()
    blob1 = cipher.encrypt("t1", 1, salt)
    blob2 = cipher.encrypt("t1", 1, salt)
    assert blob1 != blob2  # random nonce
    assert salt not in blob1
    assert len(blob1) == 32 + 29
    assert cipher.decrypt("t1", 1, blob1) == salt
    assert cipher.decrypt("t1", 1, blob2) == salt


def test_ciphertext_is_bound_to_tenant_and_version(cipher: SaltCipher) -> None:
    blob = cipher.encrypt("tenant-a", 3, new_salt())
    with pytest.raises(SaltDecryptionError):
        cipher.decrypt("tenant-b", 3, blob)
    with pytest.raises(SaltDecryptionError):
        cipher.decrypt("tenant-a", 4, blob)


def test_tampered_or_foreign_ciphertext_fails(cipher: SaltCipher) -> None:
    blob = bytearray(cipher.encrypt("t", 1, new_salt()))
    blob[-1] ^= 1
    with pytest.raises(SaltDecryptionError, match="failed to decrypt"):
        cipher.decrypt("t", 1, bytes(blob))
    with pytest.raises(SaltDecryptionError, match="malformed"):
        cipher.decrypt("t", 1, b"\x01short")
    other = SaltCipher(os.urandom(32))
    with pytest.raises(SaltDecryptionError):
        other.decrypt("t", 1, cipher.encrypt("t", 1, new_salt()))


def test_cipher_rejects_bad_key_and_hides_it() -> None:
    with pytest.raises(ValueError):
        SaltCipher(b"short")
    key = os.urandom(32)
    assert key.hex() not in repr(SaltCipher(key))
