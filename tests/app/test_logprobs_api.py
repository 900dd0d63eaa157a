"""Logprobs, echo scoring and sampling defaults through the API on the real bundled model."""

from __future__ import annotations

import json
import math

import pytest
import torch

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _post(env, path: str, body: dict):
    r = env.client.post(path, json={"model": env.model, **body}, headers=env.headers(env.key_a))
    assert r.status_code == 200, r.text
    return r


def test_chat_logprobs_are_consistent_and_streaming_agrees(real_app_env):
    body = {"messages": CHAT, "max_tokens": 12, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}
    full = _post(real_app_env, "/v1/chat/completions", body).json()
    choice = full["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == full["usage"]["completion_tokens"]
    # Greedy: each token is its position's most likely one; the alternatives are sorted.
    for t in content:
        assert t["top_logprobs"][0]["token"] == t["token"]
        assert t["top_logprobs"][0]["logprob"] == pytest.approx(t["logprob"])
        values = [a["logprob"] for a in t["top_logprobs"]]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert bytes(t["bytes"]).decode("utf-8", errors="replace") == t["token"]
    text = "".join(t["token"] for t in content)
    assert text.startswith(choice["message"]["content"])  # the eos token's text may follow
    s = real_app_env.client.post("/v1/chat/completions", json={
        "model": real_app_env.model, **body, "stream": True},
        headers=real_app_env.headers(real_app_env.key_a))
    streamed = []
    for line in s.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                if c.get("logprobs"):
                    streamed.extend(c["logprobs"]["content"])
    assert [t["token"] for t in streamed] == [t["token"] for t in content]
    assert [t["logprob"] for t in streamed] == pytest.approx([t["logprob"] for t in content],
                                                             abs=1e-4)


def test_echo_scores_match_hugging_face_cold_and_warm(real_app_env, hf_model, tokenizer):
    prompt = ("The capital of France is Paris. The capital of Italy is Rome. The capital of "
              "Spain is Madrid.")
    ids = tokenizer.encode(prompt)
    assert len(ids) > 16  # at least one full block to cache
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)
    expected = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
    body = {"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 2}
    for _ in ("cold", "warm"):  # the second call's prefix is cached; scores are recomputed
        r = _post(real_app_env, "/v1/completions", body).json()
        lp = r["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None
        assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], expected)) < 1e-4
        assert r["usage"]["completion_tokens"] == 0
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # A plain repeat of the same prompt does hit the cache.
    plain = _post(real_app_env, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    total = sum(expected)
    assert math.isfinite(total) and total < 0


def test_omitted_sampling_fields_take_the_models_recommended_defaults(real_app_env):
    assert real_app_env.engine.model_info().default_sampling == {"temperature": 0.2,
                                                                 "top_p": 0.9}
    seeded = {"messages": CHAT, "max_tokens": 16, "seed": 7}
    omitted = _post(real_app_env, "/v1/chat/completions", seeded).json()
    explicit = _post(real_app_env, "/v1/chat/completions",
                     {**seeded, "temperature": 0.2, "top_p": 0.9}).json()
    assert omitted["choices"][0]["message"]["content"] == \
        explicit["choices"][0]["message"]["content"]
    assert "Paris" in omitted["choices"][0]["message"]["content"]
