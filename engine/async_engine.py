"""``AsyncLLM``: the ``EngineClient`` of the server. One thread steps the engine; asyncio consumers
stream.

The engine thread owns the ``LLMEngine`` exclusively. Callers talk to it through a thread-safe
queue of typed commands (``_AddRequest``, ``_Abort``, ``_Call``) and receive ``RequestOutput``
records on per-request asyncio queues, so tokens stream to HTTP clients as they are produced.
Requests are validated on the caller's thread against the frozen ``ModelInfo`` before anything
is queued (``engine.protocol.validate_request``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.errors import EngineDeadError
from engine.llm_engine import LLMEngine
from engine.protocol import (
    EngineClient,
    ModelInfo,
    OutputObserver,
    attach_grammar,
    validate_request,
)
from engine.request import EngineRequest, RequestOutput
from engine.stats import EngineStatsSnapshot

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["AsyncLLM", "EngineDeadError", "OutputObserver"]


@dataclass(frozen=True)
class _AddRequest:
    request: EngineRequest


@dataclass(frozen=True)
class _Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: Future


_Command = _AddRequest | _Abort | _Call


class RequestStream:
    """The outputs of one request, as an async iterator on the submitting event loop.

    Ends after the finished output. ``close()`` (or ``aclose()``) before that aborts the request
    and frees its blocks; closing twice is harmless.
    """

    def __init__(self, client: AsyncLLM, request: EngineRequest) -> None:
        self.request = request
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._client = client
        self._finished = False
        self._closed = False
        self._last_token_time: float | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished or self._closed:
            raise StopAsyncIteration
        try:
            item = await self.queue.get()
        except BaseException:  # cancelled: the consumer is gone
            self.close()
            raise
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.new_token_ids and self._client.output_observers:
            now = time.monotonic()
            gap = None if self._last_token_time is None else now - self._last_token_time
            self._last_token_time = now
            self._client._observe(self.request, item, gap)
        if item.finished:
            self._finished = True
            self.close()
        return item

    def close(self) -> None:
        """Stops delivery; aborts the request unless it finished."""
        if self._closed:
            return
        self._closed = True
        self._client._streams.pop(self.request.request_id, None)
        if not self._finished:
            self._client._send(_Abort((self.request.request_id,)))

    async def aclose(self) -> None:
        self.close()


class AsyncLLM(EngineClient):
    """``EngineClient`` over an in-process ``LLMEngine`` stepped by one background thread.

    Args:
        engine: a constructed engine; from now on only the loop thread touches it.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._model_info: ModelInfo = engine.model_info
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wakeup = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._dead_error: BaseException | None = None
        self.last_step_time = time.monotonic()
        self.output_observers: list[OutputObserver] = []

    @classmethod
    def from_config(cls, config: Any, **engine_kwargs: Any) -> AsyncLLM:
        """Builds the ``LLMEngine`` for ``config`` (an ``EngineConfig``) on the engine thread
        itself and starts stepping it there: the way to serve.

        Why: torch's OpenMP pool belongs to the thread that runs a parallel op. A model loaded
        on one thread and stepped on another leaves two pools on the machine's cores, and
        libgomp then spins less before sleeping (more threads than cores), so each op waits for
        its workers to wake: decode runs about 40% slower on 2 cores. For the same
        reason a ``start()`` after ``shutdown()`` (a new thread) runs slower; the server never
        restarts an engine.

        An unset ``one_token_step_threads`` means measured here: one-token CPU steps run on
        the faster of torch's threads and one fewer, timed while serving
        (``ModelRunner.tune_one_token_threads``): on 2 vCPUs one thread is much faster on some
        machines and two on others, so no fixed count fits (docs/benchmarks.md).

        Raises:
            whatever ``LLMEngine(config, **engine_kwargs)`` raises (ValueError for a bad
            setting, FileNotFoundError for missing weights); no thread is left running.
        """
        self = cls.__new__(cls)
        ready = threading.Event()
        failure: list[BaseException] = []

        def build_then_loop() -> None:
            try:
                engine = LLMEngine(config, **engine_kwargs)
                if getattr(config, "one_token_step_threads", 0) is None:  # served: measure
                    tune = getattr(engine.runner, "tune_one_token_threads", None)
                    if tune is not None:
                        tune()
                cls.__init__(self, engine)
                self._thread = threading.current_thread()
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                failure.append(e)
                return
            finally:
                ready.set()
            self._loop()

        thread = threading.Thread(target=build_then_loop, name="saltserve-engine", daemon=True)
        thread.start()
        ready.wait()
        if failure:
            thread.join()
            raise failure[0]
        return self

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None and self._dead_error is None:
            self._stop = False  # a clean shutdown() may be followed by start()
            self._thread = threading.Thread(target=self._loop, name="saltserve-engine",
                                            daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wakeup.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=30)
            self._thread = None
        offloader = getattr(self.engine, "offloader", None)
        if offloader is not None and (thread is None or not thread.is_alive()) \
                and self._dead_error is None:
            # The engine is stopped (cleanly: a dead engine's pool is not trusted): the pool's
            # cached blocks join the tiers too, and every queued write lands before the exit
            # (a restart finds them).
            saved = offloader.save_pool(self.engine.block_pool.cached_block_hash_to_block.values())
            offloader.flush()
            logger.info("KV offload tier: %d cached blocks written at shutdown", saved)

    @property
    def is_running(self) -> bool:
        """True while the loop runs, has not failed and is not shutting down."""
        return (self._thread is not None and self._thread.is_alive()
                and self._dead_error is None and not self._stop)

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    # -- EngineClient --------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return self._model_info

    def add_output_observer(self, observer: OutputObserver) -> None:
        """Registers ``observer(request, output, seconds_since_previous_token)``.

        It runs on the consumer's event loop for every output with new tokens (inter-token
        latency as the client sees it, vLLM ``inter_token_latency_seconds``); it must be cheap
        and must not raise (an exception is logged and dropped, the stream goes on).
        """
        self.output_observers.append(observer)

    def add_request(self, request: EngineRequest) -> RequestStream:
        """Validates ``request`` on the caller's thread, queues it, and returns its stream.

        Raises:
            InvalidRequestError: the request fails ``validate_request`` or its grammar does not
                compile (nothing is queued).
            EngineDeadError: the engine loop is not running.
        """
        if not self.is_running:
            raise EngineDeadError("engine is not running")
        validate_request(request, self._model_info)
        request = attach_grammar(request, self._model_info)
        stream = RequestStream(self, request)
        self._streams[request.request_id] = (stream.loop, stream.queue)
        if not self.is_running:  # the loop died between the check above and registering
            self._streams.pop(request.request_id, None)
            raise EngineDeadError("engine is not running")
        self._send(_AddRequest(request))
        return stream

    async def abort(self, request_ids: list[str]) -> None:
        self._send(_Abort(tuple(request_ids)))

    async def evict_tenant_cache(self, tenant_id: str | None, reason: str) -> int:
        return await self._call(lambda e: e.evict_tenant_cache(tenant_id, reason))

    async def reset_prefix_cache(self) -> int:
        return await self._call(lambda e: e.reset_prefix_cache())

    async def stats(self) -> EngineStatsSnapshot:
        return await self._call(lambda e: e.stats_snapshot())

    # -- internals -----------------------------------------------------------------------------
    def _observe(self, request: EngineRequest, output: RequestOutput, gap: float | None) -> None:
        for observer in self.output_observers:
            try:
                observer(request, output, gap)
            except Exception as e:  # noqa: BLE001 - observers never break a stream
                logger.error("output observer failed: %s", type(e).__name__)

    async def _call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs ``fn(engine)`` on the engine thread between steps and returns its result.

        Private: the typed methods above are the interface; tests use it to inspect the engine.
        """
        if not self.is_running:
            raise EngineDeadError("engine is not running")
        fut: Future = Future()
        self._send(_Call(fn, fut))
        return await asyncio.wrap_future(fut)

    def _send(self, command: _Command) -> None:
        self._commands.put(command)
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

    def _queued_commands(self) -> Iterator[_Command]:
        """Pops queued commands until the queue is empty (never blocks)."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain_commands(self) -> None:
        for cmd in self._queued_commands():
            if isinstance(cmd, _AddRequest):
                try:
                    self.engine.enqueue(cmd.request)
                except ValueError as e:  # duplicate request id
                    self._deliver(cmd.request.request_id, e)
            elif isinstance(cmd, _Abort):
                self.engine.abort_request(list(cmd.request_ids))
            elif cmd.future.set_running_or_notify_cancel():  # else the caller gave up
                try:
                    cmd.future.set_result(cmd.fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                    cmd.future.set_exception(e)

    def _loop(self) -> None:
        try:
            import torch

            torch.set_grad_enabled(False)
        except ImportError:  # a torch-free executor (tests)
            pass
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
            self._dead_error = e
        finally:
            restore = getattr(getattr(self.engine, "runner", None), "restore_threads", None)
            if restore is not None:  # --one-token-step-threads may have left fewer
                restore()
            self._fail_pending()

    def _fail_pending(self) -> None:
        """On loop exit: answers every queued command and open stream with EngineDeadError."""
        for cmd in self._queued_commands():
            if isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(EngineDeadError("engine is not running"))
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError("engine is not running"))
