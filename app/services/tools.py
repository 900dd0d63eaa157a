"""Tool calling in the Hermes format (vLLM's ``hermes`` tool parser):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- Prompt: a chat template that renders ``tools`` itself gets them; one that does not (the
  bundled SmolLM2's) gets a system section that lists the functions as JSON and shows the
  format above. Assistant ``tool_calls`` and ``tool`` results in the history are rendered as
  text in the same format (``<tool_response>``), so a multi-turn round trip keeps them.
- A grammar (``tool_grammar``) makes every call well formed, its ``arguments`` matching the
  function's JSON schema (compact JSON: no free whitespace): ``required`` or a named function
  allow only calls; ``auto`` allows either calls or a text answer (one that does not start
  with ``<``), so a call the model starts is always valid.
- Parsing (``parse_tool_calls``, linear time): the ``<tool_call>`` blocks at the start of the
  output become ``ToolCall`` records; an output that does not start with one is the content.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from app.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    ToolDef,
)
from engine.structured_output import StructuredOutput

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
# Compact JSON inside calls: free whitespace would let a call grow without bound.
_STRICT_JSON = {"whitespace_flexible": False}


def template_renders_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def tool_system_prompt(tools: list[ToolDef], parallel: bool) -> str:
    """The system section that offers ``tools`` to a template without tool support."""
    listing = "\n".join(json.dumps(t.function.model_dump(exclude_none=True))
                        for t in tools)
    many = ("You may call several functions, one block each."
            if parallel else "Call at most one function.")
    return ("You can call functions. Their signatures are JSON objects, one per line:\n"
            f"<tools>\n{listing}\n</tools>\n"
            "To call a function, answer with only this block:\n"
            '<tool_call>\n{"name": <function name>, "arguments": <JSON object of arguments>}\n'
            f"</tool_call>\n{many} Otherwise answer normally.")


def _call_text(call: ToolCall) -> str:
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    return f"{_OPEN}\n" + json.dumps({"name": call.function.name, "arguments": arguments}) \
        + "\n</tool_call>"


def plain_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """``{role, content}`` messages for ``render_chat``; tool calls and results of the history
    are written out in the Hermes format."""
    return [{"role": m.role, "content": _message_text(m)} for m in messages]


def offer_tools(plain: list[dict[str, str]], body: ChatCompletionRequest,
                template: str | None) -> tuple[list[dict[str, str]], list[dict] | None]:
    """(messages, tools for the template): a template that renders ``tools`` gets them;
    otherwise the tools are described in the leading system message."""
    if not body.calls_tools():
        return plain, None
    offered = _offered(body)
    if template_renders_tools(template):
        return plain, [t.model_dump(exclude_none=True) for t in offered]
    section = tool_system_prompt(offered, body.parallel_tool_calls is not False)
    if plain and plain[0]["role"] in ("system", "developer"):
        return [{**plain[0], "content": plain[0]["content"] + "\n\n" + section},
                *plain[1:]], None
    return [{"role": "system", "content": section}, *plain], None


def _message_text(m: ChatMessage) -> str:
    if m.role == "tool":
        return f"<tool_response>\n{m.text()}\n</tool_response>"
    if m.tool_calls:
        calls = "\n".join(_call_text(c) for c in m.tool_calls)
        return f"{m.text()}\n{calls}" if m.text() else calls
    return m.text()


def _offered(body: ChatCompletionRequest) -> list[ToolDef]:
    """The tools the model sees: only the named one with a named ``tool_choice``."""
    assert body.tools is not None
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        return [t for t in body.tools if t.function.name == choice.function.name]
    return body.tools


def _call_schema(tool: ToolDef) -> dict[str, Any]:
    """The JSON schema of one call. Unless the function sets ``strict: false``, its arguments
    object takes no properties beyond the declared ones (OpenAI strict mode; a small model
    otherwise invents extra keys)."""
    params = dict(tool.function.parameters or {"type": "object", "properties": {}})
    if tool.function.strict is not False and "properties" in params:
        params.setdefault("additionalProperties", False)
    return {"type": "object", "properties": {"name": {"const": tool.function.name},
                                             "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_grammar(body: ChatCompletionRequest) -> StructuredOutput | None:
    """The Lark grammar of the output when tools are offered: one call (or, with
    ``parallel_tool_calls``, one or more) whose JSON matches an offered function's schema;
    with ``auto``, a text answer not starting with ``<`` is allowed instead."""
    if not body.calls_tools():
        return None
    choice = body.tool_choice
    schemas = [_call_schema(t) for t in _offered(body)]
    schema = {"x-guidance": _STRICT_JSON,
              **(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})}
    repeat = ' ("\\n" call)*' if body.parallel_tool_calls is not False and \
        not isinstance(choice, NamedToolChoice) else ""
    answer = "free | " if choice in (None, "auto") else ""
    lark = (f"start: {answer}calls\n"
            f"calls: call{repeat}\n"
            "free: /[^<](?s:.*)/\n"
            'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {json.dumps(schema)}\n")
    return StructuredOutput("lark", lark)


def parse_tool_calls(text: str, body: ChatCompletionRequest) -> tuple[str | None,
                                                                     list[ToolCall]]:
    """(content, tool calls) of a model output, in linear time: the ``<tool_call>`` blocks at
    the start of the output (the grammar only lets calls start there) whose body is a JSON
    object naming an offered function; without ``parallel_tool_calls`` only the first is kept.
    Anything else is content."""
    names = {t.function.name for t in _offered(body)}
    calls: list[ToolCall] = []
    pos = len(text) - len(text.lstrip())
    while text.startswith(_OPEN, pos):
        end = text.find(_CLOSE, pos + len(_OPEN))
        if end < 0:
            break
        try:
            value = json.loads(text[pos + len(_OPEN):end])
        except ValueError:
            break
        if not isinstance(value, dict) or value.get("name") not in names:
            break
        arguments = value.get("arguments", value.get("parameters", {}))
        calls.append(ToolCall(id=f"call_{secrets.token_hex(12)}", function=FunctionCall(
            name=value["name"], arguments=json.dumps(arguments))))
        pos = end + len(_CLOSE)
        while pos < len(text) and text[pos].isspace():  # the newline between calls
            pos += 1
    if not calls:
        return text, []
    if body.parallel_tool_calls is False:
        calls = calls[:1]
    content = text[pos:].strip()
    return (content or None), calls
