"""The completions service: everything between an authenticated OpenAI request and its response.

One API call (``CompletionCall``) goes through (DESIGN "Multi-tenant capacity": a refused call
costs almost nothing)::

    admit (rpm / concurrency limits: a lease; before the body is even read)
      -> preprocess in a worker thread (``app.services.preprocess``): parse and validate the
         body, model check, chat template, tokenise
      -> sampling, cache_salt, max_tokens and prompt checks -> reserve tokens (tpm)
      -> submit n engine requests (validated once by ``EngineClient.add_request``)
      -> stream SSE chunks, or collect one JSON body
      -> finalise: release the lease, record usage, count metrics

Finalisation happens exactly once per call, in one place: the ``finally`` of ``_run`` for JSON
responses and for calls refused before a response exists, or the ``finally`` of
``_FinalizingStreamingResponse.__call__`` once a stream response has been handed to Starlette
(also when the client leaves before the first byte). ``CompletionsService._finalize`` refuses a
second run (it would double-count usage). The call's state lives in ``app.services.call``; its
JSON bodies and SSE chunks are built by ``app.services.responses``.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from app.errors import APIError, error_body
from app.limits import Lease, RateLimiter, RateLimitExceeded
from app.metrics import ServerMetrics
from app.protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionStreamResponse,
    client_cache_salt,
)
from app.services.call import ChoiceState, CompletionCall, Endpoint, Prompt
from app.services.logprobs import (
    TokenTexts,
)
from app.services.preprocess import Preprocessor
from app.services.prompts import PromptEncoder
from app.services.responses import ResponseBuilder, sse
from engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from engine.protocol import EngineClient, RequestStreamLike, validate_request
from engine.request import RequestOutput
from engine.structured_output import StructuredOutput
from tenants.records import AuthContext, TenantQuota, UsageRecord
from tenants.tenant_store import RETENTIONS

logger = logging.getLogger(__name__)


class ClientGaveUp(Exception):
    """The client of a non-streamed call disconnected before its answer (the call is
    aborted and recorded as such)."""

UsageSink = Callable[[UsageRecord], None]
BodyReader = Callable[[], Awaitable[bytes]]


async def merge_streams(streams: Sequence[RequestStreamLike]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves the outputs of several engine requests as they arrive, as (choice, output).

    Closing the iterator (or an error in one stream) closes every stream, aborting the requests
    that have not finished.
    """
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStreamLike) -> None:
        try:
            async for out in stream:
                await q.put((i, out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer, re-raised there
            await q.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
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
        for s in streams:
            s.close()


def prompt_cache_retention(requested: str | None, quota: TenantQuota, has_tier: bool) -> str:
    """The retention a call gets: what it asks (OpenAI ``prompt_cache_retention``), else the
    tenant's default (``TenantQuota.prompt_cache_retention``; unset: ``"24h"``), capped by the
    tenant's maximum. ``"in_memory"``: its blocks stay in the KV pool only; ``"24h"``: they
    also go to the offload tiers, where the tenant's tier quota or a reset may still remove
    them earlier. A server without a tier gives ``"in_memory"``.

    Raises:
        APIError: 400 when the call asks for ``"24h"`` from a server without an offload tier,
            or above the tenant's maximum (``max_prompt_cache_retention``, set by the
            operator).
    """
    ceiling = quota.max_prompt_cache_retention or "24h"
    if requested is None:
        chosen = quota.prompt_cache_retention or "24h"
        if not has_tier or RETENTIONS.index(chosen) > RETENTIONS.index(ceiling):
            return "in_memory"
        return chosen
    if requested == "24h" and not has_tier:
        raise APIError(400, "prompt_cache_retention '24h' needs an offload tier, and this "
                       "server keeps cached prefixes in memory only; use 'in_memory'",
                       "prompt_cache_retention", "invalid_value")
    if RETENTIONS.index(requested) > RETENTIONS.index(ceiling):
        raise APIError(400, f"prompt_cache_retention '{requested}' is above this tenant's "
                       f"maximum, '{ceiling}'", "prompt_cache_retention", "invalid_value")
    return requested


class _FinalizingStreamingResponse(StreamingResponse):
    """SSE response that owns its call's finalisation from the moment Starlette gets it: the
    body generator is closed and the call finalised on every path, also when the client went
    away before the body started."""

    def __init__(self, body: AsyncGenerator[str, None], call: CompletionCall,
                 streams: list[RequestStreamLike],
                 finalize: Callable[[CompletionCall], None]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", **call.limit_headers()})
        self._body, self._call, self._streams, self._finalize = body, call, streams, finalize

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._call.status is None:  # the body never got to its end: the client left
                self._call.status = "aborted"
            await self._body.aclose()
            for s in self._streams:  # also when the body never started: abort, free blocks
                s.close()
            self._finalize(self._call)


class CompletionsService:
    """Serves ``/v1/chat/completions`` and ``/v1/completions`` over an ``EngineClient``.

    Args:
        engine: the engine (``engine.protocol.EngineClient``).
        record_usage: stores one usage record; called from a worker thread, may block.
        metrics: request-level Prometheus metrics.
        limiter: per-tenant rpm / tpm / concurrency limits.
        usage_sink_blocks: False when ``record_usage`` never blocks (``UsageJournal.append``):
            it is then called on the event loop, before the call's response ends.
    """

    def __init__(self, engine: EngineClient, record_usage: UsageSink, metrics: ServerMetrics,
                 limiter: RateLimiter, preprocessor: Preprocessor | None = None,
                 usage_sink_blocks: bool = True) -> None:
        self.engine = engine
        self.info = engine.model_info()
        self.record_usage = record_usage
        self.usage_sink_blocks = usage_sink_blocks
        self.metrics = metrics
        self.limiter = limiter
        self.preprocessor = preprocessor or Preprocessor(self.info.tokenizer)
        self.prompts = PromptEncoder(self.info, self.preprocessor)
        # Its own tokenizer copy: the engine thread decodes with the original.
        self.responses = ResponseBuilder(TokenTexts(copy.deepcopy(self.info.tokenizer)),
                                         self.prompts.tool_format)

    # -- entry points --------------------------------------------------------------------------
    async def create_chat_completion(
            self, read_body: BodyReader, auth: AuthContext,
            is_disconnected: Callable[[], Awaitable[bool]]) -> Response:
        """OpenAI chat completions over the tokenizer's chat template.

        Args:
            read_body: returns the raw JSON body (awaited only once the call is admitted).

        Returns:
            The JSON response or the SSE stream; for a non-streamed call whose client
            disconnected, an empty 499 (the call is aborted and recorded; one log line, no
            traceback).

        Raises:
            APIError: 400 (bad model, sampling values, cache_salt, template, lengths, token
                ids; ``param`` set), 429 over a tenant limit; every refusal is recorded as usage.
            RequestValidationError: the body is not valid JSON or has invalid fields (400).
            EngineDeadError: the engine is not running (503).
            RequestFailedError: a fault inside the engine failed this call alone (500).
        """
        return await self._run("chat.completions", "chatcmpl", ChatCompletionRequest, read_body,
                               auth, is_disconnected)

    async def create_completion(
            self, read_body: BodyReader, auth: AuthContext,
            is_disconnected: Callable[[], Awaitable[bool]]) -> Response:
        """OpenAI (legacy) completions; ``prompt`` is text or a list of token ids.

        Raises:
            APIError, EngineDeadError: as ``create_chat_completion``.
        """
        return await self._run("completions", "cmpl", CompletionRequest, read_body, auth,
                               is_disconnected)

    # -- one call ------------------------------------------------------------------------------
    async def _run(self, endpoint: Endpoint, prefix: str,
                   model_cls: type[ChatCompletionRequest | CompletionRequest],
                   read_body: BodyReader, auth: AuthContext,
                   is_disconnected: Callable[[], Awaitable[bool]]
                   ) -> Response:
        call = CompletionCall(f"{prefix}-{uuid.uuid4().hex}", endpoint,
                              self.info.served_model_name, auth)
        handed_off = False  # True once a streaming response owns finalisation
        try:
            call.lease = self.admit(call.auth)  # before the body is read: a 429 costs nothing
            try:
                raw = await read_body()
            except ClientDisconnect:
                call.status = "aborted"
                return JSONResponse(error_body(400, "the client disconnected while sending the "
                                               "body", None, "client_disconnected"),
                                    status_code=400)
            body = await self.preprocessor.parse(auth.tenant_id, model_cls, raw,
                                                 self.info.max_model_len)
            self._describe(call, body)
            call.prompts, spec, call.grammar = await self.preprocessor.run(
                auth.tenant_id, self._prepare, body, "messages" if call.chat else "prompt",
                auth.tenant_id)
            streams = self._submit(call, body, spec)
            if body.stream:
                include = bool(body.stream_options and body.stream_options.include_usage)
                response = _FinalizingStreamingResponse(self._stream(call, streams, include),
                                                        call, streams, self._finalize)
                handed_off = True
                return response
            await self._collect(call, streams, is_disconnected)
            call.status = "ok"
            params = call.params
            if params is not None and (params.logprobs is not None
                                       or params.prompt_logprobs is not None):
                # Naming thousands of tokens takes a while: not on the event loop.
                body = await asyncio.to_thread(self.responses.response_body, call)
            else:
                body = self.responses.response_body(call)
            return JSONResponse(body, headers=call.limit_headers())
        except ClientGaveUp:
            # A normal event (a client timeout, a closed tab): one line, no traceback; the
            # response goes nowhere (nginx's 499: the client closed the request).
            usage = call.usage()
            logger.info("client gave up: request %s, tenant %s, %d prompt tokens, %d completion "
                        "tokens generated", call.request_id, call.auth.tenant_id,
                        usage.prompt_tokens, usage.completion_tokens)
            return Response(status_code=499)
        except asyncio.CancelledError:
            call.status = "aborted"
            raise
        finally:
            if not handed_off:
                self._finalize(call)

    @staticmethod
    def _describe(call: CompletionCall, body: ChatCompletionRequest | CompletionRequest) -> None:
        """Copies what shapes the response from the parsed body onto the call.

        Raises:
            APIError: 400 for ``prompt_logprobs`` with a streamed chat completion.
        """
        call.end_user = body.end_user()
        call.prompt_cache_key = body.prompt_cache_key
        call.wants_prompt_logprobs = body.prompt_logprobs is not None
        call.as_token_ids = body.return_tokens_as_token_ids
        if isinstance(body, CompletionRequest):
            call.echo, call.score_only = body.echo, body.echo and body.max_tokens == 0
        else:
            call.service_tier = "default" if body.service_tier else None
            call.tool_body = body if body.calls_tools() else None
            if body.stream and body.prompt_logprobs is not None:
                raise APIError(400, "prompt_logprobs: unsupported with stream for chat "
                               "completions; use a non-streamed call", "prompt_logprobs",
                               "unsupported_parameter")

    def _prepare(self, body: ChatCompletionRequest | CompletionRequest, prompt_param: str,
                 tenant_id: str) -> tuple[list[Prompt], StructuredOutput | None, Any]:
        """Checks the model, renders and tokenises the prompts and compiles the structured-output
        grammar, if any (in a worker thread: a costly schema costs its own tenant's share of the
        workers, never the engine loop). Returns (prompts, grammar spec, matcher), the last two
        None without a grammar.

        Raises:
            APIError: 400 unknown model, over-long prompt text, template or tokenizer failure.
        """
        if body.model != self.info.served_model_name:  # OpenAI answers 404 model_not_found
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{self.info.served_model_name!r}", "model", "model_not_found")
        prompts = self._tokenize(body, prompt_param)
        if not isinstance(body, ChatCompletionRequest):
            return prompts, None, None
        spec, param = self.prompts.tool_format.grammar(body), "tools"
        if spec is None and body.response_format is not None:
            spec, param = body.response_format.structured_output(), "response_format"
        if spec is None:
            return prompts, None, None
        try:
            return prompts, spec, self.info.grammar_compiler.matcher(spec, tenant_id)
        except InvalidRequestError as e:
            raise APIError(400, e.message, param, "invalid_value") from None

    def _submit(self, call: CompletionCall, body: ChatCompletionRequest | CompletionRequest,
                spec: StructuredOutput | None = None) -> list[RequestStreamLike]:
        """Checks the admitted, tokenised call, reserves its tokens and submits it; returns its
        n engine streams. ``spec``: the call's grammar (from ``_prepare``), checked with the
        other sampling settings (``SamplingParams`` refuses it with ``min_tokens``).

        Raises:
            APIError: 400 / 429 (nothing reaches the engine).
            EngineDeadError: the engine is not running.
        """
        prompt_param = "messages" if call.chat else "prompt"
        try:
            call.params = body.sampling_params(self.info.default_sampling, spec)
        except InvalidRequestError as e:
            raise APIError(400, e.message, e.param, e.code) from None
        if isinstance(body, ChatCompletionRequest) and body.calls_tools() \
                and self.prompts.tool_format.keep_special_tokens:
            call.params = dataclasses.replace(call.params, skip_special_tokens=False)
        try:
            call.cache_salt = call.auth.effective_salt(
                client_cache_salt(body.cache_salt, body.prompt_cache_key))
        except ValueError as e:
            raise APIError(400, str(e), "cache_salt", "invalid_value") from None
        call.offload = prompt_cache_retention(body.prompt_cache_retention, call.auth.quota,
                                              bool(self.info.kv_offload_tiers)) == "24h"
        limit, max_tokens = self.info.max_model_len, call.params.max_tokens
        for prompt in call.prompts:
            n = len(prompt.token_ids)
            if max_tokens is not None and n < limit and n + max_tokens > limit:  # OpenAI rule
                raise APIError(400, f"this model's maximum context length is {limit} tokens; "
                               f"you requested {n + max_tokens} tokens ({n} in the prompt, "
                               f"{max_tokens} in the completion)", "max_tokens",
                               "context_length_exceeded")
        requests = call.engine_requests()
        try:  # the engine's own check, before tokens are reserved: a bad prompt is a 400
            for req in requests[::call.params.n]:  # a prompt's n requests share it
                validate_request(req, self.info)
        except InvalidRequestError as e:
            raise APIError(400, e.message, prompt_param if e.param == "prompt" else e.param,
                           e.code) from None
        self._reserve(call)
        streams: list[RequestStreamLike] = []
        try:
            for req in requests:
                streams.append(self.engine.add_request(req))
        except BaseException:  # e.g. EngineDeadError (the prompt was validated above)
            for s in streams:
                s.close()
            if call.lease is not None:
                call.lease.cancel()  # refused before any work: counts nothing
                call.lease = None
            raise
        call.submitted = True
        call.choices = [ChoiceState(i, i // call.params.n) for i in range(len(requests))]
        return streams

    def _tokenize(self, body: ChatCompletionRequest | CompletionRequest,
                  prompt_param: str) -> list[Prompt]:
        """Chat template and tokenisation with this worker's tokenizer (worker thread)."""
        if isinstance(body, ChatCompletionRequest):
            return [Prompt(self.prompts.encode_chat(body.messages, param=prompt_param,
                                                    body=body))]
        prompts = body.prompts()
        self.prompts.check_chars(sum(len(p) for p in prompts if isinstance(p, str)),
                                 prompt_param)
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(Prompt(self.prompts.encode(p, prompt_param), p))
            else:  # out-of-vocabulary ids are refused by validate_request later
                text = self.prompts.decode(p, prompt_param) \
                    if body.echo and self.prompts.in_vocab(p) else ""
                out.append(Prompt(list(p), text))
        return out

    def admit(self, auth: AuthContext) -> Lease | None:
        """Takes a lease on the tenant's limits before any work: one request (rpm), one
        concurrency slot, and a token window that is not already full (tpm). Also used by
        other tenant routes that cost server work (``GET /v1/usage``).

        Returns:
            The lease (release it on every path), or None when the tenant has no limits.

        Raises:
            APIError: 429 ``rate_limit_exceeded`` with ``x-ratelimit-*`` and ``Retry-After``.
        """
        quota = auth.quota
        if not quota.any_limit:
            return None
        try:
            return self.limiter.acquire(auth.tenant_id, quota, 0)
        except RateLimitExceeded as e:
            raise APIError(429, e.message, None, "rate_limit_exceeded", e.headers) from None

    def _reserve(self, call: CompletionCall) -> None:
        """Reserves, per prompt, its tokens + n * max_tokens on the call's lease (tpm).

        Raises:
            APIError: 429 over the tenant's tpm; the call counts as one request, no tokens.
        """
        params = call.params
        if call.lease is None or params is None:
            return
        limit = self.info.max_model_len
        tokens = sum(len(p.token_ids) + params.n * (params.max_tokens or limit - len(p.token_ids))
                     for p in call.prompts)
        try:
            call.lease.reserve(call.auth.quota, tokens)
        except RateLimitExceeded as e:
            # The body was read and tokenised: the call counts as a request, with no tokens.
            call.lease.release(0)
            call.lease = None
            raise APIError(429, e.message, None, "rate_limit_exceeded", e.headers) from None

    def _finalize(self, call: CompletionCall) -> None:
        """Releases the lease (corrected to the tokens really used), counts metrics and stores
        usage without awaiting (so it also happens when the client has gone away)."""
        if call.finalized:
            logger.error("call %s finalised twice; ignoring the second time", call.request_id)
            return
        call.finalized = True
        if call.lease is not None:  # a call refused after admission counts as a request only
            call.lease.release(call.usage().total_tokens if call.submitted else 0)
        self.metrics.observe_request(call)
        if not self.usage_sink_blocks:
            try:
                self.record_usage(call.usage_record())
            except Exception as e:  # noqa: BLE001 - never fails the call it records
                logger.error("failed to record usage: %s", type(e).__name__)
            return
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, self.record_usage, call.usage_record())
        fut.add_done_callback(lambda f: f.exception() and logger.error(
            "failed to record usage: %s", type(f.exception()).__name__))

    # -- responses -----------------------------------------------------------------------------
    async def _collect(self, call: CompletionCall, streams: list[RequestStreamLike],
                       is_disconnected: Callable[[], Awaitable[bool]]) -> None:
        """Runs the call to completion; aborts it when the client disconnects (polled every
        second)."""

        async def run() -> None:
            async with aclosing(merge_streams(streams)) as outputs:
                async for i, out in outputs:
                    call.apply(i, out)

        task = asyncio.create_task(run())
        gone = False
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=1.0)
                if not task.done() and await is_disconnected():
                    task.cancel()
                    call.status = "aborted"
                    gone = True
            try:
                await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if gone and not (current is not None and current.cancelling()):
                    raise ClientGaveUp from None  # our own cancel, not the server's
                raise
        finally:
            if not task.done():
                task.cancel()
            for s in streams:
                s.close()

    async def _stream(self, call: CompletionCall, streams: list[RequestStreamLike],
                      include_usage: bool) -> AsyncGenerator[str, None]:
        """SSE body: role chunk (chat), one chunk per text delta or finish, the usage chunk
        (``stream_options.include_usage``), ``[DONE]``. Engine errors mid-stream are sent
        in-band in the OpenAI error shape.

        Completions with ``echo`` send each prompt's text (and, with ``logprobs``, its
        tokens' logprobs) in the choice's first chunk, once its prompt logprobs are known. A
        chat with tools offered sends each choice's content and ``delta.tool_calls`` in one
        chunk when it finishes (the text must be complete to be parsed)."""
        try:
            if call.chat:
                for c in call.choices:
                    yield sse(self.responses.chunk(call, include_usage, c.index, "", None,
                                                   role=True))
            # Characters sent per choice (completions ``text_offset``), None until the first.
            sent: list[int | None] = [None] * len(call.choices)
            assert call.params is not None
            n = call.params.n
            # A prompt's choices share the prompt logprobs its first choice computes: the
            # others' outputs wait until those are known (their first chunk carries them).
            wait_for_source = not call.chat and call.params.prompt_logprobs is not None
            held: dict[int, list[RequestOutput]] = {}
            async with aclosing(merge_streams(streams)) as outputs:
                async for i, out in outputs:
                    call.apply(i, out)
                    source = i - i % n
                    if wait_for_source and i != source \
                            and call.choices[source].prompt_logprobs is None:
                        held.setdefault(i, []).append(out)
                        continue
                    ready = [(i, out)]
                    if i == source:
                        ready += [(j, o) for j in range(i + 1, i + n) for o in held.pop(j, [])]
                    for j, o in ready:
                        for chunk in self.responses.output_chunks(call, j, o, sent, include_usage):
                            yield chunk
            call.status = "ok"
            if include_usage:
                cls = ChatCompletionStreamResponse if call.chat else CompletionStreamResponse
                yield sse(cls(id=call.request_id, created=call.created, model=call.model,
                               choices=[], usage=call.usage(), include_usage=True))
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            call.status = "aborted"
            raise
        except EngineDeadError:
            call.status = "error"
            yield sse(error_body(503, "the inference engine is not available", None,
                                  "engine_unavailable"))
        except RequestFailedError as e:
            call.status = "error"
            yield sse(error_body(500, e.message, None, "request_failed"))
        except Exception as e:  # noqa: BLE001 - never a stack trace to the client
            call.status = "error"
            logger.error("stream failed: %s", type(e).__name__)
            yield sse(error_body(500, "internal server error", None, "internal_error"))
        finally:
            for s in streams:
                s.close()
