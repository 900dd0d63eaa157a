"""No OpenAI field is silently ignored: every field of the chat completions and completions
references is accepted with an effect that is checked here, or refused with 400
``unsupported_parameter`` naming it; unknown fields are refused the same way.

Effects are checked on what reaches the engine (the ``SamplingParams`` of the submitted
requests: the sampler's own semantics are tested in tests/engine) or on the response and the
usage row. Runs on the fake model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from app.protocol import ChatCompletionRequest, CompletionRequest

# The request fields of the OpenAI API reference (chat completions; legacy completions).
OPENAI_CHAT_FIELDS = {
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
    "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities",
    "n", "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
    "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop",
    "store", "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs",
    "top_p", "user", "verbosity", "web_search_options"}
OPENAI_COMPLETION_FIELDS = {
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user"}
# vLLM extensions we implement (docs/api.md).
VLLM_FIELDS = {"top_k", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
               "skip_special_tokens", "prompt_logprobs", "return_tokens_as_token_ids",
               "cache_salt"}


@dataclass
class Seen:
    """What one call produced: its HTTP response and the engine requests it submitted."""

    status: int
    body: dict
    text: str
    requests: list

    @property
    def params(self):
        return self.requests[0].sampling_params


@pytest.fixture
def send(app_env, monkeypatch) -> Callable[..., Seen]:
    submitted: list = []
    real = app_env.engine.add_request

    def spy(req):
        submitted.append(req)
        return real(req)

    monkeypatch.setattr(app_env.engine, "add_request", spy)

    def post(path: str, body: dict, key: str | None = None) -> Seen:
        submitted.clear()
        r = app_env.client.post(path, json={"model": app_env.model, **body},
                                headers=app_env.headers(key or app_env.key_a))
        try:
            parsed = r.json()
        except ValueError:
            parsed = {}
        return Seen(r.status_code, parsed, r.text, list(submitted))

    return post


def _stored(env, request_id: str):
    return env.usage_row(env.tenant_a, request_id)


def _stored_end_user(env, request_id: str) -> str | None:
    return _stored(env, request_id).end_user


CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def _prompt_text(seen: Seen, env) -> str:
    return env.engine.model_info().tokenizer.decode(seen.requests[0].prompt_token_ids)
PROMPT = {"prompt": "The sky is", "max_tokens": 4}


def _sse_events(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# field -> (extra body, check(seen, env)). Each check asserts the field's effect.
CHAT_ACCEPTED: dict[str, tuple[dict, Callable]] = {
    "messages": ({}, lambda s, e: s.requests[0].prompt_token_ids),
    "model": ({}, lambda s, e: s.body["model"] == e.model),
    "frequency_penalty": ({"frequency_penalty": 0.5},
                          lambda s, e: s.params.frequency_penalty == 0.5),
    "presence_penalty": ({"presence_penalty": -0.5},
                         lambda s, e: s.params.presence_penalty == -0.5),
    "logit_bias": ({"logit_bias": {"42": 3.0}}, lambda s, e: s.params.logit_bias == {42: 3.0}),
    "logprobs": ({"logprobs": True}, lambda s, e: len(
        s.body["choices"][0]["logprobs"]["content"]) == s.body["usage"]["completion_tokens"]),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 2}, lambda s, e: all(
        len(t["top_logprobs"]) == 2 for t in s.body["choices"][0]["logprobs"]["content"])),
    "max_completion_tokens": ({"max_completion_tokens": 3, "ignore_eos": True},
                              lambda s, e: s.body["usage"]["completion_tokens"] == 3),
    "max_tokens": ({"max_tokens": 2, "ignore_eos": True},
                   lambda s, e: s.body["usage"]["completion_tokens"] == 2),
    "modalities": ({"modalities": ["text"]}, lambda s, e: s.body["choices"][0]["message"]),
    "n": ({"n": 3}, lambda s, e: [c["index"] for c in s.body["choices"]] == [0, 1, 2]),
    "response_format": ({"response_format": {"type": "json_object"}}, lambda s, e: (
        s.params.structured_output.kind == "json_object"
        and all(r.grammar is not None for r in s.requests))),
    "safety_identifier": ({"safety_identifier": "end-user-7"},
                          lambda s, e: _stored_end_user(e, s.body["id"]) == "end-user-7"),
    "user": ({"user": "end-user-8"},
             lambda s, e: _stored_end_user(e, s.body["id"]) == "end-user-8"),
    "seed": ({"seed": 99}, lambda s, e: s.params.seed == 99),
    "service_tier": ({"service_tier": "auto"}, lambda s, e: s.body["service_tier"] == "default"),
    "stop": ({"stop": ["zz", "yy"]}, lambda s, e: s.params.stop == ("zz", "yy")),
    "store": ({"store": False}, lambda s, e: s.status == 200),
    "stream": ({"stream": True}, lambda s, e: _sse_events(s.text)[0]["object"]
               == "chat.completion.chunk"),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}},
                       lambda s, e: _sse_events(s.text)[-1]["usage"]["completion_tokens"] > 0),
    "temperature": ({"temperature": 0.7}, lambda s, e: s.params.temperature == 0.7),
    "top_p": ({"top_p": 0.5}, lambda s, e: s.params.top_p == 0.5),
    "tools": ({"tools": [WEATHER]}, lambda s, e: "get_weather" in _prompt_text(s, e)),
    "tool_choice": ({"tools": [WEATHER], "tool_choice": "required"},
                    lambda s, e: all(r.grammar is not None for r in s.requests)),
    "parallel_tool_calls": ({"tools": [WEATHER], "parallel_tool_calls": False},
                            lambda s, e: "Call at most one function." in _prompt_text(s, e)),
    "prompt_cache_key": ({"prompt_cache_key": "team-1"}, lambda s, e: s.requests[0].cache_salt
                         not in (None, _tenant_salt(e))
                         and _stored(e, s.body["id"]).prompt_cache_key == "team-1"),
    # The fake engine has no offload tier: "in_memory" is what any call gets ("24h" is a 400,
    # tests/app/test_prompt_cache_retention.py).
    "prompt_cache_retention": ({"prompt_cache_retention": "in_memory"},
                               lambda s, e: not s.requests[0].offload),
}
# Refused whatever their value (a value equal to the default is accepted: store false,
# modalities ["text"]; those refusals are the values below).
CHAT_REFUSED: dict[str, object] = {
    "audio": {"voice": "alloy", "format": "wav"},
    "function_call": "auto",
    "functions": [{"name": "f", "parameters": {}}],
    "metadata": {"k": "v"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "store": True,
    "verbosity": "low",
    "web_search_options": {},
}

COMPLETION_ACCEPTED: dict[str, tuple[dict, Callable]] = {
    "model": ({}, lambda s, e: s.body["model"] == e.model),
    "prompt": ({}, lambda s, e: s.body["usage"]["prompt_tokens"] == 3),
    "best_of": ({"best_of": 2, "n": 2}, lambda s, e: len(s.body["choices"]) == 2),
    "echo": ({"echo": True}, lambda s, e: s.body["choices"][0]["text"].startswith("The sky is")),
    "frequency_penalty": ({"frequency_penalty": 1.5},
                          lambda s, e: s.params.frequency_penalty == 1.5),
    "presence_penalty": ({"presence_penalty": 1.0},
                         lambda s, e: s.params.presence_penalty == 1.0),
    "logit_bias": ({"logit_bias": {"7": -100}}, lambda s, e: s.params.logit_bias == {7: -100}),
    "logprobs": ({"logprobs": 2}, lambda s, e: all(
        len(t) >= 2 for t in s.body["choices"][0]["logprobs"]["top_logprobs"])),
    "max_tokens": ({"max_tokens": 2, "ignore_eos": True},
                   lambda s, e: s.body["usage"]["completion_tokens"] == 2),
    "n": ({"n": 2}, lambda s, e: [c["index"] for c in s.body["choices"]] == [0, 1]),
    "seed": ({"seed": 5}, lambda s, e: s.params.seed == 5),
    "stop": ({"stop": "zz"}, lambda s, e: s.params.stop == ("zz",)),
    "stream": ({"stream": True}, lambda s, e: _sse_events(s.text)[0]["object"]
               == "text_completion"),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}},
                       lambda s, e: _sse_events(s.text)[-1]["usage"]["prompt_tokens"] == 3),
    "temperature": ({"temperature": 0.0}, lambda s, e: s.params.greedy),
    "top_p": ({"top_p": 0.25}, lambda s, e: s.params.top_p == 0.25),
    "user": ({"user": "u-1"}, lambda s, e: _stored_end_user(e, s.body["id"]) == "u-1"),
}
# OpenAI documents these on chat completions; legacy completions take them too (a prompt
# cache is not a chat feature).
COMPLETION_EXTRAS: dict[str, tuple[dict, Callable]] = {
    "prompt_cache_key": ({"prompt_cache_key": "team-1"},
                         lambda s, e: _stored(e, s.body["id"]).prompt_cache_key == "team-1"),
    "prompt_cache_retention": ({"prompt_cache_retention": "in_memory"},
                               lambda s, e: not s.requests[0].offload),
}
COMPLETION_REFUSED: dict[str, object] = {"suffix": "!", "best_of": 3}

VLLM_ACCEPTED: dict[str, tuple[dict, Callable]] = {
    "top_k": ({"top_k": 5}, lambda s, e: s.params.top_k == 5),
    "repetition_penalty": ({"repetition_penalty": 1.3},
                           lambda s, e: s.params.repetition_penalty == 1.3),
    "min_tokens": ({"min_tokens": 2}, lambda s, e: s.params.min_tokens == 2),
    "stop_token_ids": ({"stop_token_ids": [5, 6]},
                       lambda s, e: s.params.stop_token_ids == (5, 6)),
    "ignore_eos": ({"ignore_eos": True}, lambda s, e: s.params.ignore_eos),
    "skip_special_tokens": ({"skip_special_tokens": False},
                            lambda s, e: not s.params.skip_special_tokens),
    "prompt_logprobs": ({"prompt_logprobs": 1}, lambda s, e: (
        s.body["choices"][0]["prompt_logprobs"][0] is None
        and len(s.body["choices"][0]["prompt_logprobs"]) == 3)),
    "return_tokens_as_token_ids": ({"return_tokens_as_token_ids": True, "logprobs": 0},
                                   lambda s, e: all(t.startswith("token_id:") for t in
                                                    s.body["choices"][0]["logprobs"]["tokens"])),
    "cache_salt": ({"cache_salt": "user-1"}, lambda s, e: s.requests[0].cache_salt
                   not in (None, _tenant_salt(e))),
}


def _tenant_salt(env) -> bytes:
    """Tenant A's effective salt without a client cache_salt (read from a plain call)."""
    captured = []
    spy = env.engine.add_request
    env.engine.add_request = lambda req: captured.append(req) or spy(req)
    try:
        r = env.client.post("/v1/completions", json={"model": env.model, **PROMPT},
                            headers=env.headers(env.key_a))
        assert r.status_code == 200
    finally:
        env.engine.add_request = spy
    return captured[0].cache_salt


def test_every_reference_field_is_classified():
    assert set(CHAT_ACCEPTED) | set(CHAT_REFUSED) == OPENAI_CHAT_FIELDS
    assert set(CHAT_ACCEPTED) & set(CHAT_REFUSED) == {"modalities", "store"}
    assert set(COMPLETION_ACCEPTED) | set(COMPLETION_REFUSED) == OPENAI_COMPLETION_FIELDS
    assert set(VLLM_ACCEPTED) == VLLM_FIELDS
    # Every field our request models declare is an OpenAI field or a listed vLLM extension: a
    # field added later without an entry here fails.
    assert set(ChatCompletionRequest.model_fields) <= OPENAI_CHAT_FIELDS | VLLM_FIELDS
    assert set(CompletionRequest.model_fields) <= (OPENAI_COMPLETION_FIELDS | VLLM_FIELDS
                                                   | set(COMPLETION_EXTRAS))


ACCEPTED = ([("/v1/chat/completions", CHAT, CHAT_ACCEPTED, f) for f in sorted(CHAT_ACCEPTED)]
            + [("/v1/completions", PROMPT, COMPLETION_ACCEPTED, f)
               for f in sorted(COMPLETION_ACCEPTED)]
            + [("/v1/completions", PROMPT, COMPLETION_EXTRAS, f)
               for f in sorted(COMPLETION_EXTRAS)]
            + [("/v1/completions", PROMPT, VLLM_ACCEPTED, f) for f in sorted(VLLM_ACCEPTED)])


@pytest.mark.parametrize(("path", "base", "table", "field"), ACCEPTED,
                         ids=[f"{p.rsplit('/', 1)[1]}-{f}" for p, _, _, f in ACCEPTED])
def test_field_is_accepted_with_its_effect(send, app_env, path, base, table, field):
    extra, check = table[field]
    seen = send(path, {**base, **extra})
    assert seen.status == 200, seen.text
    assert check(seen, app_env), field


def _assert_unsupported(seen: Seen, param: str) -> None:
    assert seen.status == 400, seen.text
    err = seen.body["error"]
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "unsupported_parameter"
    assert err["param"] == param
    assert "unsupported" in err["message"]
    assert seen.requests == []  # nothing reached the engine


@pytest.mark.parametrize("field", sorted(CHAT_REFUSED))
def test_chat_field_is_refused_naming_it(send, field):
    _assert_unsupported(send("/v1/chat/completions", {**CHAT, field: CHAT_REFUSED[field]}),
                        field)


@pytest.mark.parametrize("field", sorted(COMPLETION_REFUSED))
def test_completion_field_is_refused_naming_it(send, field):
    _assert_unsupported(send("/v1/completions", {**PROMPT, field: COMPLETION_REFUSED[field]}),
                        field)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {**PROMPT, "min_p": 0.1}, "min_p"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x",
                                                   "weight": 2}]}, "messages.0.weight"),
    ("/v1/chat/completions", {**CHAT, "stream": True,
                              "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x"),
])
def test_unknown_fields_are_refused_not_ignored(send, path, body, param):
    _assert_unsupported(send(path, body), param)


def test_non_text_content_parts_are_refused_saying_text_only(send):
    for part in ({"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                 {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}):
        seen = send("/v1/chat/completions", {**CHAT, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]})
        _assert_unsupported(seen, "messages.0.content")
        assert "text only" in seen.body["error"]["message"]


def test_tool_fields_are_checked(send):
    other = {"type": "function", "function": {"name": "other"}}
    for body in ({"tool_choice": "auto"}, {"parallel_tool_calls": True},
                 {"tools": [WEATHER, WEATHER]},
                 {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                      "function": {"name": "nope"}}},
                 {"tools": [WEATHER], "response_format": {"type": "json_object"}},
                 {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
                 {"tools": [other] * 129}):
        seen = send("/v1/chat/completions", {**CHAT, **body})
        assert seen.status == 400, (body, seen.text)
        assert seen.requests == []
    # tool_choice none with tools: accepted, tools not offered, no grammar.
    seen = send("/v1/chat/completions", {**CHAT, "tools": [WEATHER], "tool_choice": "none"})
    assert seen.status == 200 and seen.requests[0].grammar is None


def test_bad_field_values_are_400_with_param(send):
    for body, param in (({"logprobs": 6}, "logprobs"),
                        ({"logit_bias": {"x": 1}}, "logit_bias"),
                        ({"logit_bias": {"5": 101}}, "logit_bias"),
                        ({"logit_bias": {"999999": 1}}, "logit_bias"),
                        ({"stop_token_ids": [-1]}, "stop_token_ids"),
                        ({"min_tokens": 9}, "min_tokens"),
                        ({"max_tokens": 0}, "max_tokens"),
                        ({"prompt": ["a"] * 33}, "prompt"),
                        ({"prompt": ["a", "b", "c", "d", "e"], "n": 16}, "prompt"),
                        ({"user": "u" * 257}, "user"),
                        ({"user": "\u0000x"}, "user"),
                        ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),
                        ({"stream_options": {"include_usage": True}}, "stream_options"),
                        ({"stop_token_ids": list(range(257))}, "stop_token_ids")):
        seen = send("/v1/completions", {**PROMPT, **body})
        assert seen.status == 400, (body, seen.text)
        assert seen.body["error"]["param"] == param, (body, seen.body)
        assert seen.requests == []
    seen = send("/v1/chat/completions", {**CHAT, "top_logprobs": 2})
    assert seen.status == 400 and seen.body["error"]["param"] == "top_logprobs"
    for body in ({"safety_identifier": "a\nb"},
                 {"min_tokens": 2, "response_format": {"type": "json_object"}},
                 {"min_tokens": 2, "tools": [WEATHER]},
                 {"response_format": {"type": "json_schema", "json_schema": {
                     "name": "x", "description": "d", "schema": {"type": "object"}}}},
                 {"response_format": {"type": "json_schema", "json_schema": {
                     "name": "x", "schema": {"type": "no-such-type"}}}}):
        seen = send("/v1/chat/completions", {**CHAT, **body})
        assert seen.status == 400, (body, seen.text)
        assert seen.requests == []
    for grammar in ({"response_format": {"type": "json_object"}}, {"tools": [WEATHER]}):
        seen = send("/v1/chat/completions", {**CHAT, "min_tokens": 2, **grammar})
        assert seen.body["error"]["param"] == "min_tokens", seen.text  # one rule, one place
    r = send("/tokenize", {"messages": CHAT["messages"], "add_special_tokens": True})
    assert r.status == 400 and r.body["error"]["code"] == "unsupported_parameter"


def test_prompt_cache_key_partitions_the_tenants_cache(send, app_env):
    """Same key: the same effective salt (its prefixes shared; the repeat hits); another key,
    no key, or the key with a cache_salt: each another partition. A key over 1,024 characters
    is a 400 naming it, and nothing reaches the engine."""
    def salt(**extra):
        seen = send("/v1/chat/completions", {**CHAT, **extra})
        assert seen.status == 200, seen.text
        return seen.requests[0].cache_salt, seen.body["usage"]

    a, _ = salt(prompt_cache_key="team-1")
    again, usage = salt(prompt_cache_key="team-1")
    assert again == a and usage["prompt_tokens_details"]["cached_tokens"] > 0
    others = [salt(prompt_cache_key="team-2")[0], salt()[0],
              salt(prompt_cache_key="team-1", cache_salt="u")[0], salt(cache_salt="u")[0]]
    assert len({a, *others}) == 5
    seen = send("/v1/chat/completions", {**CHAT, "prompt_cache_key": "k" * 1025})
    assert seen.status == 400 and seen.body["error"]["param"] == "prompt_cache_key"
    assert seen.requests == []
