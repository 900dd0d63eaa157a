"""Console sessions: an admin JWT pasted once becomes a short, server-side session.

The browser holds only a random session id (32 bytes, ``secrets.token_urlsafe``) in an HttpOnly,
SameSite=Strict cookie; the store keys sessions by the id's SHA-256, so the ids themselves are
never kept. A session ends at the first of: ``idle_s`` without a request, ``max_age_s`` after
login, the JWT's own ``exp``, logout, or the JWT's revocation (checked by the console routes on
every request). Each session has its own CSRF token (OWASP "synchronizer token" pattern), sent
back on every mutation as the ``X-CSRF-Token`` header or the ``csrf_token`` form field.

Sessions live in this process's memory: a restart logs every operator out, and behind a load
balancer the console needs sticky sessions (``docs/admin.md``). Thread-safe; ``now`` (seconds)
is injectable for tests.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

COOKIE = "saltserve_console"
LOGIN_COOKIE = "saltserve_console_login"  # the login form's own CSRF token (double submit)


@dataclass
class ConsoleSession:
    """One logged-in operator. ``subject`` is the JWT ``sub`` (the audit actor)."""

    subject: str
    jti: str | None
    csrf_token: str = field(repr=False)
    created_at: float
    expires_at: float  # absolute end: login + max_age_s, or the JWT's exp if sooner
    last_seen: float
    flashes: list[tuple[str, str]] = field(default_factory=list)  # (level, text), shown once

    def flash(self, level: str, text: str) -> None:
        """Queues a message for the next page (``level``: ``ok`` or ``error``)."""
        self.flashes.append((level, text))

    def take_flashes(self) -> list[tuple[str, str]]:
        out, self.flashes = self.flashes, []
        return out

    def csrf_ok(self, presented: str | None) -> bool:
        """Constant-time check of a presented CSRF token."""
        return presented is not None and hmac.compare_digest(presented.encode(),
                                                               self.csrf_token.encode())


def _digest(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


class ConsoleSessions:
    """The server-side session store.

    Args:
        idle_s: a session ends after this many seconds without a request.
        max_age_s: and at most this many seconds after login.
        max_sessions: the oldest session is dropped when a login would exceed this.
        secure_cookie: always mark the cookie Secure (set it behind a TLS-terminating proxy;
            over ``https`` it is Secure anyway).
    """

    def __init__(self, idle_s: float = 900.0, max_age_s: float = 3600.0,
                 max_sessions: int = 1000, secure_cookie: bool = False,
                 now: Callable[[], float] = time.time) -> None:
        if not 0 < idle_s <= max_age_s:
            raise ValueError("console sessions need 0 < idle_s <= max_age_s")
        self.idle_s, self.max_age_s, self.max_sessions = idle_s, max_age_s, max_sessions
        self.secure_cookie = secure_cookie
        self._now = now
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, ConsoleSession] = OrderedDict()  # digest -> session

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, subject: str, jti: str | None,
               token_expires_at: float | None) -> tuple[str, ConsoleSession]:
        """A new session: (the session id for the cookie, the session)."""
        now = self._now()
        end = now + self.max_age_s
        if token_expires_at is not None:
            end = min(end, token_expires_at)
        session_id = secrets.token_urlsafe(32)
        session = ConsoleSession(subject=subject, jti=jti, csrf_token=secrets.token_urlsafe(32),
                                 created_at=now, expires_at=end, last_seen=now)
        with self._lock:
            self._sessions[_digest(session_id)] = session
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return session_id, session

    def get(self, session_id: str | None, touch: bool = True) -> ConsoleSession | None:
        """The live session of this id, or None: unknown, idle too long, or past its absolute
        end (an ended session is dropped). ``touch``: the request is the operator's own, so
        the idle clock restarts (a page's automatic refresh passes False)."""
        if not session_id:
            return None
        key, now = _digest(session_id), self._now()
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                return None
            if now >= session.expires_at or now - session.last_seen >= self.idle_s:
                del self._sessions[key]
                return None
            if touch:
                session.last_seen = now
            return session

    def end(self, session_id: str | None) -> ConsoleSession | None:
        """Logs out: drops the session; returns it (None when there was none)."""
        if not session_id:
            return None
        with self._lock:
            return self._sessions.pop(_digest(session_id), None)
