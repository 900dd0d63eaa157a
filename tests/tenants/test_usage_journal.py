"""The usage journal (``tenants.usage_journal``): no usage row of a finished call is lost when
the database refuses for a while or the process is killed, and none is written twice."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from tenants.records import UsageRecord
from tenants.repository import TenantRepository
from tenants.usage_journal import JournalInUse, UsageJournal

REPO_ROOT = Path(__file__).resolve().parents[2]


def record(tenant_id: str, i: int, **kw) -> UsageRecord:
    return UsageRecord(request_id=f"req-{i}", tenant_id=tenant_id, key_id=None, model="m",
                       endpoint="completions", status="ok", prompt_tokens=10 + i,
                       completion_tokens=1, **kw)


def restart(directory: Path, repo: TenantRepository, records=()) -> UsageJournal:
    """A server's life for the journal in ``directory``: it starts (storing what an earlier
    process left), takes ``records``, and shuts down once every row is stored."""
    journal = UsageJournal(directory, repo.usage.record_usage_batch)
    journal.start()
    for r in records:
        journal.append(r)
    assert journal.wait_stored()
    journal.close()
    return journal


def test_records_reach_the_table_in_batches_and_leave_no_segment(repo: TenantRepository,
                                                                 tmp_path) -> None:
    t = repo.tenants.create("acme")
    journal = UsageJournal(tmp_path / "j", repo.usage.record_usage_batch)
    journal.start()
    for i in range(50):
        journal.append(record(t.id, i))
    assert journal.wait_stored()
    rows = repo.usage.list_usage(t.id)
    assert sorted(r.prompt_tokens for r in rows) == [10 + i for i in range(50)]
    assert all(r.created_at is not None for r in rows)
    assert journal.pending_segments() == [] and journal.rows_written == 50
    assert (tmp_path / "j").stat().st_mode & 0o777 == 0o700
    journal.close()
    # A call the shutdown finished after close: straight to a segment, stored at the next start.
    journal.append(record(t.id, 99))
    assert len(journal.pending_segments()) == 1
    restart(tmp_path / "j", repo)
    assert len(repo.usage.list_usage(t.id)) == 51
    with pytest.raises(ValueError, match="status"):
        UsageJournal(tmp_path / "k", repo.usage.record_usage_batch).append(
            UsageRecord("r", t.id, None, "m", "completions", "maybe"))


def test_a_refusing_database_loses_nothing_and_writes_nothing_twice(repo: TenantRepository,
                                                                    tmp_path) -> None:
    t = repo.tenants.create("acme")
    down = threading.Event()
    down.set()
    calls = []

    def store(records):
        calls.append(len(records))
        if down.is_set():
            raise OperationalError("INSERT", {}, Exception("database is locked"))
        return repo.usage.record_usage_batch(records)

    journal = UsageJournal(tmp_path / "j", store, retry_max_s=0.2)
    journal.start()
    t0 = time.perf_counter()
    for i in range(30):
        journal.append(record(t.id, i))
    assert time.perf_counter() - t0 < 0.5          # appending never waits for the database
    time.sleep(0.5)
    assert repo.usage.list_usage(t.id) == [] and journal.store_failures >= 1
    segments = journal.pending_segments()
    assert segments and all(p.stat().st_mode & 0o777 == 0o600 for p in segments)
    journalled = [json.loads(line)["request_id"] for p in segments
                  for line in p.read_text().splitlines()]
    assert sorted(journalled) == sorted(f"req-{i}" for i in range(30))
    down.clear()
    assert journal.wait_stored()
    assert sorted(r.request_id for r in repo.usage.list_usage(t.id)) == sorted(journalled)
    journal.close()


def test_a_segment_stored_twice_writes_each_row_once(repo: TenantRepository, tmp_path) -> None:
    """A crash after the rows were written but before the segment was deleted: the replay at
    the next start skips request ids already stored."""
    t = repo.tenants.create("acme")
    restart(tmp_path / "j", repo, [record(t.id, i) for i in range(5)])
    # The same five rows, as if their segment had survived the crash, plus one new row.
    lines = [json.dumps(dataclasses.asdict(record(t.id, i))) for i in range(6)]
    (tmp_path / "j" / "00000000000000000001-replay.jsonl").write_text("\n".join(lines) + "\n")
    restart(tmp_path / "j", repo)
    assert sorted(r.request_id for r in repo.usage.list_usage(t.id)) == [f"req-{i}" for i in range(6)]


def test_a_record_the_database_can_never_take_does_not_block_the_rest(
        repo: TenantRepository, tmp_path) -> None:
    t = repo.tenants.create("acme")
    journal = UsageJournal(tmp_path / "j", repo.usage.record_usage_batch)
    journal.append(record(t.id, 1))
    journal.append(record("f" * 32, 2))          # no such tenant: a foreign-key refusal
    journal.append(record(t.id, 3))
    journal.start()
    assert journal.wait_stored()
    journal.close()
    assert sorted(r.request_id for r in repo.usage.list_usage(t.id)) == ["req-1", "req-3"]
    assert journal.records_dropped == 1


CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from sqlalchemy.exc import OperationalError
    from tenants.records import UsageRecord
    from tenants.usage_journal import UsageJournal

    def refuse(records):
        raise OperationalError("INSERT", {}, Exception("database is locked"))

    journal = UsageJournal(sys.argv[1], refuse, retry_max_s=0.05)
    journal.start()
    for i in range(int(sys.argv[3])):
        journal.append(UsageRecord(f"req-{i}", sys.argv[2], None, "m", "completions", "ok",
                                   prompt_tokens=i))
    while not journal.pending_segments() or journal._queue or journal._busy:
        time.sleep(0.01)
    print("journalled", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 with every row still pending
""")


def test_kill_9_with_rows_pending_loses_none_and_duplicates_none(repo: TenantRepository,
                                                                 tmp_path) -> None:
    t = repo.tenants.create("acme")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "j"), t.id, "40"],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert proc.returncode == -signal.SIGKILL and "journalled" in proc.stdout, proc.stderr
    assert repo.usage.list_usage(t.id) == []
    for _ in range(2):  # the restart stores them; a second restart finds nothing to store
        restart(tmp_path / "j", repo)
    rows = repo.usage.list_usage(t.id)
    assert sorted(r.prompt_tokens for r in rows) == list(range(40))
    assert len({r.request_id for r in rows}) == 40


def test_a_locked_sqlite_database_delays_rows_but_loses_none(tmp_path) -> None:
    from tenants.crypto import SaltCipher
    from tenants.db import make_engine, make_session_factory, run_migrations

    url = f"sqlite:///{tmp_path / 'locked.db'}"
    engine = make_engine(url)
    run_migrations(engine)
    repo = TenantRepository(make_session_factory(engine), SaltCipher(os.urandom(32)))
    t = repo.tenants.create("acme")
    journal = UsageJournal(tmp_path / "j", repo.usage.record_usage_batch, retry_max_s=0.2)
    journal.start()
    locker = make_engine(url).raw_connection()
    locker.execute("PRAGMA busy_timeout=0")
    locker.execute("BEGIN EXCLUSIVE")                # another process holds the write lock
    try:
        for i in range(20):
            journal.append(record(t.id, i))
        time.sleep(1.0)
        assert journal.pending_segments()             # journalled, not stored
    finally:
        locker.rollback()
        locker.close()
    assert journal.wait_stored(timeout_s=20)
    journal.close()
    assert len(repo.usage.list_usage(t.id)) == 20
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM usage_records")).scalar() == 20


def test_one_process_owns_a_journal_directory(repo: TenantRepository, tmp_path) -> None:
    first = UsageJournal(tmp_path / "j", repo.usage.record_usage_batch)
    first.start()
    with pytest.raises(JournalInUse, match="in use by another process"):
        UsageJournal(tmp_path / "j", repo.usage.record_usage_batch)
    first.close()
    first.close()  # twice is harmless
    never_started = UsageJournal(tmp_path / "j", repo.usage.record_usage_batch)  # free again
    t = repo.tenants.create("acme")
    never_started.append(record(t.id, 1))
    never_started.close()  # what it queued waits in a segment for the next start
    assert len(never_started.pending_segments()) == 1
    restart(tmp_path / "j", repo)
    assert [r.request_id for r in repo.usage.list_usage(t.id)] == ["req-1"]


def test_a_large_segment_is_stored_in_chunks(repo: TenantRepository, tmp_path) -> None:
    t = repo.tenants.create("acme")
    sizes = []

    def store(records):
        sizes.append(len(records))
        return repo.usage.record_usage_batch(records)

    journal = UsageJournal(tmp_path / "j", store, flush_interval_s=0.5)
    for i in range(1200):
        journal.append(record(t.id, i))
    journal.start()
    assert journal.wait_stored(timeout_s=30)
    journal.close()
    assert sizes == [500, 500, 200] and len(repo.usage.list_usage(t.id)) == 1200
