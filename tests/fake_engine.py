"""A fake model for app tests: the real engine (scheduler, block pool, prefix cache, detokenizer,
``AsyncLLM`` thread) over a deterministic ``ModelExecutor`` that loads no weights and imports no
torch.

Tokens are a pure function of the sequence so far (``FakeExecutor.next_token``), drawn from plain
word tokens of the real tokenizer, so text is readable, stop strings work, the same prompt always
gives the same completion and different prompts give different ones. Block accounting, cache hits
(``cached_tokens``), evictions, resets and metrics are the real engine's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from engine.async_engine import AsyncLLM
from engine.config import EngineConfig
from engine.executor import ExecuteOutput
from engine.faults import fire
from engine.llm_engine import LLMEngine
from engine.request import TokenLogprobs
from engine.scheduler import SchedulerOutput

_WORDS = (" the quick brown fox jumps over a lazy dog while seven small cats watch from an old"
          " red barn near the river and sing about bread")


class FakeExecutor:
    """Deterministic ``engine.executor.ModelExecutor``.

    Args:
        tokenizer: used once to pick the word tokens.

    Attributes:
        fail: when True the next ``execute`` raises (a failed forward kills the engine loop).
        step_delay_s: seconds each ``execute`` sleeps (to keep requests in flight in a test).
        steps / tokens_computed: batches run and tokens "computed" (prefill + decode), so tests
            can tell a prefix hit (fewer tokens computed) from a miss.
    """

    device = "cpu"
    dtype = "float32"
    attention_backend = "fake"

    def __init__(self, tokenizer: Any) -> None:
        self.words: list[int] = tokenizer.encode(_WORDS, add_special_tokens=False)
        self.fail = False
        self.step_delay_s = 0.0
        self.steps = 0
        self.tokens_computed = 0

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 64 * block_size

    def kv_cache_budget_bytes(self) -> int:
        return 1 << 20

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size

    def next_token(self, token_ids: list[int]) -> int:
        """The "greedy" next token after ``token_ids``."""
        return self.words[(sum(token_ids[-8:]) + 7 * len(token_ids)) % len(self.words)]

    def execute(self, scheduled: SchedulerOutput) -> ExecuteOutput:
        if self.fail:
            raise RuntimeError("fake forward failed")
        fire("forward")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.steps += 1
        sampled, failed = {}, {}
        logprobs: dict[str, TokenLogprobs] = {}
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        for s in scheduled.scheduled:
            self.tokens_computed += s.num_new_tokens
            if s.samples:
                rid = s.request.request_id
                try:  # the real runner's per-request fault points
                    fire("logits", rid)
                    fire("sample", rid)
                except Exception:  # noqa: BLE001 - this request's fault only
                    failed[rid] = "sampling failed for this request"
                    continue
                end = s.num_computed_tokens + s.num_new_tokens
                sampled[rid] = self.next_token(s.request.all_token_ids[:end])
                num_top = s.request.sampling_params.logprobs
                if num_top is not None:
                    logprobs[rid] = self.logprobs(sampled[rid], num_top)
            num_top = s.request.sampling_params.prompt_logprobs
            if num_top is not None:
                req = s.request
                stop = min(s.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens - 1)
                prompt_logprobs[req.request_id] = (s.num_computed_tokens + 1, [
                    self.logprobs(req.all_token_ids[p + 1], num_top)
                    for p in range(s.num_computed_tokens, stop)])
        return ExecuteOutput(sampled, failed, logprobs, prompt_logprobs)

    def logprobs(self, token_id: int, num_top: int) -> TokenLogprobs:
        """Made-up but well-formed logprobs: the token is the most likely one (-0.25), then
        the word tokens at -1, -2, ..."""
        top = [(token_id, -0.25)] + [(w, -1.0 - i) for i, w in enumerate(
            dict.fromkeys(w for w in self.words if w != token_id))]
        return TokenLogprobs(token_id, -0.25, 1, tuple(top[:num_top]))

    def release(self, request_id: str) -> None:
        pass


def make_fake_llm_engine(model_dir: Path, tokenizer: Any, **overrides: Any) -> LLMEngine:
    """An ``LLMEngine`` on the bundled model's config and tokenizer over a ``FakeExecutor``.

    ``overrides`` are ``EngineConfig`` fields (default max_model_len 512, 128 KV blocks).
    """
    # Step times of a fake are noise: no measured stall-free cap unless a test sets one.
    kwargs = {"max_model_len": 512, "num_gpu_blocks_override": 128,
              "interactive_step_tokens": 0, **overrides}
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", **kwargs)
    return LLMEngine(config, tokenizer=tokenizer, executor=FakeExecutor(tokenizer))


def make_fake_engine_client(model_dir: Path, tokenizer: Any, **overrides: Any) -> AsyncLLM:
    """The server's ``EngineClient`` (``AsyncLLM``) over ``make_fake_llm_engine``."""
    return AsyncLLM(make_fake_llm_engine(model_dir, tokenizer, **overrides))
