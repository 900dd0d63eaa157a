"""Chat templating that keeps message text as text.

Two faults of rendering with ``apply_chat_template`` and tokenising the result are fixed here:

- Control-token text inside a message (``<|im_end|>``, ``<|im_start|>system``) would become real
  control tokens and forge turns. Each message's content is replaced by a sentinel, the template
  is rendered, and the result is tokenised piece by piece: the template's own text with special
  tokens recognised, each message's content with special tokens split into plain text
  (``split_special_tokens``), so only the template's markers are control tokens.
- A ``developer`` message (OpenAI's newer name for ``system``) rendered by a template without a
  developer branch becomes an unknown role after the template's default system prompt. It is
  rendered as ``system``; leading system messages are merged into one (OpenAI sends both).

A message may carry ``tool_calls`` as data for a template that writes them itself (the Mistral
templates: ``app.services.tools.MistralFormat``): every string inside a call's ``function``
(the name, the arguments' keys and string values) is masked the same way, so the template
writes the call's JSON while the client's strings stay text.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Private-use code points: never produced by a template; a message's own text is tokenised
# separately, so a client sending these characters cannot forge a sentinel.
_OPEN, _CLOSE = "\ue000", "\ue001"
_SENTINEL = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


def normalize_roles(messages: list[dict[str, Any]], template: str | None
                    ) -> list[dict[str, Any]]:
    """``developer`` -> ``system`` when the template has no developer branch; leading system
    messages merged into one (joined by a blank line)."""
    if template is None or "developer" not in template:
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m
                    for m in messages]
    merged: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "system" and merged and all(x["role"] == "system" for x in merged):
            merged[0] = {**merged[0], "content": merged[0]["content"] + "\n\n" + m["content"]}
        else:
            merged.append(m)
    return merged


class _Masker:
    """Replaces texts by sentinels and remembers them (``texts[i]`` for sentinel ``i``)."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def text(self, text: str) -> str:
        self.texts.append(text)
        return f"{_OPEN}{len(self.texts) - 1}{_CLOSE}"

    def json_strings(self, value: Any) -> Any:
        """``value`` with every string (keys included) a sentinel for its JSON-escaped text:
        a template's ``tojson`` then writes the quotes around it."""
        if isinstance(value, str):
            return self.text(json.dumps(value, ensure_ascii=False)[1:-1])
        if isinstance(value, dict):
            return {self.json_strings(k): self.json_strings(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.json_strings(v) for v in value]
        return value

    def message(self, m: dict[str, Any]) -> dict[str, Any]:
        out = {**m, "content": self.text(m["content"])}
        if m.get("tool_calls"):  # the function's own keys stay (templates index them)
            out["tool_calls"] = [{**c, "function": {k: self.json_strings(v)
                                                    for k, v in c["function"].items()}}
                                 for c in m["tool_calls"]]
        return out


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True, tools: list[dict] | None = None
                ) -> list[int]:
    """Prompt token ids of ``messages`` under the tokenizer's chat template (with the
    generation prompt unless told otherwise), message text never parsed as special tokens;
    ``tools`` (OpenAI tool definitions) are passed to a template that renders them.

    Raises:
        Exception: whatever the template or the tokenizer raises (the caller answers 400).
    """
    messages = normalize_roles(messages, getattr(tokenizer, "chat_template", None))
    masker = _Masker()
    masked = [masker.message(m) for m in messages]
    contents = masker.texts
    extra = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(masked, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **extra)
    ids: list[int] = []
    pos = 0
    for match in _SENTINEL.finditer(text):
        if match.start() > pos:
            ids.extend(tokenizer.encode(text[pos:match.start()], add_special_tokens=False))
        content = contents[int(match.group(1))]
        if content:
            ids.extend(tokenizer.encode(content, add_special_tokens=False,
                                        split_special_tokens=True))
        pos = match.end()
    if pos < len(text):
        ids.extend(tokenizer.encode(text[pos:], add_special_tokens=False))
    return ids
