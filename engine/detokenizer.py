"""Incremental detokenization with stop strings (the prefix/read offset scheme of vLLM and TGI)."""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as decoding context so the first output token gets the right spacing.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    A delta is withheld while the text ends in an incomplete UTF-8 sequence ("\\ufffd"), and the
    last ``len(longest stop) - 1`` characters are held back while streaming so a stop string is never
    partly sent (OpenAI: the stop sequence itself is not returned).

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompt_token_ids: the prompt (its tail is decoding context).
        stop: stop strings.
        skip_special_tokens: drop special tokens (eos, chat markers) from the text.
        min_tokens: stop strings are not looked for before this many tokens were added (vLLM).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""          # all output text decoded so far (truncated at a stop string)
        self.num_sent = 0       # characters of ``text`` already returned
        self.stopped_by: str | None = None
        self.min_tokens = min_tokens
        self.num_tokens = 0     # output tokens added

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int], finished: bool) -> str:
        """Appends tokens; returns the text delta ready to send.

        After it returns, ``stopped_by`` is the stop string that matched (the caller finishes the
        request), else None.
        """
        for tid in token_ids:
            self.ids.append(tid)
            self.num_tokens += 1
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                before = len(self.text)
                self.text += full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                if self.stop and self.num_tokens >= self.min_tokens \
                        and self._check_stop(before):
                    finished = True
                    break
        end = len(self.text) if finished else max(self.num_sent, len(self.text) - self.hold)
        delta = self.text[self.num_sent:end]
        self.num_sent = end
        return delta

    def _check_stop(self, before: int) -> bool:
        start = max(0, before - self.hold)
        hits = [(idx, s) for s in self.stop if (idx := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        idx, s = min(hits)
        self.text = self.text[:idx]
        self.stopped_by = s
        return True
