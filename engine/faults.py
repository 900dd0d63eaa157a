"""Test-only fault injection at the engine's per-request and per-step fault points.

Off in production: ``fire`` is a no-op unless a test has installed an injector with
``inject``; nothing in the server, the CLI, the config or the environment can install one
(``tests/engine/test_fault_containment.py`` checks that no production module calls ``inject``).

Fault points (``point`` argument of the injector):

- ``"allocate"``   one request's KV block allocation (``KVCacheManager.allocate_slots``)
- ``"logits"``     one request's logits processing, before sampling
- ``"sample"``     one request's sampling
- ``"stop"``       one request's stop checks (``Scheduler.update_from_output``)
- ``"detokenize"`` one request's incremental detokenisation
- ``"forward"``    the batched forward pass of a step (request id None)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

FAULT_POINTS = ("allocate", "logits", "sample", "stop", "detokenize", "forward")

Injector = Callable[[str, "str | None"], None]
_injector: Injector | None = None


def fire(point: str, request_id: str | None = None) -> None:
    """Calls the installed injector (which may raise); a no-op when none is installed."""
    if _injector is not None:
        _injector(point, request_id)


@contextmanager
def inject(injector: Injector) -> Iterator[None]:
    """Installs ``injector(point, request_id)`` for the ``with`` block (tests only).

    Raises:
        RuntimeError: an injector is already installed.
    """
    global _injector
    if _injector is not None:
        raise RuntimeError("a fault injector is already installed")
    _injector = injector
    try:
        yield
    finally:
        _injector = None
