"""``ModelExecutor``: what ``LLMEngine`` needs from whatever runs the model (torch-free).

``engine.model_runner.ModelRunner`` is the real one (our model code on torch); tests use a
deterministic fake (``tests/fake_engine.py``) to run the real scheduler, block pool and API
without loading weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.request import TokenLogprobs
from engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class ExecuteOutput:
    """One step's results.

    Attributes:
        sampled: request id -> sampled token id, for chunks that reach the end of their known
            tokens (the others only filled KV).
        failed: request id -> client-safe reason, for requests whose own logits processing or
            sampling failed (the batched forward itself succeeded; their KV is valid).
        logprobs: request id -> the sampled token's logprobs, for requests with ``logprobs``.
        prompt_logprobs: request id -> (index of the first prompt token covered, logprobs of
            the prompt tokens this step's chunk predicts), for requests with
            ``prompt_logprobs``.
    """

    sampled: dict[str, int]
    failed: dict[str, str] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


class ModelExecutor(Protocol):
    """Runs scheduled batches on a model and owns the KV cache memory.

    Attributes:
        device: e.g. ``"cpu"``, ``"cuda:0"``.
        dtype: e.g. ``"float32"``.
        attention_backend: the resolved backend name (``"torch"`` | ``"triton"``).
        kv_cache_dtype: optional, the KV cache's dtype name (``--kv-cache-dtype``); read with
            ``dtype`` as its default.
    """

    device: str
    dtype: str
    attention_backend: str

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of K and V per block of ``block_size`` tokens, all layers."""
        ...

    def kv_cache_budget_bytes(self) -> int:
        """Bytes available for the KV cache (``--kv-cache-memory-bytes``, else a share of free
        GPU memory, else 1 GiB on CPU)."""
        ...

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocates the KV cache: ``num_blocks`` blocks of ``block_size`` tokens."""
        ...

    def execute(self, scheduled: SchedulerOutput) -> ExecuteOutput:
        """Runs one step: the batched forward, then sampling per request.

        Raises:
            Exception: the batched forward failed (every request of the step is affected).
        """
        ...

    def release(self, request_id: str) -> None:
        """Drops per-request state (e.g. a seeded RNG) when a request finishes."""
        ...
