"""``UsageJournal``: the durable outbox between finished API calls and the usage table.

A usage row must survive a locked, read-only or briefly unreachable database and a ``kill -9``
of the server. ``append`` only queues the record (never blocks on the database); a background
thread, every ``flush_interval_s``:

1. writes the queued records to a new segment file in the journal directory (JSON lines, mode
   0600) and fsyncs it and the directory: from here the records survive a crash;
2. stores every segment on disk, oldest first, in one transaction per segment, skipping
   request ids the table already holds (so a replay after a crash between storing and
   deleting never writes a row twice);
3. deletes each stored segment.

When the database refuses (locked, read-only, down), the segment stays and is retried with
exponential backoff (up to ``retry_max_s``) while new records keep being journalled. Segments
left by an earlier process are stored first at start (``start``). A record the database can
never take (its tenant was deleted) is dropped with an error log instead of blocking the rest.
One process owns a journal directory at a time (an exclusive ``flock`` on ``.lock``), so two
servers never store the same segment. Records appended after ``close`` (calls the shutdown
finished) go straight to a segment for the next start.

What can still be lost: records appended in the last ``flush_interval_s`` before a ``kill -9``
(not yet written to a segment) and anything on a lost disk.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from tenants.models import utcnow
from tenants.records import UsageRecord
from tenants.usage import check_usage_record

logger = logging.getLogger(__name__)

StoreBatch = Callable[[list[UsageRecord]], int]
SEGMENT_SUFFIX = ".jsonl"
STORE_CHUNK = 500  # records per store call (bounded SQL parameter lists)


def _encode(record: UsageRecord) -> str:
    d = dataclasses.asdict(record)
    d["created_at"] = record.created_at.isoformat() if record.created_at else None
    return json.dumps(d, separators=(",", ":"))


def _decode(line: str) -> UsageRecord:
    d = json.loads(line)
    d["created_at"] = datetime.fromisoformat(d["created_at"]) if d["created_at"] else None
    return UsageRecord(**d)



class JournalInUse(RuntimeError):
    """Another process holds the journal directory (one server per data dir)."""

class UsageJournal:
    """Durable, batched usage writes (see the module docstring). Thread-safe.

    Args:
        directory: where segments live (created 0700); one journal per directory.
        store_batch: stores records idempotently by request id in one transaction and returns
            how many rows it wrote (``UsageStore.record_usage_batch``); raises on failure.
        flush_interval_s: longest time a record waits in memory before its segment is written.
        retry_max_s: longest wait between two retries while the database refuses.

    Raises:
        JournalInUse: another process holds this journal directory.
    """

    def __init__(self, directory: Path, store_batch: StoreBatch, *,
                 flush_interval_s: float = 0.05, retry_max_s: float = 5.0) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise JournalInUse(f"the usage journal {self.directory} is in use by another "
                               "process (one server per data dir)") from None
        self._store_batch = store_batch
        self._flush_interval_s = flush_interval_s
        self._retry_max_s = retry_max_s
        self._cond = threading.Condition()
        self._queue: list[UsageRecord] = []
        self._closing = False
        self._busy = False  # the thread holds records taken from the queue
        self._retry_at = 0.0
        self._backoff = 0.0
        self._thread: threading.Thread | None = None
        self.rows_written = 0
        self.store_failures = 0
        self.records_dropped = 0

    def __repr__(self) -> str:
        return f"UsageJournal({str(self.directory)!r})"

    # -- producer side -------------------------------------------------------------------------
    def append(self, record: UsageRecord) -> None:
        """Queues one call's usage (non-blocking).

        Raises:
            ValueError: a status other than "ok", "error" or "aborted", or a negative count.
        """
        check_usage_record(record)
        if record.created_at is None:  # the time of the call, not of a later (re)play
            record = dataclasses.replace(record, created_at=utcnow())
        with self._cond:
            if not self._closing:
                self._queue.append(record)
                self._cond.notify()
                return
        try:  # after close (a call the shutdown finished): straight to disk, stored next start
            self._write_segment([record])
        except OSError as e:
            logger.error("could not journal the usage of request %s at shutdown: %s",
                         record.request_id, type(e).__name__)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the writer thread; it first stores segments an earlier process left."""
        self._thread = threading.Thread(target=self._run, name="usage-journal", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Journals what is queued and tries the database once more; segments it cannot store
        stay for the next start."""
        with self._cond:
            self._closing = True
            self._retry_at = 0.0
            self._cond.notify()
            if self._thread is None:  # never started: what is queued waits for the next start
                batch, self._queue = self._queue, []
        if self._thread is None:
            try:
                if batch:
                    self._write_segment(batch)
            except OSError as e:
                logger.error("could not journal %d usage records: %s", len(batch),
                             type(e).__name__)
        else:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return  # still storing: it keeps the directory
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # the next process may take the directory
            self._lock_fd = -1

    def pending_segments(self) -> list[Path]:
        """Segments written but not yet stored, oldest first."""
        return sorted(p for p in self.directory.iterdir() if p.name.endswith(SEGMENT_SUFFIX))

    def wait_stored(self, timeout_s: float = 10.0) -> bool:
        """Waits until every appended record is in the database (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._cond:
                idle = not self._queue and not self._busy
            if idle and not self.pending_segments():
                return True
            time.sleep(0.01)
        return False

    # -- writer thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._closing:
                    self._cond.wait(self._flush_interval_s)
                batch, self._queue = self._queue, []
                self._busy = bool(batch)
                closing = self._closing
            try:
                if batch:
                    self._write_segment(batch)
            except OSError as e:  # the disk refuses: keep them in memory and try again
                logger.error("could not journal %d usage records: %s", len(batch),
                             type(e).__name__)
                with self._cond:
                    self._queue[:0] = batch
                if not closing:
                    time.sleep(min(self._retry_max_s, 1.0))  # no busy loop on a full disk
            finally:
                with self._cond:
                    self._busy = False
            try:
                if closing or time.monotonic() >= self._retry_at:
                    self._store_segments()
            except Exception as e:  # noqa: BLE001 - the thread must outlive any one failure
                logger.error("the usage journal could not store its segments: %s",
                             type(e).__name__)
            if closing:
                return

    def _write_segment(self, records: list[UsageRecord]) -> None:
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}{SEGMENT_SUFFIX}"
        fd = os.open(self.directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            data = memoryview("".join(_encode(r) + "\n" for r in records).encode())
            while data:  # a short write is continued, never left truncated
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _store_segments(self) -> None:
        for path in self.pending_segments():
            records = self._read_segment(path)
            try:
                self.rows_written += self._store(records)
            except Exception as e:  # noqa: BLE001 - the database refuses: retry later
                self.store_failures += 1
                self._backoff = min(max(self._backoff * 2, 0.1), self._retry_max_s)
                self._retry_at = time.monotonic() + self._backoff
                logger.error("storing usage failed (%s); %d segment(s) kept, retry in %.1f s",
                             type(e).__name__, len(self.pending_segments()), self._backoff)
                return
            path.unlink(missing_ok=True)
            self._backoff = 0.0

    def _store(self, records: list[UsageRecord]) -> int:
        """One transaction; when the batch holds a record the database can never take, each
        record alone, dropping the ones refused for good (ValueError, IntegrityError)."""
        from sqlalchemy.exc import IntegrityError

        if len(records) > STORE_CHUNK:
            return sum(self._store(records[i:i + STORE_CHUNK])
                       for i in range(0, len(records), STORE_CHUNK))
        try:
            return self._store_batch(records)
        except (IntegrityError, ValueError):
            written = 0
            for r in records:
                try:
                    written += self._store_batch([r])
                except (IntegrityError, ValueError) as e:
                    self.records_dropped += 1
                    logger.error("dropped the usage row of request %s: %s", r.request_id,
                                 type(e).__name__)
            return written

    @staticmethod
    def _read_segment(path: Path) -> list[UsageRecord]:
        """The records of a segment; a line that does not parse (a torn last line of a segment
        written as the machine died) is skipped with an error log, the rest is kept."""
        out, bad = [], 0
        for line in path.read_bytes().decode("utf-8", "replace").splitlines():
            if not line.strip():
                continue
            try:
                out.append(_decode(line))
            except (ValueError, TypeError, KeyError):
                bad += 1
        if bad:
            logger.error("usage journal segment %s has %d damaged line(s); storing the rest",
                         path.name, bad)
        return out
