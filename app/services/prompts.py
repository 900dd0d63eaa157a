"""Prompt text -> token ids (and back) for the API: length caps first, chat templating through
``app.services.chat_template``, tokenizer failures as 400s. Runs in a preprocessing worker
thread (``app.services.preprocess.Preprocessor``), with that thread's tokenizer copy."""

from __future__ import annotations

import json

from app.errors import APIError
from app.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from app.services.chat_template import render_chat
from app.services.preprocess import MAX_CHARS_PER_TOKEN, Preprocessor
from app.services.tools import offer_tools, plain_messages, tool_format_for
from engine.protocol import ModelInfo


class PromptEncoder:
    """Encodes prompts for one model with a preprocessor's per-thread tokenizers.

    Every method raises ``APIError`` (400, ``param`` as given) for input it cannot take.

    Attributes:
        tool_format: the model's tool-call format (``app.services.tools.tool_format_for``),
            chosen once from its chat template.
    """

    def __init__(self, info: ModelInfo, preprocessor: Preprocessor) -> None:
        self.info = info
        self.preprocessor = preprocessor
        self.tool_format = tool_format_for(info.tokenizer)

    def check_chars(self, num_chars: int, param: str) -> None:
        """Refuses prompt text that cannot fit the context, before any templating work."""
        limit = self.info.max_model_len * MAX_CHARS_PER_TOKEN
        if num_chars > limit:
            raise APIError(400, f"the prompt has {num_chars} characters; at most {limit} are "
                           f"accepted ({MAX_CHARS_PER_TOKEN} per token of the model's maximum "
                           f"context length of {self.info.max_model_len} tokens)", param,
                           "context_length_exceeded")

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Text the tokenizer cannot take (e.g. a lone UTF-16 surrogate from JSON ``"\\ud800"``)
        is a 400, not a 500."""
        self.check_chars(len(text), param)
        try:
            return self.preprocessor.tokenizer().encode(text,
                                                        add_special_tokens=add_special_tokens)
        except Exception:  # noqa: BLE001 - tokenizers raises TypeError/ValueError/Exception
            raise APIError(400, "the text could not be tokenized (invalid Unicode?)", param,
                           "invalid_value") from None

    def encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    param: str = "messages", body: ChatCompletionRequest | None = None
                    ) -> list[int]:
        """The chat template over ``messages`` (and the tools ``body`` offers); message text
        never becomes control tokens."""
        tokenizer = self.preprocessor.tokenizer()
        plain = plain_messages(messages, self.tool_format)
        tools = None
        if body is not None:
            plain, tools = offer_tools(plain, body, getattr(tokenizer, "chat_template", None),
                                       self.tool_format)
        # Tools a template renders, and calls it writes (passed as data), are prompt text too.
        tool_chars = len(json.dumps(tools)) if tools else 0
        self.check_chars(tool_chars, "tools")
        call_chars = sum(len(c.function.name) + len(c.function.arguments)
                         for m in messages for c in m.tool_calls or ()) \
            if any("tool_calls" in m for m in plain) else 0
        self.check_chars(sum(len(m["content"]) for m in plain) + call_chars + tool_chars,
                         param)
        try:
            return render_chat(tokenizer, plain, add_generation_prompt, tools)
        except Exception:  # noqa: BLE001 - any template or tokenizer error is a bad request
            raise APIError(400, "messages could not be rendered with the model's chat template",
                           param, "invalid_value") from None

    def in_vocab(self, ids: list[int]) -> bool:
        return all(0 <= t < self.info.vocab_size for t in ids)

    def decode(self, ids: list[int], param: str) -> str:
        """Raises APIError (400) for ids outside the vocabulary."""
        if not self.in_vocab(ids):
            raise APIError(400, f"token ids must be in [0, {self.info.vocab_size})", param,
                           "invalid_value")
        return self.preprocessor.tokenizer().decode(ids)


class TokenizerService:
    """vLLM's ``POST /tokenize`` and ``POST /detokenize`` for an authenticated tenant.

    The body is parsed and the work done in the tenant's share of the preprocessing workers
    (``Preprocessor``), so a flood of huge bodies from one tenant queues behind its own cap
    and does not stall other tenants; these calls use no engine time and are not rate
    limited (vLLM does not either).
    """

    def __init__(self, info: ModelInfo, preprocessor: Preprocessor) -> None:
        self.info = info
        self.preprocessor = preprocessor
        self.prompts = PromptEncoder(info, preprocessor)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.info.served_model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.info.served_model_name!r}", "model", "model_not_found")

    async def tokenize(self, raw: bytes, tenant_id: str) -> TokenizeResponse:
        """Raises APIError / RequestValidationError (400, 404 unknown model, 429 busy)."""
        body = await self.preprocessor.parse(tenant_id, TokenizeRequest, raw,
                                             self.info.max_model_len)
        self._check_model(body.model)
        return await self.preprocessor.run(tenant_id, self._tokenize, body)

    def _tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        if body.messages is not None:
            ids = self.prompts.encode_chat(body.messages, body.add_generation_prompt)
        else:
            ids = self.prompts.encode(body.prompt or "", "prompt",
                                      body.add_special_tokens is not False)
        strs = self.preprocessor.tokenizer().convert_ids_to_tokens(ids) \
            if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.info.max_model_len,
                                tokens=ids, token_strs=strs)

    async def detokenize(self, raw: bytes, tenant_id: str) -> DetokenizeResponse:
        """Raises APIError / RequestValidationError (400 ids outside the vocabulary, 404)."""
        body = await self.preprocessor.parse(tenant_id, DetokenizeRequest, raw,
                                             self.info.max_model_len)
        self._check_model(body.model)
        text = await self.preprocessor.run(tenant_id, self.prompts.decode, body.tokens,
                                           "tokens")
        return DetokenizeResponse(prompt=text)
