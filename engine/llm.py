"""Offline API: ``LLM(model=..., enable_prefix_caching=True).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
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
        results: dict[str, GenerationResult] = {}
        order = []
        for prompt in prompts:
            ids = (self.engine.tokenizer.encode(prompt) if isinstance(prompt, str)
                   else list(prompt))
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(EngineRequest(rid, tuple(ids), params, tenant_id=tenant_id,
                                                  cache_salt=cache_salt))
            results[rid] = GenerationResult(rid, ids, [], "", None, 0)
            order.append(rid)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                r = results[out.request_id]
                r.token_ids.extend(out.new_token_ids)
                r.text += out.new_text
                r.num_cached_tokens = out.num_cached_tokens
                if out.finished:
                    r.finish_reason = out.finish_reason
        return [results[rid] for rid in order]
