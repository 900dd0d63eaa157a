"""``app.services.completions``: every call is finalised exactly once (one usage record, lease
released, metrics counted once) on every path: success, bad request, client disconnect,
cancellation, engine failure; streaming and not. Runs on the fake model."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import pytest
from starlette.requests import ClientDisconnect

from app.limits import RateLimiter
from app.protocol import ChatCompletionRequest, CompletionRequest


class Recorder:
    """Stands in for the usage store: records every call (from worker threads)."""

    def __init__(self) -> None:
        self.records = []
        self.lock = threading.Lock()

    def __call__(self, record) -> None:
        with self.lock:
            self.records.append(record)

    def settled(self, n: int, timeout: float = 5.0) -> list:
        """The records once there are ``n`` of them (and no more arrive for 0.2 s)."""
        deadline = time.time() + timeout
        while time.time() < deadline and len(self.records) < n:
            time.sleep(0.02)
        time.sleep(0.2)
        return list(self.records)


@pytest.fixture(scope="module")
def env(app_env_builder, tmp_path_factory):
    with app_env_builder(tmp_path_factory.mktemp("service")) as env:
        yield env


@pytest.fixture
def service(env):
    svc = env.parts.completions
    svc.record_usage = Recorder()
    svc.limiter = RateLimiter()
    env.repo.tenants.update(env.tenant_a, rpm_limit=100, tpm_limit=100_000, max_concurrent=4)
    yield svc
    env.fake.step_delay_s = 0.0
    env.repo.tenants.update(env.tenant_a, rpm_limit=None, tpm_limit=None, max_concurrent=None)


def _auth(env):
    return env.repo.authenticator.authenticate_api_key(env.key_a)


def _engine_idle(env) -> tuple[int, int, bool]:
    deadline = time.time() + 5
    while time.time() < deadline:
        state = env.engine_state()
        if not state[2]:
            return state
        time.sleep(0.02)
    return state


def _requests_total(env, status: str) -> float:
    metric = env.parts.metrics.requests
    return metric.labels(env.model, env.tenant_a, status)._value.get()


def _window_requests(service, tenant: str) -> int:
    """Calls of ``tenant`` counted in the limiter's rpm window."""
    window = service.limiter._tenants.get(tenant)
    return 0 if window is None else len(window.requests)


def _window_tokens(service, tenant: str) -> int:
    """Tokens of ``tenant`` counted in the limiter's tpm window."""
    window = service.limiter._tenants.get(tenant)
    return 0 if window is None else window.tokens_used


def _reader(body):
    """The service's body reader for a request model (what ``Request.body`` gives the route)."""
    async def read() -> bytes:
        return body.model_dump_json(exclude_unset=True).encode()
    return read


def _in_flight(service, env) -> int:
    return service.limiter.in_flight(env.tenant_a)


@pytest.mark.parametrize("stream", [False, True])
def test_success_is_recorded_once(env, service, stream):
    ok_before = _requests_total(env, "ok")
    r = env.client.post("/v1/chat/completions", headers=env.headers(env.key_a), json={
        "model": env.model, "max_tokens": 5, "stream": stream, "n": 2,
        "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]
    records = service.record_usage.settled(1)
    assert [(x.status, x.completion_tokens, x.endpoint) for x in records] == [
        ("ok", 10, "chat.completions")]
    assert records[0].prompt_tokens > 0 and records[0].ttft_s is not None
    assert _requests_total(env, "ok") == ok_before + 1
    assert _in_flight(service, env) == 0
    assert _engine_idle(env)[2] is False


@pytest.mark.parametrize("stream", [False, True])
def test_refused_by_the_engine_is_recorded_once_and_counts_no_rate_limit(env, service, stream):
    """A token id outside the vocabulary passes the API checks and the lease, then the engine's
    single validation refuses it: 400 with param, one error record; the call counts as one
    request (it was admitted before its body was read) and no tokens, in its usage record
    too (billing matches the work: nothing was processed)."""
    r = env.client.post("/v1/completions", headers=env.headers(env.key_a), json={
        "model": env.model, "prompt": [1, 2, 10**9], "max_tokens": 3, "stream": stream})
    assert r.status_code == 400
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("prompt", "invalid_value")
    records = service.record_usage.settled(1)
    assert [(x.status, x.prompt_tokens, x.completion_tokens) for x in records] == [
        ("error", 0, 0)]
    assert _in_flight(service, env) == 0
    assert _window_requests(service, env.tenant_a) == 1  # admitted, then refused
    assert _window_tokens(service, env.tenant_a) == 0
    assert _engine_idle(env) == (128, 128, False)


def test_bad_request_before_admission_is_recorded_once(env, service):
    r = env.client.post("/v1/completions", headers=env.headers(env.key_a), json={
        "model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert [x.status for x in service.record_usage.settled(1)] == ["error"]
    assert _in_flight(service, env) == 0


def test_disconnect_during_a_non_streaming_call_aborts_and_records_once(env, service, caplog):
    """A client giving up is a normal event: the call is aborted and recorded once, and the
    server logs one line (request, tenant, how far it got), no traceback."""
    body = CompletionRequest(model=env.model, prompt=list(range(300, 340)), max_tokens=400,
                             ignore_eos=True)
    polls = []
    env.fake.step_delay_s = 0.01  # 400 tokens take 4 s; the service polls every second

    async def gone() -> bool:
        polls.append(1)
        return True

    async def run():
        return await service.create_completion(_reader(body), _auth(env), gone)

    with caplog.at_level(logging.INFO):
        response = env.client.portal.call(run)
    assert response.status_code == 499 and response.body == b""
    [line] = [r for r in caplog.records if "client gave up" in r.getMessage()]
    assert line.levelno == logging.INFO and line.exc_info is None
    assert env.tenant_a in line.getMessage() and "40 prompt tokens" in line.getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert polls  # the service noticed through is_disconnected
    records = service.record_usage.settled(1)
    assert [x.status for x in records] == ["aborted"]
    assert records[0].completion_tokens < 400
    assert _in_flight(service, env) == 0
    assert _engine_idle(env) == (128, 128, False)


def test_cancellation_of_the_handler_records_once(env, service):
    body = ChatCompletionRequest(model=env.model, max_tokens=400, ignore_eos=True,
                                 messages=[{"role": "user", "content": "a long answer please"}])
    env.fake.step_delay_s = 0.01

    async def never() -> bool:
        return False

    async def run() -> None:
        task = asyncio.create_task(service.create_chat_completion(_reader(body), _auth(env),
                                                                  never))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    env.client.portal.call(run)
    assert [x.status for x in service.record_usage.settled(1)] == ["aborted"]
    assert _in_flight(service, env) == 0
    assert _engine_idle(env) == (128, 128, False)


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_stream_client_gone_before_the_first_byte_records_once(env, service, spec):
    """Drives the ASGI app directly: the client disconnects before the body is read (2.3), or
    the first send fails (2.4: Starlette then never starts the body). Either way the engine
    requests are aborted at once (no 400-token run to the end), the stream is unregistered and
    the call recorded once as aborted."""
    body = json.dumps({"model": env.model, "prompt": "hello there", "max_tokens": 400,
                       "ignore_eos": True, "stream": True}).encode()
    scope = env.completion_scope(body, spec)
    messages = iter([{"type": "http.request", "body": body, "more_body": False}])
    env.fake.step_delay_s = 0.01

    async def receive() -> dict:
        return next(messages, {"type": "http.disconnect"})

    async def send(message: dict) -> None:
        if spec == "2.4":
            raise OSError("client gone")

    async def run() -> None:
        try:
            await asyncio.wait_for(env.client.app(scope, receive, send), 10)
        except ClientDisconnect:  # 2.4: Starlette turns the failed send into this; the server
            pass                  # (uvicorn) swallows it

    env.client.portal.call(run)
    assert env.engine._streams == {}
    state = _engine_idle(env)
    records = service.record_usage.settled(1)
    assert [x.status for x in records] == ["aborted"]
    assert records[0].completion_tokens < 100  # aborted early, not run to max_tokens
    assert _in_flight(service, env) == 0
    assert state == (128, 128, False)


def test_a_non_streamed_client_giving_up_ends_the_asgi_call_quietly(env, service, caplog):
    """Through the ASGI app (what uvicorn calls): the client of a non-streamed call
    disconnects after sending its body; the app returns normally (nothing for the server to
    log as "Exception in ASGI application"), the call is aborted and recorded once, and the
    log has one line for it."""
    body = json.dumps({"model": env.model, "prompt": "hello there", "max_tokens": 400,
                       "ignore_eos": True}).encode()
    scope = env.completion_scope(body)
    messages = iter([{"type": "http.request", "body": body, "more_body": False}])
    sent: list[dict] = []
    env.fake.step_delay_s = 0.01

    async def receive() -> dict:
        return next(messages, {"type": "http.disconnect"})

    async def send(message: dict) -> None:
        sent.append(message)

    with caplog.at_level(logging.INFO):
        env.client.portal.call(lambda: asyncio.wait_for(env.client.app(scope, receive, send), 10))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    records = service.record_usage.settled(1)
    assert [x.status for x in records] == ["aborted"] and records[0].completion_tokens < 400
    assert sum("client gave up" in r.getMessage() for r in caplog.records) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert _in_flight(service, env) == 0
    assert _engine_idle(env) == (128, 128, False)


def test_finalize_refuses_a_second_run(env, service, caplog):
    from app.services.call import CompletionCall

    call = CompletionCall("cmpl-x", "completions", env.model, _auth(env))

    async def twice() -> None:
        service._finalize(call)
        service._finalize(call)

    env.client.portal.call(twice)
    assert len(service.record_usage.settled(1)) == 1
    assert "finalised twice" in caplog.text


def test_engine_failure_mid_call_records_once_and_fails_cleanly(app_env_builder, tmp_path):
    with app_env_builder(tmp_path, max_consecutive_step_failures=1) as env:
        svc = env.parts.completions
        svc.record_usage = recorder = Recorder()
        env.fake.fail = True
        r = env.client.post("/v1/completions", headers=env.headers(env.key_b), json={
            "model": env.model, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "engine_unavailable"
        assert [x.status for x in recorder.settled(1)] == ["error"]
        assert env.client.get("/health").status_code == 503
        r = env.client.post("/v1/completions", headers=env.headers(env.key_b), json={
            "model": env.model, "prompt": "hi", "max_tokens": 3, "stream": True})
        assert r.status_code == 503
        assert [x.status for x in recorder.settled(2)] == ["error", "error"]


def test_engine_death_mid_stream_is_an_in_band_error_recorded_once(app_env_builder, tmp_path):
    with app_env_builder(tmp_path, max_consecutive_step_failures=1) as env:
        svc = env.parts.completions
        svc.record_usage = recorder = Recorder()
        env.fake.step_delay_s = 0.01
        lines = []
        with env.client.stream("POST", "/v1/completions", headers=env.headers(env.key_b), json={
                "model": env.model, "prompt": "hi", "max_tokens": 200, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 3:
                        env.fake.fail = True  # the next forward raises: the engine loop dies
        last = json.loads(lines[-1].removeprefix("data: "))
        assert last["error"]["code"] == "engine_unavailable"
        assert 3 <= len(lines) < 200
        records = recorder.settled(1)
        assert [x.status for x in records] == ["error"]
        assert 2 <= records[0].completion_tokens < 200


def test_a_tenant_flooding_bad_requests_does_not_harm_another(env, service):
    """Tenant A floods requests the engine refuses (bad token ids, over-long prompts, bad
    templates) while B works: B is served and keeps its cache hits, nothing of A's is queued,
    leased or leaked, and every refused call of A is recorded once."""
    from concurrent.futures import ThreadPoolExecutor

    bad_bodies = [
        ("/v1/completions", {"prompt": [5, 6, 10**9], "max_tokens": 2}),
        ("/v1/completions", {"prompt": list(range(1, 600)), "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}),
    ] * 10
    b_prompt = list(range(1000, 1040))

    def bad(i: int) -> int:
        path, body = bad_bodies[i]
        return env.client.post(path, content=json.dumps({"model": env.model, **body}),
                               headers={**env.headers(env.key_a),
                                        "Content-Type": "application/json"}).status_code

    def good(_: int) -> dict:
        r = env.client.post("/v1/completions", headers=env.headers(env.key_b), json={
            "model": env.model, "prompt": b_prompt, "max_tokens": 4})
        assert r.status_code == 200
        return r.json()

    first = good(0)
    with ThreadPoolExecutor(4) as pool:
        bad_codes = pool.map(bad, range(len(bad_bodies)))
        b_results = list(pool.map(good, range(6)))
    assert set(bad_codes) == {400}
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert {r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in b_results} == {32}
    assert {r["choices"][0]["text"] for r in b_results} == {first["choices"][0]["text"]}
    records = service.record_usage.settled(len(bad_bodies) + 7)
    a = [x for x in records if x.tenant_id == env.tenant_a]
    assert len(a) == len(bad_bodies) and {x.status for x in a} == {"error"}
    assert {x.status for x in records if x.tenant_id == env.tenant_b} == {"ok"}
    assert _in_flight(service, env) == 0
    # Each bad call was admitted (before its body was read) and counts as a request, no tokens.
    assert _window_requests(service, env.tenant_a) == len(bad_bodies)
    assert _window_tokens(service, env.tenant_a) == 0
    assert _engine_idle(env) == (128, 128, False)
