"""Reading a GGUF file's weights under Hugging Face names, 4-bit blocks kept as they are.

``--quantization gguf`` serves a GGUF's own 4-bit weights without dequantizing them to fp32
first: Q4_1 (and Q4_0) tensors become ``GroupedInt4`` (one code per byte, fp32 scale and minimum
per 32-weight block); F32 and F16 tensors are read as they are; every other type (Q8_0, K-quants,
...) is dequantized with the ``gguf`` library to fp32, and ``make_linear`` then quantizes it per
channel to int8 (the documented fallback). The model's ``config.json``, tokenizer and norms'
shapes come from the converted Hugging Face folder beside it (``engine/weights.py``).

Block layouts (ggml ``ggml-common.h``): Q4_1 is 20 bytes per 32 weights: fp16 ``d``, fp16 ``m``,
then 16 bytes whose low nibbles are weights 0-15 and high nibbles weights 16-31; ``w = q * d +
m``. Q4_0 is 18 bytes: fp16 ``d`` and the same nibbles; ``w = (q - 8) * d``.

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of Llama models for its rotary
layout; they are permuted back here as transformers does (``reverse_permute_weights``). Rows are
whole blocks, so 4-bit tensors are permuted without being dequantized.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from engine.models.config import ModelConfig
from engine.quantization import INT4_GROUP_SIZE, GroupedInt4

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), or None for one we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


# Block bytes of the 4-bit types kept as they are: fp16 d (and fp16 m for Q4_1) + 16 bytes.
_Q4_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


def grouped_from_blocks(raw: np.ndarray, type_name: str) -> GroupedInt4:
    """A Q4_0 or Q4_1 tensor's raw blocks [rows, blocks * block bytes] uint8 as
    ``GroupedInt4`` (codes [rows, in] uint8; scale and minimum [rows, blocks] fp32; Q4_0's
    minimum is ``-8 * d``)."""
    block_bytes = _Q4_BLOCK_BYTES[type_name]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, block_bytes)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    m = (torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
         if type_name == "Q4_1" else -8 * d)
    qs = blocks[..., block_bytes - 16:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)
    return GroupedInt4(torch.from_numpy(codes), d, m, INT4_GROUP_SIZE)


def _unpermute_rows(rows: int, n_head: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation for ``n_head`` heads."""
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(rows)


def read_gguf_state(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor | GroupedInt4]:
    """Every weight of the GGUF at ``path`` under its Hugging Face name.

    Returns:
        name -> ``GroupedInt4`` for Q4_1 / Q4_0 tensors, else an fp32 tensor ([out, in] for
        matrices, [n] for norms).

    Raises:
        ValueError: the file is not a GGUF, has an architecture other than llama / qwen2, or
            its shapes do not match ``cfg``.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot read GGUF {path.name}: {e}") from None
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "llama"
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"GGUF {path.name}: architecture {arch!r} is not supported by "
                         "--quantization gguf (llama, qwen2)")
    state: dict[str, torch.Tensor | GroupedInt4] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        raw = np.asarray(t.data)
        if t.tensor_type.name in _Q4_BLOCK_BYTES:
            value: torch.Tensor | GroupedInt4 = grouped_from_blocks(raw, t.tensor_type.name)
        elif t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            value = torch.from_numpy(raw.astype(np.float32))
        else:
            value = torch.from_numpy(gguf.quants.dequantize(raw, t.tensor_type)
                                     .astype(np.float32))
        # llama.cpp permutes q/k rows (weights and biases) of Llama models only.
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                              "k_proj.bias")):
            heads = (cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
            order = _unpermute_rows(value.shape[0], heads)
            value = value.rows(order) if isinstance(value, GroupedInt4) else value[order]
        state[name] = value
    if state.get("model.embed_tokens.weight") is None or \
            tuple(state["model.embed_tokens.weight"].shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"GGUF {path.name} does not match the model's config.json "
                         f"(vocab {cfg.vocab_size} x hidden {cfg.hidden_size})")
    return state


__all__ = ["grouped_from_blocks", "hf_name", "read_gguf_state"]
