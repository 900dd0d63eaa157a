"""Per-request sampling parameters (OpenAI / vLLM semantics)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.structured_output import StructuredOutput

MAX_LOGPROBS = 20  # top logprobs per token (OpenAI chat ``top_logprobs`` <= 20; vLLM's default)
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit on ``logit_bias`` keys
MAX_STOP_TOKEN_IDS = 256  # each is masked per step while ``min_tokens`` holds


@dataclass(frozen=True)
class SamplingParams:
    """How to pick and when to stop generating tokens.

    Order of the logits processing (vLLM v1 sampler): ``logit_bias`` and the ``min_tokens`` mask
    on the raw logits, then the penalties, then greedy argmax, or temperature, top-k, top-p and a
    draw. Logprobs are the model's raw ``log_softmax`` (vLLM's default ``raw_logprobs``), so they
    match Hugging Face on the same model whatever the sampling settings.

    Attributes:
        max_tokens: upper bound on generated tokens; None = until max_model_len.
        temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables (vLLM uses -1).
        seed: per-request RNG seed; same seed + same prompt = same tokens.
        stop: strings that end generation; the matched string is not returned (OpenAI).
        stop_token_ids: extra token ids that end generation (besides the model's eos ids).
        ignore_eos: keep generating past eos (benchmarks).
        n: completions per prompt (the API layer fans out n requests).
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token already in
            the output (OpenAI).
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time it is in
            the output (OpenAI).
        repetition_penalty: > 0, 1 disables; the logit of a token in the prompt or the output is
            divided by it when positive, multiplied when negative (CTRL paper; vLLM, HF).
        logit_bias: token id -> bias in [-100, 100] added to its logit (OpenAI).
        min_tokens: eos and ``stop_token_ids`` are masked, and stop strings not checked, until
            this many tokens were generated (vLLM).
        logprobs: None, or the number (0..20) of top alternatives returned with the logprob of
            each generated token.
        prompt_logprobs: None, or the number (0..20) of top alternatives returned with the
            logprob of each prompt token after the first (vLLM); such a request skips the prefix
            cache lookup (its whole prompt is computed, as in vLLM), still adding to the cache.
        structured_output: None, or the grammar the output must match (JSON schema, any JSON
            object, regex, Lark); applied as a token mask before everything else.

    Raises:
        InvalidRequestError: (a ValueError) from ``validate``, ``param`` naming the field.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict, compare=False)
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    skip_special_tokens: bool = True
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def validate(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}", "top_k")
        if not 1 <= self.n <= 16:
            raise InvalidRequestError(f"n must be in [1, 16], got {self.n}", "n")
        if len(self.stop) > 4 or any(not s for s in self.stop):
            raise InvalidRequestError("stop takes up to 4 non-empty strings", "stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}",
                                          name)
        if not (0.0 < self.repetition_penalty <= 100.0 and math.isfinite(self.repetition_penalty)):
            raise InvalidRequestError("repetition_penalty must be in (0, 100], got "
                                      f"{self.repetition_penalty}", "repetition_penalty")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids",
                                      "stop_token_ids")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens",
                                      "logit_bias")
        for tid, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias} "
                                          f"for token {tid}", "logit_bias")
        if self.min_tokens < 0 or (self.max_tokens is not None
                                   and self.min_tokens > self.max_tokens):
            raise InvalidRequestError(f"min_tokens must be in [0, max_tokens], got "
                                      f"{self.min_tokens}", "min_tokens")
        if self.structured_output is not None and self.min_tokens:
            # A complete grammar allows only eos, which min_tokens would mask: nothing left.
            raise InvalidRequestError("min_tokens cannot be combined with structured output",
                                      "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v}", name)
