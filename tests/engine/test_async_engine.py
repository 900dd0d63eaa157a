"""AsyncLLM's engine thread: cancelled calls, engine failure, no hung streams (fake engine)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.async_engine import AsyncLLM, EngineDeadError
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams


class FakeEngine:
    """Has work once a request is added; ``step`` raises when ``fail`` is set."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.fail = False

    def validate_request(self, req: EngineRequest) -> None:
        pass

    def add_request(self, req: EngineRequest) -> None:
        self.requests.append(req.request_id)

    def abort_request(self, ids: list[str]) -> list:
        self.requests = [r for r in self.requests if r not in ids]
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list:
        if self.fail:
            raise RuntimeError("kernel exploded")
        return []


def _req(rid: str) -> EngineRequest:
    return EngineRequest(rid, (1, 2, 3), SamplingParams(max_tokens=1))


def test_cancelled_call_does_not_kill_the_engine_thread():
    llm = AsyncLLM(FakeEngine())
    llm.start()
    gate = threading.Event()

    async def scenario() -> int:
        blocker = asyncio.ensure_future(llm.call(lambda e: gate.wait(5)))
        await asyncio.sleep(0.05)                      # the engine thread is inside blocker
        doomed = asyncio.ensure_future(llm.call(lambda e: 1))
        await asyncio.sleep(0.05)
        doomed.cancel()                                # cancelled while still queued
        gate.set()
        await blocker
        return await asyncio.wait_for(llm.call(lambda e: 42), 5)

    try:
        assert asyncio.run(scenario()) == 42
        assert llm.is_running
    finally:
        llm.shutdown()


def test_engine_failure_fails_streams_and_queued_calls_instead_of_hanging():
    engine = FakeEngine()
    llm = AsyncLLM(engine)
    llm.start()

    async def scenario() -> None:
        engine.fail = True
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate(_req("r1")):
                pass
        assert not llm.is_running
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate(_req("r2")):
                pass
        with pytest.raises(EngineDeadError):
            await llm.call(lambda e: 1)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 10))
    finally:
        llm.shutdown()
    assert isinstance(llm.errored, RuntimeError)
