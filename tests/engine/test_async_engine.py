"""AsyncLLM's engine thread: cancelled calls, engine failure, no hung streams (fake engine)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.async_engine import AsyncLLM, EngineDeadError
from engine.errors import InvalidRequestError
from engine.protocol import ModelInfo
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams


class FakeEngine:
    """Has work once a request is added; ``step`` raises when ``fail`` is set."""

    model_info = ModelInfo("fake", max_model_len=16, vocab_size=100, block_size=4, num_blocks=8)

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.fail = False

    def enqueue(self, req: EngineRequest) -> None:
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
        blocker = asyncio.ensure_future(llm._call(lambda e: gate.wait(5)))
        await asyncio.sleep(0.05)                      # the engine thread is inside blocker
        doomed = asyncio.ensure_future(llm._call(lambda e: 1))
        await asyncio.sleep(0.05)
        doomed.cancel()                                # cancelled while still queued
        gate.set()
        await blocker
        return await asyncio.wait_for(llm._call(lambda e: 42), 5)

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
            await llm._call(lambda e: 1)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 10))
    finally:
        llm.shutdown()
    assert llm.errored and isinstance(llm.dead_error, RuntimeError)


def test_invalid_request_is_refused_on_the_callers_thread_before_anything_is_queued():
    engine = FakeEngine()
    llm = AsyncLLM(engine)
    llm.start()

    async def scenario() -> list[tuple[str | None, str]]:
        errors = []
        for ids in [(), tuple(range(16)), (1, 100), (-1, 2)]:
            with pytest.raises(InvalidRequestError) as e:
                llm.add_request(EngineRequest("bad", ids, SamplingParams(max_tokens=1)))
            errors.append((e.value.param, e.value.code))
        stream = llm.add_request(_req("ok"))  # a valid one is queued
        await llm._call(lambda e: None)       # the engine thread has drained its commands
        stream.close()                        # closing early aborts it
        await llm._call(lambda e: None)
        return errors

    try:
        errors = asyncio.run(asyncio.wait_for(scenario(), 10))
    finally:
        llm.shutdown()
    assert errors == [("prompt", "invalid_value"), ("prompt", "context_length_exceeded"),
                      ("prompt", "invalid_value"), ("prompt", "invalid_value")]
    assert engine.requests == []  # "ok" was added then aborted; "bad" never reached the engine


def test_requests_after_shutdown_are_refused_instead_of_hanging():
    engine = FakeEngine()
    llm = AsyncLLM(engine)
    llm.start()
    assert llm.is_running
    llm.shutdown()

    async def scenario() -> None:
        with pytest.raises(EngineDeadError):
            llm.add_request(_req("late"))
        with pytest.raises(EngineDeadError):
            await llm.check_health()

    asyncio.run(asyncio.wait_for(scenario(), 5))
    assert not llm.is_running and engine.requests == []
    llm.start()  # a clean shutdown can be followed by a start (an app's lifespan run again)
    try:
        assert llm.is_running
    finally:
        llm.shutdown()


def test_from_config_builds_the_engine_on_the_thread_that_steps_it(monkeypatch):
    """The engine is constructed on the engine thread (one torch OpenMP pool, not two), which
    then steps it; a construction error is raised to the caller and leaves no thread."""
    from engine import async_engine

    built_on: list[threading.Thread] = []

    def fake_engine(config, **kwargs):
        if config == "bad":
            raise ValueError("--dtype must be one of ...")
        built_on.append(threading.current_thread())
        return FakeEngine()

    monkeypatch.setattr(async_engine, "LLMEngine", fake_engine)
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="--dtype"):
        AsyncLLM.from_config("bad")
    assert not built_on
    assert not [t for t in set(threading.enumerate()) - before if t.name == "saltserve-engine"]
    llm = AsyncLLM.from_config("good")
    try:
        assert llm.is_running and built_on == [llm._thread]
        assert built_on[0] is not threading.current_thread()
        stepped_on = asyncio.run(llm._call(lambda e: threading.current_thread()))
        assert stepped_on is built_on[0]
        llm.start()  # idempotent: no second thread
        assert llm._thread is built_on[0]
    finally:
        llm.shutdown()
    assert not built_on[0].is_alive()


@pytest.mark.parametrize(("given", "tuned"), [(None, True), (0, False), (2, False)])
def test_served_engines_time_their_one_token_steps_unless_told(monkeypatch, given, tuned):
    """``one_token_step_threads`` unset: a served engine (``from_config``) has its runner
    time one-token steps on its candidate thread counts; set, the count is kept (0 = off)."""
    from engine import async_engine
    from engine.config import EngineConfig

    class Runner:
        calls = 0

        def tune_one_token_threads(self):
            Runner.calls += 1

    seen = []

    def build(config, **kw):
        seen.append(config)
        engine = FakeEngine()
        engine.runner = Runner()
        return engine

    monkeypatch.setattr(async_engine, "LLMEngine", build)
    llm = AsyncLLM.from_config(EngineConfig(model="m", one_token_step_threads=given))
    llm.shutdown()
    assert [c.one_token_step_threads for c in seen] == [given]  # the config is not rewritten
    assert Runner.calls == int(tuned)
