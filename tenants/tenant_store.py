"""``TenantStore``: tenant rows and their salt rows (create, read, update, rotate, re-encrypt).

Salts are generated and encrypted here and never returned: a new or rotated salt is handed,
sealed (``tenants.salts.SealedSalt``), to the optional ``SaltObserver`` (the ``Authenticator``,
which caches it), and a master-key rotation hands it the new cipher. Audit rows record salt
versions only.

Thread-safe: every method opens its own short session; the cipher swap is a single assignment.
"""

from __future__ import annotations

import re
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from tenants.crypto import SaltCipher
from tenants.errors import DuplicateTenant, TenantNotFound
from tenants.models import Tenant, TenantSalt, new_tenant_id, utcnow
from tenants.records import TenantInfo, from_row
from tenants.salts import SealedSalt, new_salt
from tenants.usage import add_audit

__all__ = ["MAX_LIMIT", "MAX_TENANT_NAME_CHARS", "UNCHANGED", "SaltObserver", "TenantStore",
           "check_tenant_name", "name_key", "tenant_info"]

MAX_TENANT_NAME_CHARS = 255
MAX_LIMIT = 2**31 - 1  # limits and cache bounds are 32-bit integer columns
_ID_SHAPED = re.compile(r"[0-9a-fA-F]{32}")


def check_tenant_name(name: object) -> str:
    """Returns the tenant name stripped of surrounding whitespace.

    Raises:
        ValueError: not a string of 1..255 printable characters (no control characters,
            newlines or NUL), or shaped like a tenant id (32 hex characters), which would make
            "name or id" arguments ambiguous.
    """
    name = name.strip() if isinstance(name, str) else ""
    if not 1 <= len(name) <= MAX_TENANT_NAME_CHARS:
        raise ValueError(f"tenant name must be 1 to {MAX_TENANT_NAME_CHARS} characters")
    if not name.isprintable():
        raise ValueError("tenant name must not contain control characters")
    if _ID_SHAPED.fullmatch(name):
        raise ValueError("tenant name must not look like a tenant id (32 hex characters)")
    if len(name_key(name)) > MAX_TENANT_NAME_CHARS:  # casefolding lengthens "ß" to "ss"
        raise ValueError(f"tenant name must be at most {MAX_TENANT_NAME_CHARS} characters "
                         "when compared ignoring case")
    return name


def name_key(name: str) -> str:
    """The form names are compared in: ``str.casefold`` ("CAFÉ", "café" and "Café" match)."""
    return name.casefold()


def _check_int(name: str, value: object, low: int, high: int, none_means: str | None) -> None:
    """Strict: a real int (not a bool) in [low, high], or None where ``none_means`` says."""
    if value is None and none_means is not None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        alt = f"None ({none_means}) or " if none_means else ""
        raise ValueError(f"{name} must be {alt}an integer in [{low}, {high}]")


class _Unchanged:
    """Type of ``UNCHANGED``: "keep the current value" where None means "unlimited"."""

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED = _Unchanged()
MAX_WEIGHT = 1000
_LIMIT_NAMES = ("rpm_limit", "tpm_limit", "max_concurrent")
# OpenAI's prompt_cache_retention values, shortest first.
RETENTIONS = ("in_memory", "24h")


def tenant_info(row: Tenant) -> TenantInfo:
    """The ``TenantInfo`` of a tenant row (the one row-to-record copy for tenants)."""
    return from_row(TenantInfo, row)


class SaltObserver(Protocol):
    """Told about salt changes once they are committed (implemented by ``Authenticator``)."""

    def salt_created(self, tenant_id: str, version: int, salt: SealedSalt) -> None:
        """A tenant got salt ``version`` (creation or rotation); it is current from now on."""

    def cipher_replaced(self, cipher: SaltCipher) -> None:
        """Every stored salt is now encrypted under ``cipher`` (master-key rotation)."""


class TenantStore:
    """Tenant CRUD and salt rows.

    Args:
        session_factory: from ``tenants.db.make_session_factory``.
        cipher: encrypts (and, for re-encryption, decrypts) salts at rest.
        observer: told about new salts and cipher changes (usually the ``Authenticator``).
    """

    def __init__(self, session_factory: sessionmaker[Session], cipher: SaltCipher,
                 observer: SaltObserver | None = None) -> None:
        self._session_factory = session_factory
        self._cipher = cipher
        self._observer = observer

    def __repr__(self) -> str:
        return "TenantStore(<redacted>)"

    def _salt_row(self, tenant_id: str, version: int, salt: bytes) -> TenantSalt:
        return TenantSalt(
            tenant_id=tenant_id,
            version=version,
            encrypted_salt=self._cipher.encrypt(tenant_id, version, salt),
            created_at=utcnow(),
        )

    def _notify(self, tenant_id: str, version: int, salt: bytes) -> None:
        if self._observer is not None:
            self._observer.salt_created(tenant_id, version, SealedSalt(salt))

    def create(
        self, name: str, *, enable_prefix_caching: bool = True, actor: str = "system"
    ) -> TenantInfo:
        """Creates a tenant with salt version 1.

        Args:
            name: display name (``check_tenant_name``), unique ignoring case.
            enable_prefix_caching: whether the tenant's requests use the prefix cache.
            actor: who did it, for the audit log.

        Returns:
            The new tenant.

        Raises:
            ValueError: if ``name`` is not a valid tenant name (``check_tenant_name``) or
                ``enable_prefix_caching`` is not a bool.
            DuplicateTenant: if a tenant with this name exists, ignoring case.
        """
        name = check_tenant_name(name)
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError("enable_prefix_caching must be true or false")  # noqa: TRY004 - a 400
        tenant_id = new_tenant_id()
        salt = new_salt()
        try:
            with self._session_factory.begin() as session:
                if session.scalar(select(Tenant.id).where(
                        Tenant.name_key == name_key(name))) is not None:
                    raise DuplicateTenant(f"tenant {name!r} already exists")
                tenant = Tenant(
                    id=tenant_id,
                    name=name,
                    name_key=name_key(name),
                    created_at=utcnow(),
                    disabled=False,
                    current_salt_version=1,
                    enable_prefix_caching=enable_prefix_caching,
                    weight=1,
                )
                session.add(tenant)
                session.flush()  # tenant row before its FK children
                session.add(self._salt_row(tenant_id, 1, salt))
                add_audit(session, actor, "tenant.create", tenant_id, "salt_version=1")
                info = tenant_info(tenant)
        except IntegrityError:  # lost a race with a concurrent create of the same name
            raise DuplicateTenant(f"tenant {name!r} already exists") from None
        self._notify(tenant_id, 1, salt)
        return info

    def get(self, tenant_id: str) -> TenantInfo:
        """Returns a tenant by id.

        Raises:
            TenantNotFound: if there is no such tenant.
        """
        with self._session_factory() as session:
            row = session.get(Tenant, tenant_id)
            if row is None:
                raise TenantNotFound(f"tenant {tenant_id!r} not found")
            return tenant_info(row)

    def get_by_name(self, name: str) -> TenantInfo:
        """Returns a tenant by its unique name, ignoring case.

        Raises:
            TenantNotFound: if there is no such tenant.
        """
        with self._session_factory() as session:
            row = session.scalar(select(Tenant).where(Tenant.name_key == name_key(name)))
            if row is None:
                raise TenantNotFound(f"tenant {name!r} not found")
            return tenant_info(row)

    def resolve(self, name_or_id: str) -> TenantInfo:
        """Returns the tenant with this id, else the one with this name (ids first: a name can
        never shadow another tenant's id).

        Raises:
            TenantNotFound: if neither exists.
            ValueError: if the string is one tenant's id and another tenant's name (possible
                only for names stored before names could not look like ids).
        """
        by_id = by_name = None
        try:
            by_id = self.get(name_or_id)
        except TenantNotFound:
            pass
        try:
            by_name = self.get_by_name(name_or_id)
        except TenantNotFound:
            pass
        if by_id is not None and by_name is not None and by_id.id != by_name.id:
            raise ValueError(f"{name_or_id!r} is one tenant's id and another tenant's name; "
                             "use the id of the one you mean")
        if by_id or by_name:
            return by_id or by_name
        raise TenantNotFound(f"no tenant named or with id {name_or_id!r}")

    def list_all(self) -> list[TenantInfo]:
        """Returns all tenants, oldest first."""
        with self._session_factory() as session:
            rows = session.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.id))
            return [tenant_info(r) for r in rows]

    def update(
        self,
        tenant_id: str,
        *,
        disabled: bool | None = None,
        enable_prefix_caching: bool | None = None,
        rpm_limit: int | None | _Unchanged = UNCHANGED,
        tpm_limit: int | None | _Unchanged = UNCHANGED,
        max_concurrent: int | None | _Unchanged = UNCHANGED,
        weight: int | None = None,
        min_cache_blocks: int | None | _Unchanged = UNCHANGED,
        max_cache_blocks: int | None | _Unchanged = UNCHANGED,
        prompt_cache_retention: str | None | _Unchanged = UNCHANGED,
        max_prompt_cache_retention: str | None | _Unchanged = UNCHANGED,
        actor: str = "system",
    ) -> TenantInfo:
        """Changes a tenant's flags; None leaves a flag as it is.

        A disabled tenant's keys are refused (``TenantDisabled``) until it is enabled again.
        Disabling a tenant or turning its prefix caching off bumps ``cache_epoch`` in the same
        transaction (the caller evicts, from the pool and the offload tiers; replicas that miss
        its broadcast evict on the tenant's next request).
        Limits (requests / tokens per minute, concurrent requests; enforced by ``app.limits``)
        take ``UNCHANGED`` (the default) to keep, None for unlimited, or an int >= 1; they apply
        from the tenant's next authenticated request. Changes are audited (only real changes).

        Returns:
            The tenant after the change.

        Capacity share (``engine.request.TenantShare``; applies from the tenant's next request):
        ``weight`` an int >= 1 (None keeps it); ``min_cache_blocks`` / ``max_cache_blocks``
        ``UNCHANGED``, None (no bound) or an int >= 0.

        Prompt-cache retention (OpenAI ``prompt_cache_retention``; ``TenantQuota``): the
        default of calls that ask none and the longest a call may ask, ``UNCHANGED``, None
        (``"24h"``), ``"in_memory"`` or ``"24h"``; the default must not exceed the maximum.

        Raises:
            TenantNotFound: if there is no such tenant.
            ValueError: if a flag is not a bool; a limit is not None, UNCHANGED or an int in
                [1, ``MAX_LIMIT``]; a bad weight or cache bound (an int in [0, ``MAX_LIMIT``]);
                or min_cache_blocks > max_cache_blocks after the change; a retention that is
                not one of ``RETENTIONS``, or a default above the maximum. Strict: a bool or a
                string is never taken for a number, nor a string for a bool.
        """
        for flag, value in (("disabled", disabled),
                            ("enable_prefix_caching", enable_prefix_caching)):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{flag} must be true or false")
        limits = dict(zip(_LIMIT_NAMES, (rpm_limit, tpm_limit, max_concurrent), strict=True))
        for name, value in limits.items():
            if value is not UNCHANGED:
                _check_int(name, value, 1, MAX_LIMIT, "unlimited")
        if weight is not None:
            _check_int("weight", weight, 1, MAX_WEIGHT, None)
        bounds = {"min_cache_blocks": min_cache_blocks, "max_cache_blocks": max_cache_blocks}
        for name, value in bounds.items():
            if value is not UNCHANGED:
                _check_int(name, value, 0, MAX_LIMIT, "no bound")
        limits.update(bounds)
        retention = {"prompt_cache_retention": prompt_cache_retention,
                     "max_prompt_cache_retention": max_prompt_cache_retention}
        for name, value in retention.items():
            if value is not UNCHANGED and value is not None and value not in RETENTIONS:
                raise ValueError(f"{name} must be one of {', '.join(RETENTIONS)} (or null)")
        limits.update(retention)
        with self._session_factory.begin() as session:
            row = session.get(Tenant, tenant_id, with_for_update=True)
            if row is None:
                raise TenantNotFound(f"tenant {tenant_id!r} not found")
            changes = []
            if disabled is not None and disabled != row.disabled:
                row.disabled = disabled
                changes.append(f"disabled={disabled}")
                if disabled:  # nothing of a disabled tenant's stays cached, in any tier
                    row.cache_epoch += 1
            if (
                enable_prefix_caching is not None
                and enable_prefix_caching != row.enable_prefix_caching
            ):
                row.enable_prefix_caching = enable_prefix_caching
                changes.append(f"enable_prefix_caching={enable_prefix_caching}")
                if not enable_prefix_caching:  # its cached blocks must go, on every replica
                    row.cache_epoch += 1
            if weight is not None and weight != row.weight:
                row.weight = weight
                changes.append(f"weight={weight}")
            for name, value in limits.items():
                if value is not UNCHANGED and value != getattr(row, name):
                    setattr(row, name, value)
                    changes.append(f"{name}={value}")
            if (row.min_cache_blocks is not None and row.max_cache_blocks is not None
                    and row.min_cache_blocks > row.max_cache_blocks):
                raise ValueError("min_cache_blocks must not exceed max_cache_blocks")
            if RETENTIONS.index(row.prompt_cache_retention or "24h") \
                    > RETENTIONS.index(row.max_prompt_cache_retention or "24h"):
                raise ValueError("prompt_cache_retention must not exceed "
                                 "max_prompt_cache_retention")
            if changes:
                add_audit(session, actor, "tenant.update", tenant_id, " ".join(changes))
            return tenant_info(row)

    def rotate_salt(self, tenant_id: str, *, actor: str = "system") -> int:
        """Creates a new salt version and makes it current at once.

        Blocks cached under older versions become unreachable: new requests derive a different
        effective salt. Older salt rows are kept (encrypted) for the audit trail. The observer
        (the ``Authenticator``) drops the older decrypted salt from its cache.

        Args:
            tenant_id: the tenant.
            actor: who did it, for the audit log (which records the version, never the salt).

        Returns:
            The new current salt version.

        Raises:
            TenantNotFound: if there is no such tenant.
        """
        salt = new_salt()
        with self._session_factory.begin() as session:
            row = session.get(Tenant, tenant_id, with_for_update=True)
            if row is None:
                raise TenantNotFound(f"tenant {tenant_id!r} not found")
            version = row.current_salt_version + 1
            session.add(self._salt_row(tenant_id, version, salt))
            row.current_salt_version = version
            add_audit(session, actor, "tenant.rotate_salt", tenant_id, f"salt_version={version}")
        self._notify(tenant_id, version, salt)
        return version

    def bump_cache_epoch(self, tenant_id: str | None) -> list[TenantInfo]:
        """Records a reset of one tenant's prefix cache (every tenant's with None): bumps
        ``cache_epoch``, so that replicas that miss the broadcast drop the blocks on the
        tenant's next request. Not audited here (the caller audits the reset).

        Returns:
            The tenants after the bump.

        Raises:
            TenantNotFound: if there is no such tenant.
        """
        with self._session_factory.begin() as session:
            query = select(Tenant).with_for_update().order_by(Tenant.id)
            if tenant_id is not None:
                query = query.where(Tenant.id == tenant_id)
            rows = list(session.scalars(query))
            if tenant_id is not None and not rows:
                raise TenantNotFound(f"tenant {tenant_id!r} not found")
            for row in rows:
                row.cache_epoch += 1
            session.flush()
            return [tenant_info(row) for row in rows]

    def reencrypt_salts(self, new_cipher: SaltCipher, *, actor: str = "system") -> int:
        """Re-encrypts every stored salt under a new master key (master-key rotation).

        Runs in one transaction; afterwards this store and its observer use ``new_cipher``.
        Restart other processes with the new master key once this returns.

        Returns:
            The number of salt rows re-encrypted.

        Raises:
            SaltDecryptionError: if a stored salt does not decrypt with the current key
                (nothing is changed).
        """
        with self._session_factory.begin() as session:
            rows = session.scalars(select(TenantSalt).with_for_update()).all()
            for row in rows:
                plain = self._cipher.decrypt(row.tenant_id, row.version, row.encrypted_salt)
                row.encrypted_salt = new_cipher.encrypt(row.tenant_id, row.version, plain)
            add_audit(session, actor, "master_key.rotate", None, f"salts={len(rows)}")
        self._cipher = new_cipher
        if self._observer is not None:
            self._observer.cipher_replaced(new_cipher)
        return len(rows)
