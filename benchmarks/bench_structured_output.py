"""Structured-output benchmark on the bundled model: constrained vs unconstrained decode speed,
measured in one run (target: constrained >= 0.9x unconstrained tokens/s).

Both sides decode the same prompt greedily with the same engine; the constrained side must
produce JSON matching a schema (a list of strings, long enough to fill ``--new-tokens``), the
unconstrained side ignores eos for the same number of tokens. Reported for 1 and 8 concurrent
requests: tokens/s of the decode phase (the first token, i.e. the prefill, excluded).

Usage: ``python benchmarks/bench_structured_output.py [--new-tokens 96] [--data-dir .saltserve]``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput
from engine.weights import ensure_default_model

SCHEMA = {"type": "object", "properties": {"cities": {
    "type": "array", "minItems": 40, "items": {"type": "string", "maxLength": 24}}},
    "required": ["cities"], "additionalProperties": False}


def decode_rate(engine: LLMEngine, prompt: tuple[int, ...], params: SamplingParams,
                batch: int, tag: str) -> tuple[float, int]:
    """(decode tokens/s, tokens decoded after each request's first token)."""
    for i in range(batch):
        engine.add_request(EngineRequest(f"{tag}-{i}", prompt, params, tenant_id="bench"))
    first_seen: dict[str, float] = {}
    counts: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                if out.request_id not in first_seen:
                    first_seen[out.request_id] = time.perf_counter()
                    counts[out.request_id] = 0
                else:
                    counts[out.request_id] += len(out.new_token_ids)
    t_end = time.perf_counter()
    tokens = sum(counts.values())
    start = max(first_seen.values())  # every request decoding from here on
    return tokens / max(t_end - start, 1e-9) if tokens else 0.0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--data-dir", type=Path, default=Path(".saltserve"))
    args = ap.parse_args()
    model_dir = ensure_default_model(args.data_dir)
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                    max_model_len=1024, enable_prefix_caching=False))
    tok = engine.tokenizer
    prompt = tuple(tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "List many city names as JSON."}], tokenize=False,
        add_generation_prompt=True), add_special_tokens=False))
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    free = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.new_tokens, temperature=0,
                                 structured_output=spec)
    decode_rate(engine, prompt, constrained, 1, "warmup")  # compiles the grammar once
    print(f"structured output, {args.new_tokens} new tokens, greedy, CPU fp32")
    for batch in (1, 8):
        free_rate, free_n = decode_rate(engine, prompt, free, batch, f"free-{batch}")
        con_rate, con_n = decode_rate(engine, prompt, constrained, batch, f"json-{batch}")
        print(f"  batch {batch}: unconstrained {free_rate:7.1f} tok/s ({free_n} tokens), "
              f"constrained {con_rate:7.1f} tok/s ({con_n} tokens), "
              f"ratio {con_rate / free_rate:.2f}x (target >= 0.90x)")


if __name__ == "__main__":
    main()
