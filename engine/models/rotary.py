"""Rotary position embeddings (RoPE) of every scaling type we serve, bit-identical to Hugging Face.

``RopeConfig`` is a layer's rotary as data, read from a Hugging Face ``config.json`` by
``RopeConfig.from_hf_config``. ``rotary_table`` builds its fp32 cos/sin table (one row per
position), ``RotaryEmbedding`` holds that table as module buffers, and ``apply_rotary_`` rotates
q or k heads in place (neox style, with the pass-through of a partial rotary).

The inverse frequencies and attention factors repeat transformers' ``modeling_rope_utils``
operation for operation (same order, same dtypes, same scalar-versus-tensor arithmetic), so each
row equals transformers' cos/sin for that position bit for bit on the CPU.

Importing this module does not import torch (``engine.models.spec`` and ``config`` are
torch-free): the functions import it when called, and ``RotaryEmbedding`` is made on first use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [  # noqa: F822 - RotaryEmbedding comes from the module's __getattr__
    "SUPPORTED_ROPE_TYPES", "RopeConfig", "RotaryEmbedding", "apply_rotary_", "rotary_dim",
    "rotary_table",
]

SUPPORTED_ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "longrope", "yarn")

# Phi-3's configuration maps its early names for LongRoPE ("su", "yarn") to "longrope".
_PHI3_MODEL_TYPES = ("phi3", "phi4_multimodal")
_GEMMA3_MODEL_TYPES = ("gemma3", "gemma3_text")
# Gemma3TextConfig.default_theta: the full-attention and the sliding-window layers' bases.
_GEMMA3_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
# Rows of the dynamic table per op: under ATen's parallel grain (32768 elements), so each row's
# ``pow`` runs in one piece the way Hugging Face's single row does.
_DYNAMIC_CHUNK_ELEMENTS = 16384
# The fields each type reads (``from_hf_config`` leaves the others at their defaults, so equal
# rotaries compare equal).
_FIELDS_BY_TYPE = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "max_position_embeddings",
             "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
             "truncate"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "factor", "attention_factor",
                 "original_max_position_embeddings", "max_position_embeddings"),
}


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _factors(value: Any) -> tuple[float, ...] | None:
    return None if value is None else tuple(float(v) for v in value)


@dataclass(frozen=True)
class RopeConfig:
    """One layer's rotary embedding: the type and every parameter its rule reads.

    ``RopeConfig()`` is plain RoPE with base 10000 over the whole head.

    Attributes:
        rope_type: one of ``SUPPORTED_ROPE_TYPES``: ``default`` (RoFormer), ``linear``
            (position interpolation), ``dynamic`` (NTK-aware, length-dependent), ``yarn``
            (arXiv 2309.00071), ``longrope`` (arXiv 2402.13753, Phi-3) or ``llama3``
            (Llama 3.1's rope scaling).
        theta: the base of the frequencies (``rope_theta``).
        factor: the context extension factor (linear, dynamic, yarn, llama3, longrope; yarn and
            longrope fall back to ``max_position_embeddings / original_max_position_embeddings``).
        original_max_position_embeddings: the pre-training context in tokens (yarn, llama3,
            longrope).
        max_position_embeddings: the model's ``max_position_embeddings`` in tokens (dynamic's
            threshold; yarn's and longrope's fallback factor).
        low_freq_factor, high_freq_factor: llama3's wavelength band edges.
        beta_fast, beta_slow: yarn's ramp bounds in rotations (None: 32 and 1).
        mscale, mscale_all_dim: yarn's attention-factor terms (DeepSeek); None where unused.
        attention_factor: the cos/sin scale of yarn and longrope; None: derived from factor.
        truncate: yarn rounds its correction range to whole dimensions (gpt-oss sets False).
        short_factor, long_factor: longrope's per-frequency divisors, ``rotary_dim // 2`` each.
        partial_rotary_factor: the share of each head that rotates (Phi-4-mini: 0.75).

    Raises:
        ValueError: an unsupported ``rope_type``, or a parameter its type needs is missing (one
            line naming them).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):  # lists from JSON: kept hashable
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _factors(getattr(self, name)))
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        needs = {
            "default": (),
            "linear": ("factor",),
            "dynamic": ("factor", "max_position_embeddings"),
            "yarn": ("original_max_position_embeddings",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"),
            "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
        }[self.rope_type]
        missing = [name for name in needs if getattr(self, name) is None]
        if (self.rope_type in ("yarn", "longrope") and self.factor is None
                and self.max_position_embeddings is None):
            missing.append("factor (or max_position_embeddings)")
        if missing:
            raise ValueError(f"rope type {self.rope_type!r} needs {', '.join(missing)}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got "
                             f"{self.partial_rotary_factor}")

    @classmethod
    def from_hf_config(cls, cfg: dict, layer_type: str | None = None) -> RopeConfig:
        """The rotary of a Hugging Face ``config.json`` dict (a multimodal checkpoint's
        ``text_config``), for the layers of ``layer_type`` where it differs per layer type.

        Reads, as transformers' ``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`` and
        ``standardize_rope_params`` do: ``rope_scaling`` (older files; "type" or "rope_type") or
        else ``rope_parameters`` (5.x), with ``rope_theta`` and ``partial_rotary_factor`` taken
        from it first and from the top level second; no rope fields at all is default RoPE with
        base 10000. A top-level ``original_max_position_embeddings`` (Phi-3) wins over the
        dict's, which defaults to ``max_position_embeddings``. Per-layer-type parameters
        (Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``) pick
        ``layer_type``; Gemma 3's older form (``rope_theta`` and ``rope_scaling`` for the full
        layers, ``rope_local_base_freq`` for the sliding ones, bases 1e6 and 1e4 if absent) is
        converted as ``Gemma3TextConfig.convert_rope_params_to_dict`` does. Phi-3's "su" and
        "yarn" mean "longrope" (``Phi3Config``).

        Raises:
            ValueError: an unsupported rope type (the message lists the supported ones), a
                missing parameter, or per-layer-type parameters without a ``layer_type`` they
                have.
        """
        model_type = cfg.get("model_type")
        rope_parameters = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling")
        gemma3 = model_type in _GEMMA3_MODEL_TYPES or "rope_local_base_freq" in cfg
        nested = any(isinstance(value, dict) for value in rope_parameters.values())
        if (nested or gemma3) and layer_type is None:
            raise ValueError("rope parameters are per layer type "
                             f"({', '.join(rope_parameters) or 'Gemma 3'}); pass the layer type")
        if nested:
            if rope_parameters.get(layer_type) is None:
                raise ValueError(f"no rope parameters for layer type {layer_type!r} "
                                 f"(have: {', '.join(rope_parameters)})")
            params = dict(rope_parameters[layer_type])
        elif gemma3:  # the older Gemma 3 form: rope_scaling belongs to the full layers
            params = {}
        else:
            params = dict(rope_scaling or rope_parameters)
        if gemma3 and layer_type == "full_attention" and rope_scaling:
            params.update(rope_scaling)
        if gemma3 and layer_type == "sliding_attention":
            top_theta = cfg.get("rope_local_base_freq", _GEMMA3_DEFAULT_THETA[layer_type])
        elif gemma3:
            top_theta = cfg.get("rope_theta", _GEMMA3_DEFAULT_THETA["full_attention"])
        else:
            top_theta = cfg.get("rope_theta", 10000.0)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if model_type in _PHI3_MODEL_TYPES and rope_type in ("su", "yarn"):
            rope_type = "longrope"
        theta = params.get("rope_theta")
        if theta is None:
            theta = top_theta if top_theta is not None else 10000.0
        partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        max_pos = cfg.get("max_position_embeddings")
        original = params.get("original_max_position_embeddings", max_pos)
        if not nested and cfg.get("original_max_position_embeddings") is not None:
            original = cfg["original_max_position_embeddings"]
        read = {
            "factor": _float(params.get("factor")),
            "original_max_position_embeddings": _int(original),
            "max_position_embeddings": _int(max_pos),
            "low_freq_factor": _float(params.get("low_freq_factor")),
            "high_freq_factor": _float(params.get("high_freq_factor")),
            "beta_fast": _float(params.get("beta_fast")),
            "beta_slow": _float(params.get("beta_slow")),
            "mscale": _float(params.get("mscale")),
            "mscale_all_dim": _float(params.get("mscale_all_dim")),
            "attention_factor": _float(params.get("attention_factor")),
            "truncate": bool(params.get("truncate", True)),
            "short_factor": _factors(params.get("short_factor")),
            "long_factor": _factors(params.get("long_factor")),
        }
        used = _FIELDS_BY_TYPE.get(rope_type, ())
        return cls(rope_type=rope_type, theta=float(theta),
                   partial_rotary_factor=float(partial if partial is not None else 1.0),
                   **{name: value for name, value in read.items() if name in used})


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """The features of each head that rotate: ``int(head_dim * partial_rotary_factor)``, as
    transformers computes ``dim`` in ``modeling_rope_utils``."""
    return int(head_dim * rope.partial_rotary_factor)


def _inv_freq(rope: RopeConfig, dim: int, seq_len: int | None = None
              ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] fp32 and the cos/sin scale for a sequence of ``seq_len``
    tokens (None: transformers' init-time value), as ``ROPE_INIT_FUNCTIONS[rope_type]`` (or the
    models' ``compute_default_rope_parameters``) compute them, step for step."""
    import torch

    base = rope.theta
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    kind = rope.rope_type
    if kind in ("default", "linear"):
        inv_freq = 1.0 / (base ** shape)
        if kind == "linear":  # _compute_linear_scaling_rope_parameters
            inv_freq /= rope.factor
        return inv_freq, 1.0
    if kind == "dynamic":  # _compute_dynamic_ntk_parameters (Python numbers at init)
        factor, max_pos = rope.factor, rope.max_position_embeddings
        seq_len = max_pos if seq_len is None else max(seq_len, max_pos)
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** shape), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(rope, dim, shape), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(rope, dim, shape)
    # longrope: _compute_longrope_parameters
    original = rope.original_max_position_embeddings
    factor = rope.factor
    if factor is None:
        factor = rope.max_position_embeddings / original
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if factor <= 1.0:
            attention_factor = 1.0
        else:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    chosen = rope.long_factor if seq_len and seq_len > original else rope.short_factor
    ext_factors = torch.tensor(chosen, dtype=torch.float32, device="cpu")
    return 1.0 / (ext_factors * base ** shape), attention_factor


def _llama3_inv_freq(rope: RopeConfig, dim: int, shape: torch.Tensor) -> torch.Tensor:
    """``_compute_llama3_parameters``: Llama 3.1's band-wise scaling of the inverse frequencies."""
    import torch

    inv_freq = 1.0 / (rope.theta ** shape)
    factor, low_freq_factor = rope.factor, rope.low_freq_factor
    high_freq_factor = rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = ((old_context_len / wavelen - low_freq_factor)
                     / (high_freq_factor - low_freq_factor))
    smoothed_inv_freq = ((1 - smooth_factor) * inv_freq_llama / factor
                         + smooth_factor * inv_freq_llama)
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _yarn_inv_freq(rope: RopeConfig, dim: int, shape: torch.Tensor
                   ) -> tuple[torch.Tensor, float]:
    """``_compute_yarn_parameters`` (YaRN, arXiv 2309.00071): a ramp between interpolated and
    extrapolated frequencies, and the attention factor (``mscale``)."""
    import torch

    base = rope.theta
    factor = rope.factor
    original = rope.original_max_position_embeddings
    if factor is None:
        factor = rope.max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1) -> float:
        if scale <= 1:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(get_mscale(factor, rope.mscale)
                                     / get_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def find_correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = find_correction_dim(beta_fast)
    high = find_correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    linear_func = (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
    ramp = torch.clamp(linear_func, 0, 1)
    pos_freqs = base ** shape
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = (inv_freq_interpolation * (1 - extrapolation_factor)
                + inv_freq_extrapolation * extrapolation_factor)
    return inv_freq, attention_factor


def _dynamic_rows(rope: RopeConfig, dim: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK inverse frequencies [len(seq_lens), dim // 2] fp32, row i as transformers
    computes them for a sequence of ``seq_lens[i]`` tokens (``dynamic_rope_update``).

    There the length is a 0-dim int64 tensor, so the base is an fp32 0-dim tensor and its power
    takes ATen's scalar loop; a contiguous tensor of bases would take the SIMD loop, whose ``pow``
    differs in the last bit for some lengths (tests/engine/test_rotary.py checks such lengths).
    A strided view takes the scalar loop for every element."""
    import torch

    factor, max_pos = rope.factor, rope.max_position_embeddings
    ratio = (factor * seq_lens / max_pos) - (factor - 1)
    strided = torch.empty(2 * ratio.numel(), dtype=ratio.dtype, device="cpu")[::2]
    strided.copy_(ratio)
    base = rope.theta * strided ** (dim / (dim - 2))
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    step = max(1, _DYNAMIC_CHUNK_ELEMENTS // max(1, dim // 2))
    return torch.cat([1.0 / (base[i:i + step, None] ** shape[None, :])
                      for i in range(0, base.numel(), step)])


def rotary_table(rope: RopeConfig, rotary_dim: int, max_position: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables, each [max_position, rotary_dim] fp32 on the CPU (also inside a
    ``torch.device`` context), row p for position p (tokens), the type's attention scaling
    folded in: ``cat(f, f).cos() * attention_scaling`` with ``f = p * inv_freq``, transformers'
    ``<Model>RotaryEmbedding.forward`` row for row, bit for bit.

    Length-dependent types get one fixed row per position, so K rotated for one request is right
    for another that shares its prefix:

    - ``dynamic`` (``dynamic_rope_update``): positions below ``max_position_embeddings`` use
      the unscaled frequencies; position p at or beyond it uses the NTK-scaled base
      transformers uses for a sequence of p + 1 tokens.
    - ``longrope`` (``longrope_frequency_update``): positions below
      ``original_max_position_embeddings`` use ``short_factor``, the others ``long_factor``.

    So every row equals transformers' for any sequence shorter than that threshold. Past it,
    transformers rescales every position of a sequence by the sequence's length, so its numbers
    for position p depend on how long the prompt is while ours depend on p alone (vLLM makes a
    similar approximation, per batch).

    Raises:
        ValueError: ``rotary_dim`` not a positive even number, or longrope factors whose length
            is not ``rotary_dim // 2``.
    """
    import torch

    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if rope.rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            if len(getattr(rope, name)) != rotary_dim // 2:
                raise ValueError(f"longrope {name} has {len(getattr(rope, name))} values; "
                                 f"rotary_dim {rotary_dim} needs {rotary_dim // 2}")
    inv_freq, scaling = _inv_freq(rope, rotary_dim)
    rows = inv_freq[None, :]
    if rope.rope_type == "dynamic" and max_position > rope.max_position_embeddings:
        start = rope.max_position_embeddings
        seq_lens = torch.arange(start + 1, max_position + 1, dtype=torch.int64, device="cpu")
        rows = torch.cat((inv_freq.expand(start, -1), _dynamic_rows(rope, rotary_dim, seq_lens)))
    elif (rope.rope_type == "longrope"
          and max_position > rope.original_max_position_embeddings):
        start = rope.original_max_position_embeddings
        long_inv_freq, _ = _inv_freq(rope, rotary_dim, seq_len=start + 1)
        rows = torch.cat((inv_freq.expand(start, -1),
                          long_inv_freq.expand(max_position - start, -1)))
    positions = torch.arange(max_position, dtype=torch.int64, device="cpu").float()
    freqs = positions[:, None] * rows
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates the first ``rotary_dim = cos.shape[-1]`` features of every head of x in place,
    neox style, leaving the rest as they are: transformers' ``apply_rotary_pos_emb``
    (``x_rot * cos + rotate_half(x_rot) * sin``, Phi-3's and GPT-NeoX's pass-through), bit for
    bit in x's dtype.

    Args:
        x: [T, H, head_dim] (a view, possibly strided: the fused qkv projection's q or k).
        cos, sin: [T, 1, rotary_dim] in x's dtype (``RotaryEmbedding.cos_sin``).
    """
    half = cos.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:2 * half]
    # rotate_half(x) = cat(-x2, x1); x1 * c + (-x2) * s equals x1 * c - x2 * s bit for bit.
    out1 = x1 * cos[..., :half] - x2 * sin[..., :half]
    out2 = x2 * cos[..., half:] + x1 * sin[..., half:]
    x1.copy_(out1)
    x2.copy_(out2)


def _make_rotary_embedding() -> type:
    from torch import nn

    class RotaryEmbedding(nn.Module):
        """A layer's rotary table as non-persistent buffers ``cos`` and ``sin``, each
        [max_position, rotary_dim] fp32 (``rotary_table``; built on the CPU, ``.to()`` moves
        them with the model).

        Args:
            rope: the layer's rotary.
            rotary_dim: the features of each head that rotate (``rotary_dim(rope, head_dim)``).
            max_position: the table's length in tokens (the engine's max_model_len).
        """

        def __init__(self, rope: RopeConfig, rotary_dim: int, max_position: int) -> None:
            super().__init__()
            self.rope = rope
            self.rotary_dim = rotary_dim
            cos, sin = rotary_table(rope, rotary_dim, max_position)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

        def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
            """positions [T] int64 -> cos, sin [T, 1, rotary_dim] in ``dtype``."""
            return (self.cos[positions].unsqueeze(1).to(dtype),
                    self.sin[positions].unsqueeze(1).to(dtype))

    RotaryEmbedding.__module__ = __name__
    RotaryEmbedding.__qualname__ = "RotaryEmbedding"
    return RotaryEmbedding


def __getattr__(name: str) -> Any:
    """``RotaryEmbedding`` (an ``nn.Module``) is made on first access, so importing this module
    does not import torch."""
    if name == "RotaryEmbedding":
        cls = _make_rotary_embedding()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
