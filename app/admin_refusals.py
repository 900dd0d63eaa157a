"""Refused ``/admin`` calls, recorded so that no caller can flood the audit log."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from urllib.parse import quote

logger = logging.getLogger(__name__)

MAX_AUDITED_PATH_CHARS = 128


class AdminRefusals:
    """Refused ``/admin`` calls, recorded so that no caller can flood the audit log.

    - Unauthenticated (no, bad or expired credentials): ``anonymous`` counts them by reason
      (``count_refusal``, the Prometheus counter) and logs at most one line per
      ``log_interval_s`` with the number seen since the last line. No audit row: an anonymous
      flood would push real admin rows out of the reachable window.
    - Forbidden (valid tenant credentials): ``forbidden`` aggregates per (actor, minute);
      ``flush`` writes one ``auth.admin_forbidden`` row per closed minute with its count and the
      first method and path seen (percent-escaped, at most 128 characters).

    Thread-safe; ``now`` (seconds) is injectable for tests.

    Args:
        count_refusal: called with the reason of each unauthenticated refusal.
        log_interval_s: at most one log line per this many seconds.
        max_pending: (actor, minute) entries kept before a forced flush of every entry.
    """

    def __init__(self, count_refusal: Callable[[str], None] = lambda reason: None,
                 log_interval_s: float = 10.0, max_pending: int = 10_000,
                 now: Callable[[], float] = time.time) -> None:
        self._count = count_refusal
        self._log_interval_s = log_interval_s
        self._max_pending = max_pending
        self._now = now
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], list] = {}  # (actor, minute) -> [n, first request]
        self._unlogged = 0
        self._last_log = -float("inf")

    def anonymous(self, reason: str) -> None:
        self._count(reason)
        with self._lock:
            self._unlogged += 1
            now = self._now()
            if now - self._last_log < self._log_interval_s:
                return
            n, self._unlogged, self._last_log = self._unlogged, 0, now
        logger.warning("refused %d unauthenticated /admin request(s) (latest reason: %s)",
                       n, reason)

    def forbidden(self, actor: str, method: str, path: str) -> bool:
        """Counts one; True when too many entries are pending (the caller flushes all)."""
        first = f"{method} {quote(path, safe='/')[:MAX_AUDITED_PATH_CHARS]}"
        with self._lock:
            entry = self._pending.setdefault((actor[:255], int(self._now() // 60)), [0, first])
            entry[0] += 1
            return len(self._pending) > self._max_pending

    def flush(self, audit: Callable[..., None], everything: bool = False) -> int:
        """Writes the aggregated rows of closed minutes (all with ``everything``, e.g. at
        shutdown) through ``audit(actor, action, tenant_id, detail)``. Returns rows written;
        entries whose write fails stay pending."""
        minute = int(self._now() // 60)
        with self._lock:
            done = {k: v for k, v in self._pending.items() if everything or k[1] < minute}
            for k in done:
                del self._pending[k]
        written = 0
        for (actor, m), (n, first) in sorted(done.items(), key=lambda kv: kv[0][1]):
            at = datetime.fromtimestamp(m * 60, UTC).strftime("%Y-%m-%dT%H:%MZ")
            try:
                audit(actor, "auth.admin_forbidden", None,
                      f"reason=not_admin count={n} minute={at} first={first}")
                written += 1
            except Exception as e:  # noqa: BLE001 - kept for the next flush
                logger.error("could not write auth.admin_forbidden audit row: %s",
                             type(e).__name__)
                with self._lock:
                    self._pending.setdefault((actor, m), [0, first])[0] += n
        return written
