"""One API call's state: its prompts, its n choices per prompt as they accumulate, its usage
(``CompletionCall``). Plain data plus the rules that fold engine outputs into it; the service
(``app.services.completions``) drives it and ``app.services.responses`` renders it."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from app.limits import Lease
from app.protocol import ChatCompletionRequest, PromptTokensDetails, UsageInfo
from engine.errors import RequestFailedError
from engine.request import EngineRequest, RequestOutput, TenantShare, TokenLogprobs
from engine.sampling_params import SamplingParams
from tenants.records import AuthContext, UsageRecord

Endpoint = Literal["chat.completions", "completions"]


@dataclass
class Prompt:
    """One prompt of a call: its token ids and text (``echo`` returns the text)."""

    token_ids: list[int] = field(repr=False)
    text: str = field(default="", repr=False)


@dataclass
class ChoiceState:
    """One completion of the call (prompt ``prompt_index``), as accumulated from engine
    outputs."""

    index: int
    prompt_index: int = 0
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_tier_tokens: int = 0  # of the cached tokens, loaded from the offload tiers
    num_cache_write_tokens: int = 0
    token_ids: list[int] = field(default_factory=list, repr=False)
    logprobs: list[TokenLogprobs] = field(default_factory=list, repr=False)
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = field(default=None, repr=False)


@dataclass
class CompletionCall:
    """One API call: n engine requests per prompt, and what it used.

    Choice ``i`` answers prompt ``i // n`` (OpenAI and vLLM number a batch of prompts so).
    ``status`` is None while the outcome is open; then ``"ok"`` (completed), ``"error"``
    (refused or failed) or ``"aborted"`` (client disconnect or cancellation). A call finalised
    while still open is recorded as ``"error"``.
    """

    request_id: str
    endpoint: Endpoint
    model: str
    auth: AuthContext
    created: int = field(default_factory=lambda: int(time.time()))
    start: float = field(default_factory=time.monotonic)
    prompts: list[Prompt] = field(default_factory=list, repr=False)
    params: SamplingParams | None = None
    cache_salt: bytes | None = field(default=None, repr=False)
    first_token_time: float | None = None
    choices: list[ChoiceState] = field(default_factory=list)
    status: str | None = None
    lease: Lease | None = None
    submitted: bool = False  # the engine has the call's requests
    finalized: bool = False
    end_user: str | None = field(default=None, repr=False)
    prompt_cache_key: str | None = field(default=None, repr=False)
    offload: bool = True  # prompt_cache_retention "24h" (False: "in_memory")
    echo: bool = False  # completions: the prompt text is returned before the completion
    score_only: bool = False  # completions with echo and max_tokens 0: no generated token
    wants_prompt_logprobs: bool = False  # vLLM ``prompt_logprobs`` asked for by name
    as_token_ids: bool = False  # vLLM ``return_tokens_as_token_ids``
    service_tier: str | None = None  # echoed as "default" when the request named one
    grammar: Any = field(default=None, repr=False)  # structured output: a compiled matcher
    # Chat with tools offered: the request, to parse tool calls from the output
    # (``app.services.tools``); the text is then sent once complete, also when streaming.
    tool_body: ChatCompletionRequest | None = field(default=None, repr=False)

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat.completions"

    def prompt_logprobs_of(self, c: ChoiceState) -> tuple[TokenLogprobs | None, ...] | None:
        """The prompt logprobs of ``c``'s prompt: its first choice computes them for all."""
        n = self.params.n if self.params is not None else 1
        return self.choices[c.prompt_index * n].prompt_logprobs

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    def limit_headers(self) -> dict[str, str]:
        return dict(self.lease.headers) if self.lease is not None else {}

    def engine_requests(self) -> list[EngineRequest]:
        """The n engine requests of each prompt; with n > 1 and a seed, choice i of a prompt
        uses seed + i. The n choices share one prefill: through the tenant's prefix cache, or,
        for a tenant with caching off, through a private per-call cache that no other request
        can hit and that leaves nothing cached (``EngineRequest.private_cache``)."""
        assert self.params is not None
        n = self.params.n
        private = n > 1 and not self.auth.enable_prefix_caching
        quota = self.auth.quota
        share = TenantShare(quota.weight, quota.min_cache_blocks, quota.max_cache_blocks)
        reqs = []
        for j, prompt in enumerate(self.prompts):
            salt = secrets.token_bytes(32) if private else self.cache_salt
            for i in range(n):
                params = self.params
                if n > 1 and params.seed is not None:
                    params = replace(params, seed=params.seed + i)
                if i > 0 and params.prompt_logprobs is not None:
                    # Computed once per prompt (by choice 0): the others may hit the cache.
                    params = replace(params, prompt_logprobs=None)
                reqs.append(EngineRequest(
                    request_id=f"{self.request_id}-{j * n + i}",
                    prompt_token_ids=tuple(prompt.token_ids),
                    sampling_params=params, tenant_id=self.auth.tenant_id,
                    cache_salt=salt, private_cache=private,
                    # salt version and cache epoch: the key of offloaded blocks moves with both
                    cache_generation=(self.auth.salt_version << 32) | self.auth.cache_epoch,
                    offload=self.offload,
                    grammar=None if self.grammar is None else self.grammar.deep_copy(),
                    enable_prefix_caching=self.auth.enable_prefix_caching,
                    tenant_share=share))
        return reqs

    def apply(self, i: int, out: RequestOutput) -> None:
        """Folds one engine output of choice ``i`` into the call."""
        if self.first_token_time is None and out.new_token_ids:
            self.first_token_time = time.monotonic()
        c = self.choices[i]
        c.num_cached_tokens = out.num_cached_tokens
        c.num_tier_tokens = out.num_tier_tokens
        c.num_cache_write_tokens = out.num_cache_write_tokens
        if out.prompt_logprobs is not None:
            c.prompt_logprobs = out.prompt_logprobs
        if not self.score_only:
            c.text += out.new_text
            c.num_tokens = out.num_output_tokens
            c.token_ids.extend(out.new_token_ids)
            c.logprobs.extend(out.new_logprobs)
        if out.finished:
            if out.finish_reason == "error":  # a fault of this request only (engine/faults.py)
                raise RequestFailedError(out.error or "the request failed in the engine")
            c.finish_reason = "length" if self.score_only else out.finish_reason

    def usage(self) -> UsageInfo:
        """OpenAI ``usage``: cached tokens are those of each prompt's first choice (a prompt's
        n choices share it)."""
        completion = sum(c.num_tokens for c in self.choices)
        prompt = self.num_prompt_tokens
        n = self.params.n if self.params is not None else 1
        cached = sum(c.num_cached_tokens for c in self.choices[::n])
        written = sum(c.num_cache_write_tokens for c in self.choices)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached,
                                                                   cache_write_tokens=written))

    def usage_record(self) -> UsageRecord:
        """The call's usage row. A call refused before it reached the engine (400, 429)
        processed nothing and records 0 tokens, whatever its prompt: usage sums then equal the
        Prometheus token counters (``ServerMetrics.observe_request``)."""
        u = self.usage() if self.submitted else UsageInfo()
        n = self.params.n if self.params is not None else 1
        return UsageRecord(
            request_id=self.request_id, tenant_id=self.auth.tenant_id, key_id=self.auth.key_id,
            model=self.model, endpoint=self.endpoint, status=self.status or "error",
            prompt_tokens=u.prompt_tokens,
            cached_tokens=u.prompt_tokens_details.cached_tokens,
            completion_tokens=u.completion_tokens,
            ttft_s=None if self.first_token_time is None else self.first_token_time - self.start,
            latency_s=time.monotonic() - self.start, end_user=self.end_user,
            tier_cached_tokens=sum(c.num_tier_tokens for c in self.choices[::n])
            if self.submitted else 0,
            cache_write_tokens=u.prompt_tokens_details.cache_write_tokens,
            prompt_cache_key=self.prompt_cache_key)
