"""GGUF weights in memory against their file size, for an 8B-shaped model (Llama 3.1 8B's
shapes: hidden 4096, MLP 14336, 32 query / 8 KV heads of 128, vocab 128256, 32 layers).

For each GGUF type, a file with ``--layers`` decoder layers of those shapes (every projection in
that type, random valid blocks; norms F32; a small vocabulary, so the layers dominate) is written,
then loaded in a fresh process with ``--quantization gguf`` as the engine does. Printed per type:

- bytes per layer in the file and in memory (every projection's ``weight_bytes``), their ratio,
  and the whole 8B model extrapolated: 32 layers + the embedding and the LM head in that type
  (a quantized embedding is held unpacked, one code a byte: ``EMBEDDING_BYTES``);
- the loading process's resident memory after the load and its peak during it (``ru_maxrss``),
  each over the process before loading, against the file size and the same layers in fp32:
  loading decodes one tensor at a time (``engine.models.gguf.GGUFState``), so the peak is the
  model plus the largest tensor's transient copies, not the model in fp32.

Usage: ``python benchmarks/bench_gguf_memory.py [--types Q4_0,Q4_K,...] [--layers 2]``.
Numbers in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS_8B = 4096, 14336, 32, 8, 128, 128256, 32
SMALL_VOCAB = 1024
# block bytes per 256 weights, and fp16 fields (offsets) to set to a finite scale
LAYOUT = {"Q4_0": (144, range(0, 144, 18)), "Q4_1": (160, [*range(0, 160, 20),
                                                           *range(2, 160, 20)]),
          "Q8_0": (272, range(0, 272, 34)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
          "Q6_K": (210, (208,))}
# Bytes per weight of an embedding table in the type, held unpacked (decoder.BlockEmbedding:
# one code a byte; GroupedInt4's fp32 scale and minimum per 32; KQuantBlocks' integer scales per
# sub-block and fp32 d (dmin) per 256, Q8_0's fp32 d per 32).
EMBEDDING_BYTES = {"Q4_0": 1 + 8 / 32, "Q4_1": 1 + 8 / 32, "Q4_K": 1 + 2 / 32 + 8 / 256,
                   "Q5_K": 1 + 2 / 32 + 8 / 256, "Q6_K": 1 + 1 / 16 + 4 / 256, "Q8_0": 1 + 4 / 32}
PROJECTIONS = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
               "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
               "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 256 * bytes] uint8 of valid ``kind`` blocks (finite small fp16 scales)."""
    nbytes, halves = LAYOUT[kind]
    raw = rng.integers(0, 256, size=(rows, cols // 256, nbytes), dtype=np.uint8)
    small = np.array([1e-3], dtype=np.float16).view(np.uint8)
    for off in halves:
        raw[..., off:off + 2] = small
    return raw.reshape(rows, -1)


def write(kind: str, layers: int, out: Path) -> int:
    """Writes the model folder (config.json + model.gguf); returns the file's projection bytes."""
    import gguf

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "vocab_size": SMALL_VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER,
           "num_hidden_layers": layers, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 1024, "tie_word_embeddings": False}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(out / "model.gguf"), "llama")
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    writer.add_tensor("token_embd.weight",
                      rng.standard_normal((SMALL_VOCAB, HIDDEN), dtype=np.float32))
    writer.add_tensor("output.weight", rng.standard_normal((SMALL_VOCAB, HIDDEN),
                                                           dtype=np.float32) * 0.01)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    proj_bytes = 0
    for i in range(layers):
        for name, (rows, cols) in PROJECTIONS.items():
            raw = random_blocks(kind, rows, cols, rng)
            proj_bytes += raw.nbytes
            writer.add_tensor(f"blk.{i}.{name}.weight", raw, raw_dtype=qtype)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return proj_bytes


LOAD = """
import gc, json, os, resource, sys, torch
# As ModelRunner.load: our CPU kernels loaded first, so the layers take their layouts.
def rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
from kernels import cpu_linear
cpu_linear.load()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
base_now = rss_kib()
from engine.attention import get_attention_backend
from engine.models.config import ModelConfig
from engine.models.loader import load_model
cfg = ModelConfig.from_pretrained(sys.argv[1])
cpu = torch.device("cpu")
model = load_model(sys.argv[1], cfg, 1024, torch.float32, cpu, get_attention_backend("torch", cpu),
                   quantization="gguf")
layer_bytes = sum(m.weight_bytes for layer in model.layers for m in layer.linears())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
gc.collect()
print(json.dumps({"layer_bytes": layer_bytes, "peak_kib": peak, "base_kib": base,
                  "resident_kib": rss_kib() - base_now,
                  "linear": type(model.layers[0].gate_up).__name__}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", default="Q4_0,Q4_1,Q4_K,Q5_K,Q6_K,Q8_0")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    per_layer_fp32 = sum(r * c for r, c in PROJECTIONS.values()) * 4
    print(f"CPU: {platform.processor() or platform.machine()}; {args.layers} layers of "
          f"Llama-3.1-8B shapes; fp32 projections {per_layer_fp32 / 2**20:.0f} MiB a layer")
    print(f"{'type':6} {'file MiB/layer':>14} {'ours MiB/layer':>14} {'ratio':>6} "
          f"{'8B file GiB':>11} {'8B ours GiB':>11} {'resident MiB':>12} {'peak MiB':>9} "
          f"{'file MiB':>9} {'fp32 MiB':>9}  layer kind")
    root = Path(tempfile.mkdtemp(prefix="gguf-memory-"))
    repo = Path(__file__).resolve().parents[1]
    for kind in args.types.split(","):
        folder = root / kind
        proj = write(kind, args.layers, folder)
        run = subprocess.run([sys.executable, "-c", LOAD, str(folder)], cwd=repo,
                             capture_output=True, text=True, check=True)
        got = json.loads(run.stdout.strip().splitlines()[-1])
        file_layer = proj / args.layers
        ours_layer = got["layer_bytes"] / args.layers
        bits = file_layer * 8 / (per_layer_fp32 / 4)
        head_file = VOCAB * HIDDEN * bits / 8
        file_8b = LAYERS_8B * file_layer + 2 * head_file  # embedding and head in the type
        ours_8b = (LAYERS_8B * ours_layer + VOCAB * HIDDEN * EMBEDDING_BYTES[kind]
                   + VOCAB * HIDDEN * ours_layer / (per_layer_fp32 / 4))  # head like a layer
        peak = (got["peak_kib"] - got["base_kib"]) / 1024
        resident = got["resident_kib"] / 1024
        size = (folder / "model.gguf").stat().st_size / 2**20
        print(f"{kind:6} {file_layer / 2**20:14.0f} {ours_layer / 2**20:14.0f} "
              f"{ours_layer / file_layer:6.2f} {file_8b / 2**30:11.2f} {ours_8b / 2**30:11.2f} "
              f"{resident:12.0f} {peak:9.0f} {size:9.0f} {args.layers * per_layer_fp32 / 2**20:9.0f}  "
              f"{got['linear']}")


if __name__ == "__main__":
    main()
