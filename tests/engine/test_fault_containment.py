"""Fault containment (DESIGN "Multi-tenant capacity", ``engine/faults.py``): a fault in one
request's block allocation, logits, sampling, stop checks or detokenisation fails that request
alone; a failed batched forward fails that step's requests and drops the prefix-cache entries of
the blocks it was writing; ``max_consecutive_step_failures`` failed forwards in a row kill the
engine. Engine level over the fake model (``tests/fake_engine.py``: real scheduler, block pool and
prefix cache), plus the HTTP view of a failed request. No production module installs an injector.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
from fake_engine import make_fake_llm_engine

import engine.faults
from engine.errors import EngineDeadError
from engine.faults import FAULT_POINTS, fire, inject
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput

REPO_ROOT = Path(__file__).resolve().parents[2]
BS = 16  # EngineConfig's default block_size, which the fake engine keeps

# The client-safe reason each fault point yields (no token ids, no prompt, no exception text).
PER_REQUEST_REASONS = {
    "allocate": "the request failed while its KV blocks were allocated",
    "logits": "sampling failed for this request",
    "sample": "sampling failed for this request",
    "stop": "the request failed in its stop checks",
    "detokenize": "detokenisation failed for this request",
}
STEP_FAILED_REASON = "the engine step computing this request failed"


class InjectedFault(RuntimeError):
    pass


@pytest.fixture(autouse=True)
def _no_injector_left_over() -> Iterator[None]:
    assert engine.faults._injector is None  # nothing installed one at import or by a test
    yield
    assert engine.faults._injector is None


# -- helpers ---------------------------------------------------------------------------------
@dataclass
class Result:
    tokens: list[int]
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    num_finished_outputs: int = 0
    num_output_tokens: int = 0  # as reported by the last output (what usage bills)


def _req(rid: str, tenant: str, prompt: tuple[int, ...], max_tokens: int = 6) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                     ignore_eos=True),
                         tenant_id=tenant, cache_salt=f"salt-{tenant}".encode())


def _prompt(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def _add(engine: LLMEngine, results: dict[str, Result], reqs: list[EngineRequest]) -> None:
    for r in reqs:
        engine.add_request(r)
        results[r.request_id] = Result([])


def _step(engine: LLMEngine, results: dict[str, Result]) -> list:
    outputs = engine.step()
    for out in outputs:
        r = results[out.request_id]
        assert r.num_finished_outputs == 0, f"{out.request_id} got output after finishing"
        r.tokens.extend(out.new_token_ids)
        r.text += out.new_text
        r.num_cached_tokens = out.num_cached_tokens
        r.num_output_tokens = out.num_output_tokens
        if out.finished:
            r.finish_reason, r.error = out.finish_reason, out.error
            r.num_finished_outputs += 1
    engine.kv_cache_manager.check_integrity()
    return outputs


def _drive(engine: LLMEngine, results: dict[str, Result], max_steps: int = 100) -> int:
    """Steps until idle; returns the steps taken."""
    steps = 0
    while engine.has_unfinished_requests():
        _step(engine, results)
        steps += 1
        assert steps < max_steps, "engine not idle"
    return steps


def _assert_clean(engine: LLMEngine) -> None:
    """Nothing of any request is left: no blocks pinned, no state, no pending failure."""
    kv, pool, sched = engine.kv_cache_manager, engine.block_pool, engine.scheduler
    kv.check_integrity()
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert pool.num_used_blocks == 0
    assert sched.requests == {}
    assert sched.running == [] and list(sched.waiting) == []
    assert sched.failed == []
    assert sched.num_unfinished == {} and sched.vtime == {}
    assert engine.detokenizers == {}
    assert kv.req_to_blocks == {} and kv.num_cached_block == {}
    engine.stats_snapshot().check_integrity()


def _capture_schedules(engine: LLMEngine) -> list[SchedulerOutput]:
    """Records every ``SchedulerOutput`` the engine runs (to know who a failed step held)."""
    seen: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        seen.append(schedule())
        return seen[-1]

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return seen


# -- 1. per-request faults -------------------------------------------------------------------
TARGET = "b1"
# Three tenants, two requests each, prompts of 20..40 tokens; a budget of 48 tokens per step
# makes the prefills chunked and the tenants compete for every step.
WORKLOAD = [("a0", "tenant-a", 1000, 33), ("a1", "tenant-a", 1100, 20),
            ("b0", "tenant-b", 2000, 40), ("b1", "tenant-b", 2100, 27),
            ("c0", "tenant-c", 3000, 24), ("c1", "tenant-c", 3100, 36)]
MAX_TOKENS = 6
ENGINE_KW = {"max_num_batched_tokens": 48}


def _workload() -> list[EngineRequest]:
    return [_req(rid, tenant, _prompt(start, n), MAX_TOKENS) for rid, tenant, start, n in WORKLOAD]


def _per_request_cases() -> list:
    cases = []
    for point in PER_REQUEST_REASONS:
        for which in ("first", "middle", "last"):
            cases.append(pytest.param(point, which, id=f"{point}-{which}"))
    return cases


@pytest.mark.parametrize(("point", "which"), _per_request_cases())
def test_a_per_request_fault_fails_that_request_alone(model_dir, tokenizer, point, which):
    # Baseline: the same workload without a fault; count the target's firings of ``point`` and
    # the tokens it had received before each of them.
    base = make_fake_llm_engine(model_dir, tokenizer, **ENGINE_KW)
    expected: dict[str, Result] = {}
    delivered_at_firing: list[int] = []

    def count(p: str, rid: str | None) -> None:
        if p == point and rid == TARGET:
            delivered_at_firing.append(len(expected[TARGET].tokens))

    with inject(count):
        _add(base, expected, _workload())
        _drive(base, expected)
    _assert_clean(base)
    assert {r.finish_reason for r in expected.values()} == {"length"}
    assert all(len(r.tokens) == MAX_TOKENS for r in expected.values())
    n_firings = len(delivered_at_firing)
    # One logits/sample/stop/detokenize per generated token; at least one allocation per step.
    if point == "allocate":
        assert n_firings > MAX_TOKENS
    else:
        assert n_firings == MAX_TOKENS
    nth = {"first": 1, "middle": (n_firings + 1) // 2, "last": n_firings}[which]

    # The same run with the target's nth firing of ``point`` raising (the exception text holds
    # token ids: none of it may reach the output).
    engine = make_fake_llm_engine(model_dir, tokenizer, **ENGINE_KW)
    results: dict[str, Result] = {}
    fired = [0]
    prompt_text = " ".join(map(str, _prompt(2100, 27)))

    def fault(p: str, rid: str | None) -> None:
        if p == point and rid == TARGET:
            fired[0] += 1
            if fired[0] == nth:
                raise InjectedFault(f"boom on token ids {prompt_text}")

    with inject(fault):
        _add(engine, results, _workload())
        _drive(engine, results)

    assert fired[0] == nth  # the request was gone after its fault
    failed = results.pop(TARGET)
    assert failed.finish_reason == "error"
    assert failed.error == PER_REQUEST_REASONS[point]
    assert not re.search(r"\d", failed.error)
    assert failed.num_finished_outputs == 1
    # It received exactly what it had received before the faulty firing, then the error.
    assert failed.tokens == expected[TARGET].tokens[:delivered_at_firing[nth - 1]]
    assert failed.num_output_tokens == len(failed.tokens)  # only delivered tokens are billed
    assert failed.text == tokenizer.decode(failed.tokens)
    for rid, r in results.items():
        want = expected[rid]
        assert (r.tokens, r.text, r.finish_reason, r.error, r.num_cached_tokens,
                r.num_finished_outputs) == (want.tokens, want.text, "length", None,
                                            want.num_cached_tokens, 1), rid
    _assert_clean(engine)
    stats = engine.stats_snapshot()
    assert stats.evictions["fault"] == 0  # its KV was computed fine: nothing to drop
    assert engine.consecutive_step_failures == 0


def _forward_failing_on(calls_to_fail: set[int]) -> Callable[[str, str | None], None]:
    calls = [0]

    def fault(p: str, rid: str | None) -> None:
        if p == "forward":
            calls[0] += 1
            if calls[0] in calls_to_fail:
                raise InjectedFault(f"forward {calls[0]} failed")

    return fault


# -- 2. one failed forward -------------------------------------------------------------------
X_PROMPT = _prompt(4000, 40)  # 2 full blocks + 8 tokens: 2 blocks hittable on a repeat
Y_PROMPT = _prompt(5000, 24)  # 1 full block + 8 tokens: 1 block hittable on a repeat
V_PROMPT = _prompt(6000, 20)


def _forward_fault_scenario(model_dir, tokenizer, fail_forward: int | None):
    """X (tenant-a) and Y (tenant-b) prefill in 16-token chunks (budget 32, two seats) while V
    (tenant-c) waits for a seat; forward call ``fail_forward`` raises. After that step, Z (X's
    prompt and tenant) and W (Y's prompt and tenant) arrive, and everything runs to the end."""
    engine = make_fake_llm_engine(model_dir, tokenizer, max_num_batched_tokens=32,
                                  max_num_seqs=2)
    schedules = _capture_schedules(engine)
    results: dict[str, Result] = {}
    consecutive = []
    with inject(_forward_failing_on(set() if fail_forward is None else {fail_forward})):
        _add(engine, results, [_req("X", "tenant-a", X_PROMPT), _req("Y", "tenant-b", Y_PROMPT),
                               _req("V", "tenant-c", V_PROMPT)])
        step_outputs = []
        for _ in range(2):
            step_outputs.append(_step(engine, results))
            consecutive.append(engine.consecutive_step_failures)
        _add(engine, results, [_req("Z", "tenant-a", X_PROMPT), _req("W", "tenant-b", Y_PROMPT)])
        step_outputs.append(_step(engine, results))
        consecutive.append(engine.consecutive_step_failures)
        _drive(engine, results)
    return engine, schedules, step_outputs, consecutive, results


def _rows(sched: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens)
            for s in sched.scheduled]


def test_a_failed_forward_fails_its_step_and_drops_the_blocks_it_was_writing(model_dir,
                                                                             tokenizer):
    base, base_scheds, _, base_consecutive, expected = _forward_fault_scenario(
        model_dir, tokenizer, None)
    engine, scheds, step_outputs, consecutive, results = _forward_fault_scenario(
        model_dir, tokenizer, 2)

    # The same two steps were planned in both runs: chunk 1 of X and Y, then X's last 24
    # tokens (block 1 completed, block 2 started) and Y's last 8 (block 1 started).
    for s in (base_scheds, scheds):
        assert _rows(s[0]) == [("X", 0, 16), ("Y", 0, 16)]
        assert _rows(s[1]) == [("X", 16, 24), ("Y", 16, 8)]
    # Step 2 failed: exactly its requests got error outputs, with nothing generated.
    assert [(o.request_id, o.finished, o.finish_reason, o.error, o.new_token_ids,
             o.num_output_tokens) for o in step_outputs[1]] == [
        ("X", True, "error", STEP_FAILED_REASON, (), 0),
        ("Y", True, "error", STEP_FAILED_REASON, (), 0)]
    assert step_outputs[0] == []  # chunked prefill: nothing sampled yet
    assert consecutive[:3] == [0, 1, 0]  # back to 0 after the next (successful) step
    assert base_consecutive == [0, 0, 0]
    for rid in ("X", "Y"):
        assert results[rid].tokens == [] and results[rid].num_finished_outputs == 1
        assert expected[rid].finish_reason == "length"

    # Requests that were not in the failed step, or came after it, complete normally.
    for rid in ("V", "Z", "W"):
        r, want = results[rid], expected[rid]
        assert (r.tokens, r.text, r.finish_reason, r.error, r.num_finished_outputs) == (
            want.tokens, want.text, "length", None, 1), rid
        assert len(r.tokens) == 6
    assert results["Z"].tokens == expected["X"].tokens  # same prompt, same tokens

    # Cache: X's block 1 was completed (and cached) by the failed step: dropped, reason fault.
    # X's block 0 and Y's block 0, computed in step 1, stay hittable. Without the fault Z hits
    # both of X's full blocks.
    assert (expected["Z"].num_cached_tokens, results["Z"].num_cached_tokens) == (2 * BS, 1 * BS)
    assert (expected["W"].num_cached_tokens, results["W"].num_cached_tokens) == (1 * BS, 1 * BS)
    assert (expected["V"].num_cached_tokens, results["V"].num_cached_tokens) == (0, 0)
    stats, base_stats = engine.stats_snapshot(), base.stats_snapshot()
    assert stats.evictions["fault"] == 1 and base_stats.evictions["fault"] == 0
    assert {t: s.evictions["fault"] for t, s in stats.tenants.items()} == {
        "tenant-a": 1, "tenant-b": 0, "tenant-c": 0}
    assert {(c.tenant, c.reason, c.evicted_by, c.num_blocks) for c in stats.eviction_counts} == {
        ("tenant-a", "fault", None, 1)}
    assert stats.tenants["tenant-a"].prefix_cache_hits == 1 * BS
    assert stats.tenants["tenant-b"].prefix_cache_hits == 1 * BS
    _assert_clean(engine)
    _assert_clean(base)


@pytest.mark.parametrize("fail", [False, True], ids=["no-fault", "fault"])
def test_a_failed_forward_spares_running_requests_it_did_not_schedule(model_dir, tokenizer,
                                                                     fail):
    """A budget of one 16-token slice per step alternates between two tenants: X (tenant-a)
    runs step 1, Y (tenant-b) step 2, where the forward fails. X is running but not in that
    step: it completes normally, its cached block stays; only Y's block 0 is dropped."""
    engine = make_fake_llm_engine(model_dir, tokenizer, max_num_batched_tokens=16)
    schedules = _capture_schedules(engine)
    results: dict[str, Result] = {}
    with inject(_forward_failing_on({2} if fail else set())):
        _add(engine, results, [_req("X", "tenant-a", X_PROMPT), _req("Y", "tenant-b", X_PROMPT)])
        _step(engine, results)
        outputs = _step(engine, results)
        assert [_rows(s) for s in schedules] == [[("X", 0, 16)], [("Y", 0, 16)]]
        assert engine.scheduler.requests["X"].status.value == "running"
        if fail:
            assert [(o.request_id, o.finish_reason, o.error) for o in outputs] == [
                ("Y", "error", STEP_FAILED_REASON)]
        else:
            assert outputs == []
        _drive(engine, results)
        _add(engine, results, [_req("X2", "tenant-a", X_PROMPT),
                               _req("Y2", "tenant-b", X_PROMPT)])
        _drive(engine, results)
    assert (results["X"].finish_reason, len(results["X"].tokens)) == ("length", 6)
    assert results["X2"].tokens == results["X"].tokens
    if fail:
        assert (results["Y"].finish_reason, results["Y"].tokens) == ("error", [])
    else:
        assert results["Y"].tokens == results["X"].tokens  # same prompt, other tenant and salt
    assert [results[r].num_cached_tokens for r in ("X", "Y", "X2", "Y2")] == [
        0, 0, 2 * BS, 0 if fail else 2 * BS]
    assert engine.stats_snapshot().evictions["fault"] == (1 if fail else 0)
    _assert_clean(engine)


@pytest.mark.parametrize("fail", [False, True], ids=["no-fault", "fault"])
def test_a_failed_forward_mid_decode_drops_the_block_it_completed(model_dir, tokenizer, fail):
    """D's first decode (prompt 31 + 1 output token = 32) completes block 1, cached when it is
    allocated; when that forward fails, block 1 is dropped and block 0 (computed by the
    successful prefill) is not. E extends D's first 32 tokens by one, so it could hit both."""
    engine = make_fake_llm_engine(model_dir, tokenizer)
    schedules = _capture_schedules(engine)
    results: dict[str, Result] = {}
    prompt = _prompt(7000, 31)
    with inject(_forward_failing_on({2} if fail else set())):
        _add(engine, results, [_req("D", "tenant-a", prompt)])
        _drive(engine, results)
        assert _rows(schedules[1]) == [("D", 31, 1)]
        assert engine.block_pool.get_num_cached_blocks() == (1 if fail else 2)
        _add(engine, results, [_req("E", "tenant-a", prompt + (results["D"].tokens[0], 123))])
        _drive(engine, results)
    if fail:
        assert (results["D"].finish_reason, results["D"].error) == ("error", STEP_FAILED_REASON)
        assert len(results["D"].tokens) == 1
    else:
        assert (results["D"].finish_reason, len(results["D"].tokens)) == ("length", 6)
    assert (results["E"].finish_reason, results["E"].num_cached_tokens) == (
        "length", BS if fail else 2 * BS)
    assert engine.stats_snapshot().evictions["fault"] == (1 if fail else 0)
    assert engine.consecutive_step_failures == 0
    _assert_clean(engine)


# -- 3. consecutive failed forwards ----------------------------------------------------------
def test_max_consecutive_failed_forwards_kill_the_engine(model_dir, tokenizer):
    engine = make_fake_llm_engine(model_dir, tokenizer, max_consecutive_step_failures=2,
                                  max_num_seqs=1)
    results: dict[str, Result] = {}
    with inject(_forward_failing_on({1, 2})):
        _add(engine, results, [_req(f"R{i}", f"tenant-{i % 2}", _prompt(1000 + 100 * i, 20))
                               for i in range(3)])
        outputs = _step(engine, results)
        assert [(o.request_id, o.finish_reason, o.error) for o in outputs] == [
            ("R0", "error", STEP_FAILED_REASON)]
        assert engine.consecutive_step_failures == 1
        with pytest.raises(EngineDeadError, match="^2 engine steps failed in a row$") as info:
            engine.step()
    assert isinstance(info.value.__cause__, InjectedFault)
    assert str(info.value.__cause__) == "forward 2 failed"
    assert engine.consecutive_step_failures == 2


def test_failed_forwards_interleaved_with_successes_do_not_kill_the_engine(model_dir, tokenizer):
    engine = make_fake_llm_engine(model_dir, tokenizer, max_consecutive_step_failures=2,
                                  max_num_seqs=1)
    results: dict[str, Result] = {}
    consecutive = []
    with inject(_forward_failing_on({1, 3, 5})):
        _add(engine, results, [_req(f"R{i}", f"tenant-{i % 2}", _prompt(1000 + 100 * i, 20), 3)
                               for i in range(4)])
        while engine.has_unfinished_requests():
            _step(engine, results)
            consecutive.append(engine.consecutive_step_failures)
            assert len(consecutive) < 20
    # R0 fails in its prefill (1), R1 and R2 each in their first decode (3, 5); R3 runs alone.
    assert consecutive == [1, 0, 1, 0, 1, 0, 0, 0]
    assert [(rid, r.finish_reason, r.error, len(r.tokens)) for rid, r in results.items()] == [
        ("R0", "error", STEP_FAILED_REASON, 0), ("R1", "error", STEP_FAILED_REASON, 1),
        ("R2", "error", STEP_FAILED_REASON, 1), ("R3", "length", None, 3)]
    # Only R0's prefill completed a block in a failed step (R1 and R2 were writing token 20,
    # in their unhashed block 1).
    assert engine.stats_snapshot().evictions["fault"] == 1
    _assert_clean(engine)


# -- 4. no production code installs an injector ----------------------------------------------
def test_no_production_module_installs_a_fault_injector():
    sources = [p for d in ("app", "engine", "tenants", "kernels")
               for p in sorted((REPO_ROOT / d).rglob("*.py"))]
    assert REPO_ROOT / "engine" / "faults.py" in sources
    assert len(sources) > 20  # the scan really covers the packages
    offenders = [str(p.relative_to(REPO_ROOT)) for p in sources
                 if p != REPO_ROOT / "engine" / "faults.py"
                 and ("inject(" in (text := p.read_text()) or "_injector" in text)]
    assert offenders == []


def test_every_fault_point_is_covered():
    assert set(FAULT_POINTS) == {*PER_REQUEST_REASONS, "forward"}


def test_inject_installs_for_the_block_only_and_refuses_nesting():
    calls = []
    fire("sample", "r")  # no injector: a no-op

    def record(p: str, rid: str | None) -> None:
        calls.append((p, rid))

    with inject(record):
        assert engine.faults._injector is record
        with pytest.raises(RuntimeError, match="already installed"), \
                inject(lambda p, rid: None):
            pass
        assert engine.faults._injector is record  # the refused one replaced nothing
        fire("stop", "r1")
        fire("forward")
    assert engine.faults._injector is None
    fire("sample", "r2")
    assert calls == [("stop", "r1"), ("forward", None)]
    with pytest.raises(InjectedFault), inject(record):
        raise InjectedFault("x")
    assert engine.faults._injector is None  # removed on an exception too


# -- 5. HTTP -----------------------------------------------------------------------------------
def _load_build_app_env():
    """``build_app_env`` from tests/app/conftest.py (its fixtures are not visible here)."""
    spec = importlib.util.spec_from_file_location(
        "_fault_containment_app_conftest", REPO_ROOT / "tests" / "app" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.build_app_env


@pytest.fixture(scope="module")
def app_env_builder(make_llm_engine, model_dir, tokenizer):
    return partial(_load_build_app_env(), make_llm_engine, model_dir, tokenizer)


def _usage(env, tenant: str, n: int, timeout: float = 5.0) -> list:
    """The tenant's usage rows once there are ``n`` (usage is written off the request path),
    after a short wait for any extra row."""
    deadline = time.monotonic() + timeout
    rows = env.repo.usage.list_usage(tenant)
    while len(rows) < n and time.monotonic() < deadline:
        time.sleep(0.02)
        rows = env.repo.usage.list_usage(tenant)
    time.sleep(0.2)
    return env.repo.usage.list_usage(tenant)


def _sse_events(text: str) -> list:
    return [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_request_fault_is_a_500_for_that_call_only(app_env_builder, tmp_path, stream):
    prompt = list(_prompt(1000, 20))
    body = {"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "stream": stream}
    firings: dict[str, int] = {}
    armed = [True]

    def fault(p: str, rid: str | None) -> None:
        # While armed (only A's call in flight), every request fails at its 2nd sampling, so A
        # has received one token (one streamed chunk) before the fault.
        if armed[0] and p == "sample" and rid is not None:
            firings[rid] = firings.get(rid, 0) + 1
            if firings[rid] == 2:
                raise InjectedFault(f"boom {prompt}")

    with app_env_builder(tmp_path) as env, inject(fault):
        r = env.client.post("/v1/completions", headers=env.headers(env.key_a),
                            json={"model": env.model, **body})
        armed[0] = False
        error = {"error": {"message": "sampling failed for this request", "type": "server_error",
                           "param": None, "code": "request_failed"}}
        assert "Traceback" not in r.text and "boom" not in r.text
        assert "InjectedFault" not in r.text
        if stream:
            assert r.status_code == 200
            events = _sse_events(r.text)
            assert len(events) == 2 and "[DONE]" not in events
            first = json.loads(events[0])
            assert first["object"] == "text_completion"
            assert first["choices"][0]["finish_reason"] is None
            assert json.loads(events[1]) == error
        else:
            assert r.status_code == 500
            assert r.json() == error
        assert len(firings) == 1 and list(firings.values()) == [2]  # one engine request, A's
        rows = _usage(env, env.tenant_a, 1)
        assert [(u.status, u.endpoint, u.prompt_tokens, u.completion_tokens) for u in rows] == [
            ("error", "completions", 20, 1)]
        assert env.client.get("/health").status_code == 200
        assert env.engine_state() == (128, 128, False)

        ok = {**body, "stream": False}
        r_b = env.client.post("/v1/completions", headers=env.headers(env.key_b),
                              json={"model": env.model, **ok})
        r_a = env.client.post("/v1/completions", headers=env.headers(env.key_a),
                              json={"model": env.model, **ok})
        for resp in (r_b, r_a):
            assert resp.status_code == 200
            assert resp.json()["choices"][0]["finish_reason"] == "length"
            assert resp.json()["usage"]["completion_tokens"] == 5
        assert r_a.json()["choices"][0]["text"] == r_b.json()["choices"][0]["text"]
        rows = _usage(env, env.tenant_a, 2)
        assert [(u.status, u.completion_tokens) for u in rows] == [("error", 1), ("ok", 5)]
        assert [(u.status, u.completion_tokens) for u in _usage(env, env.tenant_b, 1)] == [
            ("ok", 5)]
        assert len(firings) == 1  # disarmed: the later calls never reached the injector's count
        assert env.client.get("/health").status_code == 200
        assert env.engine_state() == (128, 128, False)
