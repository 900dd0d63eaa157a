"""``EngineClient``: the one interface between the API layer and an inference engine.

Modelled on vLLM's ``vllm/engine/protocol.py``. ``app`` holds an ``EngineClient`` and nothing
else of the engine: it submits ``EngineRequest`` records, streams ``RequestOutput`` records back,
and manages the prefix cache through typed methods. This module imports no torch, so ``app`` and
its tests run the real ``AsyncLLM`` over a fake model (``tests/fake_engine.py``).

``validate_request`` is the single implementation of the checks of a request against the model
(prompt length, vocabulary). ``add_request`` runs it on the caller's thread before anything is
queued; an API layer may run it earlier (before its rate limits), the engine thread never does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from engine.errors import EngineDeadError, InvalidRequestError
from engine.request import EngineRequest, RequestOutput
from engine.stats import EngineStatsSnapshot

# Called on the consumer's event loop for each output that carries new tokens, with the seconds
# since the previous such output of the same request (None for the first one).
OutputObserver = Callable[[EngineRequest, RequestOutput, "float | None"], None]


class RequestStreamLike(Protocol):
    """What ``EngineClient.add_request`` returns: an async iterator of ``RequestOutput`` that
    aborts its request when closed early."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ModelInfo:
    """What a client may know about the served model (frozen at engine start-up).

    Attributes:
        served_model_name: the model id of ``/v1/models`` and the ``model`` request field.
        max_model_len: prompt + output tokens per request.
        vocab_size: valid token ids are ``[0, vocab_size)``.
        block_size: tokens per KV block (``cached_tokens`` is a multiple of it).
        num_blocks: KV blocks in the pool.
        device: where the model runs (``cpu``, ``cuda``, ...).
        cache_dtype: the KV cache's dtype (``float32``, ``bfloat16``: ``--kv-cache-dtype``).
        enable_prefix_caching: whether the engine caches prefixes at all (per-tenant switches
            come on top).
        eos_token_ids: token ids that end generation unless ``ignore_eos``.
        tokenizer: the Hugging Face tokenizer (chat template, encode); read-only use only.
        default_sampling: temperature / top_p / top_k / repetition_penalty defaults from the
            model's generation config (``--generation-config``), for requests that omit them.
        kv_offload_tiers: the offload tiers behind the pool, nearest first (``host``, ``disk``,
            ``redis``); empty: cached prefixes live in the pool only.
    """

    served_model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    eos_token_ids: tuple[int, ...] = ()
    device: str = "cpu"
    enable_prefix_caching: bool = True
    cache_dtype: str = "float32"
    kv_offload_tiers: tuple[str, ...] = ()
    tokenizer: Any = field(default=None, repr=False, compare=False)
    # Sampling defaults for fields a request omits (``engine.config.sampling_defaults``).
    default_sampling: dict[str, float] = field(default_factory=dict, compare=False)
    # The engine's ``engine.structured_output.GrammarCompiler`` (shared cache), thread-safe.
    grammar_compiler: Any = field(default=None, repr=False, compare=False)


def validate_request(request: EngineRequest, info: ModelInfo) -> None:
    """Checks ``request`` against the model; pure, thread-safe, cheap (one pass over the ids).

    Sampling parameters were already checked when ``SamplingParams`` was built.

    Raises:
        InvalidRequestError: empty prompt (``param="prompt"``), prompt that leaves no room for one
            output token (``context_length_exceeded``), or a token id outside the vocabulary (in
            the prompt, ``logit_bias`` or ``stop_token_ids``).
    """
    n = len(request.prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", "prompt")
    limit = info.max_model_len
    if n >= limit:
        raise InvalidRequestError(
            f"this model's maximum context length is {limit} tokens; the prompt has {n} tokens "
            "and at least 1 output token is needed", "prompt", "context_length_exceeded")
    vocab = info.vocab_size
    if min(request.prompt_token_ids) < 0 or max(request.prompt_token_ids) >= vocab:
        raise InvalidRequestError(f"token ids must be in [0, {vocab})", "prompt")
    params = request.sampling_params
    for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"{name} token ids must be in [0, {vocab})", name)


def attach_grammar(request: EngineRequest, info: ModelInfo) -> EngineRequest:
    """``request`` with its own grammar matcher when it asks for structured output and has
    none yet (compiled, or copied from the compiler's cache, on the caller's thread).

    Raises:
        InvalidRequestError: the schema or grammar is invalid (``param="response_format"``).
    """
    spec = request.sampling_params.structured_output
    if spec is None or request.grammar is not None:
        return request
    return replace(request, grammar=info.grammar_compiler.matcher(spec, request.tenant_id))


class EngineClient(ABC):
    """An engine as the API layer sees it (vLLM ``EngineClient``).

    Lifecycle: ``start()`` before the first request (the app's lifespan does it), ``shutdown()``
    at the end. Every method may raise ``EngineDeadError`` once the engine has died.
    """

    # -- lifecycle -----------------------------------------------------------------------------
    @abstractmethod
    def start(self) -> None:
        """Starts the engine loop (idempotent)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stops the engine loop; open streams end with ``EngineDeadError``."""

    @property
    @abstractmethod
    def is_running(self) -> bool:
        """True while the loop runs and has not failed."""

    @property
    def errored(self) -> bool:
        """True once the engine loop has failed (``dead_error`` says why)."""
        return self.dead_error is not None

    @property
    @abstractmethod
    def dead_error(self) -> BaseException | None:
        """The exception that killed the engine loop, or None."""

    async def check_health(self) -> None:
        """Returns while the engine can serve.

        Raises:
            EngineDeadError: the loop has died or is not running.
        """
        if not self.is_running:
            raise EngineDeadError("engine is not running")

    # -- requests ------------------------------------------------------------------------------
    @abstractmethod
    def model_info(self) -> ModelInfo:
        """The served model's frozen facts (no engine-thread hop)."""

    @abstractmethod
    def add_request(self, request: EngineRequest) -> RequestStreamLike:
        """Validates ``request`` (``validate_request``, on the caller's thread), queues it
        and returns the stream of its outputs (vLLM ``AsyncLLM.add_request``).

        The stream ends after the finished output; closing it earlier aborts the request and
        frees its blocks.

        Raises:
            InvalidRequestError: the request is invalid; nothing was queued.
            EngineDeadError: the engine is not running.
        """

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """``add_request`` + iterate: yields outputs until the finished one.

        Closing or cancelling the iterator (client disconnect) aborts the request.

        Raises:
            InvalidRequestError, EngineDeadError: see ``add_request``; EngineDeadError also when
                the engine dies mid-stream.
        """
        stream = self.add_request(request)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    @abstractmethod
    async def abort(self, request_ids: list[str]) -> None:
        """Aborts requests wherever they are (unknown ids are ignored); their blocks are freed."""

    def add_output_observer(self, observer: OutputObserver) -> None:
        """Registers ``observer(request, output, seconds_since_previous_token)`` (optional)."""

    # -- prefix cache and stats ----------------------------------------------------------------
    @abstractmethod
    async def evict_tenant_cache(self, tenant_id: str | None, reason: str) -> int:
        """Drops every cached block owned by ``tenant_id``; running requests are unharmed.

        Returns:
            Blocks dropped (counted as evictions of ``tenant_id`` for ``reason``).

        Raises:
            ValueError: ``reason`` is not ``"salt_rotation"`` or ``"reset"``.
        """

    @abstractmethod
    async def reset_prefix_cache(self) -> int:
        """Drops every cached block of every tenant. Returns blocks dropped."""

    @abstractmethod
    async def stats(self) -> EngineStatsSnapshot:
        """A frozen snapshot of the engine's counters and gauges (``engine.stats``)."""


__all__ = ["EngineClient", "EngineDeadError", "InvalidRequestError", "ModelInfo",
           "OutputObserver", "RequestStreamLike", "attach_grammar", "validate_request"]
