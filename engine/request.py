"""Engine-side request state and the plain-data records that cross the engine boundary."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from engine.block_hash import BlockHash
from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Waiting while the offload tiers' blocks of its prefix are loaded into the pool (vLLM's
    # WAITING_FOR_REMOTE_KVS); admitted as WAITING once they are.
    WAITING_FOR_KV_LOAD = "waiting_for_kv_load"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"          # eos, stop token or stop string
    FINISHED_LENGTH = "length"         # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"           # a fault attributable to this request (or its step)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass(frozen=True)
class TokenLogprobs:
    """The logprob of one token and the most likely alternatives at its position.

    Attributes:
        token_id: the token (sampled, or the prompt's).
        logprob: its natural-log probability under the model's raw logits (fp32).
        rank: 1 + the number of tokens more likely than it.
        top: (token id, logprob) of the most likely tokens, most likely first.
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TenantShare:
    """A tenant's claim on shared capacity (DESIGN "Multi-tenant capacity").

    Attributes:
        weight: integer >= 1; the tenant's share of each step's token budget and of the cached
            blocks is proportional to it (weighted fair queuing).
        min_cache_blocks: cached blocks the tenant keeps before any share-based eviction takes
            them (None: no floor).
        max_cache_blocks: above this many cached blocks the tenant is always over its share
            (None: no cap).
    """

    weight: int = 1
    min_cache_blocks: int | None = None
    max_cache_blocks: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.weight, bool) or not isinstance(self.weight, int) or self.weight < 1:
            raise ValueError(f"weight must be an integer >= 1, got {self.weight!r}")
        for name in ("min_cache_blocks", "max_cache_blocks"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be None or an integer >= 0, got {v!r}")


@dataclass(frozen=True)
class EngineRequest:
    """What the API layer submits. ``cache_salt`` is the tenant's effective salt (secret)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    tenant_id: str | None = None
    cache_salt: bytes | None = field(default=None, repr=False)
    # The tenant's cache generation (its salt version and cache epoch, opaque here): part of
    # the key of its offloaded blocks, so a reset or rotation leaves none of the older one
    # readable (engine.kv_offload.cipher).
    cache_generation: int = 0
    # False: its blocks stay in the pool only, never written to an offload tier (OpenAI's
    # prompt_cache_retention "in_memory"); it may still load what the tiers hold.
    offload: bool = True
    enable_prefix_caching: bool = True
    arrival_time: float = field(default_factory=time.monotonic)
    tenant_share: TenantShare = field(default_factory=TenantShare)
    # The n choices of one call of a tenant with prefix caching off share one prefill through a
    # private cache: ``cache_salt`` is then a random per-call salt (no other request can hit),
    # blocks lose their hash as soon as no sibling holds them (nothing stays cached), and no
    # prefix-cache statistics are recorded (vLLM shares parallel samples' prompt KV likewise).
    private_cache: bool = False
    # With ``sampling_params.structured_output``: this request's own llguidance matcher
    # (``engine.structured_output.GrammarCompiler.matcher``); compiled by ``attach_grammar``
    # when the caller did not.
    grammar: Any = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:  # redacted: no token ids, no salt
        return (f"EngineRequest(id={self.request_id!r}, tenant={self.tenant_id!r}, "
                f"num_prompt_tokens={len(self.prompt_token_ids)})")


class Request:
    """Mutable scheduler-side state of one sequence.

    Token ranges::

        |<------------- all_token_ids (num_tokens) -------------->|
        |<---- prompt_token_ids ---->|<---- output_token_ids ---->|
        |<-- num_computed_tokens -->|   (KV in cache; the rest is scheduled next)
    """

    def __init__(self, req: EngineRequest) -> None:
        self.request_id = req.request_id
        self.tenant_id = req.tenant_id
        self.cache_salt = req.cache_salt
        self.cache_generation = req.cache_generation
        self.offload = req.offload
        self.enable_prefix_caching = req.enable_prefix_caching
        self.private_cache = req.private_cache
        self.tenant_share = req.tenant_share
        self.sampling_params = req.sampling_params
        self.arrival_time = req.arrival_time
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(req.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens served from the prefix cache at first admission; -1 until admitted.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.block_hashes: list[BlockHash] = []
        # Tokens of the prefix loaded from the offload tiers before admission, and whether a
        # load ran since the request last waited (one load per wait).
        self.num_tier_tokens = 0
        self.kv_load_tried = False
        # Prompt tokens of full blocks this request added to the prefix cache (OpenAI's
        # prompt_tokens_details.cache_write_tokens).
        self.num_cache_write_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.first_token_time: float | None = None
        # Ids that end this request (eos unless ignore_eos, and stop_token_ids); set by the
        # scheduler, which knows the model's eos ids.
        self.stop_token_ids: frozenset[int] = frozenset(req.sampling_params.stop_token_ids)
        # With ``prompt_logprobs``: entry i is prompt token i's logprobs (None for token 0),
        # filled chunk by chunk as the prompt is computed.
        self.prompt_logprobs: list[TokenLogprobs | None] = [None]
        self.grammar = req.grammar  # llguidance matcher (structured output) or None
        self.penalty_state: Any = None  # engine.sampler.PenaltyState, with penalties

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def pop_output_token(self) -> None:
        """Takes back the last output token (it failed before it could be delivered)."""
        self.output_token_ids.pop()
        self.all_token_ids.pop()

    def __repr__(self) -> str:
        return (f"Request(id={self.request_id!r}, status={self.status.value}, "
                f"num_tokens={self.num_tokens}, num_computed={self.num_computed_tokens})")


@dataclass(frozen=True)
class RequestOutput:
    """One engine step's news for one request (incremental)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: str | None        # "stop" | "length" | "abort" | "error" | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    stop_reason: int | str | None = None
    # Set with finish_reason "error": what failed, client-safe (no prompt, no token ids).
    error: str | None = None
    # With ``logprobs``: one entry per id of ``new_token_ids``.
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    # With ``prompt_logprobs``: every prompt token's (None for the first), in the output that
    # carries the first generated token.
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    # Of ``num_cached_tokens``, tokens loaded from the offload tiers (the rest hit the pool).
    num_tier_tokens: int = 0
    # Prompt tokens this request added to the prefix cache (full blocks; OpenAI's
    # ``cache_write_tokens``); at most the prompt's uncached tokens.
    num_cache_write_tokens: int = 0
