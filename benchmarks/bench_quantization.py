"""Weight formats side by side on the bundled model: decode speed against the memory-bandwidth
limit, the step split into model and engine time, and fidelity to fp32.

For each format (fp32, bf16, ``--quantization int8``, ``--quantization gguf``; ``gguf-a8`` and
``gguf-torch``, two variants of gguf, and ``fp32-kv16``, ``gguf-kv16`` over a bf16 KV cache,
described at ``FORMATS``), in one run:

1. Decode: one stream (the median of ``ONE_STREAM_RUNS`` runs: this 2-vCPU VM's speed moves by
   up to 1.4x within a minute) and 16 concurrent streams, 64 tokens each (``ignore_eos``),
   tokens/s and
   the mean step time split into model time (``ModelRunner.execute``: inputs, forward,
   sampling) and engine time (scheduling, block bookkeeping, detokenisation, outputs); then
   16 streams on one cached 1,750-token system prompt (the "16 concurrent requests sharing a
   system prompt" workload, decode steps only), and its ratio to the first format's.
2. The single-stream limit: read bandwidth (measured here, summing a 1 GiB tensor) / bytes of
   weights read per token (every projection and the LM head), and the share of it reached:
   the bandwidth is read again just before each one-stream run, and "of limit" is the median
   of the runs' own ratios ("limit" the median limit), so a drift of the VM's speed between
   the bandwidth read and the decode does not land in the ratio;
   then "cached": the same with the read rate of a tensor as large as the weights, summed
   again and again, the limit where the weights stay in the CPU's caches between tokens (97 MB
   of gguf weights fit the 480 MiB L3 of some 2-vCPU Xeons; 538 MB of fp32 do not).
3. Fidelity, against fp32 (the reference, token-identical to Hugging Face):
   - greedy agreement: fp32 generates 32 tokens for each of 8 chat prompts; each format then
     reads fp32's prompt + output (``prompt_logprobs``) and we count the output positions where
     its most likely token is fp32's (rank 1): teacher-forced, so one early difference does not
     hide the agreement of the rest; plus whole outputs identical when it generates freely;
   - perplexity on ``benchmarks/data/perplexity.txt`` (public-domain prose and two plain
     technical paragraphs, 577 tokens).
   Fidelity runs twice. "kernels": ``--max-num-batched-tokens 16`` and the dense switch-over
   at ``DENSE_FROM_TOKENS`` rows, so every forward goes through the quantized kernels (with fp32
   activations, longer forwards run on the layer's dense copy and would measure that).
   "served": the engine as served (default chunk size and thresholds), so prefill chunks run
   our int8-dot kernels too (every row count), or, where those are off (``gguf-torch``), the
   dense copy: the exact fp32 dequantization, or its bf16 rounding in bf16 GEMM on CPUs with
   native bf16 (``KernelPolicy.dense_copy_dtype``).

Usage: ``python benchmarks/bench_quantization.py [--formats fp32,bf16,int8,gguf]
[--data-dir .saltserve]``. Numbers in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from engine import quantization
from engine.config import EngineConfig
from engine.llm import run_to_completion
from engine.llm_engine import LLMEngine
from engine.quantization import KernelPolicy
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from engine.weights import ensure_default_model
from kernels import cpu_linear

FORMATS = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
           "int8": {"quantization": "int8"}, "gguf": {"quantization": "gguf"},
           "gguf-a8": {"quantization": "gguf", "quantized_activation_bits": 8},
           "gguf-torch": {"quantization": "gguf"},
           "fp32-kv16": {"dtype": "float32", "kv_cache_dtype": "bfloat16"},
           "gguf-kv16": {"quantization": "gguf", "kv_cache_dtype": "bfloat16"}}
# fp32-kv16, gguf-kv16: fp32 and gguf weights over a bf16 KV cache (--kv-cache-dtype bfloat16).
# gguf-a8: gguf with our int8-dot kernels' 8-bit activation rounding (llama.cpp's Q8_1;
# --quantized-activation-bits 8, 16 for every other format). gguf-torch: gguf with our
# int8-dot kernels off (KernelPolicy.int8_dot): torch's int4 and int8 kernels, the dense copy
# from policy.dense_from_tokens rows and our Q4 kernel at one row.
ONE_STREAM_RUNS = 5  # one-stream decodes of 64 tokens a format; the median is reported
OUR_INT8_DOT = {"gguf-torch": False}
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain photosynthesis to a child.", "List three uses of a paperclip.",
           "How do I boil an egg?", "What is 17 times 3?",
           "Give me a name for a grey cat.", "Why is the sky blue?"]
TEXT = Path(__file__).parent / "data" / "perplexity.txt"
SHARED_PREFIX_TOKENS = 1750  # the 16-concurrent workload: 16 requests on one system prompt


def read_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of summing an fp32 tensor of ``nbytes`` (best of ``repeats``). 1 GiB (the
    default) measures memory: the read rate decode is bound by when the weights do not stay in
    the CPU's caches. A tensor as large as a format's weights, summed again and again, measures
    what reading them costs where they do fit (a large L3: 480 MiB on some 2-vCPU Xeons)."""
    x = torch.ones(max(nbytes // 4, 1))
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def _request(i: int, ids: list[int], max_tokens: int, salt: bytes | None = None,
             **kw) -> EngineRequest:
    return EngineRequest(f"q{i}-{time.monotonic_ns()}", tuple(ids),
                         SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw),
                         cache_salt=salt or os.urandom(16))


def shared_system_ids(engine: LLMEngine, tokens: int = SHARED_PREFIX_TOKENS) -> list[int]:
    """A system prompt of about ``tokens`` tokens (bench_servers' shape: rules to follow)."""
    ids: list[int] = []
    i = 0
    while len(ids) < tokens:
        ids += engine.tokenizer.encode(f" Rule {i}: keep bridge {i} inspected, painted and lit.")
        i += 1
    return ids[:tokens]


def decode(engine: LLMEngine, streams: int, tokens: int = 64,
           shared_prefix: list[int] | None = None) -> dict[str, float]:
    """``streams`` requests decoding ``tokens`` each; tok/s and ms per decode step split.

    ``shared_prefix``: every request starts with these tokens, in one tenant, and one request
    over them runs first, so the others hit its cached blocks and decode over a shared context
    (the issue's 16 concurrent requests on one system prompt)."""
    tok = engine.tokenizer
    salt = os.urandom(16)  # one tenant: the shared prefix's blocks are shared
    head = list(shared_prefix or [])
    if head:
        run_to_completion(engine, [_request(-1, head + tok.encode(" Warm up."), 1, salt)])
    for i in range(streams):
        engine.add_request(_request(i, head + tok.encode(f"Tell me story number {i} about a "
                                                         "lighthouse."), tokens, salt,
                                    ignore_eos=True))
    while engine.scheduler.waiting or any(not r.output_token_ids
                                          for r in engine.scheduler.running):
        engine.step()  # the prefills: time decode steps only
    runner = engine.runner
    model_s = 0.0
    execute = runner.execute

    def timed(out):
        nonlocal model_s
        t = time.perf_counter()
        try:
            return execute(out)
        finally:
            model_s += time.perf_counter() - t

    runner.execute = timed
    try:
        steps, t0 = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        wall = time.perf_counter() - t0
    finally:
        del runner.execute
    return {"tok_s": streams * steps / wall, "step_ms": 1000 * wall / steps,
            "model_ms": 1000 * model_s / steps, "engine_ms": 1000 * (wall - model_s) / steps}


def chat_ids(engine: LLMEngine, prompt: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False)


def greedy(engine: LLMEngine, prompts: list[list[int]], tokens: int = 32) -> list[list[int]]:
    return [r.token_ids for r in run_to_completion(
        engine, [_request(i, p, tokens) for i, p in enumerate(prompts)])]


def prompt_logprobs(engine: LLMEngine, ids: list[int]):
    return run_to_completion(engine, [_request(0, ids, 1, prompt_logprobs=0)])[0].prompt_logprobs


def fidelity(model_dir: Path, name: str, reference: dict, kernels_only: bool
             ) -> tuple[list, float, int, float]:
    """(outputs, teacher-forced agreement with ``reference``, identical outputs, perplexity);
    ``kernels_only``: every forward through the quantized kernels (see the docstring)."""
    fmt = FORMATS[name]
    extra = {}
    policy = KernelPolicy.detect(int8_dot=OUR_INT8_DOT.get(name, True))
    if kernels_only:  # forwards of at most 16 rows, below every dense switch-over
        policy = replace(policy, dense_from_tokens=quantization.DENSE_FROM_TOKENS,
                         int8_dense_from_tokens=quantization.DENSE_FROM_TOKENS)
        extra = {"max_num_batched_tokens": 16}
    engine = LLMEngine(EngineConfig(model=str(model_dir), **extra, **fmt),
                       kernel_policy=policy)
    prompts = [chat_ids(engine, p) for p in PROMPTS]
    text_ids = engine.tokenizer.encode(TEXT.read_text())
    outputs = greedy(engine, prompts)
    ref_outputs = reference.get("outputs", outputs)
    agree = total = 0
    for p, ref_out in zip(prompts, ref_outputs):
        lps = prompt_logprobs(engine, p + ref_out)
        ranks = [lp.rank for lp in lps[len(p):]]
        agree += sum(r == 1 for r in ranks)
        total += len(ranks)
    identical = sum(o == r for o, r in zip(outputs, ref_outputs))
    lps = prompt_logprobs(engine, text_ids)[1:]
    ppl = math.exp(-sum(lp.logprob for lp in lps) / len(lps))
    del engine
    return outputs, agree / total, identical, ppl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--data-dir", type=Path, default=Path(".saltserve"))
    args = parser.parse_args()
    model_dir = ensure_default_model(args.data_dir)
    bw = read_bandwidth_gbs()
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}; read bandwidth {bw:.1f} GB/s; our int8-dot "
          f"kernels: {cpu_linear.int8_dot_isa() if cpu_linear.load() else 'off'}")
    reference: dict[str, list] = {}
    rows = []
    for name in args.formats.split(","):
        policy = KernelPolicy.detect(int8_dot=OUR_INT8_DOT.get(name, True))
        engine = LLMEngine(EngineConfig(model=str(model_dir), **FORMATS[name]),
                           kernel_policy=policy)
        decode(engine, 1, 8)  # warm-up
        weight_mb = engine.model.weight_bytes() / 1e6
        runs = []
        for _ in range(ONE_STREAM_RUNS):  # each run against the bandwidth read just before it
            run_limit = read_bandwidth_gbs() * 1e3 / weight_mb
            decode(engine, 1, 8)  # the weights back in the caches they fit in (a large L3)
            runs.append(decode(engine, 1) | {"limit": run_limit})
        one = sorted(runs, key=lambda r: r["tok_s"])[ONE_STREAM_RUNS // 2]
        of_limit = statistics.median(r["tok_s"] / r["limit"] for r in runs)
        limit = statistics.median(r["limit"] for r in runs)
        many = decode(engine, 16)
        shared = decode(engine, 16, 32, shared_system_ids(engine))
        del engine
        outputs, agreement, identical, ppl = fidelity(model_dir, name, reference, True)
        if not reference:  # the first format is the reference (fp32 by default)
            reference = {"format": name, "outputs": outputs}
        served = fidelity(model_dir, name, reference, False)[1:]
        cached_limit = read_bandwidth_gbs(int(weight_mb * 1e6), 20) * 1e3 / weight_mb
        rows.append((name, one, many, weight_mb, limit, agreement, identical, ppl, served,
                     shared, cached_limit, of_limit))
    ref = rows[0]
    print(f"\nfidelity against {reference['format']}: greedy agreement teacher-forced over "
          f"{len(PROMPTS)} prompts x 32 tokens, perplexity over {TEXT.name}; first through the "
          f"quantized kernels only, then as served (prefill chunks through our int8-dot "
          f"kernels; where they are off, gguf-torch, on the dense copy: "
          f"{KernelPolicy.detect().dense_copy_dtype})\n")
    print(f"{'format':10} {'1 stream':>9} {'vs ' + ref[0]:>8} {'step ms':>8} {'model':>6} "
          f"{'engine':>6} {'16 streams':>10} {'vs ' + ref[0]:>8} {'16 shared':>9} "
          f"{'vs ' + ref[0]:>8} "
          f"{'weights':>8} {'limit':>7} {'of limit':>8} {'cached':>7} {'of it':>6} "
          f"{'agree':>6} {'same':>5} {'ppl':>6} | served: {'agree':>6} {'same':>5} {'ppl':>6}")
    for (name, one, many, mb, limit, agreement, identical, ppl, served, shared, cached,
         of_limit) in rows:
        print(f"{name:10} {one['tok_s']:6.1f}/s {one['tok_s'] / ref[1]['tok_s']:7.2f}x "
              f"{one['step_ms']:8.1f} {one['model_ms']:6.1f} "
              f"{one['engine_ms']:6.2f} {many['tok_s']:8.1f}/s "
              f"{many['tok_s'] / ref[2]['tok_s']:7.2f}x {shared['tok_s']:7.1f}/s "
              f"{shared['tok_s'] / ref[9]['tok_s']:7.2f}x {mb:6.0f}MB {limit:5.0f}/s "
              f"{100 * of_limit:7.0f}% {cached:5.0f}/s "
              f"{100 * one['tok_s'] / cached:5.0f}% {100 * agreement:5.1f}% "
              f"{identical}/{len(PROMPTS)} {ppl:6.2f} |         {100 * served[0]:5.1f}% "
              f"{served[1]}/{len(PROMPTS)} {served[2]:6.2f}")


if __name__ == "__main__":
    main()
