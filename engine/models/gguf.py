"""Reading a GGUF file's weights under Hugging Face names, quantized blocks kept as they are.

``--quantization gguf`` serves a GGUF's own quantized weights without dequantizing them to fp32
first: Q4_1 and Q4_0 tensors become ``GroupedInt4`` (one code per byte, fp32 scale and minimum
per 32-weight group); Q4_K, Q5_K, Q6_K and Q8_0 tensors ``KQuantWeight`` (one code per byte,
their integer and fp16 scales as stored; ``engine.quantization.kquant``); both exact. F32 and
F16 tensors are read as they are; any other type (Q2_K, Q3_K, IQ*, ...) is dequantized with the
``gguf`` library to fp32, and the quantization method then quantizes it per channel to int8
(not exact). Tensors are decoded one at a time, when the model's loader asks for them (``GGUFState``,
over the file's memory map), so loading never holds the whole model in fp32. The model's
``config.json``, tokenizer and norms' shapes come from the converted Hugging Face folder beside
it (``engine/weights.py``).

Architectures: the family is the GGUF's ``general.architecture``, and ``config.json`` must be
one llama.cpp's converter writes under it (``_FAMILIES``; else refused, one line): llama (Llama
2/3, Mistral, Mixtral), qwen2, qwen3, qwen3moe, gemma2, gemma3 (text), phi3 (Phi-3, Phi-4-mini),
olmo2, granite, smollm3 — those the installed ``gguf`` package's ``MODEL_ARCH`` knows. gpt-oss
(MXFP4 experts) and every other architecture are refused with the supported ones named.

Names: each Hugging Face name the model's loader reads (its ``DecoderSpec``) is mapped to its
GGUF name by the ``gguf`` package's own tables (``gguf.get_tensor_name_map``: ``TensorNameMap``
restricted to ``MODEL_TENSORS[arch]``, what llama.cpp's converter names tensors by), so a new
architecture is one line of ``_FAMILIES``. A weight the architecture's tables cannot name (a
dense MLP layer in a qwen3moe, whose ``MODEL_TENSORS`` have none) is refused, named.

Conversion quirks undone, each as llama.cpp's ``convert_hf_to_gguf.py`` applies it:

- q/k rows (weights and biases) permuted for llama.cpp's rotary in ``llama`` (Llama, Mistral,
  Mixtral), ``granite`` and ``smollm3`` (``LlamaModel.permute``, k by the KV heads; the other
  architectures rotate NeoX-style and are written as they are): permuted back as transformers
  does (``reverse_permute_weights``); rows are whole blocks, so 4-bit tensors stay 4-bit.
- Gemma 2 / 3 norms stored as ``w + 1`` in fp32 (``Gemma2Model`` / ``Gemma3Model``): read as
  ``stored - 1``, so the spec's own ``+ 1`` at load gives back the stored value exactly for
  ``w`` in [-0.5, 1] (stored in [0.5, 2]: the subtraction is exact, Sterbenz), which is also
  the fp32 ``1 + w`` Hugging Face's Gemma RMSNorm computes.
- Gemma 2's converter drops ``lm_head``: a GGUF without ``output.weight`` ties the head to the
  embedding, as llama.cpp does. Gemma 3's drops embedding rows past the tokenizer's
  vocabulary: such a file does not match ``config.json``'s ``vocab_size`` and is refused.
- Phi-3 keeps q/k/v fused as ``attn_qkv`` and gate/up as ``ffn_up`` [2I, H]: read as
  ``self_attn.qkv_proj`` / ``mlp.gate_up_proj``, the names its spec loads.
- Mixture-of-experts weights (Mixtral, Qwen3-MoE): experts stacked into 3-D ``ffn_gate_exps`` /
  ``ffn_up_exps`` [E, I, H] and ``ffn_down_exps`` [E, H, I] (raw blocks [E, rows, row bytes]),
  the router as ``ffn_gate_inp`` [E, H]: expert ``e`` is served under its spec's per-expert
  names (``mlp.experts.{e}.gate_proj.weight``, ``block_sparse_moe.experts.{e}.w1.weight``)
  from its own slice of the raw blocks, so an expert is decoded alone, never the whole 3-D
  tensor in fp32.

Block layouts (ggml ``ggml-common.h``): Q4_1 is 20 bytes per 32 weights: fp16 ``d``, fp16 ``m``,
then 16 bytes whose low nibbles are weights 0-15 and high nibbles weights 16-31; ``w = q * d +
m``. Q4_0 is 18 bytes: fp16 ``d`` and the same nibbles; ``w = (q - 8) * d``. Q4_K is 144 bytes
per 256 weights: fp16 ``d`` and ``dmin``, 12 bytes of eight 6-bit scales and minimums
(``get_scale_min_k4``), then 128 bytes whose 32-byte chunk ``c`` holds sub-block ``2c`` in its low
nibbles and ``2c + 1`` in its high ones; ``w = d * sc * q - dmin * m``. Q5_K is 176 bytes:
Q4_K's ``d``, ``dmin`` and scales, then 32 bytes ``qh`` whose bit ``j`` of byte ``l`` is the fifth
bit of sub-block ``j``'s weight ``l``, then Q4_K's 128 bytes of nibbles. Q6_K is 210 bytes: 128
bytes of low nibbles, 64 of two-bit high parts, sixteen int8 scales (one per 16 weights) and
fp16 ``d`` last; ``w = d * sc * (q - 32)``. Q8_0 is 34 bytes: fp16 ``d`` and 32 int8 ``q``;
``w = d * q``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.models.config import ModelConfig
from engine.models.spec import LayerSpec
from engine.quantization import INT4_GROUP_SIZE, GroupedInt4
from engine.quantization.kquant import KQuantBlocks, KQuantWeight

# GGUF ``general.architecture`` -> the Hugging Face architectures llama.cpp's converter writes
# under it (``ModelBase.register`` in convert_hf_to_gguf.py).
_FAMILIES: dict[str, tuple[str, ...]] = {
    "llama": ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"),
    "qwen2": ("Qwen2ForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
    "qwen3moe": ("Qwen3MoeForCausalLM",),
    "gemma2": ("Gemma2ForCausalLM",),
    "gemma3": ("Gemma3ForCausalLM",),
    "phi3": ("Phi3ForCausalLM",),
    "olmo2": ("Olmo2ForCausalLM",),
    "granite": ("GraniteForCausalLM",),
    "smollm3": ("SmolLM3ForCausalLM",),
}
# Converted by llama.cpp's ``LlamaModel`` (``undo_permute``): q/k rows permuted.
_PERMUTED_QK = frozenset({"llama", "granite", "smollm3"})
# Norms stored as ``w + 1`` (``Gemma2Model``, ``Gemma3Model.norm_shift``).
_NORM_PLUS_ONE = frozenset({"gemma2", "gemma3"})
# Architectures we serve from safetensors whose GGUFs we cannot read, and why.
_REFUSED = {"gpt-oss": "its experts are MXFP4 blocks, which it does not read; serve the bf16 "
                       "checkpoint without it"}
_BLOCK = re.compile(r"blk\.(\d+)\.")
_KINDS = ("weight", "bias")


def supported_architectures() -> tuple[str, ...]:
    """The GGUF architectures ``--quantization gguf`` reads: ``_FAMILIES``' keys that the
    installed ``gguf`` package's ``MODEL_ARCH`` names, in ``_FAMILIES``' order."""
    from gguf.constants import MODEL_ARCH_NAMES

    known = set(MODEL_ARCH_NAMES.values())
    return tuple(a for a in _FAMILIES if a in known)


def _name_map(arch: str, layers: Sequence[LayerSpec], prefix: str = "model."
              ) -> tuple[dict[str, tuple[str, int | None]], list[str]]:
    """Hugging Face name -> (GGUF name, expert index or None) for every weight and bias a
    decoder of ``layers`` may load, by the ``gguf`` package's tables for ``arch``; and the
    required weights (not biases, not ``lm_head``) those tables cannot name."""
    import gguf
    from gguf.constants import MODEL_ARCH_NAMES

    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    tmap = gguf.get_tensor_name_map(arch_id, len(layers))
    names: dict[str, tuple[str, int | None]] = {}
    unnamed: list[str] = []

    def add(stem: str, expert: int | None = None, stacked: str | None = None,
            required: bool = True) -> None:
        for kind in _KINDS:
            g = tmap.get_name(f"{stacked or stem}.{kind}", try_suffixes=(".weight", ".bias"))
            if g is not None:
                names[f"{stem}.{kind}"] = (g, expert)
            elif required and kind == "weight":
                unnamed.append(f"{stem}.{kind}")

    add(prefix + "embed_tokens")
    add(prefix + "norm")
    add("lm_head", required=False)
    for i, ls in enumerate(layers):
        p = f"{prefix}layers.{i}."
        for stem in (ls.attn_in_norm, ls.attn_out_norm, ls.mlp_in_norm, ls.mlp_out_norm):
            if stem is not None:
                add(p + stem)
        if ls.qk_norm is not None:
            add(p + ls.q_norm)
            add(p + ls.k_norm)
        for stem in (*ls.qkv, ls.o):
            add(p + stem)
        moe = ls.moe
        if moe is None:
            for stem in (*ls.gate_up, ls.down):
                add(p + stem)
            continue
        add(p + moe.router)
        stacked = p + moe.expert.replace("{e}.", "").replace("{e}", "")
        for e in range(moe.num_experts):
            for part in dict.fromkeys((moe.gate, moe.up, moe.down)):
                add(p + moe.expert.format(e=e) + part, e, stacked + part)
    return names, list(dict.fromkeys(unnamed))


def _layer_tensors(arch: str) -> str:
    """The per-layer tensor names llama.cpp gives ``arch`` (``MODEL_TENSORS``), joined."""
    from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES

    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    return ", ".join(TENSOR_NAMES[t].removeprefix("blk.{bid}.") for t in MODEL_TENSORS[arch_id]
                     if TENSOR_NAMES[t].startswith("blk."))


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of a plain Llama layer (``blk.3.attn_q.weight``
    -> ``model.layers.3.self_attn.q_proj.weight``) by ``arch``'s tables in the ``gguf``
    package, or None for one we do not use (``rope_freqs.weight``)."""
    m = _BLOCK.match(gguf_name)
    layers = [LayerSpec(rope=None)] * (int(m.group(1)) + 1 if m else 0)
    for name, (g, _) in _name_map(arch, layers)[0].items():
        if g == gguf_name:
            return name
    return None


# Block bytes of the 4-bit types kept as they are: fp16 d (and fp16 m for Q4_1) + 16 bytes.
_Q4_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
_KQUANT_BLOCK_BYTES = {"Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


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



def _f16(b: np.ndarray) -> torch.Tensor:
    """[..., 2] bytes of little-endian fp16 -> [...] fp32."""
    return torch.from_numpy(b.copy().view(np.float16)[..., 0].astype(np.float32))


def _blocks(raw: np.ndarray, type_name: str) -> np.ndarray:
    """[rows, row bytes] -> [rows, blocks, block bytes]; ValueError for a partial block."""
    size = _KQUANT_BLOCK_BYTES[type_name]
    if raw.shape[1] % size:
        raise ValueError(f"a {type_name} row of {raw.shape[1]} bytes is not whole {size}-byte "
                         "blocks")
    return raw.reshape(raw.shape[0], -1, size)


def _scale_min_k4(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of eight 6-bit scales and minimums (ggml ``get_scale_min_k4``)
    -> ([..., 8], [..., 8]) uint8."""
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)],
                        axis=-1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)],
                        axis=-1)
    return sc, mn


def kquant_blocks(raw: np.ndarray, type_name: str) -> KQuantBlocks:
    """A Q4_K, Q5_K, Q6_K or Q8_0 tensor's raw blocks [rows, row bytes] uint8, unpacked but not
    rounded (``KQuantBlocks``; the layouts in the module docstring). Raises ValueError for a
    row that is not whole blocks."""
    blocks = _blocks(raw, type_name)
    rows = blocks.shape[0]
    if type_name == "Q8_0":
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return KQuantBlocks("Q8_0", torch.from_numpy(codes.reshape(rows, -1)),
                            _f16(blocks[..., 0:2]))
    if type_name == "Q6_K":
        ql = blocks[..., 0:128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(
            1, 1, 1, 2, 1)
        qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array(
            [0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
        codes = (ql & 0x0F).reshape(rows, -1, 2, 4, 32) | ((qh & 3) << 4)
        sc = blocks[..., 192:208].copy().view(np.int8).reshape(rows, -1)
        return KQuantBlocks("Q6_K", torch.from_numpy(codes.reshape(rows, -1)),
                            _f16(blocks[..., 208:210]), torch.from_numpy(sc))
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, mn = _scale_min_k4(blocks[..., 4:16])
    if type_name == "Q4_K":
        qs = blocks[..., 16:].reshape(rows, -1, 4, 32)
        codes = np.stack([qs & 0x0F, qs >> 4], axis=3)  # sub-blocks 2c, 2c + 1
    else:  # Q5_K: sub-block j's fifth bit is bit j of qh[l]
        qs = blocks[..., 48:].reshape(rows, -1, 4, 32)
        low = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, -1, 8, 32)
        qh = blocks[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(
            1, 1, 8, 1)
        codes = low | ((qh & 1) << 4)
    return KQuantBlocks(type_name, torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, -1)),
                        d, torch.from_numpy(sc.reshape(rows, -1)), dmin,
                        torch.from_numpy(mn.reshape(rows, -1)))


_BLOCKS = (GroupedInt4, KQuantWeight)  # a file's blocks kept as they are


class GGUFState(Mapping[str, "torch.Tensor | GroupedInt4 | KQuantWeight"]):
    """A GGUF's weights under Hugging Face names, each decoded when it is looked up (from the
    file's memory map; nothing is cached, so a loader that takes each weight once holds at most
    the one it is converting in fp32). An expert of a 3-D expert tensor is decoded from its
    own rows alone. Names are those ``cfg``'s spec loads that the file holds (``_name_map``).

    Raises (construction):
        ValueError: a weight ``cfg``'s model needs has no name in ``arch``'s tables, or an
            expert tensor holds another number of experts than ``config.json``.
    """

    def __init__(self, reader: Any, arch: str, cfg: ModelConfig) -> None:
        self._arch, self._cfg = arch, cfg
        spec = cfg.decoder_spec()
        names, unnamed = _name_map(arch, spec.layers, spec.prefix)
        if unnamed:
            more = f" and {len(unnamed) - 1} more" if len(unnamed) > 1 else ""
            raise ValueError(f"config.json's {cfg.architecture} needs {unnamed[0]}{more}, which "
                             f"a {arch} GGUF cannot hold (its layers: {_layer_tensors(arch)})")
        by_name = {t.name: t for t in reader.tensors}
        self._tensors: dict[str, tuple[Any, int | None]] = {}
        wanted = next((ls.moe.num_experts for ls in spec.layers if ls.moe is not None), 0)
        for name, (g, expert) in names.items():
            t = by_name.get(g)
            if t is None:
                continue
            if expert is not None and int(t.shape[-1]) != wanted:
                raise ValueError(f"{g} holds {int(t.shape[-1])} experts; config.json's model "
                                 f"has {wanted}")
            self._tensors[name] = (t, expert)

    def shape(self, name: str) -> tuple[int, ...]:
        """The Hugging Face shape of ``name`` without decoding it."""
        t, expert = self._tensors[name]
        shape = tuple(int(n) for n in reversed(t.shape))
        return shape[1:] if expert is not None else shape

    def __len__(self) -> int:
        return len(self._tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __contains__(self, name: object) -> bool:  # without decoding it
        return name in self._tensors

    def __getitem__(self, name: str) -> torch.Tensor | GroupedInt4 | KQuantWeight:
        import gguf

        t, expert = self._tensors[name]
        raw = np.asarray(t.data)
        if expert is not None:  # [E, rows, row bytes] -> this expert's [rows, row bytes]
            raw = raw[expert]
        kind = t.tensor_type.name
        if kind in _Q4_BLOCK_BYTES:
            value: torch.Tensor | GroupedInt4 | KQuantWeight = grouped_from_blocks(raw, kind)
        elif kind in _KQUANT_BLOCK_BYTES:
            value = KQuantWeight((kquant_blocks(raw, kind),))
        elif t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            value = torch.from_numpy(raw.astype(np.float32))
        else:
            value = torch.from_numpy(gguf.quants.dequantize(raw, t.tensor_type)
                                     .astype(np.float32))
        if self._arch in _PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight",
                                                         "q_proj.bias", "k_proj.bias")):
            cfg = self._cfg
            heads = (cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
            order = _unpermute_rows(value.shape[0], heads)
            value = value.rows(order) if isinstance(value, _BLOCKS) else value[order]
        if self._arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            dense = value.dequantize() if isinstance(value, _BLOCKS) else value
            value = dense.float() - 1.0  # stored w + 1; the spec's norm_offset adds it back
        return value


def _field(reader: Any, key: str) -> Any:
    """A scalar or string metadata field of ``reader``, or None."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types and field.types[0].name == "STRING" \
        else value[0].item()


def read_gguf_state(path: Path, cfg: ModelConfig) -> GGUFState:
    """Every weight of the GGUF at ``path`` that ``cfg``'s model loads, under its Hugging Face
    name, decoded on lookup (quirks of llama.cpp's converter undone: module docstring).

    Returns:
        name -> ``GroupedInt4`` for Q4_1 / Q4_0 tensors, ``KQuantWeight`` for Q4_K / Q5_K /
        Q6_K / Q8_0 ones, else an fp32 tensor ([out, in]
        for matrices, [n] for norms; an expert's own [out, in]).

    Raises:
        ValueError (one line each): the file is not a GGUF; its architecture is gpt-oss (MXFP4)
            or one we do not read (the supported ones named); ``config.json``'s architecture is
            not one llama.cpp writes under it; its block count, expert count, weight names or
            embedding shape do not match ``cfg``.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot read GGUF {path.name}: {e}") from None
    arch = _field(reader, "general.architecture") or "llama"
    supported = supported_architectures()
    if arch not in supported:
        why = f" ({_REFUSED[arch]})" if arch in _REFUSED else ""
        raise ValueError(f"GGUF {path.name}: architecture {arch!r} is not supported by "
                         f"--quantization gguf{why}; supported: {', '.join(supported)}")
    if cfg.architecture not in _FAMILIES[arch]:
        raise ValueError(f"GGUF {path.name}: architecture {arch!r} does not match config.json's "
                         f"{cfg.architecture} (a {arch!r} GGUF holds "
                         f"{' / '.join(_FAMILIES[arch])})")
    blocks = _field(reader, f"{arch}.block_count")
    if blocks is not None and blocks != cfg.num_hidden_layers:
        raise ValueError(f"GGUF {path.name} has {blocks} blocks but config.json has "
                         f"{cfg.num_hidden_layers} layers")
    try:
        state = GGUFState(reader, arch, cfg)
    except ValueError as e:
        raise ValueError(f"GGUF {path.name}: {e}") from None
    embed = "model.embed_tokens.weight"
    found = "none" if embed not in state else " x ".join(map(str, state.shape(embed)))
    if found != f"{cfg.vocab_size} x {cfg.hidden_size}":
        raise ValueError(f"GGUF {path.name} does not match the model's config.json: token_embd "
                         f"is {found}, config.json's vocab x hidden {cfg.vocab_size} x "
                         f"{cfg.hidden_size}")
    return state


__all__ = ["GGUFState", "grouped_from_blocks", "hf_name", "kquant_blocks", "read_gguf_state",
           "supported_architectures"]
