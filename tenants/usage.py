"""Persistence of usage records and audit entries.

``UsageStore`` (``TenantRepository.usage``) writes and reads them in its own short sessions:
``record_usage`` / ``list_usage`` / ``audit`` / ``list_audit``. The session-level functions
below are its building blocks; other writers (tenant, key and salt changes) call ``add_audit``
inside their own transaction so the audit row commits or rolls back with the change. Audit
``detail`` never holds a salt, key secret or key hash: salt changes record the version only.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tenants.models import USAGE_STATUSES, AuditLogRow, UsageRecordRow, require_aware, utcnow
from tenants.records import AuditEntry, UsageRecord, from_row, row_values
from tenants.usage_reports import UsageReportQuery, UsageReportRow, add_to_daily, usage_report


def check_usage_record(record: UsageRecord) -> None:
    """Raises ValueError if ``status`` is not "ok", "error" or "aborted" or a token count is
    negative."""
    if record.status not in USAGE_STATUSES:
        raise ValueError(f"usage status must be one of {USAGE_STATUSES}")
    if min(record.prompt_tokens, record.cached_tokens, record.completion_tokens) < 0:
        raise ValueError("token counts must be >= 0")


def add_usage_record(session: Session, record: UsageRecord) -> datetime:
    """Adds one request's usage to the session (written at the session's commit); returns the
    time it is stored under. The caller adds it to ``usage_daily`` too (``add_to_daily``).

    Args:
        session: an open session, usually inside ``sessionmaker.begin()``.
        record: the usage; ``created_at`` None means now.

    Raises:
        ValueError: if ``status`` is not "ok", "error" or "aborted", a token count is negative,
            or ``created_at`` is naive.
    """
    check_usage_record(record)
    require_aware(record.created_at, "created_at")
    created_at = record.created_at or utcnow()
    session.add(UsageRecordRow(**row_values(record, created_at=created_at)))
    return created_at


def select_usage(
    session: Session,
    tenant_id: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int | None = None,
    end_user: str | None = None,
) -> list[UsageRecord]:
    """Returns usage records, oldest first.

    Args:
        session: an open session.
        tenant_id: only this tenant's records, or None for all.
        since: inclusive lower bound on ``created_at`` (timezone-aware), or None.
        until: exclusive upper bound on ``created_at`` (timezone-aware), or None.
        limit: at most this many records, or None for all.
        end_user: only the records of calls made for this end user (OpenAI ``user``).

    Raises:
        ValueError: if ``since`` or ``until`` is naive.
    """
    require_aware(since, "since")
    require_aware(until, "until")
    stmt = select(UsageRecordRow)
    if tenant_id is not None:
        stmt = stmt.where(UsageRecordRow.tenant_id == tenant_id)
    if since is not None:
        stmt = stmt.where(UsageRecordRow.created_at >= since)
    if until is not None:
        stmt = stmt.where(UsageRecordRow.created_at < until)
    if end_user is not None:
        stmt = stmt.where(UsageRecordRow.end_user == end_user)
    stmt = stmt.order_by(UsageRecordRow.created_at, UsageRecordRow.id)
    if limit is not None:
        stmt = stmt.limit(limit)
    return [from_row(UsageRecord, r) for r in session.scalars(stmt)]


# The HTTP request being served (set per request by the app's RequestIdMiddleware): audit rows
# written while serving it carry the server's id for it unless the caller passes one, and the
# client's own X-Request-ID (when it sent a safe one) in a column of its own.
current_request_id: ContextVar[str | None] = ContextVar("current_request_id", default=None)
current_client_request_id: ContextVar[str | None] = ContextVar("current_client_request_id",
                                                               default=None)
# The tenant the request authenticated as (set by app.auth), for log lines (app.logs).
current_tenant_id: ContextVar[str | None] = ContextVar("current_tenant_id", default=None)


def add_audit(
    session: Session,
    actor: str,
    action: str,
    tenant_id: str | None = None,
    detail: str | None = None,
    request_id: str | None = None,
) -> None:
    """Adds an audit entry to the session, timestamped now.

    Args:
        session: an open session; the entry commits with the change it describes.
        actor: who acted, e.g. "admin:alice" or "system".
        action: dotted verb, e.g. "tenant.rotate_salt".
        tenant_id: the tenant concerned, if any.
        detail: short free text. Never a salt, key secret or key hash.
        request_id: the HTTP request that caused it; defaults to ``current_request_id``.
    """
    session.add(
        AuditLogRow(
            time=utcnow(),
            actor=actor,
            action=action,
            tenant_id=tenant_id,
            detail=detail,
            request_id=request_id or current_request_id.get(),
            client_request_id=current_client_request_id.get(),
        )
    )


@dataclass(frozen=True)
class AuditQuery:
    """Filters of ``select_audit``; None means any. Times are timezone-aware; ``since`` is
    inclusive, ``until`` exclusive. ``before_id``: only rows older than this one (the cursor of
    the previous page)."""

    tenant_id: str | None = None
    action: str | None = None
    actor: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    before_id: int | None = None


def select_audit(session: Session, query: AuditQuery = AuditQuery(), limit: int = 100
                 ) -> list[AuditEntry]:
    """Returns the newest matching audit entries first (at most ``limit``), in insertion order
    (``id``), so that ``before_id`` pages through them without gaps or repeats.

    Raises:
        ValueError: if ``since`` or ``until`` is naive.
    """
    require_aware(query.since, "since")
    require_aware(query.until, "until")
    stmt = select(AuditLogRow)
    for column, value in ((AuditLogRow.tenant_id, query.tenant_id),
                          (AuditLogRow.action, query.action), (AuditLogRow.actor, query.actor)):
        if value is not None:
            stmt = stmt.where(column == value)
    if query.since is not None:
        stmt = stmt.where(AuditLogRow.time >= query.since)
    if query.until is not None:
        stmt = stmt.where(AuditLogRow.time < query.until)
    if query.before_id is not None:
        stmt = stmt.where(AuditLogRow.id < query.before_id)
    stmt = stmt.order_by(AuditLogRow.id.desc()).limit(limit)
    return [from_row(AuditEntry, r) for r in session.scalars(stmt)]


class UsageStore:
    """Usage records and the audit log, each call in its own short session (thread-safe).

    Args:
        session_factory: from ``tenants.db.make_session_factory``.
    """

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._session_factory = session_factory

    def __repr__(self) -> str:
        return "UsageStore()"

    def record_usage(self, record: UsageRecord) -> None:
        """Stores one request's usage (see ``add_usage_record``; token counts in tokens, times
        in seconds).

        Raises:
            ValueError: if ``status`` is not "ok", "error" or "aborted", a token count is
                negative, or ``created_at`` is naive.
            sqlalchemy.exc.IntegrityError: if ``tenant_id`` does not exist.
        """
        with self._session_factory.begin() as session:
            add_to_daily(session, [(record, add_usage_record(session, record))])

    def record_usage_batch(self, records: list[UsageRecord]) -> int:
        """Stores records in one transaction, skipping request ids already stored (replaying a
        journal segment twice writes nothing twice). Returns the rows written.

        Raises:
            ValueError: as ``add_usage_record``.
            sqlalchemy.exc.SQLAlchemyError: the database refused (nothing is written).
        """
        ids = {r.request_id for r in records}
        with self._session_factory.begin() as session:
            stored = set(session.scalars(select(UsageRecordRow.request_id).where(
                UsageRecordRow.request_id.in_(ids)))) if ids else set()
            fresh = {}
            for r in records:
                if r.request_id not in stored:
                    fresh.setdefault(r.request_id, r)  # a request id twice in one batch: once
            add_to_daily(session, [(r, add_usage_record(session, r)) for r in fresh.values()])
        return len(fresh)

    def list_usage(
        self,
        tenant_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int | None = None,
        end_user: str | None = None,
    ) -> list[UsageRecord]:
        """Returns usage records, oldest first; ``since`` inclusive, ``until`` exclusive;
        ``end_user``: only calls made for this end user (OpenAI ``user``).

        Raises:
            ValueError: if ``since`` or ``until`` is naive.
        """
        with self._session_factory() as session:
            return select_usage(session, tenant_id, since, until, limit, end_user)

    def report(self, query: UsageReportQuery) -> list[UsageReportRow]:
        """Usage per bucket and group (``tenants.usage_reports``).

        Raises:
            ValueError: a bad query (``UsageReportQuery.check``).
        """
        with self._session_factory() as session:
            return usage_report(session, query)

    def audit(
        self,
        actor: str,
        action: str,
        tenant_id: str | None = None,
        detail: str | None = None,
        request_id: str | None = None,
    ) -> None:
        """Appends an audit record (see ``add_audit``). Never pass a salt, key secret or key
        hash in ``detail``.

        Raises:
            sqlalchemy.exc.SQLAlchemyError: if the write fails.
        """
        with self._session_factory.begin() as session:
            add_audit(session, actor, action, tenant_id, detail, request_id)

    def list_audit(self, tenant_id: str | None = None, limit: int = 100,
                   query: AuditQuery | None = None) -> list[AuditEntry]:
        """Returns the newest audit records first (at most ``limit``): one tenant's, or those
        matching ``query`` (``select_audit``).

        Raises:
            ValueError: if a time in ``query`` is naive.
        """
        if query is None:
            query = AuditQuery(tenant_id=tenant_id)
        with self._session_factory() as session:
            return select_audit(session, query, limit)
