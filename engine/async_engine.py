"""Background engine loop for the server: one thread steps the engine, asyncio consumers stream.

The engine thread owns the ``LLMEngine`` exclusively. Callers talk to it through a thread-safe
command queue (add / abort / call) and receive ``RequestOutput`` objects on per-request asyncio
queues, so tokens stream to HTTP clients as they are produced.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any

from engine.llm_engine import LLMEngine
from engine.request import EngineRequest, RequestOutput

logger = logging.getLogger(__name__)


# Called on the consumer's event loop for each output that carries new tokens, with the seconds
# since the previous such output of the same request (None for the first one).
OutputObserver = Callable[[EngineRequest, RequestOutput, "float | None"], None]


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class AsyncLLM:
    """Async facade over ``LLMEngine``.

    Args:
        engine: a constructed engine; from now on only the loop thread touches it.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wakeup = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.errored: BaseException | None = None
        self.last_step_time = time.monotonic()
        self.output_observers: list[OutputObserver] = []

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="saltserve-engine",
                                            daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.errored is None

    # -- API -----------------------------------------------------------------------------------
    def add_output_observer(self, observer: OutputObserver) -> None:
        """Registers ``observer(request, output, seconds_since_previous_token)``.

        It runs on the consumer's event loop for every output with new tokens (inter-token
        latency as the client sees it, vLLM ``inter_token_latency_seconds``); it must be cheap
        and must not raise (an exception is logged and dropped, the stream goes on).
        """
        self.output_observers.append(observer)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submits ``request`` and yields its outputs until the finished one.

        Raises:
            ValueError: invalid request (checked before anything is queued).
            EngineDeadError: the engine loop has died.

        Cancelling the consumer (client disconnect) aborts the request and frees its blocks.
        """
        if not self.is_running:
            raise EngineDeadError("engine is not running")
        self.engine.validate_request(request)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = (loop, q)
        if not self.is_running:  # the loop died between the check above and registering
            self._streams.pop(request.request_id, None)
            raise EngineDeadError("engine is not running")
        self._send("add", request)
        finished = False
        last_token_time: float | None = None
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.new_token_ids and self.output_observers:
                    now = time.monotonic()
                    gap = None if last_token_time is None else now - last_token_time
                    last_token_time = now
                    self._observe(request, item, gap)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self._send("abort", [request.request_id])

    def _observe(self, request: EngineRequest, output: RequestOutput, gap: float | None) -> None:
        for observer in self.output_observers:
            try:
                observer(request, output, gap)
            except Exception as e:  # noqa: BLE001 - observers never break a stream
                logger.error("output observer failed: %s", type(e).__name__)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs ``fn(engine)`` on the engine thread between steps and returns its result."""
        if not self.is_running:
            raise EngineDeadError("engine is not running")
        fut: Future = Future()
        self._send("call", (fn, fut))
        return await asyncio.wrap_future(fut)

    def _send(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        self._wakeup.set()

    # -- engine thread -------------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed
                pass

    def _queued_commands(self) -> Iterator[tuple[str, Any]]:
        """Pops queued commands until the queue is empty (never blocks)."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain_commands(self) -> None:
        for kind, payload in self._queued_commands():
            if kind == "add":
                try:
                    self.engine.add_request(payload)
                except ValueError as e:
                    self._deliver(payload.request_id, e)
            elif kind == "abort":
                self.engine.abort_request(payload)
            elif kind == "call":
                fn, fut = payload
                if not fut.set_running_or_notify_cancel():
                    continue  # the caller gave up (cancelled) before we got to it
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                    fut.set_exception(e)

    def _loop(self) -> None:
        import torch

        torch.set_grad_enabled(False)
        try:
            while not self._stop:
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                self.last_step_time = time.monotonic()
                for out in outputs:
                    self._deliver(out.request_id, out)
        except Exception as e:  # a model/kernel/engine failure: fail everyone, stop serving
            logger.exception("engine loop failed; stopping it")
            self.errored = e
        finally:
            self._fail_pending()

    def _fail_pending(self) -> None:
        """On loop exit: answers every queued command and open stream with EngineDeadError."""
        for kind, payload in self._queued_commands():
            if kind == "call":
                fut = payload[1]
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(EngineDeadError("engine is not running"))
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError("engine is not running"))
