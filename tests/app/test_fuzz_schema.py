"""Fuzz every route of the app's OpenAPI schema with schemathesis (bounded, deterministic).

For each operation schemathesis generates ``MAX_EXAMPLES`` requests (hypothesis, derandomized, no
deadline) which are sent with a valid tenant API key (the admin JWT on ``/admin`` and ``/metrics``
routes, so their validation is fuzzed too) through the app's own TestClient, so they
reach the running engine (schemathesis's own ASGI client would start a second lifespan). Every
response must be: no 5xx, no stack trace, no salt, and errors in the OpenAI shape. Afterwards the
block pool passes ``check_integrity()`` with every block free.

Keeping it fast on 2 CPU cores (the completions run the real model): ``_tame`` rewrites a
generated JSON body before it is sent: ``model`` is set to the served model (so bodies pass the
model check and reach validation and the engine instead of all stopping at "unknown model"),
``max_tokens`` / ``max_completion_tokens`` in 2..512 become 2 (a larger value is rejected anyway,
and stays, so the over-limit path is fuzzed too), a missing one becomes 2, ``n`` over 2 becomes 2,
and prompts / messages / message contents are cut to 64 items or characters. Since every OpenAI
field is now either implemented (with its checks) or refused, a generated body almost always
carries some refused or out-of-range field: every other body (by a hash of its JSON) is cut to the
core sampling fields (``CORE``), with their generated values, so bodies also reach the engine.
Everything else (types, other fields, invalid values) is as generated.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

MAX_EXAMPLES = 20
CORE = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "temperature",
        "top_p", "seed", "stream"}

@pytest.fixture(scope="module")
def env(app_env_builder, tmp_path_factory):
    with app_env_builder(tmp_path_factory.mktemp("fuzz")) as env:
        yield env


@pytest.fixture(scope="module")
def fuzz_schema(env):
    # Straight from the app object: the /openapi.json route itself is not public.
    return schemathesis.openapi.from_dict(env.client.app.openapi())


def _cut(value, limit: int = 64):
    return value[:limit] if isinstance(value, str | list) else value


def _tame(body, model: str):
    """Caps what a fuzzed completion may cost (see the module docstring)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if "model" in body or "prompt" in body or "messages" in body:
        if zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode()) % 2:
            body = {k: v for k, v in body.items() if k in CORE}
            if isinstance(body.get("messages"), list):  # plain turns (a tool turn needs its
                body["messages"] = [                    # call: a 400 every time)
                    {"role": m.get("role") if m.get("role") in ("system", "user") else "user",
                     **{k: v for k, v in m.items() if k == "content"}}
                    if isinstance(m, dict) else m for m in body["messages"]]
        body["model"] = model
        for name in ("max_tokens", "max_completion_tokens"):
            v = body.get(name)
            if isinstance(v, int) and not isinstance(v, bool) and 2 < v <= 512:
                body[name] = 2
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 2
        if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
            body["n"] = 2
        if body.get("prompt_cache_retention") == "24h":  # the fake model has no tier: a 400
            body["prompt_cache_retention"] = "in_memory"
        if "prompt" in body:
            body["prompt"] = _cut(body["prompt"])
            prompt = body["prompt"]
            if not prompt or (isinstance(prompt, list) and not all(prompt)):
                body["prompt"] = "Hello"  # empty prompts are a 400 every time
        if isinstance(body.get("messages"), list):
            body["messages"] = [
                {**m, "content": _cut(m.get("content"))} if isinstance(m, dict) else m
                for m in body["messages"][:4]]
    return body


def _send(env, case):
    admin_token = getattr(env, "admin_token", "")
    admin = case.path.startswith(("/admin", "/metrics")) and admin_token
    kwargs = case.as_transport_kwargs(
        base_url="http://testserver", headers=env.headers(admin_token if admin else env.key_a))
    request = {"method": kwargs["method"], "url": kwargs["url"],
               "headers": kwargs.get("headers"), "params": kwargs.get("params")}
    if "json" in kwargs:
        request["json"] = _tame(kwargs["json"], env.model)
    elif kwargs.get("data") is not None:
        data = kwargs["data"]
        request["content"] = data.encode() if isinstance(data, str) else data
    return env.client.request(**request)


def _check(env, case, statuses: Counter) -> None:
    r = _send(env, case)
    statuses[r.status_code] += 1
    assert r.status_code < 500, (r.status_code, r.text[:500])
    assert "Traceback" not in r.text and 'File "' not in r.text
    assert not env.salt_ctx.salt_occurs_in(r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"]
        assert isinstance(err["type"], str)
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in r.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event or set(event["error"]) == {
                    "message", "type", "param", "code"}


def _fuzz_operation(env, operation, statuses: Counter) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        _check(env, case, statuses)

    try:
        run()
    except Exception as e:
        raise AssertionError(f"{operation.label}: {e}") from e


def test_fuzzed_requests_never_break_the_server(env, fuzz_schema):
    """One bounded hypothesis run per operation (schemathesis's pytest plugin is not used: its
    lazy-fixture loader does not run on pytest 9)."""
    env.salt_ctx = env.repo.authenticator.authenticate_api_key(env.key_a)
    statuses: dict[str, Counter] = {}
    for result in fuzz_schema.get_all_operations():
        operation = result.ok()
        statuses[operation.label] = Counter()
        _fuzz_operation(env, operation, statuses[operation.label])
    print("\nfuzzed status codes per operation:",
          {label: dict(sorted(c.items())) for label, c in statuses.items()})
    # The taming above lets fuzzed bodies through to the engine, not only to the validators.
    assert statuses["POST /v1/chat/completions"][200] > 0, statuses
    assert statuses["POST /v1/completions"][200] > 0, statuses


def test_denormal_top_p_does_not_kill_the_engine(env):
    """A case the fuzzer found: top_p=5e-324 must not round to 0 in the sampler's fp32
    comparison, or every token is dropped and the NaN probabilities stop the engine loop (503
    for every tenant from then on)."""
    body = {"model": env.model, "prompt": "Hello", "max_tokens": 2, "temperature": 1.0,
            "top_p": 5e-324, "seed": 1}
    for _ in range(2):
        r = env.client.post("/v1/completions", json=body, headers=env.headers(env.key_a))
        assert r.status_code == 200, r.text


def test_block_pool_is_intact_after_fuzzing(env):
    """Runs after the fuzz test (file order): nothing leaked, every block is free."""
    free, total, busy = env.engine_state()
    assert (total - free, busy) == (0, False)
