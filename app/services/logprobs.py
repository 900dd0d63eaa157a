"""Logprobs in the OpenAI shapes: token text and bytes per token id, chat ``logprobs.content``,
completions ``logprobs`` (with ``echo``, the prompt's tokens first) and vLLM ``prompt_logprobs``.

Values come from the engine (``engine.request.TokenLogprobs``: raw ``log_softmax``); this module
only names the tokens. A byte-level BPE token (GPT-2 style, as SmolLM2's) may hold part of a
UTF-8 character: its ``bytes`` are exact and its ``token`` text has U+FFFD for the partial bytes,
as in the OpenAI API.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from app.protocol import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from engine.request import TokenLogprobs


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenTexts:
    """Token id -> (text, UTF-8 bytes), cached; event-loop use only.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        as_token_ids: vLLM ``return_tokens_as_token_ids``: every token is named
            ``"token_id:<id>"`` (unambiguous for clients that re-tokenise).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        decoder = _byte_decoder()
        if token_id not in self._special and piece and all(c in decoder for c in piece):
            raw = bytes(decoder[c] for c in piece)
        else:  # special tokens and tokenizers that are not byte-level
            raw = (piece if token_id in self._special
                   else self.tokenizer.decode([token_id])).encode("utf-8")
        result = (raw.decode("utf-8", errors="replace"), list(raw))
        if len(self._cache) < 1 << 17:
            self._cache[token_id] = result
        return result

    def text(self, token_id: int, as_token_ids: bool = False) -> str:
        return f"token_id:{token_id}" if as_token_ids else self.get(token_id)[0]


def chat_logprobs(texts: TokenTexts, entries: Sequence[TokenLogprobs],
                  as_token_ids: bool = False) -> ChatChoiceLogprobs:
    """Chat ``choices[].logprobs`` (or a stream delta's) for these generated tokens."""

    def top(tid: int, lp: float) -> TopLogprob:
        return TopLogprob(token=texts.text(tid, as_token_ids), logprob=lp,
                          bytes=texts.get(tid)[1])

    content = []
    for e in entries:
        head = top(e.token_id, e.logprob)
        content.append(ChatTokenLogprob(token=head.token, logprob=head.logprob, bytes=head.bytes,
                                        top_logprobs=[top(t, v) for t, v in e.top]))
    return ChatChoiceLogprobs(content=content)


def completion_logprobs(texts: TokenTexts, entries: Sequence[TokenLogprobs | None],
                        token_ids: Sequence[int], num_top: int, text_offset: int,
                        as_token_ids: bool = False) -> CompletionLogprobs:
    """Completions ``logprobs`` over ``token_ids`` (``entries[i]`` is token i's, None for the
    prompt's first token); ``text_offset``: characters of text before the first token.

    ``top_logprobs`` holds the ``num_top`` most likely tokens and the chosen one (vLLM)."""
    out = CompletionLogprobs()
    offset = text_offset
    for tid, e in zip(token_ids, entries):
        name = texts.text(tid, as_token_ids)
        out.tokens.append(name)
        out.text_offset.append(offset)
        offset += len(texts.text(tid))
        if e is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(e.logprob)
        top = {texts.text(t, as_token_ids): v for t, v in e.top[:num_top]}
        top.setdefault(name, e.logprob)
        out.top_logprobs.append(top)
    return out


def prompt_logprobs(texts: TokenTexts, entries: Sequence[TokenLogprobs | None],
                    as_token_ids: bool = False) -> PromptLogprobs:
    """vLLM ``prompt_logprobs``: per prompt token, None (the first) or token id -> entry, the
    prompt's own token and the top alternatives."""
    out: PromptLogprobs = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        row = {str(e.token_id): PromptLogprob(logprob=e.logprob, rank=e.rank,
                                              decoded_token=texts.text(e.token_id, as_token_ids))}
        for rank, (t, v) in enumerate(e.top, start=1):
            row.setdefault(str(t), PromptLogprob(logprob=v, rank=rank,
                                                 decoded_token=texts.text(t, as_token_ids)))
        out.append(row)
    return out
