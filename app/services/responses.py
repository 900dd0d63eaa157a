"""Rendering a call as OpenAI responses: the JSON body, SSE chunks, logprobs (named by
``app.services.logprobs``), echo and tool calls (parsed by ``app.services.tools``)."""

from __future__ import annotations

import json

from pydantic import BaseModel

from app.protocol import (
    AssistantMessage,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    DeltaToolCall,
    PromptLogprobs,
    ToolCall,
)
from app.services.call import ChoiceState, CompletionCall
from app.services.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from app.services.tools import HERMES, ToolFormat
from engine.request import RequestOutput, TokenLogprobs


def sse(obj: BaseModel | dict) -> str:
    body = (obj.model_dump_json() if isinstance(obj, BaseModel)
            else json.dumps(obj, separators=(",", ":")))
    return f"data: {body}\n\n"


class ResponseBuilder:
    """Builds a call's response body and stream chunks.

    Args:
        token_texts: names tokens in logprobs (its own tokenizer copy; see ``TokenTexts``).
        tool_format: the model's tool-call format, which parses chat outputs when tools are
            offered (``app.services.tools``).
    """

    def __init__(self, token_texts: TokenTexts, tool_format: ToolFormat = HERMES) -> None:
        self.token_texts = token_texts
        self.tool_format = tool_format

    def response_body(self, call: CompletionCall) -> dict:
        return self._full_response(call).model_dump(mode="json")

    def _full_response(self, call: CompletionCall) -> ChatCompletionResponse | CompletionResponse:
        if call.chat:
            choices = []
            for c in call.choices:
                content, calls, finish = self._message(call, c)
                choices.append(ChatCompletionChoice(
                    index=c.index, message=AssistantMessage(content=content, tool_calls=calls),
                    logprobs=self._chat_logprobs(call, c.logprobs), finish_reason=finish))
            return ChatCompletionResponse(
                id=call.request_id, created=call.created, model=call.model, usage=call.usage(),
                choices=choices,
                service_tier=call.service_tier,
                prompt_logprobs=self._prompt_logprobs(call, call.choices[0]))
        return CompletionResponse(
            id=call.request_id, created=call.created, model=call.model, usage=call.usage(),
            choices=[CompletionChoice(
                index=c.index, text=self._echo_text(call, c) + c.text,
                logprobs=self._completion_logprobs(call, c, c.token_ids, c.logprobs,
                                                   echo=call.echo),
                finish_reason=c.finish_reason, prompt_logprobs=self._prompt_logprobs(call, c))
                for c in call.choices])

    def _message(self, call: CompletionCall, c: ChoiceState
                 ) -> tuple[str | None, list[ToolCall] | None, str | None]:
        """(content, tool calls, finish reason) of a finished chat choice: with tools offered,
        the output is parsed for calls, and a choice that made one finishes with
        ``tool_calls`` (OpenAI)."""
        if call.tool_body is None:
            return c.text, None, c.finish_reason
        content, calls = self.tool_format.parse(c.text, call.tool_body)
        if not calls:
            return content or "", None, c.finish_reason
        return content, calls, "tool_calls" if c.finish_reason == "stop" else c.finish_reason

    # -- logprobs and echo (app.services.logprobs names the tokens) -------------------------------
    def _chat_logprobs(self, call: CompletionCall, entries: list[TokenLogprobs]
                       ) -> ChatChoiceLogprobs | None:
        if call.params is None or call.params.logprobs is None:
            return None
        return chat_logprobs(self.token_texts, entries, call.as_token_ids)

    def _completion_logprobs(self, call: CompletionCall, c: ChoiceState, token_ids: list[int],
                             entries: list[TokenLogprobs], echo: bool,
                             text_offset: int = 0) -> CompletionLogprobs | None:
        """``echo``: the prompt's tokens (and their logprobs) come first."""
        params = call.params
        if params is None or params.logprobs is None:
            return None
        ids: list[int] = list(token_ids)
        lps: list[TokenLogprobs | None] = list(entries)
        if echo:
            prompt = call.prompts[c.prompt_index]
            ids = prompt.token_ids + ids
            lps = list(call.prompt_logprobs_of(c) or [None] * len(prompt.token_ids)) + lps
        return completion_logprobs(self.token_texts, lps, ids, params.logprobs, text_offset,
                                   call.as_token_ids)

    def _prompt_logprobs(self, call: CompletionCall, c: ChoiceState) -> PromptLogprobs | None:
        """vLLM ``prompt_logprobs``, only when the request asked for it by that name."""
        entries = call.prompt_logprobs_of(c)
        if not call.wants_prompt_logprobs or entries is None:
            return None
        return prompt_logprobs(self.token_texts, entries, call.as_token_ids)

    @staticmethod
    def _echo_text(call: CompletionCall, c: ChoiceState) -> str:
        return call.prompts[c.prompt_index].text if call.echo else ""

    def chunk(self, call: CompletionCall, include_usage: bool, i: int, text: str | None,
               finish_reason: str | None, role: bool = False,
               logprobs: ChatChoiceLogprobs | CompletionLogprobs | None = None,
               prompt_lps: PromptLogprobs | None = None,
               tool_calls: list[ToolCall] | None = None) -> BaseModel:
        if call.chat:
            delta = DeltaMessage(role="assistant" if role else None, content=text,
                                 tool_calls=None if tool_calls is None else [
                                     DeltaToolCall(index=k, **t.model_dump())
                                     for k, t in enumerate(tool_calls)])
            return ChatCompletionStreamResponse(
                id=call.request_id, created=call.created, model=call.model,
                include_usage=include_usage,
                choices=[ChatCompletionStreamChoice(
                    index=i, delta=delta, finish_reason=finish_reason,
                    logprobs=logprobs if isinstance(logprobs, ChatChoiceLogprobs) else None)])
        return CompletionStreamResponse(
            id=call.request_id, created=call.created, model=call.model,
            include_usage=include_usage,
            choices=[CompletionChoice(
                index=i, text=text or "", finish_reason=finish_reason,
                logprobs=logprobs if isinstance(logprobs, CompletionLogprobs) else None,
                prompt_logprobs=prompt_lps)])

    def _delta_logprobs(self, call: CompletionCall, c: ChoiceState, out: RequestOutput,
                        text_before: int) -> ChatChoiceLogprobs | CompletionLogprobs | None:
        """The logprobs of one engine output's new tokens, for a stream chunk."""
        if call.score_only or not out.new_logprobs:
            return None
        if call.chat:
            return self._chat_logprobs(call, list(out.new_logprobs))
        return self._completion_logprobs(call, c, list(out.new_token_ids),
                                         list(out.new_logprobs), echo=False,
                                         text_offset=text_before)

    def output_chunks(self, call: CompletionCall, i: int, out: RequestOutput,
                       sent: list[int | None], include_usage: bool) -> list[str]:
        """The SSE chunks of one engine output of choice ``i`` (already applied to the call);
        ``sent``: characters sent per choice, updated."""
        c = call.choices[i]
        chunks = []
        if sent[i] is None and not call.chat:
            first = self._first_completion_chunk(call, c, include_usage)
            sent[i] = len(self._echo_text(call, c))
            if first is not None:
                chunks.append(sse(first))
        new_text = "" if call.score_only else out.new_text
        logprobs = self._delta_logprobs(call, c, out, sent[i] or 0)
        if call.tool_body is not None:  # the text is parsed once complete
            if out.finished:
                content, calls, finish = self._message(call, c)
                chunks.append(sse(self.chunk(call, include_usage, i, content, finish,
                                               logprobs=logprobs, tool_calls=calls)))
            elif logprobs is not None:
                chunks.append(sse(self.chunk(call, include_usage, i, None, None,
                                               logprobs=logprobs)))
            return chunks
        if new_text or out.finished or logprobs is not None:
            chunks.append(sse(self.chunk(call, include_usage, i, new_text or None,
                                           c.finish_reason if out.finished else None,
                                           logprobs=logprobs)))
            sent[i] = (sent[i] or 0) + len(new_text)
        return chunks

    def _first_completion_chunk(self, call: CompletionCall, c: ChoiceState,
                                include_usage: bool) -> BaseModel | None:
        """A completions stream's first chunk for choice ``c``: the echoed prompt text (with
        its logprobs) and vLLM ``prompt_logprobs``; None when neither was asked for."""
        if not call.echo and not call.wants_prompt_logprobs:
            return None
        logprobs = None
        if call.echo:
            logprobs = self._completion_logprobs(call, c, [], [], echo=True)
        return self.chunk(call, include_usage, c.index, self._echo_text(call, c), None,
                           logprobs=logprobs, prompt_lps=self._prompt_logprobs(call, c))
