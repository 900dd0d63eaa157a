"""Master key handling and encryption of tenant salts at rest.

Master key
    32 random bytes, written as URL-safe base64 (44 chars, the same text format as a
    ``cryptography.fernet.Fernet.generate_key()`` key, so either tool can generate one). It comes
    from the environment if set, else from ``<data_dir>/master.key`` (mode 0600), else a new one is
    generated and written there.

Salt encryption
    AES-256-GCM. The AES key is not the master key itself but
    ``HKDF-SHA256(master_key, salt=None, info=b"saltserve/salt-encryption/v1", length=32)``, so
    the same master key can later serve other purposes without key reuse across algorithms.
    Blob layout::

        | 0x01 (format) | nonce (12 random bytes) | ciphertext + 16-byte GCM tag |

    Associated data binds the blob to its row, so a ciphertext copied to another tenant or
    version fails authentication::

        b"saltserve/tenant-salt/v1" | 0x01 (format) | u16be len(tenant_id) | tenant_id utf-8 |
        u32be version

Master-key rotation: decrypt with the old ``SaltCipher`` and encrypt with the new one
(``TenantStore.reencrypt_salts``, ``TenantRepository.tenants``).
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import secrets
import struct
import tempfile
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from tenants.errors import SaltDecryptionError

logger = logging.getLogger(__name__)

MASTER_KEY_FILENAME = "master.key"
MASTER_KEY_BYTES = 32

_FORMAT_V1 = 1
_NONCE_BYTES = 12
_TAG_BYTES = 16
_HKDF_INFO = b"saltserve/salt-encryption/v1"
_KV_OWNER_INFO = b"saltserve/kv-owner-tag/v1"
_AAD_DOMAIN = b"saltserve/tenant-salt/v1"


def generate_master_key() -> str:
    """Returns a new master key as URL-safe base64 text (44 chars, Fernet-compatible)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(MASTER_KEY_BYTES)).decode("ascii")


def decode_master_key(text: str) -> bytes:
    """Decodes a master key from its URL-safe base64 text form.

    Args:
        text: URL-safe base64 of exactly 32 bytes; surrounding whitespace is ignored.

    Returns:
        The 32 raw key bytes.

    Raises:
        ValueError: if ``text`` is not URL-safe base64 of 32 bytes (the message says how to make
            a valid key; it never echoes the input).
    """
    try:
        raw = base64.urlsafe_b64decode(text.strip().encode("ascii"))
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raw = b""
    if len(raw) != MASTER_KEY_BYTES:
        raise ValueError(
            "master key must be URL-safe base64 of 32 bytes (44 chars); generate one with "
            '`python -c "from cryptography.fernet import Fernet; print(Fernet.generate_key()'
            '.decode())"`'
        )
    return raw


def require_private_file(path: Path) -> None:
    """Refuses a secret file that group or others may read or write.

    Raises:
        ValueError: naming the file, its mode and the command that fixes it.
    """
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(f"{path} is accessible by group or others (mode {mode:o}); it holds a "
                         f"secret: run chmod 600 {path}")


def load_or_create_master_key(data_dir: Path, env_value: str | None) -> bytes:
    """Returns the master key: from the environment, else the key file, else a new key file.

    A new key file is written atomically with mode 0600 (temporary file + ``os.link``), so two
    processes starting together agree on one key.

    Args:
        data_dir: directory holding ``master.key``; created (mode 0700) if missing.
        env_value: the master key from the environment (URL-safe base64), or None/empty to use
            the key file. Wins over the file when set.

    Returns:
        The 32 raw key bytes.

    Raises:
        ValueError: if ``env_value`` or the key file does not hold a valid key, or the key
            file is accessible by group or others (``require_private_file``).
        OSError: if the key file cannot be read or written.
    """
    if env_value:
        return decode_master_key(env_value)
    path = Path(data_dir) / MASTER_KEY_FILENAME
    if not path.exists():
        _create_key_file(path)
    require_private_file(path)
    try:
        return decode_master_key(path.read_text(encoding="ascii"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"invalid master key file {path}: {exc}") from None


def _create_key_file(path: Path) -> None:
    """Writes a new key to ``path`` unless another process got there first."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp_name = tempfile.mkstemp(prefix=".master.key.", dir=path.parent)  # mode 0600
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (generate_master_key() + "\n").encode("ascii"))
        os.fsync(fd)
        os.close(fd)
        fd = -1
        try:
            os.link(tmp_name, path)  # atomic; fails if the file exists
        except FileExistsError:
            pass
        else:
            logger.info("generated a new master key at %s", path)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(tmp_name)


class SaltCipher:
    """Encrypts tenant salts with AES-256-GCM, bound to (tenant_id, version).

    See the module docstring for the key derivation and the exact blob and associated-data
    layouts. Thread-safe; holds no per-call state.
    """

    def __init__(self, master_key: bytes) -> None:
        """Derives the AES key from the master key.

        Args:
            master_key: the 32 raw master-key bytes (``load_or_create_master_key``).

        Raises:
            ValueError: if ``master_key`` is not 32 bytes.
        """
        if len(master_key) != MASTER_KEY_BYTES:
            raise ValueError("master key must be 32 raw bytes (see load_or_create_master_key)")
        aes_key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_HKDF_INFO).derive(
            master_key
        )
        self._aead = AESGCM(aes_key)
        # Keys the owner tags of the KV offload tiers (engine.kv_offload): a second HKDF output
        # of the same master key, so every replica of a deployment tags a tenant alike.
        self.kv_owner_key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                                 info=_KV_OWNER_INFO).derive(master_key)

    def __repr__(self) -> str:
        return "SaltCipher(<redacted>)"

    @staticmethod
    def _aad(tenant_id: str, version: int) -> bytes:
        tid = tenant_id.encode("utf-8")
        return (
            _AAD_DOMAIN
            + struct.pack(">BH", _FORMAT_V1, len(tid))
            + tid
            + struct.pack(">I", version)
        )

    def encrypt(self, tenant_id: str, version: int, salt: bytes) -> bytes:
        """Encrypts one salt version of one tenant.

        Args:
            tenant_id: the tenant the salt belongs to (bound as associated data).
            version: the salt version, 0 <= version < 2**32 (bound as associated data).
            salt: the secret salt bytes.

        Returns:
            The blob ``0x01 | nonce | ciphertext+tag`` (len(salt) + 29 bytes).

        Raises:
            ValueError: if ``version`` is out of range.
        """
        if not 0 <= version < 2**32:
            raise ValueError(f"salt version out of range: {version}")
        nonce = os.urandom(_NONCE_BYTES)
        ct = self._aead.encrypt(nonce, salt, self._aad(tenant_id, version))
        return bytes([_FORMAT_V1]) + nonce + ct

    def decrypt(self, tenant_id: str, version: int, blob: bytes) -> bytes:
        """Decrypts a blob made by ``encrypt`` for the same tenant and version.

        Args:
            tenant_id: the tenant the blob is stored for.
            version: the salt version the blob is stored for.
            blob: the stored ciphertext.

        Returns:
            The salt bytes.

        Raises:
            SaltDecryptionError: if the blob is malformed or fails authentication (tampered,
                copied from another tenant/version, or encrypted under another master key).
        """
        if len(blob) < 1 + _NONCE_BYTES + _TAG_BYTES or blob[0] != _FORMAT_V1:
            raise SaltDecryptionError(
                f"malformed salt ciphertext for tenant {tenant_id} version {version}"
            )
        if not 0 <= version < 2**32:
            raise SaltDecryptionError(f"salt version out of range: {version}")
        nonce, ct = bytes(blob[1 : 1 + _NONCE_BYTES]), bytes(blob[1 + _NONCE_BYTES :])
        try:
            return self._aead.decrypt(nonce, ct, self._aad(tenant_id, version))
        except InvalidTag:
            raise SaltDecryptionError(
                f"salt of tenant {tenant_id} version {version} failed to decrypt: wrong master "
                "key, or the stored ciphertext was tampered with or belongs to another "
                "tenant/version"
            ) from None
