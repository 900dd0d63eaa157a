"""``TokenRevocations``: platform JWTs revoked by ``jti``, checked on every JWT request.

Revoking is idempotent and audited (``token.revoke``, the jti only: a jti is an identifier,
not a credential). Every call opens its own short session (thread-safe).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from tenants.models import RevokedToken, utcnow
from tenants.usage import add_audit

MAX_JTI_CHARS = 64


class TokenRevocations:
    """Args: session_factory: from ``tenants.db.make_session_factory``."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._session_factory = session_factory

    def __repr__(self) -> str:
        return "TokenRevocations()"

    def revoke(self, jti: str, *, actor: str = "system") -> datetime:
        """Revokes the token with this ``jti`` from its next request on; idempotent.

        Returns:
            When it was (first) revoked.

        Raises:
            ValueError: ``jti`` is not a 1..64 character printable string.
        """
        if not isinstance(jti, str) or not 0 < len(jti) <= MAX_JTI_CHARS \
                or not jti.isprintable():
            raise ValueError(f"jti must be 1 to {MAX_JTI_CHARS} printable characters")
        try:
            with self._session_factory.begin() as session:
                row = session.get(RevokedToken, jti)
                if row is None:
                    row = RevokedToken(jti=jti, revoked_at=utcnow(), actor=actor)
                    session.add(row)
                    add_audit(session, actor, "token.revoke", None, f"jti={jti}")
                return row.revoked_at
        except IntegrityError:  # a concurrent revoke of the same jti committed first
            with self._session_factory() as session:
                return session.get(RevokedToken, jti).revoked_at

    def is_revoked(self, jti: str) -> bool:
        """One primary-key lookup."""
        with self._session_factory() as session:
            return session.scalar(select(RevokedToken.jti).where(RevokedToken.jti == jti)) \
                is not None
