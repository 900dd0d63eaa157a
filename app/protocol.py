"""OpenAI request and response bodies (the subset we serve); requests convert to ``SamplingParams``.

Field names, ranges and defaults follow the OpenAI API reference; unknown fields are ignored, as
vLLM's OpenAI server does.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    field_validator,
    model_serializer,
)

from engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    ignore_eos: bool = False
    cache_salt: str | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: float | None) -> float | None:
        if v:
            raise ValueError("only 0 is supported")
        return v

    def _sampling_params(self, max_tokens: int | None) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            seed=self.seed, stop=tuple(stops), ignore_eos=self.ignore_eos, n=self.n)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_completion_tokens or self.max_tokens)


class CompletionRequest(_SamplingFields):
    prompt: str | Annotated[list[StrictInt], Field(min_length=1)] | list[str]
    max_tokens: int | None = Field(16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list) -> str | list:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            return v[0]
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        return v

    def sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens)


# -- responses ---------------------------------------------------------------------------------
# Shapes of the OpenAI API reference (chat.completion, chat.completion.chunk, text_completion).


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """``usage``; ``prompt_tokens_details.cached_tokens`` is always present (0 on a miss)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """A stream delta; unset fields are left out (the final delta is ``{}``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class _StreamChunk(BaseModel):
    """With ``include_usage`` (``stream_options``) every chunk carries ``usage`` (null until the
    last, choice-less chunk); without it the key is absent, as in the OpenAI API."""

    id: str
    created: int
    model: str
    usage: UsageInfo | None = None
    include_usage: bool = Field(False, exclude=True)

    @model_serializer(mode="wrap")
    def _usage_only_when_asked(self, handler: SerializerFunctionWrapHandler) -> dict:
        body = handler(self)
        usage = body.pop("usage", None)
        ordered = {k: body[k] for k in ("id", "object", "created", "model", "choices")}
        if self.include_usage:
            ordered["usage"] = usage
        return ordered


class ChatCompletionStreamResponse(_StreamChunk):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionStreamChoice]


class CompletionStreamResponse(_StreamChunk):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "saltserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
