"""``--one-token-step-threads``: CPU steps of one token (a lone decoding stream) run on that
many torch threads and every other step on the threads the runner was loaded with; the
tokens are the same (each output of our CPU kernels is summed by one thread)."""

from __future__ import annotations

import pytest
import torch

from engine.llm import run_to_completion
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams


@pytest.fixture
def threads_calls(monkeypatch):
    calls: list[int] = []
    real = torch.set_num_threads
    before = torch.get_num_threads()
    real(max(2, before))  # the machine has 2+ cores (CI: 2); the runner reads this at load
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n) or real(n))
    yield calls
    real(before)  # this test's thread is pytest's: leave it as it was


def _run(engine, tokenizer, tag: str, n: int):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"][:n]
    return [r.token_ids for r in run_to_completion(engine, [
        EngineRequest(f"{tag}-{i}", tuple(tokenizer.encode(p)), params, tenant_id="t")
        for i, p in enumerate(prompts)])]


def test_one_token_steps_switch_threads_and_keep_the_tokens(make_llm_engine, tokenizer,
                                                            threads_calls):
    plain = make_llm_engine()  # in-process default: unset = 0, never switches
    want_one, want_two = _run(plain, tokenizer, "a", 1), _run(plain, tokenizer, "b", 2)
    assert threads_calls == []
    engine = make_llm_engine(one_token_step_threads=1)
    loaded = engine.runner.step_threads
    assert loaded == torch.get_num_threads() >= 2
    assert _run(engine, tokenizer, "c", 1) == want_one
    # The prefill step runs on all threads (no switch needed), then each decode step on one.
    assert threads_calls == [1] and torch.get_num_threads() == 1
    assert _run(engine, tokenizer, "d", 2) == want_two  # prefill, 2-row decodes: all threads
    assert threads_calls[1:] == [loaded] and torch.get_num_threads() == loaded
    _run(engine, tokenizer, "e", 1)  # ends on one thread; restore_threads puts it back
    assert torch.get_num_threads() == 1
    engine.runner.restore_threads()
    assert threads_calls[-1] == loaded and torch.get_num_threads() == loaded


def test_a_served_engine_times_both_counts_and_gives_the_threads_back(model_dir, tokenizer,
                                                                       threads_calls):
    import asyncio

    from engine.async_engine import AsyncLLM
    from engine.config import EngineConfig

    loaded = torch.get_num_threads()
    llm = AsyncLLM.from_config(EngineConfig(model=str(model_dir), max_model_len=256,
                                            num_gpu_blocks_override=32), tokenizer=tokenizer)
    try:
        tuner = llm.engine.runner.thread_tuner
        assert llm.engine.runner.one_token_threads == 0
        assert tuner is not None and tuner.candidates == (loaded - 1, loaded)

        async def one(i: int, n: int):
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            req = EngineRequest(f"served-{i}", tuple(tokenizer.encode("The capital of France is")), params,
                                tenant_id="t")
            return [t for o in [o async for o in llm.add_request(req)] for t in o.new_token_ids]

        # One trial's worth of one-token steps (the prefill step of each request is not one).
        tokens = asyncio.run(one(0, tuner.trial_steps + 1))
        assert tuner.trials == 1 and tuner.chosen in tuner.candidates
        # Both counts ran, in blocks, and the tokens are those of an engine that never switches.
        assert set(threads_calls) == {loaded - 1, loaded}
        assert len(threads_calls) == 2 * tuner.rounds  # a switch at each block of a round
        plain = _run_ids(model_dir, tokenizer, len(tokens))
        assert tokens == plain
    finally:
        llm.shutdown()
    assert torch.get_num_threads() == loaded


def _run_ids(model_dir, tokenizer, n: int) -> list[int]:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=256,
                                    num_gpu_blocks_override=32), tokenizer=tokenizer)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    [result] = run_to_completion(engine, [EngineRequest(
        "plain", tuple(tokenizer.encode("The capital of France is")), params, tenant_id="t")])
    return list(result.token_ids)


def test_negative_thread_counts_are_refused():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="--one-token-step-threads must be at least 0"):
        EngineConfig(model="m", one_token_step_threads=-1)
