"""OpenAI routes: hit arithmetic, isolation, streaming, errors (fake model: real engine, block pool
and prefix cache), and model output end to end on the real bundled model (``real_app_env``)."""

from __future__ import annotations

import json
import time

import pytest


def _complete(env, key: str, prompt, **kw) -> dict:
    body = {"model": env.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **kw}
    r = env.client.post("/v1/completions", json=body, headers=env.headers(key))
    assert r.status_code == 200, r.text
    return r.json()


def _cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def _engine_state(env) -> tuple[int, int]:
    """(free blocks, total blocks) read on the engine thread after checking pool integrity."""
    free, total, _busy = env.engine_state()
    return free, total


@pytest.mark.parametrize("n", [15, 16, 17, 31, 32, 33, 64, 65])
def test_repeated_prompt_hits_full_blocks_except_last_token(app_env, n):
    # A distinct first token per n keeps the cases from hitting each other's blocks.
    prompt = [2000 + n] + [(7 * i + n) % 5000 + 3000 for i in range(n - 1)]
    cold = _complete(app_env, app_env.key_a, prompt)
    warm = _complete(app_env, app_env.key_a, prompt)
    assert cold["usage"]["prompt_tokens"] == n
    assert _cached(cold) == 0
    assert _cached(warm) == 16 * ((n - 1) // 16)


def test_tenant_b_never_hits_tenant_a_prompt_but_hits_its_own(app_env):
    prompt = [4321] + list(range(10000, 10047))  # 48 tokens -> 2 reusable blocks
    assert _cached(_complete(app_env, app_env.key_a, prompt)) == 0
    assert _cached(_complete(app_env, app_env.key_b, prompt)) == 0     # A's blocks: invisible
    assert _cached(_complete(app_env, app_env.key_b, prompt)) == 32    # B's own repeat hits
    assert _cached(_complete(app_env, app_env.key_a, prompt)) == 32    # A unaffected by B


def test_client_cache_salt_splits_a_tenant_and_cannot_reach_another(app_env):
    prompt = [4322] + list(range(11000, 11047))
    a = app_env.key_a
    assert _cached(_complete(app_env, a, prompt, cache_salt="user-1")) == 0
    assert _cached(_complete(app_env, a, prompt, cache_salt="user-1")) == 32
    assert _cached(_complete(app_env, a, prompt, cache_salt="user-2")) == 0
    assert _cached(_complete(app_env, a, prompt)) == 0
    # Tenant B with A's client salt is still in B's namespace.
    assert _cached(_complete(app_env, app_env.key_b, prompt, cache_salt="user-1")) == 0
    assert _cached(_complete(app_env, app_env.key_b, prompt, cache_salt="user-1")) == 32


def test_chat_completion_and_stream_agree(app_env):
    body = {"model": app_env.model, "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Name three colors."}]}
    h = app_env.headers(app_env.key_a)
    r = app_env.client.post("/v1/chat/completions", json=body, headers=h)
    assert r.status_code == 200, r.text
    full = r.json()
    assert full["object"] == "chat.completion"
    text = full["choices"][0]["message"]["content"]
    assert text and full["choices"][0]["finish_reason"] in ("stop", "length")
    usage = full["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with app_env.client.stream("POST", "/v1/chat/completions", json=stream_body,
                               headers=h) as s:
        assert s.status_code == 200
        assert s.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage_chunks = [c for c in chunks if c["usage"] is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert usage_chunks[0]["choices"] == []
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert streamed == text
    final = usage_chunks[0]["usage"]
    assert final["completion_tokens"] == usage["completion_tokens"]
    # The repeat shares the whole prompt except the partial last block.
    assert final["prompt_tokens_details"]["cached_tokens"] == 16 * ((usage["prompt_tokens"] - 1)
                                                                    // 16)


def test_stop_string_and_n(app_env):
    """Stop strings (matched across token boundaries by the detokenizer, OpenAI semantics: the
    stop text is not returned) and n > 1, on the fake model's word stream."""
    h = app_env.headers(app_env.key_a)
    body = {"model": app_env.model, "prompt": "Count: 1, 2, 3, 4,", "max_tokens": 20,
            "temperature": 0}
    plain = app_env.client.post("/v1/completions", json=body, headers=h).json()
    text = plain["choices"][0]["text"]
    words = text.split()
    stop = " " + words[3]  # a word of the completion, not at its start
    assert text.index(stop) > 0
    stopped = app_env.client.post("/v1/completions", json={**body, "stop": [stop]},
                                  headers=h).json()
    assert stopped["choices"][0]["text"] == text[:text.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] < plain["usage"]["completion_tokens"]

    r = app_env.client.post("/v1/completions", json={**body, "n": 3, "max_tokens": 4},
                            headers=h).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["completion_tokens"] == 12


def test_seeded_sampling_with_n_is_reproducible_on_the_real_model(real_app_env):
    """Seeds reach the real sampler: the same seeded n=2 call gives the same two texts, and
    choice i samples with seed + i (vLLM), so the two choices differ."""
    env = real_app_env
    h = env.headers(env.key_a)
    sampled = {"model": env.model, "prompt": "Once upon a time", "max_tokens": 8,
               "temperature": 1.0, "top_p": 0.9, "seed": 1234, "n": 2}
    r1 = env.client.post("/v1/completions", json=sampled, headers=h).json()
    r2 = env.client.post("/v1/completions", json=sampled, headers=h).json()
    texts = [c["text"] for c in r1["choices"]]
    assert texts == [c["text"] for c in r2["choices"]]
    assert texts[0] != texts[1]
    assert [c["index"] for c in r1["choices"]] == [0, 1]
    assert 2 <= r1["usage"]["completion_tokens"] <= 16


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "temperature": 3}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": [1, 2, 999999]}, "prompt"),
    ({"prompt": list(range(600))}, "prompt"),
    ({"prompt": list(range(500)), "max_tokens": 100}, "max_tokens"),
    ({"prompt": "hi", "cache_salt": ""}, "cache_salt"),
    ({"prompt": "hi", "cache_salt": "x" * 129}, "cache_salt"),
    ({"prompt": ""}, "prompt"),
])
def test_bad_completion_requests_get_400_with_param_and_change_nothing(app_env, body, param):
    body = {"model": app_env.model, **body}
    r = app_env.client.post("/v1/completions", json=body, headers=app_env.headers(app_env.key_a))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert err["type"] == "invalid_request_error" and err["message"]
    assert "Traceback" not in r.text
    free, total = _engine_state(app_env)
    assert free == total


def test_rejected_request_is_recorded_as_error_usage(app_env):
    before = len([u for u in app_env.repo.usage.list_usage(app_env.tenant_b) if u.status == "error"])
    r = app_env.client.post("/v1/completions", headers=app_env.headers(app_env.key_b),
                            json={"model": "not-a-model", "prompt": [1, 2, 3]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    deadline = time.time() + 5
    while time.time() < deadline:
        errors = [u for u in app_env.repo.usage.list_usage(app_env.tenant_b) if u.status == "error"]
        if len(errors) > before:
            break
        time.sleep(0.05)
    assert len(errors) == before + 1
    # The model is checked before the prompt is tokenised: no prompt tokens are counted.
    assert (errors[-1].prompt_tokens, errors[-1].completion_tokens, errors[-1].cached_tokens) \
        == (0, 0, 0)


def test_bad_chat_requests_and_auth(app_env):
    c, h = app_env.client, app_env.headers(app_env.key_a)
    r = c.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
               headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = c.post("/v1/chat/completions", json={"model": app_env.model, "messages": []}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    long = {"model": app_env.model, "messages": [{"role": "user", "content": "word " * 700}]}
    r = c.post("/v1/chat/completions", json=long, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert r.json()["error"]["code"] == "context_length_exceeded"
    ok = {"model": app_env.model, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"Authorization": "Bearer nope"},
                    {"Authorization": app_env.headers(app_env.key_a)["Authorization"] + "x"}):
        r = c.post("/v1/chat/completions", json=ok, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert c.get("/v1/models").status_code == 401
    r = c.post("/v1/completions", content=b"x" * (5 << 20), headers=h)
    assert r.status_code == 413 and "error" in r.json()
    lone_surrogate = ('{"model": "' + app_env.model + '", "prompt": "a\\ud800b"}').encode()
    r = c.post("/v1/completions", content=lone_surrogate,
               headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    free, total = _engine_state(app_env)
    assert free == total


def test_models_health_and_usage_records(app_env):
    c = app_env.client
    assert c.get("/health").json() == {"status": "ok"}
    models = c.get("/v1/models", headers=app_env.headers(app_env.key_b)).json()
    assert [m["id"] for m in models["data"]] == [app_env.model]
    prompt = [4323] + list(range(12000, 12040))
    _complete(app_env, app_env.key_b, prompt)
    resp = _complete(app_env, app_env.key_b, prompt)
    deadline = time.time() + 5
    while time.time() < deadline:  # usage is written off the request path
        rows = [u for u in app_env.repo.usage.list_usage(app_env.tenant_b)
                if u.request_id == resp["id"]]
        if rows:
            break
        time.sleep(0.05)
    assert len(rows) == 1
    row = rows[0]
    assert (row.status, row.prompt_tokens, row.cached_tokens, row.completion_tokens) == \
        ("ok", 41, 32, 1)
    assert row.ttft_s is not None and 0 < row.ttft_s <= row.latency_s


def test_abandoned_stream_is_aborted_and_frees_its_blocks(app_env):
    from engine.request import EngineRequest
    from engine.sampling_params import SamplingParams

    async def take_one_then_leave():
        req = EngineRequest("abandon-1", tuple(range(100, 160)),
                            SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
                            tenant_id=app_env.tenant_a)
        stream = app_env.engine.generate(req)
        first = await stream.__anext__()
        await stream.aclose()  # what a client disconnect does to the route's iterator
        return first

    first = app_env.client.portal.call(take_one_then_leave)
    assert not first.finished and len(first.new_token_ids) == 1
    deadline = time.time() + 10
    while time.time() < deadline:
        free, total = _engine_state(app_env)
        if free == total:
            break
        time.sleep(0.05)
    assert free == total
    assert not app_env.on_engine_thread(lambda e: e.has_unfinished_requests())


def test_n_choices_share_one_prefill_even_with_caching_off(app_env):
    """n=8 for a tenant with prefix caching off computes the prompt once (plus each choice's
    partial last block), not 8 times; nothing of it stays cached, no other tenant is touched,
    and the prompt is billed once."""
    env = app_env
    t = env.repo.tenants.create("no-cache-n")
    env.repo.tenants.update(t.id, enable_prefix_caching=False)
    key, _ = env.repo.keys.create(t.id)
    prompt = [(13 * i) % 30000 + 700 for i in range(100)]   # 6 full blocks + 4 tokens
    body = {"model": env.model, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True}

    def cached_blocks() -> int:
        return env.on_engine_thread(lambda core: core.block_pool.get_num_cached_blocks())

    before_blocks = cached_blocks()
    computed = env.fake.tokens_computed
    r = env.client.post("/v1/completions", json={**body, "n": 8}, headers=env.headers(key))
    assert r.status_code == 200, r.text
    shared = env.fake.tokens_computed - computed
    assert len(r.json()["choices"]) == 8
    assert r.json()["usage"]["prompt_tokens"] == 100
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # 100 prompt tokens once + 7 x 4 tail tokens, + 8 x 1 decode step (max_tokens 2).
    assert shared == 100 + 7 * 4 + 8
    computed = env.fake.tokens_computed
    for _ in range(2):  # the same prompt again, n=1: nothing of it was left cached
        one = env.client.post("/v1/completions", json=body, headers=env.headers(key)).json()
        assert one["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert env.fake.tokens_computed - computed == 2 * (100 + 1)
    assert cached_blocks() == before_blocks
    free, total, busy = env.engine_state()
    assert free == total and not busy
