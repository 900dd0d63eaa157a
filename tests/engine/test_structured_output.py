"""Structured outputs on the bundled model: the grammar mask makes greedy and sampled output
match a JSON schema or a regex; grammars are compiled once per spec; a bad schema is a clear
error; constrained and unconstrained requests share a batch."""

from __future__ import annotations

import json
import re

import pytest

from engine.errors import InvalidRequestError
from engine.llm import run_to_completion
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarCompiler, StructuredOutput

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "population": {"type": "integer", "minimum": 0},
    "capital": {"type": "boolean"}},
    "required": ["city", "population", "capital"], "additionalProperties": False}


def _chat(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False))


def test_json_schema_and_regex_hold_greedy_and_sampled(make_llm_engine, tokenizer):
    engine = make_llm_engine()
    prompt = _chat(tokenizer, "Describe Paris as JSON.")
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    reqs = [EngineRequest(f"json-{i}", prompt, SamplingParams(
        max_tokens=80, temperature=t, seed=i, structured_output=spec), tenant_id="t")
        for i, t in enumerate((0.0, 1.0, 1.5))]
    regex = StructuredOutput("regex", r"(yes|no), because [a-z ]{5,30}\.")
    reqs.append(EngineRequest("regex", _chat(tokenizer, "Is the sky blue?"), SamplingParams(
        max_tokens=40, temperature=1.0, seed=3, structured_output=regex), tenant_id="t"))
    reqs.append(EngineRequest("free", prompt, SamplingParams(max_tokens=20, temperature=0),
                              tenant_id="t"))
    results = run_to_completion(engine, reqs, max_steps=5_000)
    for r in results[:3]:
        assert r.finish_reason == "stop", r.text
        value = json.loads(r.text)
        assert list(value) == ["city", "population", "capital"]  # the schema's order
        assert isinstance(value["population"], int) and value["population"] >= 0
        assert isinstance(value["capital"], bool) and len(value["city"]) <= 20
    assert re.fullmatch(r"(yes|no), because [a-z ]{5,30}\.", results[3].text), results[3].text
    free = results[4].text
    with pytest.raises(ValueError):
        json.loads(free)  # the unconstrained neighbour in the batch stays free text
    compiler = engine.model_info.grammar_compiler
    assert compiler.num_compiled == 2  # three JSON requests, one compile
    pool = engine.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_invalid_grammars_are_refused_before_queueing(make_llm_engine, tokenizer):
    engine = make_llm_engine()
    for spec in (StructuredOutput("json_schema", '{"type": "nonsense"}'),
                 StructuredOutput("json_schema", "not json"),
                 StructuredOutput("regex", "(unclosed")):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request(EngineRequest("bad", (1, 2, 3), SamplingParams(
                structured_output=spec), tenant_id="t"))
        assert e.value.param == "response_format"
    assert not engine.has_unfinished_requests()


def test_the_grammar_cache_is_per_tenant(tokenizer):
    compiler = GrammarCompiler(tokenizer, max_per_tenant=4)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    compiler.matcher(spec, "a")
    compiler.matcher(spec, "a")
    assert compiler.num_compiled == 1  # a's repeat hits
    compiler.matcher(spec, "b")
    assert compiler.num_compiled == 2  # b never hits a's entry (no cross-tenant timing)
    for i in range(10):  # b floods its own cache
        compiler.matcher(StructuredOutput("regex", f"x{{{i + 1}}}"), "b")
    before = compiler.num_compiled
    compiler.matcher(spec, "a")
    assert compiler.num_compiled == before  # a's entry survived b's flood
