"""Tool calling in each model family's own format, chosen once per model from its chat template.

Three formats, each the text of one of vLLM's tool parsers (``--tool-call-parser``):

- ``hermes`` (Qwen2.5, Qwen3, Hermes, SmolLM3; the default)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): ``{"name": "get_weather", "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several calls separated by ``"; "``.
- ``mistral`` (Mistral v0.3 and later templates):
  ``[TOOL_CALLS][{"name": "get_weather", "arguments": {...}}, ...]``; with the templates of
  Mistral's v11+ tokenizers (Mistral Small 3.2, Magistral, Devstral, Ministral 3), whose
  template writes ``[ARGS]``, one ``[TOOL_CALLS]get_weather[ARGS]{...}`` per call.

``tool_call_format`` picks the name from markers in the chat template (the rule is in its
docstring and in docs/api.md); ``tool_format_for`` builds the format object for a tokenizer.
Each object (``ToolFormat``) offers the same five things:

- ``system_prompt``: for a template that does not render ``tools``, a system section that lists
  the functions and shows the format (a template that renders ``tools`` gets them instead).
- ``grammar``: the llguidance grammar of the output. Every call is well formed, its arguments
  valid against the function's JSON schema in compact JSON (no free whitespace); ``required``
  and a named function allow only calls, ``auto`` allows calls or a text answer whose first
  non-blank character can never begin a call, so any call the model starts is valid.
- ``parse``: (content, calls) of a finished output, in linear time; calls are recognised only
  at the start of the output (the only place the grammar lets them begin); malformed text is
  content, never an error.
- ``render_call`` / ``render_message``: assistant ``tool_calls`` and ``tool`` results of the
  history as the family's template expects them, so a multi-turn round trip keeps them.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from typing import Any, Protocol

from app.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    ToolDef,
)
from engine.structured_output import StructuredOutput

# Compact JSON inside calls: free whitespace would let a call grow without bound.
_STRICT_JSON = {"whitespace_flexible": False}
# The blanks a text answer may start with (``auto``), skipped by the parsers too: the same set
# on both sides, so a text answer can never be read back as a call.
_BLANKS = " \t\r\n"
_BLANKS_CLASS = r" \t\r\n"  # the same, inside a grammar's regex character class
_DECODER = json.JSONDecoder()


class ToolFormat(Protocol):
    """One tool-call format: prompt, grammar, parser and history rendering of one family."""

    name: str
    # The output's text keeps special tokens when tools are offered (the format's markers are
    # special tokens that ``parse`` must see).
    keep_special_tokens: bool

    def system_prompt(self, tools: list[ToolDef], parallel: bool) -> str:
        """The system section that offers ``tools`` to a template without tool support."""
        ...

    def grammar(self, body: ChatCompletionRequest) -> StructuredOutput | None:
        """The output's grammar when ``body`` offers tools, else None."""
        ...

    def parse(self, text: str, body: ChatCompletionRequest
              ) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output; never raises."""
        ...

    def render_call(self, calls: list[ToolCall]) -> str:
        """The text of ``calls`` in this format (what ``parse`` reads back)."""
        ...

    def render_message(self, message: ChatMessage) -> dict[str, Any]:
        """One history message for ``render_chat`` (``role``, ``content`` and whatever else
        the family's template reads)."""
        ...


def _template_text(template: Any) -> str:
    """A tokenizer's ``chat_template`` as one string (it may be a dict of named templates)."""
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def template_renders_tools(template: Any) -> bool:
    return "tools" in _template_text(template)


def tool_call_format(chat_template: Any) -> str:
    """The tool-call format a model answers in, from markers in its chat template:

    1. ``<tool_call>`` (Qwen2.5 / Qwen3, Hermes, SmolLM3 templates): ``hermes``;
    2. ``[TOOL_CALLS]`` or ``[AVAILABLE_TOOLS]`` (Mistral v0.3+ templates): ``mistral``;
    3. ``<|python_tag|>`` or the instruction ``"parameters": dictionary`` (Llama 3.1 / 3.3
       templates carry both, Llama 3.2's the second): ``llama3_json``;
    4. anything else, a template without tool support included: ``hermes``.
    """
    text = _template_text(chat_template)
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text or "[AVAILABLE_TOOLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or '"parameters": dictionary' in text:
        return "llama3_json"
    return "hermes"


def tool_format_for(tokenizer: Any) -> ToolFormat:
    """The format object for a model's tokenizer (its chat template picks the format; its
    vocabulary says whether the format's marker is one token the grammar can name)."""
    template = _template_text(getattr(tokenizer, "chat_template", None))
    name = tool_call_format(template)
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab: dict[str, int] = get_vocab() if callable(get_vocab) else {}
    if name == "llama3_json":
        return Llama3JsonFormat(vocab.get(Llama3JsonFormat.TAG))
    if name == "mistral":
        return MistralFormat(vocab.get(MistralFormat.MARKER), "tool_calls" in template,
                             args=MistralFormat.ARGS in template,
                             args_id=vocab.get(MistralFormat.ARGS))
    return HERMES


# -- shared pieces ----------------------------------------------------------------------------
def _offered(body: ChatCompletionRequest) -> list[ToolDef]:
    """The tools the model sees: only the named one with a named ``tool_choice``."""
    assert body.tools is not None
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        return [t for t in body.tools if t.function.name == choice.function.name]
    return body.tools


def _offered_names(body: ChatCompletionRequest) -> set[str]:
    return {t.function.name for t in _offered(body)}


def _call_schema(tool: ToolDef, arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call. Unless the function sets ``strict: false``, its arguments
    object takes no properties beyond the declared ones (OpenAI strict mode; a small model
    otherwise invents extra keys)."""
    params = dict(tool.function.parameters or {"type": "object", "properties": {}})
    if tool.function.strict is not False and "properties" in params:
        params.setdefault("additionalProperties", False)
    return {"type": "object", "properties": {"name": {"const": tool.function.name},
                                             arguments_key: params},
            "required": ["name", arguments_key], "additionalProperties": False}


def _calls_lark(body: ChatCompletionRequest, arguments_key: str, call: str, sep: str,
                not_first: str, head: str = "", tail: str = "") -> StructuredOutput | None:
    """The Lark grammar shared by the formats: ``head``, one or more ``call`` (each around
    ``body``, the call's JSON) separated by ``sep`` (only one without ``parallel_tool_calls``
    or with a named ``tool_choice``), ``tail``; with ``auto``, a text answer instead whose
    first non-blank character is none of ``not_first`` (the characters a call can begin
    with)."""
    if not body.calls_tools():
        return None
    choice = body.tool_choice
    schemas = [_call_schema(t, arguments_key) for t in _offered(body)]
    schema = {"x-guidance": _STRICT_JSON,
              **(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})}
    more = f" ({sep} call)*" if body.parallel_tool_calls is not False and \
        not isinstance(choice, NamedToolChoice) else ""
    answer = "free | " if choice in (None, "auto") else ""
    return StructuredOutput("lark", (
        f"start: {answer}calls\n"
        f"calls: {head}call{more}{tail}\n"
        f"free: /[{_BLANKS_CLASS}]*[^{_BLANKS_CLASS}{not_first}](?s:.*)/\n"
        f"call: {call}\n"
        f"body: %json {json.dumps(schema)}\n"))


def _skip_blanks(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _BLANKS:
        pos += 1
    return pos


def _new_call(value: Any, names: set[str], keys: tuple[str, ...]) -> ToolCall | None:
    """A ``ToolCall`` from a decoded JSON value ``{"name": ..., <key>: {...}}`` naming an
    offered function (the first of ``keys`` present holds the arguments), else None."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    arguments = next((value[k] for k in keys if k in value), {})
    return ToolCall(id=f"call_{secrets.token_hex(12)}",
                    function=FunctionCall(name=name, arguments=json.dumps(arguments)))


def _decode(text: str, pos: int) -> tuple[Any, int] | None:
    """(value, end) of the JSON value at ``pos``, or None (also for nesting too deep for
    Python's decoder); linear in what it reads."""
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


def _arguments(call: ToolCall) -> Any:
    """A call's arguments as JSON data (the text itself when it is not JSON)."""
    try:
        return json.loads(call.function.arguments)
    except (ValueError, RecursionError):
        return call.function.arguments


def _keep(calls: list[ToolCall], body: ChatCompletionRequest) -> list[ToolCall]:
    return calls[:1] if body.parallel_tool_calls is False else calls


def _listing(tools: list[ToolDef]) -> str:
    return "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in tools)


def _with_calls(message: ChatMessage, calls: str) -> str:
    return f"{message.text()}\n{calls}" if message.text() else calls


# -- hermes -----------------------------------------------------------------------------------
class HermesFormat:
    """``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` blocks, one per call,
    separated by a newline (vLLM's ``hermes`` parser; the Qwen2.5 / Qwen3 templates). Tool
    results are rendered as ``<tool_response>`` blocks."""

    name = "hermes"
    keep_special_tokens = False
    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"

    def system_prompt(self, tools: list[ToolDef], parallel: bool) -> str:
        many = ("You may call several functions, one block each."
                if parallel else "Call at most one function.")
        return ("You can call functions. Their signatures are JSON objects, one per line:\n"
                f"<tools>\n{_listing(tools)}\n</tools>\n"
                "To call a function, answer with only this block:\n"
                '<tool_call>\n{"name": <function name>, "arguments": <JSON object of '
                'arguments>}\n'
                f"</tool_call>\n{many} Otherwise answer normally.")

    def grammar(self, body: ChatCompletionRequest) -> StructuredOutput | None:
        return _calls_lark(body, "arguments", '"<tool_call>\\n" body "\\n</tool_call>"',
                           '"\\n"', "<")

    def parse(self, text: str, body: ChatCompletionRequest
              ) -> tuple[str | None, list[ToolCall]]:
        """The ``<tool_call>`` blocks at the start of the output whose body is a JSON object
        naming an offered function; without ``parallel_tool_calls`` only the first is kept.
        Anything else is content."""
        names = _offered_names(body)
        calls: list[ToolCall] = []
        pos = _skip_blanks(text, 0)
        while text.startswith(self._OPEN, pos):
            end = text.find(self._CLOSE, pos + len(self._OPEN))
            if end < 0:
                break
            try:
                value = json.loads(text[pos + len(self._OPEN):end])
            except (ValueError, RecursionError):
                break
            call = _new_call(value, names, ("arguments", "parameters"))
            if call is None:
                break
            calls.append(call)
            pos = _skip_blanks(text, end + len(self._CLOSE))  # the newline between calls
        if not calls:
            return text, []
        return (text[pos:].strip() or None), _keep(calls, body)

    def render_call(self, calls: list[ToolCall]) -> str:
        return "\n".join(
            f"{self._OPEN}\n"
            + json.dumps({"name": c.function.name, "arguments": _arguments(c)})
            + f"\n{self._CLOSE}" for c in calls)

    def render_message(self, message: ChatMessage) -> dict[str, Any]:
        if message.role == "tool":
            text = f"<tool_response>\n{message.text()}\n</tool_response>"
        elif message.tool_calls:
            text = _with_calls(message, self.render_call(message.tool_calls))
        else:
            text = message.text()
        return {"role": message.role, "content": text}


# -- llama3_json ------------------------------------------------------------------------------
class Llama3JsonFormat:
    """``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several
    calls separated by ``"; "`` (vLLM's ``llama3_json`` parser; the Llama 3.1 / 3.2 / 3.3
    templates, whose tool instructions ask for this JSON).

    History follows the Llama 3.1 template: an assistant call is the text that template writes
    for ``tool_calls`` (``{"name": "f", "parameters": <arguments>}``; several joined by
    ``"; "``, which that template refuses to render itself), and a tool result is passed as
    the ``tool`` message's plain content (the template puts it in an ``ipython`` turn).

    Args:
        tag_id: the token id of ``<|python_tag|>``, or None when the tokenizer lacks it (the
            grammar then offers no tag).
    """

    name = "llama3_json"
    keep_special_tokens = False
    TAG = "<|python_tag|>"

    def __init__(self, tag_id: int | None = None) -> None:
        self.tag_id = tag_id

    def system_prompt(self, tools: list[ToolDef], parallel: bool) -> str:
        many = ('You may call several functions, separated by "; ".'
                if parallel else "Call at most one function.")
        return ("Given the following functions, please respond with a JSON for a function call "
                "with its proper arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of '
                "argument name and its value}. Do not use variables.\n\n"
                f"{_listing(tools)}\n\n{many} Otherwise answer normally.")

    def grammar(self, body: ChatCompletionRequest) -> StructuredOutput | None:
        tag = f"<[{self.tag_id}]>? " if self.tag_id is not None else ""
        return _calls_lark(body, "parameters", "body", '"; "', "{<", head=tag)

    def parse(self, text: str, body: ChatCompletionRequest
              ) -> tuple[str | None, list[ToolCall]]:
        """The calls at the start of the output (after ``<|python_tag|>`` when it is there, as
        text), each a JSON object naming an offered function with its ``parameters`` (or
        ``arguments``), separated by ``;``. Anything else is content."""
        names = _offered_names(body)
        calls: list[ToolCall] = []
        pos = _skip_blanks(text, 0)
        if text.startswith(self.TAG, pos):
            pos = _skip_blanks(text, pos + len(self.TAG))
        end = pos
        while True:
            decoded = _decode(text, pos)
            call = None if decoded is None else _new_call(decoded[0], names,
                                                          ("parameters", "arguments"))
            if call is None or decoded is None:
                break
            calls.append(call)
            end = decoded[1]
            after = _skip_blanks(text, end)
            if not text.startswith(";", after):
                break
            pos = _skip_blanks(text, after + 1)
        if not calls:
            return text, []
        return (text[end:].strip() or None), _keep(calls, body)

    def render_call(self, calls: list[ToolCall]) -> str:
        return "; ".join(json.dumps({"name": c.function.name, "parameters": _arguments(c)})
                         for c in calls)

    def render_message(self, message: ChatMessage) -> dict[str, Any]:
        if message.tool_calls:
            return {"role": message.role,
                    "content": _with_calls(message, self.render_call(message.tool_calls))}
        return {"role": message.role, "content": message.text()}


# -- mistral ----------------------------------------------------------------------------------
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def mistral_call_id(call_id: str) -> str:
    """The id the Mistral templates accept (nine letters or digits, mistral-common's rule): the
    id itself when it is one, else nine hex digits of its SHA-256, so a call and its result
    still match."""
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    return hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).hexdigest()[:9]


class MistralFormat:
    """``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}`` (vLLM's
    ``mistral`` parser; the Mistral v0.3 templates with ``[AVAILABLE_TOOLS]`` /
    ``[TOOL_CALLS]``); with ``args`` (the templates of Mistral's v11+ tokenizers), each call
    as ``[TOOL_CALLS]name[ARGS]{...}`` instead, one after another (vLLM's v11+ parsing).

    History follows those templates: assistant ``tool_calls`` are passed to the template as
    data (it writes ``[TOOL_CALLS] [...]`` itself and leaves those turns out of its
    user/assistant alternation check; ``render_chat`` keeps their strings plain text), and a
    tool result is the ``tool`` message's content with its ``tool_call_id``; ids become the
    nine-character ids the template demands (``mistral_call_id``). A template that does not
    read ``tool_calls`` gets the calls as text instead.

    Args:
        marker_id: the token id of ``[TOOL_CALLS]``, or None when the tokenizer lacks it (the
            grammar then spells it as text).
        template_renders_calls: the template reads messages' ``tool_calls``.
        args: calls as ``[TOOL_CALLS]name[ARGS]{...}`` (the template writes ``[ARGS]``).
        args_id: the token id of ``[ARGS]``, or None (the grammar spells it as text).
    """

    name = "mistral"
    MARKER = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def __init__(self, marker_id: int | None = None,
                 template_renders_calls: bool = True, args: bool = False,
                 args_id: int | None = None) -> None:
        self.marker_id = marker_id
        self.template_renders_calls = template_renders_calls
        self.args, self.args_id = args, args_id

    @property
    def keep_special_tokens(self) -> bool:
        """Whether a call's output must keep special tokens in its text: the v11+ markers are
        special tokens, and without them a call reads as plain text (vLLM's Mistral parser
        turns ``skip_special_tokens`` off the same way)."""
        return self.args

    def system_prompt(self, tools: list[ToolDef], parallel: bool) -> str:
        many = ("You may call several functions in the list."
                if parallel else "Call at most one function.")
        how = ("[TOOL_CALLS]<function name>[ARGS]<JSON object of arguments>, once per call"
               if self.args else
               '[TOOL_CALLS][{"name": <function name>, "arguments": <JSON object of '
               'arguments>}]')
        return ("You can call functions. Their signatures are JSON objects, one per line:\n"
                f"[AVAILABLE_TOOLS]\n{_listing(tools)}\n[/AVAILABLE_TOOLS]\n"
                f"To call functions, answer with only {how}\n"
                f"{many} Otherwise answer normally.")

    def _token(self, token_id: int | None, text: str) -> str:
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)

    def grammar(self, body: ChatCompletionRequest) -> StructuredOutput | None:
        marker = self._token(self.marker_id, self.MARKER)
        if not self.args:
            return _calls_lark(body, "arguments", "body", '","', "\\[",
                               head=marker + ' " "? "[" ', tail=' "]"')
        if not body.calls_tools():
            return None
        # One alternative per offered function: its name, [ARGS], then its arguments' schema.
        tools = _offered(body)
        alts = " | ".join(f"{json.dumps(t.function.name)} {self._token(self.args_id, self.ARGS)}"
                          f" args{i}" for i, t in enumerate(tools))
        rules = "".join(
            f"args{i}: %json "
            f"{json.dumps({'x-guidance': _STRICT_JSON, **_call_schema(t)['properties']['arguments']})}\n"
            for i, t in enumerate(tools))
        more = "+" if body.parallel_tool_calls is not False and \
            not isinstance(body.tool_choice, NamedToolChoice) else ""
        answer = "free | " if body.tool_choice in (None, "auto") else ""
        return StructuredOutput("lark", (
            f"start: {answer}calls\n"
            f"calls: call{more}\n"
            f"free: /[{_BLANKS_CLASS}]*[^{_BLANKS_CLASS}\\[](?s:.*)/\n"
            f"call: {marker} ({alts})\n" + rules))

    def parse(self, text: str, body: ChatCompletionRequest
              ) -> tuple[str | None, list[ToolCall]]:
        """``[TOOL_CALLS]`` (or nothing, when the detokenizer dropped that special token) and a
        JSON array at the start of the output whose items all name offered functions with
        their ``arguments``; with ``args``, calls ``[TOOL_CALLS]name[ARGS]{...}`` one after
        another (the marker required: the text keeps special tokens, ``keep_special_tokens``,
        so that a text answer ``name{...}`` stays text). Anything else is content."""
        names = _offered_names(body)
        if self.args:
            return self._parse_args(text, body, names)
        pos = _skip_blanks(text, 0)
        if text.startswith(self.MARKER, pos):
            pos = _skip_blanks(text, pos + len(self.MARKER))
        if not text.startswith("[", pos):
            return text, []
        decoded = _decode(text, pos)
        if decoded is None or not isinstance(decoded[0], list) or not decoded[0]:
            return text, []
        calls = [_new_call(v, names, ("arguments",)) for v in decoded[0]]
        if any(c is None for c in calls):
            return text, []
        return (text[decoded[1]:].strip() or None), _keep([c for c in calls if c], body)

    def _parse_args(self, text: str, body: ChatCompletionRequest, names: set[str]
                    ) -> tuple[str | None, list[ToolCall]]:
        # Longest name first: "get" must not cut "get_time" short.
        by_length = sorted(names, key=len, reverse=True)
        calls: list[ToolCall] = []
        pos = end = _skip_blanks(text, 0)
        while text.startswith(self.MARKER, pos):  # kept in the text: keep_special_tokens
            pos += len(self.MARKER)
            name = next((n for n in by_length if text.startswith(n, pos)), None)
            if name is None:
                break
            pos += len(name)
            if text.startswith(self.ARGS, pos):
                pos += len(self.ARGS)
            decoded = _decode(text, pos)
            if decoded is None or not isinstance(decoded[0], dict):
                break
            calls.append(ToolCall(id=f"call_{secrets.token_hex(12)}", function=FunctionCall(
                name=name, arguments=json.dumps(decoded[0]))))
            pos = end = decoded[1]
        if not calls:
            return text, []
        return (text[end:].strip() or None), _keep(calls, body)

    def render_call(self, calls: list[ToolCall]) -> str:
        if self.args:
            return "".join(f"{self.MARKER}{c.function.name}{self.ARGS}"
                           f"{json.dumps(_arguments(c))}" for c in calls)
        return self.MARKER + json.dumps([{"name": c.function.name, "arguments": _arguments(c)}
                                         for c in calls])

    def render_message(self, message: ChatMessage) -> dict[str, Any]:
        if not self.template_renders_calls:
            if message.tool_calls:
                return {"role": message.role,
                        "content": _with_calls(message, self.render_call(message.tool_calls))}
            return {"role": message.role, "content": message.text()}
        out: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.tool_calls:
            out["tool_calls"] = [{"id": mistral_call_id(c.id), "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c)}}
                for c in message.tool_calls]
        if message.tool_call_id is not None:
            out["tool_call_id"] = mistral_call_id(message.tool_call_id)
        return out


HERMES = HermesFormat()


# -- the prompt -------------------------------------------------------------------------------
def plain_messages(messages: list[ChatMessage], fmt: ToolFormat = HERMES
                   ) -> list[dict[str, Any]]:
    """The messages for ``render_chat``, tool calls and results of the history rendered as
    ``fmt`` says."""
    return [fmt.render_message(m) for m in messages]


def offer_tools(plain: list[dict[str, Any]], body: ChatCompletionRequest, template: Any,
                fmt: ToolFormat = HERMES) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """(messages, tools for the template): a template that renders ``tools`` gets them;
    otherwise ``fmt``'s system section describes them in the leading system message."""
    if not body.calls_tools():
        return plain, None
    offered = _offered(body)
    if template_renders_tools(template):
        return plain, [t.model_dump(exclude_none=True) for t in offered]
    section = fmt.system_prompt(offered, body.parallel_tool_calls is not False)
    if plain and plain[0]["role"] in ("system", "developer"):
        return [{**plain[0], "content": plain[0]["content"] + "\n\n" + section},
                *plain[1:]], None
    return [{"role": "system", "content": section}, *plain], None
