"""Request preprocessing off the event loop: JSON parsing, validation, chat template, tokenisation.

DESIGN "Multi-tenant capacity": authentication, the disabled check and the rpm / concurrency limits
run first, on the event loop, and cost almost nothing; only then is the body parsed and the prompt
rendered and tokenised, here, in a thread pool sized for the machine. A huge or pathological body
(a 4 MB prompt, 100,000 tiny messages) therefore never stalls ``/health`` or other tenants'
streams, and a tenant over its limits is refused before its body is even read.

Caps, per request and per tenant:

- Prompt text longer than ``max_model_len * MAX_CHARS_PER_TOKEN`` characters is refused (400
  ``context_length_exceeded``) before templating: it could not fit the context anyway.
- A tenant runs at most ``per_tenant`` jobs at once (the others wait on its own semaphore, so
  one tenant cannot occupy every worker) and has at most ``max_queued_per_tenant`` jobs waiting
  or running (then 429).
- A job that takes longer than ``timeout_s`` is answered with 400; its worker finishes in the
  background and keeps the tenant's slot until then.

JSON parsing and body validation run in a small process pool (``parse``): ``json.loads`` of a
4 MB list of numbers holds the GIL for about 0.1 s, which in a thread would still stall the
event loop. Chat templating (Python, which yields the GIL every few ms) and tokenisation (Rust,
which releases it) run in threads. Each worker thread has its own copy of the tokenizer: Hugging
Face fast tokenizers are not safe to share between threads ("Already borrowed"), and the engine
thread keeps the original.
"""

from __future__ import annotations

import asyncio
import copy
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from app.errors import APIError

T = TypeVar("T")
ModelT = TypeVar("ModelT", bound=BaseModel)

# A token of this tokenizer family is rarely longer than a few characters; 32 leaves room for
# long whitespace or repeated-character tokens while bounding the work on a hostile prompt.
MAX_CHARS_PER_TOKEN = 32


def default_workers() -> int:
    """Preprocessing threads: the machine's cores, at most 4."""
    return max(1, min(4, os.cpu_count() or 1))


def parse_body(model_cls: type[ModelT], raw: bytes, max_items: int | None = None) -> ModelT:
    """Parses and validates a JSON request body (call in a worker thread).

    Args:
        max_items: when set, more ``messages``, ``prompt`` or ``tokens`` items than this are refused
            before field validation (each costs at least one token, so they could not fit the
            context; and validating 100,000 tiny messages takes 0.3 s).

    Raises:
        RequestValidationError: invalid JSON or fields; answered as a 400 with ``param``
            by ``app.errors``, exactly as FastAPI's own body validation.
        APIError: 400 ``context_length_exceeded`` over ``max_items``.
    """
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",),
                                       "msg": "JSON decode error"}]) from None
    if max_items is not None and isinstance(data, dict):
        for field in ("messages", "prompt", "tokens"):
            value = data.get(field)
            if isinstance(value, list) and len(value) > max_items:
                raise APIError(400, f"{field} has {len(value)} items; at most {max_items} fit "
                               "the model's context", field, "context_length_exceeded")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_context=False, include_input=False)
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in errors]) from None


def _parse_remote(model_cls: type[ModelT], raw: bytes, max_items: int | None) -> tuple:
    """``parse_body`` in a worker process; errors come back as plain data (picklable)."""
    try:
        return ("ok", parse_body(model_cls, raw, max_items))
    except RequestValidationError as e:
        return ("invalid", list(e.errors()))
    except APIError as e:
        return ("error", (e.status, e.message, e.param, e.code))


_process_pool: ProcessPoolExecutor | None = None
_process_pool_lock = threading.Lock()


def _exit_with_parent(parent_pid: int) -> None:
    """Worker initializer: the worker exits when the server process is gone, however it ended
    (a killed server must not leave workers holding its stdout)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="saltserve-parent-watch").start()


def _parse_pool(broken: ProcessPoolExecutor | None = None) -> ProcessPoolExecutor:
    """The process-wide parse pool (spawned lazily; ``spawn``: never fork a threaded server).
    ``broken``: a pool that lost a worker; replaced (and shut down) if it is still current."""
    global _process_pool
    with _process_pool_lock:
        if broken is not None and _process_pool is broken:
            broken.shutdown(wait=False, cancel_futures=True)
            _process_pool = None
        if _process_pool is None:
            _process_pool = ProcessPoolExecutor(
                default_workers(), mp_context=multiprocessing.get_context("spawn"),
                initializer=_exit_with_parent, initargs=(os.getpid(),))
        return _process_pool


def shutdown_parse_pool() -> None:
    """Stops the parse workers (``saltserve serve`` calls it on the way out)."""
    global _process_pool
    with _process_pool_lock:
        if _process_pool is not None:
            _process_pool.shutdown(wait=True, cancel_futures=True)
            _process_pool = None


class Preprocessor:
    """A thread pool for per-request CPU work, shared fairly between tenants.

    Args:
        tokenizer: the model's Hugging Face tokenizer (copied once per worker thread).
        workers: threads; default ``default_workers()``.
        per_tenant: jobs of one tenant running at once; default ``max(1, workers // 2)``.
        max_queued_per_tenant: jobs of one tenant waiting or running before 429.
        timeout_s: seconds one job may take before the request gets a 400.
    """

    def __init__(self, tokenizer: Any, workers: int | None = None, per_tenant: int | None = None,
                 max_queued_per_tenant: int = 64, timeout_s: float = 30.0) -> None:
        self.workers = workers or default_workers()
        self.per_tenant = per_tenant or max(1, self.workers // 2)
        self.max_queued_per_tenant = max_queued_per_tenant
        self.timeout_s = timeout_s
        self._tokenizer = tokenizer
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="saltserve-preprocess")
        self._slots: dict[str, asyncio.Semaphore] = {}
        # Event loop only: tenant -> its calls waiting or running; tenant -> workers it holds
        # (a worker stays held after its call timed out, until the work ends).
        self._jobs: dict[str, int] = {}
        self._held: dict[str, int] = {}

    def tokenizer(self) -> Any:
        """This worker thread's own tokenizer copy."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self._tokenizer)
        return tok

    def jobs(self, tenant_id: str) -> int:
        """The tenant's jobs waiting or running now."""
        return self._jobs.get(tenant_id, 0)

    async def parse(self, tenant_id: str, model_cls: type[ModelT], raw: bytes,
                    max_items: int | None = None) -> ModelT:
        """``parse_body`` in the process pool, under the tenant's fair share of the workers.

        Raises:
            RequestValidationError, APIError: as ``parse_body`` and ``run``.
        """
        pool = _parse_pool()
        try:
            kind, value = await self.run(tenant_id, _parse_remote, model_cls, raw, max_items,
                                         executor=pool)
        except BrokenProcessPool:  # a worker died (e.g. killed): start a new pool, once
            _parse_pool(broken=pool)
            raise APIError(503, "the request could not be parsed; retry", None,
                           "server_busy") from None
        if kind == "invalid":
            raise RequestValidationError(value)
        if kind == "error":
            raise APIError(*value)
        return value

    async def run(self, tenant_id: str, fn: Callable[..., T], *args: Any,
                  executor: Executor | None = None) -> T:
        """Runs ``fn(*args)`` in a worker thread (or ``executor``) for ``tenant_id`` and returns
        its result.

        Raises:
            APIError: 429 when the tenant has ``max_queued_per_tenant`` jobs already; 400 when
                the job takes longer than ``timeout_s``.
            Exception: whatever ``fn`` raises.
        """
        if self._jobs.get(tenant_id, 0) >= self.max_queued_per_tenant:
            raise APIError(429, "too many of this tenant's requests are being prepared; retry "
                           "later", None, "rate_limit_exceeded", {"Retry-After": "1"})
        self._jobs[tenant_id] = self._jobs.get(tenant_id, 0) + 1
        slots = self._slots.setdefault(tenant_id, asyncio.Semaphore(self.per_tenant))
        try:
            await slots.acquire()
            self._held[tenant_id] = self._held.get(tenant_id, 0) + 1
            try:
                future = asyncio.get_running_loop().run_in_executor(executor or self._pool, fn,
                                                                    *args)
            except BaseException:
                self._job_done(tenant_id, slots)
                raise
            # The slot is held until the worker is done, also after a timeout or a cancel:
            # a tenant cannot pile up abandoned jobs on the workers.
            future.add_done_callback(lambda _: self._job_done(tenant_id, slots))
            try:
                return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
            except TimeoutError:
                raise APIError(400, "the request took too long to prepare (chat template and "
                               "tokenisation)", None, "preprocessing_timeout") from None
        finally:
            self._jobs[tenant_id] -= 1
            self._forget(tenant_id, slots)

    def _job_done(self, tenant_id: str, slots: asyncio.Semaphore) -> None:
        slots.release()
        self._held[tenant_id] -= 1
        self._forget(tenant_id, slots)

    def _forget(self, tenant_id: str, slots: asyncio.Semaphore) -> None:
        """Drops an idle tenant's entries (no per-tenant state outlives its requests)."""
        if not self._jobs.get(tenant_id) and not self._held.get(tenant_id) \
                and self._slots.get(tenant_id) is slots:
            del self._slots[tenant_id]
            self._jobs.pop(tenant_id, None)
            self._held.pop(tenant_id, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
