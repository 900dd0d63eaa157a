"""Through the real server (fake model, real scheduler and pool): a tenant flooding the KV pool
with concurrent prompts does not make another tenant's small requests wait for the flood to
drain. The small requests are admitted within their tenant's share of the pool, preempting the
flooder's newest requests; the flooder's requests all still complete."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest


@pytest.fixture()
def env(app_env_builder, tmp_path):
    # 24 blocks of 16 tokens; B's requests take 5-7 blocks each, so 6 of them overfill it
    with app_env_builder(tmp_path, num_gpu_blocks_override=24, max_model_len=256) as env:
        env.fake.step_delay_s = 0.005  # requests stay in flight for a while
        yield env


def _flood(env, stop: threading.Event, results: list) -> None:
    i = 0
    while not stop.is_set():
        i += 1
        r = env.client.post("/v1/completions", headers=env.headers(env.key_b), json={
            "model": env.model, "prompt": f"flood {threading.get_ident()} {i} " + "word " * 60,
            "max_tokens": 30, "ignore_eos": True})
        results.append(r.status_code)


def _b_running(env) -> int:
    return env.on_engine_thread(lambda core: sum(
        1 for r in core.scheduler.running if r.tenant_id == env.tenant_b))


def test_a_light_tenant_is_admitted_beside_a_flood_that_holds_the_pool(env):
    stop, flood_codes = threading.Event(), []
    with ThreadPoolExecutor(6) as pool:
        for _ in range(6):
            pool.submit(_flood, env, stop, flood_codes)
        try:
            for _ in range(400):  # until the flood holds the pool with several requests
                if _b_running(env) >= 3 and env.on_engine_thread(
                        lambda core: core.block_pool.get_num_free_blocks()) < 3:
                    break
                threading.Event().wait(0.01)
            else:
                pytest.fail("the flood never filled the pool")
            steps = []
            for i in range(3):
                before = env.fake.steps
                r = env.client.post("/v1/completions", headers=env.headers(env.key_a), json={
                    "model": env.model, "prompt": f"light question {i}", "max_tokens": 8,
                    "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 8
                steps.append(env.fake.steps - before)
            assert _b_running(env) >= 1  # the flood was in flight all along
        finally:
            stop.set()
    # One prefill and 7 decodes each, plus the steps in flight when it arrived: never a wait for
    # the flood's requests (30 tokens each) to finish and free their blocks.
    assert max(steps) <= 12, steps
    stats = env.on_engine_thread(lambda core: core.scheduler.stats)
    assert stats.num_share_preemptions >= 1
    assert flood_codes and set(flood_codes) == {200}  # preempted requests still complete
    # every flood thread got its last answer: nothing left in the engine, every block free
    assert env.on_engine_thread(lambda core: (core.has_unfinished_requests(),
                                              core.block_pool.get_num_free_blocks())) == (False, 24)
