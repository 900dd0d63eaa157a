"""Per-request sampling parameters (OpenAI / vLLM semantics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick and when to stop generating tokens.

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
    skip_special_tokens: bool = True
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

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
