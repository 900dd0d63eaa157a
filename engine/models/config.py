"""``ModelConfig``: the subset of a Hugging Face ``config.json`` our model code reads (torch-free)."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.models.registry import model_file, resolve_architecture, with_family_defaults


class UnsupportedQuantizationError(ValueError):
    """The checkpoint's weights are quantized by a method we have no kernels for
    (``quantization_config``: FP8, bitsandbytes, GPTQ, AWQ, MXFP4, ...); loading its codes as
    floats would serve garbage, so the start stops, naming it."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder, read from ``config.json``.

    Attributes:
        architecture: the registry key (Hugging Face ``architectures[0]``).
        head_dim: per-head width; ``hidden_size // num_attention_heads`` unless set.
        eos_token_ids: ``eos_token_id`` of config.json (an int or a list there).
        rope_theta: the default rotary base (the spec's layers carry each layer's rotary).
        hf_config: the whole ``config.json`` (the architecture's spec reads its own fields).
        spec: the decoder as data (an ``engine.models.spec.DecoderSpec``), built by the
            architecture's model file; None for a config made by hand (``decoder_spec()``
            then builds it).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    spec: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelConfig:
        """Reads the shape and builds the architecture's ``DecoderSpec``, so an unsupported
        model stops here, before any weight is read.

        Raises:
            UnsupportedArchitectureError: an architecture outside the registry.
            UnsupportedFeatureError: a feature of it we do not implement (rope type, ...).
            UnsupportedQuantizationError: a ``quantization_config`` (pre-quantized weights).
            (All are ValueErrors whose one-line message names what is missing.)
        """
        arch = resolve_architecture(cfg)
        quant = cfg.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
            raise UnsupportedQuantizationError(
                f"weights quantized as {method!r} (quantization_config) are not supported; serve "
                "a bf16/fp16/fp32 checkpoint (or its GGUF with --quantization gguf)")
        cfg = with_family_defaults(cfg)
        model_type = cfg.get("model_type", "llama")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if not isinstance(theta, (int, float)):  # per layer type (Gemma 3): the full layers'
            theta = rope.get("full_attention", {}).get("rope_theta", 10000.0)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        heads = cfg["num_attention_heads"]
        made = cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            eos_token_ids=eos_ids, hf_config=dict(cfg),
        )
        object.__setattr__(made, "spec", made.decoder_spec())
        return made

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Reads ``model_dir/config.json``. Raises FileNotFoundError without one."""
        return cls.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))

    def decoder_spec(self) -> Any:
        """``spec``, or else the ``DecoderSpec`` that ``architecture``'s model file declares
        for this config (``engine.models.registry.model_file``; its ``decoder_spec``).

        Raises:
            UnsupportedArchitectureError: an architecture outside the registry.
            UnsupportedFeatureError: a feature of it the model file does not implement.
        """
        if self.spec is not None:
            return self.spec
        return importlib.import_module(model_file(self.architecture)).decoder_spec(self)

    def kv_bytes_per_block(self, block_size: int, dtype_bytes: int) -> int:
        """Bytes of K and V for one block of ``block_size`` tokens across all layers."""
        return (2 * self.num_hidden_layers * block_size * self.num_key_value_heads
                * self.head_dim * dtype_bytes)

