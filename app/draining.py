"""uvicorn's server with a drain phase, for rolling restarts behind a load balancer."""

from __future__ import annotations

import logging
import threading
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """The first SIGTERM / SIGINT sets ``app.state.draining`` (``GET /health`` answers 503, new
    requests are still served) for ``drain_s`` seconds, then starts uvicorn's own graceful
    shutdown (the listener closes; running requests finish). A second signal, or ``drain_s``
    0, stops at once as uvicorn does.
    """

    def __init__(self, config: uvicorn.Config, app: Any, drain_s: float) -> None:
        super().__init__(config)
        self._app, self._drain_s, self._draining = app, drain_s, False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_s <= 0 or self._draining:
            return super().handle_exit(sig, frame)
        self._draining = True
        self._app.state.draining = True
        logger.info("draining: /health answers 503 for %.1f s, then the server stops",
                    self._drain_s)
        timer = threading.Timer(self._drain_s, super().handle_exit, (sig, frame))
        timer.daemon = True
        timer.start()
