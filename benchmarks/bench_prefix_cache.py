"""Prefix-cache benchmark on the bundled model: ratios measured in one run on this machine.

1. TTFT, cold vs warm: a ~1,000-token shared system prompt + a short user message (target: warm
   <= 20% of cold). Cold runs use a fresh tenant salt each time, so the same tokens miss.
2. Throughput: 16 concurrent requests sharing that system prompt vs Hugging Face ``generate`` on
   the same prompts run the way a user would (one batch, left padding, same max_new_tokens)
   (target: >= 2x HF).
3. Single-stream decode tokens/s vs HF ``generate`` (target: >= 1x).

Usage: ``python benchmarks/bench_prefix_cache.py [--new-tokens 64] [--data-dir .saltserve]``
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import statistics
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.llm import run_to_completion
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from engine.weights import ensure_default_model

SYSTEM = ("You are the support assistant of Northwind Bridges, a company that designs, builds and "
          "inspects steel and concrete bridges. Follow the policies below. ")
POLICY = ("Policy {i}: when a customer asks about inspection schedule {i}, explain that inspections "
          "happen every {m} months, that reports are sent within {d} days, and that urgent defects "
          "are escalated to the duty engineer at once. ")
QUESTIONS = ["How often are bridges inspected?", "Who do I call about a crack?",
             "When will I get my report?", "Do you build concrete bridges?",
             "What is policy 3 about?", "Can I move my inspection?", "What is a duty engineer?",
             "Are reports free?", "How long is a report?", "Do you inspect rail bridges?",
             "What are urgent defects?", "Who designs the bridges?", "Is steel better?",
             "What does Northwind do?", "Can I get a quote?", "Where are you based?"]


def build_prompts(tok, n: int, target_system_tokens: int = 1000) -> tuple[list[list[int]], int]:
    system = SYSTEM
    i = 0
    while len(tok.encode(system)) < target_system_tokens:
        system += POLICY.format(i=i, m=3 + i % 9, d=5 + i % 11)
        i += 1
    prompts = []
    for q in QUESTIONS[:n]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        prompts.append(tok.encode(text, add_special_tokens=False))
    return prompts, len(tok.encode(system))


def ttft(engine: LLMEngine, ids: list[int], salt: bytes, tag: str) -> tuple[float, int]:
    """Seconds from submission to the first token, and cached tokens; drains the request."""
    params = SamplingParams(max_tokens=1, temperature=0)
    [r] = run_to_completion(engine, [EngineRequest(tag, tuple(ids), params, tenant_id="bench",
                                                   cache_salt=salt)])
    assert r.ttft_s is not None
    return r.ttft_s, r.num_cached_tokens


def ours_batch(engine: LLMEngine, prompts: list[list[int]], new_tokens: int,
               salt: bytes) -> tuple[float, int]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    done = run_to_completion(engine, [EngineRequest(f"batch-{salt.hex()[:6]}-{i}", tuple(ids),
                                                    params, tenant_id="bench", cache_salt=salt)
                                      for i, ids in enumerate(prompts)])
    return time.perf_counter() - t0, sum(len(r.token_ids) for r in done)


def hf_batch(hf, tok, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    tok.padding_side = "left"
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt", padding=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=tok.pad_token_id)
    elapsed = time.perf_counter() - t0
    return elapsed, (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)


def ours_decode_rate(engine: LLMEngine, ids: list[int], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    times: list[float] = []
    run_to_completion(engine, [EngineRequest(f"single-{secrets.token_hex(4)}", tuple(ids), params,
                                             tenant_id="bench",
                                             cache_salt=secrets.token_bytes(32))],
                      on_step=lambda outs: times.extend(time.perf_counter() for _ in outs))
    return (len(times) - 1) / (times[-1] - times[0])


def hf_decode_rate(hf, ids: list[int], new_tokens: int) -> float:
    x = torch.tensor([ids])
    kw = {"attention_mask": torch.ones_like(x), "do_sample": False}
    with torch.no_grad():
        t0 = time.perf_counter()
        hf.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        hf.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        t2 = time.perf_counter()
    return (new_tokens - 1) / ((t2 - t1) - (t1 - t0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", type=Path, default=Path(os.environ.get("SALTSERVE_DATA_DIR",
                                                                         ".saltserve")))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    model_dir = ensure_default_model(args.data_dir)
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=2048, device="cpu",
                                    dtype="float32"))
    tok = engine.tokenizer
    prompts, system_tokens = build_prompts(tok, 16)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, fp32")
    print(f"model: {model_dir.name}; system prompt {system_tokens} tokens; prompts "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    ttft(engine, prompts[0][:64], secrets.token_bytes(32), "warmup")

    # 1. TTFT cold vs warm.
    tenant_salt = secrets.token_bytes(32)
    cold, warm = [], []
    for t in range(args.trials):
        c, cached = ttft(engine, prompts[t], secrets.token_bytes(32), f"cold-{t}")
        assert cached == 0
        cold.append(c)
    ttft(engine, prompts[0], tenant_salt, "prime")
    for t in range(args.trials):
        w, cached = ttft(engine, prompts[t + 1], tenant_salt, f"warm-{t}")
        assert cached >= 16 * ((system_tokens - 16) // 16), cached
        warm.append(w)
    c_med, w_med = statistics.median(cold), statistics.median(warm)
    print(f"\n[1] TTFT cold {c_med * 1000:.1f} ms, warm {w_med * 1000:.1f} ms (median of "
          f"{args.trials}); warm/cold = {w_med / c_med:.3f}  (target <= 0.20) "
          f"{'PASS' if w_med / c_med <= 0.2 else 'FAIL'}")

    # 2. Throughput, 16 concurrent requests sharing the system prompt, cold cache for both.
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t_ours, n_ours = ours_batch(engine, prompts, args.new_tokens, secrets.token_bytes(32))
    t_hf, n_hf = hf_batch(hf, tok, prompts, args.new_tokens)
    r_ours, r_hf = n_ours / t_ours, n_hf / t_hf
    print(f"[2] 16 concurrent x {args.new_tokens} new tokens: saltserve {r_ours:.1f} tok/s "
          f"({t_ours:.1f} s), HF generate {r_hf:.1f} tok/s ({t_hf:.1f} s); ratio "
          f"{r_ours / r_hf:.2f}x  (target >= 2x) {'PASS' if r_ours / r_hf >= 2 else 'FAIL'}")

    # 3. Single-stream decode.
    short = tok.encode("Write a long story about a lighthouse keeper.")
    ours_rates, hf_rates = [], []
    for _ in range(args.trials):  # interleaved, so machine noise hits both alike
        ours_rates.append(ours_decode_rate(engine, short, args.decode_tokens))
        hf_rates.append(hf_decode_rate(hf, short, args.decode_tokens))
    d_ours, d_hf = statistics.median(ours_rates), statistics.median(hf_rates)
    print(f"[3] single-stream decode ({args.decode_tokens} tokens, median of {args.trials}): "
          f"saltserve {d_ours:.1f} tok/s, HF generate {d_hf:.1f} tok/s; ratio "
          f"{d_ours / d_hf:.2f}x  (target >= 1x) {'PASS' if d_ours >= d_hf else 'FAIL'}")


if __name__ == "__main__":
    main()
