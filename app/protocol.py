"""OpenAI request and response bodies; requests convert to ``SamplingParams``.

Field names, ranges and defaults follow the OpenAI API reference. No field is silently ignored:
every field of the reference is implemented or refused with 400 ``unsupported_parameter``
naming it, and so is any unknown field (``extra="forbid"``). vLLM extensions we implement are
accepted under vLLM's names. ``docs/api.md`` has the table.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine.sampling_params import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, SamplingParams
from engine.structured_output import StructuredOutput

MAX_COMPLETION_LOGPROBS = 5  # OpenAI completions: ``logprobs`` <= 5
MAX_PROMPTS = 32  # prompts in one /v1/completions call
MAX_CHOICES = 64  # prompts x n in one call
MAX_USER_CHARS = 256  # ``user`` / ``safety_identifier``, stored in the usage row
MAX_CACHE_KEY_CHARS = 1024  # ``prompt_cache_key``, stored in the usage row
EMPTY: Mapping[str, float] = MappingProxyType({})


def _printable(v: str | None) -> str | None:
    """End-user ids are stored in usage rows: printable text only (a NUL would be refused by
    PostgreSQL at insert time, losing the row)."""
    if v is not None and not v.isprintable():
        raise ValueError("must be printable text (no control characters)")
    return v


def unsupported(reason: str) -> Any:
    """A field that is refused whenever it is set (not null): 400 ``unsupported_parameter``."""

    def check(v: Any) -> Any:
        if v is not None:
            raise PydanticCustomError("unsupported_parameter", reason)
        return v

    return Annotated[Any, AfterValidator(check),
                     Field(None, description=f"Unsupported (refused when set): {reason}")]


def _refuse(reason: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_parameter", reason)


class _Strict(BaseModel):
    """A request model that refuses unknown fields: none is ever silently ignored."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: unsupported("stream obfuscation is not supported")


class _SamplingFields(_Strict):
    """Fields common to chat completions and completions (OpenAI, then vLLM extensions)."""

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool = False
    cache_salt: str | None = None
    # OpenAI's prompt-cache grouping key: here it narrows sharing inside the tenant like
    # cache_salt (client_cache_salt); requests with the same key share cached prefixes. Stored
    # with the call's usage row.
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=MAX_CACHE_KEY_CHARS)
    # OpenAI's retention: "in_memory" keeps the prefix in the KV pool only; "24h" also in the
    # offload tiers (app.services.completions.prompt_cache_retention has the rules).
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return v

    @field_validator("user")
    @classmethod
    def _printable_user(cls, v: str | None) -> str | None:
        return _printable(v)

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo
                             ) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:  # values are checked by SamplingParams, with the other limits
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys are token ids, got {key[:20]!r}")
        return v

    def end_user(self) -> str | None:
        """The end user the call is made for (``safety_identifier``, else ``user``)."""
        return getattr(self, "safety_identifier", None) or self.user or None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None, defaults: Mapping[str, float],
                         structured_output: StructuredOutput | None = None) -> SamplingParams:
        """``defaults``: the model's generation-config values for omitted fields (vLLM)."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])

        def pick(name: str, neutral: float) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, neutral)

        top_k = int(pick("top_k", -1))
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
            top_k=-1 if top_k == 0 else top_k,
            seed=self.seed, stop=tuple(stops), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias={int(k): b for k, b in (self.logit_bias or {}).items()},
            min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured_output=structured_output, skip_special_tokens=self.skip_special_tokens)


_TEXT_ONLY = "this model takes text only"


def _check_content(v: Any) -> Any:
    """Message content: a string or a list of ``text`` parts; other parts are refused."""
    if isinstance(v, list):
        for part in v:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image_url", "input_audio", "file", "audio", "input_image"):
                raise _refuse(f"{_TEXT_ONLY}; a {kind!r} content part cannot be read")
    return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    """A call the model made: the function and its arguments as JSON text (OpenAI)."""

    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers
    refusal: str | None = None  # assistant messages: rendered as their text
    name: unsupported("message names are not rendered by this model's chat template")
    function_call: unsupported("function_call is deprecated and not supported; use tool_calls")
    audio: unsupported(_TEXT_ONLY)

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        return _check_content(v)

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("invalid_value", "only assistant messages have tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise PydanticCustomError("invalid_value",
                                      "tool messages, and only they, need a tool_call_id")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or self.refusal or ""


class FunctionDef(_Strict):
    """OpenAI ``tools[].function``: ``parameters`` is a JSON schema (default: no arguments)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
MAX_TOOLS = 128  # OpenAI's limit


class JsonSchemaFormat(BaseModel):
    """OpenAI ``response_format.json_schema``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: unsupported("the schema description is not rendered into the prompt; "
                             "describe the format in a message")
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI ``response_format``: free text, any JSON object, or JSON matching a schema
    (enforced by a grammar whether ``strict`` is set or not)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("invalid_value", "json_schema is required with type "
                                      "'json_schema' and only then")
        return self

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.json_schema is not None:
            # Key order kept: properties are generated in the schema's order (OpenAI).
            return StructuredOutput("json_schema", json.dumps(self.json_schema.schema_))
        return None



def client_cache_salt(cache_salt: str | None, prompt_cache_key: str | None) -> str | None:
    """The client part of a request's effective salt: ``cache_salt`` alone (vLLM), or, with
    ``prompt_cache_key`` (OpenAI), a digest of both, so each key (with or without a
    ``cache_salt``) is its own partition of the tenant's prefix cache."""
    if prompt_cache_key is None:
        return cache_salt
    digest = hashlib.sha256(b"saltserve/prompt-cache-key/v1\0" + (cache_salt or "").encode()
                            + b"\0" + prompt_cache_key.encode()).hexdigest()
    return "pck-" + digest


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default"] | None = None
    safety_identifier: str | None = Field(None, max_length=MAX_USER_CHARS)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: unsupported("functions is deprecated and not supported; use tools")
    function_call: unsupported("function_call is deprecated and not supported")
    audio: unsupported(_TEXT_ONLY)
    prediction: unsupported("predicted outputs are not supported")
    reasoning_effort: unsupported("this model does not reason; reasoning_effort is not "
                                  "supported")
    verbosity: unsupported("verbosity is not supported")
    web_search_options: unsupported("web search is not supported")
    metadata: unsupported("metadata needs stored completions, which are not supported")

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools: list[ToolDef] | None) -> list[ToolDef] | None:
        names = [t.function.name for t in tools or ()]
        if len(set(names)) != len(names):
            raise PydanticCustomError("invalid_value", "tool function names must be unique")
        return tools

    @model_validator(mode="after")
    def _tool_fields_need_tools(self) -> ChatCompletionRequest:
        if not self.tools:
            for name in ("tool_choice", "parallel_tool_calls"):
                if getattr(self, name) is not None:
                    raise PydanticCustomError("invalid_value",
                                              f"{name} is only allowed when tools are given")
            return self
        names = [t.function.name for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise PydanticCustomError("invalid_value", f"tool_choice names "
                                      f"{choice.function.name[:64]!r}, which is not in tools")
        if self.calls_tools() and self.response_format is not None \
                and self.response_format.type != "text":
            raise PydanticCustomError("invalid_value", "response_format cannot be combined "
                                      "with tools unless tool_choice is 'none'")
        return self

    def calls_tools(self) -> bool:
        """True when the model is offered tools (tools given and tool_choice is not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    @field_validator("safety_identifier")
    @classmethod
    def _printable_id(cls, v: str | None) -> str | None:
        return _printable(v)

    @field_validator("modalities")
    @classmethod
    def _text_modality_only(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and v != ["text"]:
            raise _refuse(f"{_TEXT_ONLY}; modalities must be [\"text\"]")
        return v

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, v: bool | None) -> bool | None:
        if v:
            raise _refuse("stored completions are not supported; store must be false")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def sampling_params(self, defaults: Mapping[str, float] = EMPTY,
                        structured_output: StructuredOutput | None = None) -> SamplingParams:
        """``structured_output``: the call's grammar (``response_format`` or the tools').

        Raises InvalidRequestError (a sampling value out of range, or ``min_tokens`` with a
        grammar)."""
        return self._sampling_params(
            self.max_completion_tokens or self.max_tokens,
            (self.top_logprobs or 0) if self.logprobs else None, self.prompt_logprobs, defaults,
            structured_output)


PromptList = str | Annotated[list[StrictInt], Field(min_length=1)] | list[str] \
    | list[Annotated[list[StrictInt], Field(min_length=1)]]


class CompletionRequest(_SamplingFields):
    # Field order matters: validators read the fields declared before theirs.
    prompt: PromptList
    echo: bool = False
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: unsupported("suffix (insertion) is not supported by this model")

    @field_validator("prompt")
    @classmethod
    def _check_prompts(cls, v: PromptList, info: ValidationInfo) -> PromptList:
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and v and not isinstance(v[0], int):
            if not 1 <= len(v) <= MAX_PROMPTS:
                raise ValueError(f"prompt takes 1 to {MAX_PROMPTS} prompts")
            if any(isinstance(p, str) and not p for p in v):
                raise ValueError("prompts must not be empty")
            if len(v) * info.data.get("n", 1) > MAX_CHOICES:
                raise ValueError(f"prompts x n must be at most {MAX_CHOICES}")
        elif isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _zero_only_to_score(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens 0 needs echo: true (scoring the prompt)")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            raise _refuse("best_of other than n is not supported")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the call: text or token ids, each its own choice index group."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self, defaults: Mapping[str, float] = EMPTY,
                        structured_output: StructuredOutput | None = None) -> SamplingParams:
        """Raises InvalidRequestError (a sampling value out of range)."""
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        # max_tokens 0 with echo scores the prompt: one token is computed, none returned.
        max_tokens = None if self.max_tokens is None else max(self.max_tokens, 1)
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, defaults,
                                     structured_output)


# -- responses ---------------------------------------------------------------------------------
# Shapes of the OpenAI API reference (chat.completion, chat.completion.chunk, text_completion).


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens served from the prefix cache (pool and offload tiers);
    ``cache_write_tokens``: prompt tokens this call added to it (OpenAI's field)."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0


class UsageInfo(BaseModel):
    """``usage``; ``prompt_tokens_details.cached_tokens`` is always present (0 on a miss)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    """One token of chat ``logprobs``: its text, logprob and UTF-8 bytes (OpenAI)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """Completions ``logprobs`` (OpenAI): parallel lists over the returned tokens; with
    ``echo`` the prompt's tokens come first (the first has no logprob)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM ``prompt_logprobs`` entry (keyed by token id in its dict)."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatCompletionChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    service_tier: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension


class DeltaToolCall(ToolCall):
    """A tool call in a stream delta: its position in the message's ``tool_calls``."""

    index: int


class DeltaMessage(BaseModel):
    """A stream delta; unset fields are left out (the final delta is ``{}``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension


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


# -- tokenizer endpoints (vLLM ``/tokenize``, ``/detokenize``) ---------------------------------


class TokenizeRequest(_Strict):
    """vLLM ``/tokenize``: ``prompt`` (completions) or ``messages`` (chat template), not both."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # prompts: default true; messages: false only
    add_generation_prompt: bool = True  # chat messages only (vLLM)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("invalid_value", "send exactly one of prompt and messages")
        if self.messages is not None and self.add_special_tokens:
            raise _refuse("add_special_tokens with messages: the chat template places the "
                          "special tokens")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str
