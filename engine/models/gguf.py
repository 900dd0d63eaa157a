"""Reading a GGUF file's weights under Hugging Face names, 4-bit blocks kept as they are.

``--quantization gguf`` serves a GGUF's own 4-bit weights without dequantizing them to fp32
first: Q4_1, Q4_0 and Q4_K tensors become ``GroupedInt4`` (one code per byte, fp32 scale and
minimum per 32-weight group; exact for all three); F32 and F16 tensors are read as they are;
every other type (Q8_0, Q5_K, Q6_K, ...) is dequantized with the ``gguf`` library to fp32, and
``make_linear`` then quantizes it per channel to int8 (not exact: a grouped 8-bit kernel would
be). Tensors are decoded one at a time, when the model's loader asks for them (``GGUFState``,
over the file's memory map), so loading never holds the whole model in fp32. The model's
``config.json``, tokenizer and norms' shapes come from the converted Hugging Face folder beside
it (``engine/weights.py``).

Block layouts (ggml ``ggml-common.h``): Q4_1 is 20 bytes per 32 weights: fp16 ``d``, fp16 ``m``,
then 16 bytes whose low nibbles are weights 0-15 and high nibbles weights 16-31; ``w = q * d +
m``. Q4_0 is 18 bytes: fp16 ``d`` and the same nibbles; ``w = (q - 8) * d``. Q4_K is 144 bytes
per 256 weights: fp16 ``d`` and ``dmin``, 12 bytes of eight 6-bit scales and minimums
(``get_scale_min_k4``), then 128 bytes whose 32-byte chunk ``c`` holds sub-block ``2c`` in its low
nibbles and ``2c + 1`` in its high ones; ``w = d * sc * q - dmin * m``, so each 32-weight
sub-block is a ``GroupedInt4`` group with scale ``d * sc`` and minimum ``-dmin * m`` (products of
an fp16 and a 6-bit integer: exact in fp32).

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of Llama models for its rotary
layout; they are permuted back here as transformers does (``reverse_permute_weights``). Rows are
whole blocks, so 4-bit tensors are permuted without being dequantized.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

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
    names = _LAYER_NAMES | _EXTRA_LAYER_NAMES
    if m is None or m.group(2) not in names:
        return None
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


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


def q4_k_grouped(raw: np.ndarray) -> GroupedInt4:
    """A Q4_K tensor's raw blocks [rows, blocks * 144] uint8 as ``GroupedInt4`` (groups of 32;
    the layout in the module docstring). Raises ValueError for a row that is not whole
    blocks."""
    rows = raw.shape[0]
    if raw.shape[1] % 144:
        raise ValueError(f"a Q4_K row of {raw.shape[1]} bytes is not whole 144-byte blocks")
    blocks = raw.reshape(rows, -1, 144)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 4:16].astype(np.uint8)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)],
                        axis=-1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)],
                        axis=-1)
    qs = blocks[..., 16:].reshape(rows, -1, 4, 32)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, -1)  # sub-blocks 2c, 2c + 1
    scale = (d[..., None] * sc.astype(np.float32)).reshape(rows, -1)
    minimum = -(dmin[..., None] * mn.astype(np.float32)).reshape(rows, -1)
    return GroupedInt4(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(scale),
                       torch.from_numpy(minimum), INT4_GROUP_SIZE)


# General architectures whose tensors we read: llama.cpp permutes the q/k rows of ``llama``.
_ARCHS = ("llama", "qwen2", "qwen3")
_EXTRA_LAYER_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


class GGUFState(Mapping[str, "torch.Tensor | GroupedInt4"]):
    """A GGUF's weights under Hugging Face names, each decoded when it is looked up (from the
    file's memory map; nothing is cached, so a loader that takes each weight once holds at most
    the one it is converting in fp32)."""

    def __init__(self, reader: Any, arch: str, cfg: ModelConfig) -> None:
        self._arch, self._cfg = arch, cfg
        self._tensors = {}
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is not None:
                self._tensors[name] = t

    def shape(self, name: str) -> tuple[int, ...]:
        """The Hugging Face shape of ``name`` without decoding it."""
        return tuple(int(n) for n in reversed(self._tensors[name].shape))

    def __len__(self) -> int:
        return len(self._tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __getitem__(self, name: str) -> torch.Tensor | GroupedInt4:
        import gguf

        t = self._tensors[name]
        raw = np.asarray(t.data)
        kind = t.tensor_type.name
        if kind in _Q4_BLOCK_BYTES:
            value: torch.Tensor | GroupedInt4 = grouped_from_blocks(raw, kind)
        elif kind == "Q4_K":
            value = q4_k_grouped(raw)
        elif t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            value = torch.from_numpy(raw.astype(np.float32))
        else:
            value = torch.from_numpy(gguf.quants.dequantize(raw, t.tensor_type)
                                     .astype(np.float32))
        # llama.cpp permutes q/k rows (weights and biases) of Llama models only.
        if self._arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight",
                                                    "q_proj.bias", "k_proj.bias")):
            cfg = self._cfg
            heads = (cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
            order = _unpermute_rows(value.shape[0], heads)
            value = value.rows(order) if isinstance(value, GroupedInt4) else value[order]
        return value


def read_gguf_state(path: Path, cfg: ModelConfig) -> GGUFState:
    """Every weight of the GGUF at ``path`` under its Hugging Face name, decoded on lookup.

    Returns:
        name -> ``GroupedInt4`` for Q4_1 / Q4_0 / Q4_K tensors, else an fp32 tensor ([out, in]
        for matrices, [n] for norms).

    Raises:
        ValueError: the file is not a GGUF, has an architecture other than llama / qwen2 /
            qwen3, or its shapes do not match ``cfg``.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot read GGUF {path.name}: {e}") from None
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "llama"
    if arch not in _ARCHS:
        raise ValueError(f"GGUF {path.name}: architecture {arch!r} is not supported by "
                         f"--quantization gguf ({', '.join(_ARCHS)})")
    state = GGUFState(reader, arch, cfg)
    if "model.embed_tokens.weight" not in state or \
            state.shape("model.embed_tokens.weight") != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"GGUF {path.name} does not match the model's config.json "
                         f"(vocab {cfg.vocab_size} x hidden {cfg.hidden_size})")
    return state


__all__ = ["GGUFState", "grouped_from_blocks", "hf_name", "q4_k_grouped", "read_gguf_state"]
