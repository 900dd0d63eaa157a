"""Tool calling helpers: Hermes-format parsing, the tool grammar, history rendering."""

from __future__ import annotations

import json

from app.protocol import ChatCompletionRequest
from app.services.tools import HERMES, offer_tools, plain_messages

parse_tool_calls, tool_grammar = HERMES.parse, HERMES.grammar

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}}]


def _body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **kw})


def test_parse_turns_leading_blocks_into_calls():
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls(text, _body())
    assert content is None
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert len({c.id for c in calls}) == 2
    # Without parallel calls only the first is kept.
    _, one = parse_tool_calls(text, _body(parallel_tool_calls=False))
    assert [c.function.name for c in one] == ["get_weather"]


def test_text_answers_unknown_names_and_broken_json_stay_text():
    for text in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                 "<tool_call>{not json</tool_call>", "<tool_call>[1, 2]</tool_call>",
                 "plain answer", 'Let me check.\n<tool_call>{"name": "get_time"}</tool_call>',
                 "<tool_call>" + " " * 100_000):
        content, calls = parse_tool_calls(text, _body())
        assert calls == [] and content == text


def test_parsing_a_huge_unterminated_call_is_linear():
    import time

    text = "<tool_call>\n{" + " " * 2_000_000
    t0 = time.perf_counter()
    assert parse_tool_calls(text, _body()) == (text, [])
    assert time.perf_counter() - t0 < 0.5  # the old regex took seconds for 2,000 spaces


def test_named_choice_offers_and_accepts_only_that_function():
    body = _body(tool_choice={"type": "function", "function": {"name": "get_time"}})
    _, calls = parse_tool_calls('<tool_call>{"name": "get_weather", "arguments": {}}'
                                "</tool_call>", body)
    assert calls == []
    plain, tools = offer_tools(plain_messages(body.messages), body, template=None)
    assert tools is None and "get_time" in plain[0]["content"]
    assert "get_weather" not in plain[0]["content"]
    grammar = tool_grammar(body)
    assert grammar is not None and grammar.kind == "lark"
    assert '"const": "get_time"' in grammar.spec and "call)*" not in grammar.spec


def test_grammar_per_tool_choice():
    assert tool_grammar(_body(tool_choice="none")) is None
    auto = tool_grammar(_body())
    assert auto is not None and "start: free | calls" in auto.spec
    required = tool_grammar(_body(tool_choice="required"))
    assert required is not None and "anyOf" in required.spec and "call)*" in required.spec
    assert "start: calls" in required.spec
    assert '"whitespace_flexible": false' in required.spec
    single = tool_grammar(_body(tool_choice="required", parallel_tool_calls=False))
    assert single is not None and "call)*" not in single.spec


def test_the_tool_grammars_accept_calls_and_refuse_free_whitespace(tokenizer):
    from engine.structured_output import GrammarCompiler

    compiler = GrammarCompiler(tokenizer)
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    padded = '<tool_call>\n{    "name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    for choice, text, ok in (("required", call, True), ("required", padded, False),
                             ("required", "Sunny.", False), ("auto", "Sunny.", True),
                             ("auto", call, True), ("auto", "<b>hi</b>", False)):
        spec = tool_grammar(_body(tool_choice=choice))
        assert spec is not None
        matcher = compiler.matcher(spec, "t")
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert (matcher.validate_tokens(ids) == len(ids)) is ok, (choice, text)


def test_history_calls_and_results_are_rendered_as_text():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Snow."}]})
    plain = plain_messages(body.messages)
    assert plain[1]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                   '{"city": "Oslo"}}\n</tool_call>')
    assert plain[2] == {"role": "tool", "content": "<tool_response>\nSnow.\n</tool_response>"}
    # A template that renders tools itself gets them instead of a system section.
    with_tools = _body()
    same, tools = offer_tools(plain_messages(with_tools.messages), with_tools,
                              template="{% for tool in tools %}...{% endfor %}")
    assert tools is not None and [t["function"]["name"] for t in tools] == [
        "get_weather", "get_time"]
    assert same == plain_messages(with_tools.messages)


def test_required_calls_take_no_undeclared_arguments_unless_strict_is_false():
    def arguments_schema(body) -> dict:
        grammar = tool_grammar(body)
        assert grammar is not None
        return json.loads(grammar.spec.split("%json ", 1)[1])["properties"]["arguments"]

    one = [TOOLS[0]]
    assert arguments_schema(_body(tools=one, tool_choice="required")
                            )["additionalProperties"] is False
    loose = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": False}}]
    assert "additionalProperties" not in arguments_schema(_body(tools=loose,
                                                                tool_choice="required"))
