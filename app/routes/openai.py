"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from app.auth import CurrentTenant
from app.errors import APIError, error_body
from app.limits import Lease, RateLimiter, RateLimitExceeded, TenantLimits
from app.protocol import ChatCompletionRequest, CompletionRequest
from engine.async_engine import AsyncLLM
from engine.request import EngineRequest, RequestOutput
from engine.sampling_params import SamplingParams
from tenants.repository import AuthContext, UsageRecord

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["openai"])


@dataclass
class _Choice:
    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    num_cached_tokens: int = 0


@dataclass
class _Job:
    """One API call: n engine requests over the same prompt."""

    request_id: str
    endpoint: str
    model: str
    auth: AuthContext
    prompt_ids: list[int] = field(repr=False)
    params: SamplingParams
    cache_salt: bytes | None = field(repr=False)
    created: int = field(default_factory=lambda: int(time.time()))
    start: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    choices: list[_Choice] = field(default_factory=list)
    status: str = "error"
    lease: Lease | None = None  # per-tenant limits (app/limits.py), released by _record_usage
    finalized: bool = False  # usage recorded and lease released (exactly once)

    def limit_headers(self) -> dict[str, str]:
        return dict(self.lease.headers) if self.lease is not None else {}

    def engine_requests(self) -> list[EngineRequest]:
        reqs = []
        for i in range(self.params.n):
            params = self.params
            if params.n > 1 and params.seed is not None:
                params = SamplingParams(**{**params.__dict__, "seed": params.seed + i})
            reqs.append(EngineRequest(
                request_id=f"{self.request_id}-{i}", prompt_token_ids=tuple(self.prompt_ids),
                sampling_params=params, tenant_id=self.auth.tenant_id,
                cache_salt=self.cache_salt,
                enable_prefix_caching=self.auth.enable_prefix_caching))
        return reqs

    def usage(self) -> dict:
        completion = sum(c.num_tokens for c in self.choices)
        cached = self.choices[0].num_cached_tokens if self.choices else 0
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": completion,
                "total_tokens": len(self.prompt_ids) + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def usage_record(self) -> UsageRecord:
        u = self.usage()
        now = time.monotonic()
        return UsageRecord(
            request_id=self.request_id, tenant_id=self.auth.tenant_id, key_id=self.auth.key_id,
            model=self.model, endpoint=self.endpoint, status=self.status,
            prompt_tokens=u["prompt_tokens"],
            cached_tokens=u["prompt_tokens_details"]["cached_tokens"],
            completion_tokens=u["completion_tokens"],
            ttft_s=None if self.first_token_time is None else self.first_token_time - self.start,
            latency_s=now - self.start)


async def _merge(engine: AsyncLLM, reqs: list[EngineRequest]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves the outputs of several engine requests as they arrive."""
    if len(reqs) == 1:
        async for out in engine.generate(reqs[0]):
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, req: EngineRequest) -> None:
        try:
            async for out in engine.generate(req):
                await q.put((i, out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer, re-raised there
            await q.put((i, e))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
    try:
        remaining = len(reqs)
        while remaining:
            i, item = await q.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


def _record_usage(request: Request, job: _Job) -> None:
    """Stores usage without awaiting, so it also happens when the client has gone away.

    Also releases the job's rate-limit lease, correcting its token reservation to the tokens
    really used. Idempotent: only the first call per job does anything.
    """
    if job.finalized:
        return
    job.finalized = True
    if job.lease is not None:
        job.lease.release(job.usage()["total_tokens"])
    repo = request.app.state.repo
    request.app.state.metrics.observe_request(job)  # Prometheus request metrics (app/metrics.py)
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(None, repo.record_usage, job.usage_record())
    fut.add_done_callback(lambda f: f.exception() and logger.error(
        "failed to record usage: %s", type(f.exception()).__name__))


def _apply(job: _Job, i: int, out: RequestOutput) -> None:
    if job.first_token_time is None and out.new_token_ids:
        job.first_token_time = time.monotonic()
    c = job.choices[i]
    c.text += out.new_text
    c.num_tokens = out.num_output_tokens
    c.num_cached_tokens = out.num_cached_tokens
    if out.finished:
        c.finish_reason = out.finish_reason


def _prepare(request: Request, auth: AuthContext, body, prompt_ids: list[int], endpoint: str,
             prefix: str, prompt_param: str) -> _Job:
    """Validates the call and builds its job; a rejected call is still recorded as usage.

    Raises:
        APIError: 400 with ``param`` set (unknown model, bad sampling values, bad cache_salt,
            prompt or prompt + max_tokens over max_model_len, token ids outside the vocabulary);
            429 over one of the tenant's limits (nothing reaches the engine).
    """
    try:
        job = _build_job(request, auth, body, prompt_ids, endpoint, prefix, prompt_param)
        job.lease = _admit(request, job)
        return job
    except APIError:
        rejected = _Job(f"{prefix}-{uuid.uuid4().hex}", endpoint, request.app.state.model_name,
                        auth, prompt_ids, SamplingParams(), None)
        _record_usage(request, rejected)
        raise


def _admit(request: Request, job: _Job) -> Lease | None:
    """Takes a lease on the tenant's limits, reserving prompt + n * max_tokens tokens.

    Returns:
        The lease, or None when the tenant has no limits.

    Raises:
        APIError: 429 ``rate_limit_exceeded`` with ``x-ratelimit-*`` and ``Retry-After``.
    """
    auth = job.auth
    limits = TenantLimits(auth.rpm_limit, auth.tpm_limit, auth.max_concurrent)
    if not limits.any:
        return None
    n_prompt = len(job.prompt_ids)
    max_tokens = job.params.max_tokens
    if max_tokens is None:
        max_tokens = request.app.state.max_model_len - n_prompt
    limiter: RateLimiter = request.app.state.limiter
    try:
        return limiter.acquire(auth.tenant_id, limits, n_prompt + job.params.n * max_tokens)
    except RateLimitExceeded as e:
        raise APIError(429, e.message, None, "rate_limit_exceeded", e.headers) from None


def _build_job(request: Request, auth: AuthContext, body, prompt_ids: list[int], endpoint: str,
               prefix: str, prompt_param: str) -> _Job:
    state = request.app.state
    if body.model != state.model_name:
        raise APIError(400, f"model {body.model!r} does not exist; this server serves "
                       f"{state.model_name!r}", "model", "model_not_found")
    try:
        params = body.sampling_params()
    except ValueError as e:
        raise APIError(400, str(e.args[0]), e.args[1] if len(e.args) > 1 else None,
                       "invalid_value") from None
    try:
        salt = auth.effective_salt(body.cache_salt)
    except ValueError as e:
        raise APIError(400, str(e), "cache_salt", "invalid_value") from None
    max_len = state.max_model_len
    n = len(prompt_ids)
    if n == 0:
        raise APIError(400, "the prompt is empty", prompt_param, "invalid_value")
    if n >= max_len:
        raise APIError(400, f"this model's maximum context length is {max_len} tokens; the "
                       f"prompt has {n} tokens", prompt_param, "context_length_exceeded")
    if params.max_tokens is not None and n + params.max_tokens > max_len:
        raise APIError(400, f"this model's maximum context length is {max_len} tokens; you "
                       f"requested {n + params.max_tokens} tokens ({n} in the prompt, "
                       f"{params.max_tokens} in the completion)", "max_tokens",
                       "context_length_exceeded")
    vocab = state.vocab_size
    if any(t < 0 or t >= vocab for t in prompt_ids):
        raise APIError(400, f"token ids must be in [0, {vocab})", prompt_param, "invalid_value")
    job = _Job(f"{prefix}-{uuid.uuid4().hex}", endpoint, state.model_name, auth, prompt_ids,
               params, salt)
    job.choices = [_Choice(i) for i in range(params.n)]
    return job


async def _collect(request: Request, job: _Job) -> None:
    """Runs a non-streaming job to completion; aborts it when the client disconnects."""
    engine: AsyncLLM = request.app.state.engine

    async def run() -> None:
        async for i, out in _merge(engine, job.engine_requests()):
            _apply(job, i, out)

    task = asyncio.create_task(run())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=1.0)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                job.status = "aborted"
        await task
        job.status = "ok"
    except asyncio.CancelledError:
        job.status = "aborted"
        raise
    except ValueError as e:  # rejected by the engine at admission
        raise APIError(400, str(e.args[0]), e.args[1] if len(e.args) > 1 else None,
                       "invalid_value") from None
    finally:
        if not task.done():
            task.cancel()
        _record_usage(request, job)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _stream(request: Request, job: _Job, chat: bool, include_usage: bool
                  ) -> AsyncGenerator[str, None]:
    engine: AsyncLLM = request.app.state.engine
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict]) -> str:
        body = {"id": job.request_id, "object": obj, "created": job.created,
                "model": job.model, "choices": choices}
        if include_usage:
            body["usage"] = None
        return _sse(body)

    try:
        if chat:
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None} for c in job.choices])
        async for i, out in _merge(engine, job.engine_requests()):
            _apply(job, i, out)
            if not out.new_text and not out.finished:
                continue
            delta = {"content": out.new_text} if out.new_text else {}
            choice: dict = ({"index": i, "delta": delta} if chat
                            else {"index": i, "text": out.new_text})
            choice["logprobs"] = None
            choice["finish_reason"] = out.finish_reason if out.finished else None
            yield chunk([choice])
        job.status = "ok"
        if include_usage:
            yield _sse({"id": job.request_id, "object": obj, "created": job.created,
                        "model": job.model, "choices": [], "usage": job.usage()})
        yield "data: [DONE]\n\n"
    except asyncio.CancelledError:
        job.status = "aborted"
        raise
    except ValueError as e:
        yield _sse(error_body(400, str(e.args[0]), None, "invalid_value"))
    except Exception as e:  # noqa: BLE001 - engine died mid-stream: tell the client in-band
        logger.error("stream failed: %s", type(e).__name__)
        yield _sse(error_body(503, "the inference engine is not available", None,
                              "engine_unavailable"))
    finally:
        _record_usage(request, job)


class _JobStreamingResponse(StreamingResponse):
    """SSE response that finalizes its job (usage row, rate-limit lease) on every path, also
    when the client went away before the body generator started or while a chunk was sent."""

    def __init__(self, request: Request, job: _Job, gen: AsyncGenerator[str, None]) -> None:
        super().__init__(gen, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", **job.limit_headers()})
        self._request, self._job, self._gen = request, job, gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._job.finalized:
                if self._job.status != "ok":
                    self._job.status = "aborted"
                await self._gen.aclose()  # runs _stream's finally if it started
                _record_usage(self._request, self._job)


def _streaming_response(request: Request, job: _Job, chat: bool,
                        include_usage: bool) -> StreamingResponse:
    return _JobStreamingResponse(request, job, _stream(request, job, chat, include_usage))


def _encode(tokenizer, text: str, param: str, **kwargs) -> list[int]:
    """Tokenizes ``text``; text the tokenizer cannot take (e.g. a lone UTF-16 surrogate from
    JSON ``"\\ud800"``) is a 400, not a 500."""
    try:
        return tokenizer.encode(text, **kwargs)
    except Exception:  # noqa: BLE001 - tokenizers raises TypeError/ValueError/Exception
        raise APIError(400, "the text could not be tokenized (invalid Unicode?)", param,
                       "invalid_value") from None


async def _respond(request: Request, job: _Job, body: ChatCompletionRequest | CompletionRequest,
                   chat: bool) -> JSONResponse | StreamingResponse:
    """Streams SSE chunks, or runs the job to completion and returns one JSON body (OpenAI
    ``chat.completion`` or ``text_completion``)."""
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        return _streaming_response(request, job, chat, include)
    await _collect(request, job)
    if chat:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": None, "finish_reason": c.finish_reason} for c in job.choices]
    else:
        choices = [{"index": c.index, "text": c.text, "logprobs": None,
                    "finish_reason": c.finish_reason} for c in job.choices]
    return JSONResponse({
        "id": job.request_id, "object": "chat.completion" if chat else "text_completion",
        "created": job.created, "model": job.model, "choices": choices,
        "usage": job.usage()}, headers=job.limit_headers())


@router.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           auth: CurrentTenant) -> JSONResponse | StreamingResponse:
    """OpenAI chat completions over the tokenizer's chat template."""
    tokenizer = request.app.state.tokenizer
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - any template error is a bad request
        raise APIError(400, "messages could not be rendered with the model's chat template",
                       "messages", "invalid_value") from None
    prompt_ids = _encode(tokenizer, text, "messages", add_special_tokens=False)
    job = _prepare(request, auth, body, prompt_ids, "chat.completions", "chatcmpl", "messages")
    return await _respond(request, job, body, chat=True)


@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request,
                      auth: CurrentTenant) -> JSONResponse | StreamingResponse:
    """OpenAI (legacy) completions; ``prompt`` is text or a list of token ids."""
    if isinstance(body.prompt, str):
        prompt_ids = _encode(request.app.state.tokenizer, body.prompt, "prompt")
    else:
        prompt_ids = list(body.prompt)
    job = _prepare(request, auth, body, prompt_ids, "completions", "cmpl", "prompt")
    return await _respond(request, job, body, chat=False)


@router.get("/models")
async def list_models(request: Request, auth: CurrentTenant) -> dict:
    state = request.app.state
    return {"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.started_at,
        "owned_by": "saltserve", "max_model_len": state.max_model_len}]}
