"""Offline API: ``LLM(model=..., enable_prefix_caching=True).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest, RequestOutput, TokenLogprobs
from engine.sampling_params import SamplingParams


@dataclass
class GenerationResult:
    """One finished prompt (vLLM's ``RequestOutput`` with a single completion)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    ttft_s: float | None = None  # seconds from submission to the first token
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # with ``logprobs``
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with ``prompt_logprobs``


def run_to_completion(engine: LLMEngine, requests: Sequence[EngineRequest],
                      on_step: Callable[[list[RequestOutput]], None] | None = None,
                      max_steps: int | None = None) -> list[GenerationResult]:
    """Adds ``requests`` (continuous batching) and steps ``engine`` until it is idle.

    Args:
        on_step: called after every step with its outputs (e.g. an integrity check).
        max_steps: raise RuntimeError after this many steps (a hang guard for tests).

    Returns:
        One result per request, in order.

    Raises:
        InvalidRequestError: a request is invalid (the ones before it are queued).
    """
    results: dict[str, GenerationResult] = {}
    t0 = time.perf_counter()
    for req in requests:
        engine.add_request(req)
        results[req.request_id] = GenerationResult(req.request_id, list(req.prompt_token_ids),
                                                   [], "", None, 0)
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for out in outputs:
            r = results.get(out.request_id)
            if r is None:
                continue
            if r.ttft_s is None and out.new_token_ids:
                r.ttft_s = time.perf_counter() - t0
            r.token_ids.extend(out.new_token_ids)
            r.logprobs.extend(out.new_logprobs)
            if out.prompt_logprobs is not None:
                r.prompt_logprobs = list(out.prompt_logprobs)
            r.text += out.new_text
            r.num_cached_tokens = out.num_cached_tokens
            if out.finished:
                r.finish_reason = out.finish_reason
        if on_step is not None:
            on_step(outputs)
        steps += 1
        if max_steps is not None and steps >= max_steps:
            raise RuntimeError(f"not idle after {max_steps} steps")
    return [results[req.request_id] for req in requests]


class LLM:
    """Runs the engine to completion over a batch of prompts.

    Args:
        model: Hugging Face folder (safetensors); use ``engine.weights.ensure_default_model``
            for the bundled SmolLM2.
        **kwargs: any ``EngineConfig`` field (vLLM names: ``enable_prefix_caching``,
            ``block_size``, ``max_model_len``, ``num_gpu_blocks_override``, ...).
    """

    def __init__(self, model: str, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **kwargs))
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | None = None,
                 cache_salt: bytes | None = None, tenant_id: str | None = None
                 ) -> list[GenerationResult]:
        """Generates for every prompt (text or token ids), returning results in prompt order."""
        params = sampling_params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        requests = []
        for prompt in prompts:
            ids = (self.engine.tokenizer.encode(prompt) if isinstance(prompt, str)
                   else list(prompt))
            requests.append(EngineRequest(f"offline-{next(self._ids)}", tuple(ids), params,
                                          tenant_id=tenant_id, cache_salt=cache_salt))
        return run_to_completion(self.engine, requests)

