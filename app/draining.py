"""uvicorn's server with a drain phase, for rolling restarts behind a load balancer."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Generator
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """The first SIGTERM / SIGINT calls ``on_drain`` (``saltserve serve`` sets
    ``ServerParts.draining``: ``GET /health`` answers 503, new requests are still served), and
    ``drain_s`` seconds later uvicorn's own graceful shutdown starts (the listener closes;
    running requests finish). A second signal during the drain, or ``drain_s`` 0, starts that
    shutdown at once.

    ``on_stop`` runs once the server has stopped, before uvicorn raises the caught signal again
    (SIGTERM's default action then ends the process at once: no ``finally`` block or ``atexit``
    handler of the caller runs after it, so a process pool left running leaks its semaphores).
    An exception from it is logged, and the signal is still raised.
    """

    def __init__(self, config: uvicorn.Config, drain_s: float,
                 on_drain: Callable[[], None] | None = None,
                 on_stop: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._drain_s, self._on_drain, self._on_stop = drain_s, on_drain, on_stop
        self._timer: threading.Timer | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        with super().capture_signals():
            try:
                yield
            finally:
                if self._on_stop is not None:
                    try:
                        self._on_stop()
                    except Exception:  # logged: the caught signal must still be raised
                        logger.exception("stopping: on_stop failed")

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._timer is not None:  # a second signal: stop now, the timer has nothing to do
            self._timer.cancel()
        if self._drain_s <= 0 or self._timer is not None:
            return super().handle_exit(sig, frame)
        if self._on_drain is not None:
            self._on_drain()
        logger.info("draining: /health answers 503 for %.1f s, then the server stops",
                    self._drain_s)
        self._timer = threading.Timer(self._drain_s, super().handle_exit, (sig, frame))
        self._timer.daemon = True
        self._timer.start()
