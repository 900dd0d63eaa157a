"""The server's stop on SIGTERM: uvicorn raises the caught signal again once it has stopped, and
the default action of SIGTERM ends the process there, so what must run on the way out runs
before that (``DrainingServer``'s ``on_stop``)."""

from __future__ import annotations

import signal

import uvicorn
from fastapi import FastAPI

from app.draining import DrainingServer


def test_on_stop_runs_before_uvicorn_raises_the_caught_signal_again():
    calls: list[str] = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: calls.append("signal"))
    try:
        app = FastAPI()
        server = DrainingServer(uvicorn.Config(app, log_config=None), 0.0,
                                on_stop=lambda: calls.append("on_stop"))
        with server.capture_signals():
            signal.raise_signal(signal.SIGTERM)  # caught by the server: it only stops
            assert calls == [] and server.should_exit
        # Then on_stop, then the signal raised again to the handler that was there before.
        assert calls == ["on_stop", "signal"]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_without_a_signal_on_stop_still_runs_once():
    calls: list[str] = []
    app = FastAPI()
    server = DrainingServer(uvicorn.Config(app, log_config=None), 0.0,
                            on_stop=lambda: calls.append("stop"))
    with server.capture_signals():
        pass
    assert calls == ["stop"]


def test_an_on_stop_that_fails_is_logged_and_the_signal_is_still_raised(caplog):
    calls: list[str] = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: calls.append("signal"))

    def fail() -> None:
        calls.append("on_stop")
        raise RuntimeError("pool would not stop")

    try:
        app = FastAPI()
        server = DrainingServer(uvicorn.Config(app, log_config=None), 0.0, on_stop=fail)
        with server.capture_signals():
            signal.raise_signal(signal.SIGTERM)
        assert calls == ["on_stop", "signal"]
        assert "on_stop failed" in caplog.text and "pool would not stop" in caplog.text
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_first_signal_starts_the_drain_and_health_answers_503(app_env):
    """``saltserve serve`` wires ``on_drain`` to ``ServerParts.start_draining``: after the first
    SIGTERM ``/health`` answers 503 (the load balancer stops sending), the server still runs."""
    parts = app_env.parts
    assert app_env.client.get("/health").status_code == 200
    server = DrainingServer(uvicorn.Config(FastAPI(), log_config=None), 30.0,
                            on_drain=parts.start_draining)
    try:
        server.handle_exit(signal.SIGTERM, None)
        r = app_env.client.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "draining"}
        assert not server.should_exit  # uvicorn's shutdown waits for the drain
    finally:
        server._timer.cancel()
        parts.draining = False
    assert app_env.client.get("/health").status_code == 200
