"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over the paged KV cache.

Our own forward: RMSNorm, rotary embeddings with the model's theta, grouped-query attention,
SwiGLU MLP, optional tied embeddings and qkv bias (Qwen2). Numerics follow Hugging Face
transformers' ``LlamaForCausalLM`` (fp32 RMSNorm, fp32 rotary tables) so greedy outputs match
``generate`` token for token. The batch is flattened: ``num_tokens`` rows from all sequences.
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import attrgetter

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.models.config import ModelConfig
from engine.quantization import (
    DEFAULT_ACT_BITS,
    DenseLinear,
    GroupedInt4,
    LinearMethod,
    dense_from_tokens,
    int8_dense_from_tokens,
    make_linear,
)
from kernels import cpu_ops

_OWN_BELOW = attrgetter("own_below")

__all__ = ["LlamaForCausalLM", "ModelConfig"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 like transformers' ``LlamaRMSNorm`` (``kernels.cpu_ops``: our
    fused CPU kernel in fp32, equal to it to fp32 rounding; torch ops elsewhere)."""
    return cpu_ops.rms_norm(x, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a precomputed fp32 cos/sin table [max_pos, head_dim]."""

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        # On the CPU even inside a ``torch.device`` context: ops on meta tensors import
        # torch._dynamo (1.4 s of start-up); ``.to()`` moves it with the model.
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                                 device="cpu").float() / head_dim))
        freqs = (torch.arange(max_position, dtype=torch.float32, device="cpu")[:, None]
                 * inv_freq[None, :])
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, 1, head_dim] (looked up once per step)."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))


class LlamaDecoderLayer(nn.Module):
    """One decoder layer. Its projections are ``LinearMethod``s (dense or weight-only quantized,
    ``engine.quantization``), fused at load time: q/k/v into ``qkv`` and gate/up into
    ``gate_up``; ``LlamaForCausalLM.load_weights`` sets them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv: LinearMethod | None = None
        self.o: LinearMethod | None = None
        self.gate_up: LinearMethod | None = None
        self.down: LinearMethod | None = None
        self.intermediate_size = cfg.intermediate_size

    def bind_weights(self) -> None:
        """Caches plain references to the weights (call after loading and after ``.to()``), so
        the hot path skips ``nn.Module.__call__``/``__getattr__`` overhead (~15% of a CPU decode
        step of the 135M model)."""
        self._w = (self.input_layernorm.weight, self.qkv, self.o,
                   self.post_attention_layernorm.weight, self.gate_up, self.down)
        self._decode_args: dict[tuple, tuple | None] = {}

    def decode_args(self, num_tokens: int) -> tuple | None:
        """The projections as ``kernels.cpu_ops.decode_layer`` takes them for ``num_tokens``
        fp32 rows (weights, kinds, groups), or None where one of them cannot run there.
        Cached per row count and the kernel thresholds the specs depend on (the quantized
        layers' ``own_below`` and ``dense_from()``); ``bind_weights`` clears it (call it
        after replacing a projection)."""
        projections = self._w[1], self._w[2], self._w[4], self._w[5]
        key = (num_tokens, *(getattr(m, "own_below", None) for m in projections),
               *(m.dense_from() if hasattr(m, "dense_from") else None for m in projections))
        if key not in self._decode_args:
            specs = [m.decode_spec(num_tokens) for m in projections]
            args = None
            if all(s is not None for s in specs):
                weights = [t for s in specs
                           for t in (*s.tensors, *(None,) * (3 - len(s.tensors)), s.bias)]
                args = (weights, [s.kind for s in specs], [s.group for s in specs])
            self._decode_args[key] = args
        return self._decode_args[key]

    def forward_decode(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                       cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, meta: AttentionMetadata, args: tuple
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` for a step of decodes only, as one fused CPU call
        (``kernels.cpu_ops.decode_layer``; bit-identical to ``forward``). ``args``: from
        ``decode_args``; the backend's ``fused_cpu_decode_usable`` must hold."""
        weights, kinds, groups = args
        first = residual is None
        if first:
            residual = hidden
        out = cpu_ops.decode_layer(hidden, residual, first, self._w[0], self._w[3],
                                   self.input_layernorm.eps, weights, kinds, groups, cos, sin,
                                   key_cache, value_cache, meta, self.num_heads,
                                   self.intermediate_size, self.scale)
        return out, residual

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, attn: AttentionBackend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual convention: the residual stream is ``residual + hidden`` (``hidden``
        alone for the first layer, ``residual`` None), and each residual add is fused into the
        RMSNorm after it (``kernels.cpu_ops.add_rms_norm``).

        Args:
            hidden, residual: [num_tokens, hidden_size].

        Returns:
            (this layer's MLP output, the residual stream before it); their sum is the layer's
            output.
        """
        ln1, qkv, o_proj, ln2, gate_up, down = self._w
        eps = self.input_layernorm.eps
        T = hidden.shape[0]
        if residual is None:
            residual, x = hidden, rms_norm(hidden, ln1, eps)
        else:
            residual, x = cpu_ops.add_rms_norm(residual, hidden, ln1, eps)
        y = qkv(x)  # [T, q_size + 2 * kv_size]: q heads, k heads, v heads
        # q and k rotated in one pass, in place, then split as views.
        cpu_ops.rotary_neox_(y, cos, sin, self.num_heads + self.num_kv_heads, self.head_dim)
        q = y[:, :self.q_size].view(T, self.num_heads, self.head_dim)
        k = y[:, self.q_size:self.q_size + self.kv_size].view(T, self.num_kv_heads,
                                                              self.head_dim)
        v = y[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        attn.write_kv(k, v, key_cache, value_cache, meta)
        out = attn.forward(q, key_cache, value_cache, meta, self.scale)
        residual, x = cpu_ops.add_rms_norm(residual, o_proj(out.reshape(T, self.q_size)), ln2,
                                            eps)
        return down(cpu_ops.silu_and_mul(gate_up(x))), residual


class LlamaForCausalLM(nn.Module):
    """Decoder over a paged KV cache.

    ``kv_caches`` is one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].

    Args:
        cfg: the model's shape.
        max_position: rotary table length (tokens; the engine's max_model_len).
        attn: the attention backend every layer calls (``engine.attention``).
    """

    def __init__(self, cfg: ModelConfig, max_position: int, attn: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        # ``_weight`` skips nn.Embedding's random init (the loaded weights replace it): 113 MB
        # of normal_ draws, and on the meta device an import of torch._dynamo (0.5 s).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head: LinearMethod | None = None
        self.max_position = max_position
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta)
        self.attn = attn

    def bind_weights(self) -> None:
        for layer in self.layers:
            layer.bind_weights()
        # Per row count: (bound weights, thresholds, their holders, _fused_decode_args' value).
        self._step_args: dict[int, tuple[list, tuple, list, tuple | None]] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Args: input_ids, positions: [num_tokens] int64. Returns hidden [num_tokens, hidden]."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        residual = None
        fused = self._fused_decode_args(hidden, kv_caches, meta)
        if fused is not None and self.fused_decode_whole:
            first = self.layers[0]
            norms, weights, kinds, groups = fused[1]
            hidden, residual = cpu_ops.decode_layers(
                hidden, norms, first.input_layernorm.eps, weights, kinds, groups,
                cos, sin, kv_caches, meta, first.num_heads, first.intermediate_size,
                first.scale)
            return cpu_ops.add_rms_norm(residual, hidden, self.norm.weight, self.norm.eps)[1]
        for i, layer in enumerate(self.layers):
            if fused is not None:
                hidden, residual = layer.forward_decode(hidden, residual, cos, sin,
                                                        kv_caches[i, 0], kv_caches[i, 1], meta,
                                                        fused[0][i])
            else:
                hidden, residual = layer.forward(hidden, residual, cos, sin, kv_caches[i, 0],
                                                 kv_caches[i, 1], meta, self.attn)
        if residual is None:  # no layers
            return self.norm(hidden)
        return cpu_ops.add_rms_norm(residual, hidden, self.norm.weight, self.norm.eps)[1]

    # Set False to run every step through the per-op Python layers (benchmarks, tests).
    fused_decode = True
    # Set False to call the fused layers one at a time from Python (decode_layer, not
    # decode_layers: the same bits; tests compare them).
    fused_decode_whole = True

    def _fused_decode_args(self, hidden: torch.Tensor, kv_caches: torch.Tensor,
                           meta: AttentionMetadata) -> tuple[list[tuple], tuple] | None:
        """When this step can run fused: (every layer's ``decode_args``, the same joined as
        ``cpu_ops.decode_layers`` takes them: (norms, weights, kinds, groups)); else None.
        Checked once a step: no autograd (``ModelRunner.execute`` runs in inference mode),
        fp32 CPU activations, and the backend (every row a decode) and every projection
        supporting it."""
        if (not self.fused_decode or torch.is_grad_enabled() or hidden.dtype != torch.float32
                or hidden.device.type != "cpu" or not self.layers
                or not self.attn.fused_cpu_decode_usable(kv_caches[0, 0], kv_caches[0, 1], meta,
                                                         self.config.num_attention_heads)):
            return None
        return self._step_decode_args(hidden.shape[0])

    def _step_decode_args(self, num_tokens: int) -> tuple[list[tuple], tuple] | None:
        """``_fused_decode_args``' value for ``num_tokens`` rows, kept per row count. An entry
        holds while every layer's bound weights are the same objects (a layer's
        ``bind_weights`` after replacing a weight makes new ones) and the kernel thresholds
        the layers' ``decode_args`` depend on are unchanged (``_thresholds``): one check a
        step in place of 30 layers' cache keys (0.09 ms of Python a one-stream step)."""
        bound = [layer._w for layer in self.layers]
        hit = self._step_args.get(num_tokens)
        if (hit is not None and all(a is b for a, b in zip(hit[0], bound, strict=True))
                and hit[1] == self._thresholds(hit[2])):
            return hit[3]
        args = [layer.decode_args(num_tokens) for layer in self.layers]
        value = None
        if all(a is not None for a in args):
            value = (args, ([w for w in bound for w in (w[0], w[3])],
                            [t for a in args for t in a[0]], [k for a in args for k in a[1]],
                            [g for a in args for g in a[2]]))
        holders = [m for w in bound for m in (w[1], w[2], w[4], w[5]) if hasattr(m, "own_below")]
        self._step_args[num_tokens] = (bound, self._thresholds(holders), holders, value)
        return value

    @staticmethod
    def _thresholds(holders: list) -> tuple:
        """What a projection's ``decode_spec`` depends on besides its rows: the dense-copy
        thresholds (every ``dense_from()`` is ``engine.quantization.dense_from_tokens()`` or
        ``int8_dense_from_tokens()``) and each 4-bit layer's ``own_below`` (tests and
        benchmarks change them)."""
        return dense_from_tokens(), int8_dense_from_tokens(), *map(_OWN_BELOW, holders)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab_size] fp32."""
        return self.lm_head(hidden).float()

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every projection and the LM head (the
        embedding reads one row per token; norms are negligible)."""
        linears = [self.lm_head] + [m for layer in self.layers
                                    for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(m.weight_bytes for m in linears)

    def load_weights(self, state: Mapping[str, torch.Tensor | GroupedInt4],
                     quantization: str | None = None,
                     act_bits: int = DEFAULT_ACT_BITS) -> None:
        """Loads Hugging Face ``model.*`` weight names, fusing q/k/v and gate/up projections
        into one ``LinearMethod`` each (``engine.quantization.make_linear``), in the dtype and
        on the device of this module's parameters (call after ``.to()``).

        Args:
            state: name -> float tensor, or ``GroupedInt4`` 4-bit blocks (from a GGUF).
            quantization: None (dense), or one of ``engine.quantization.QUANTIZATIONS``.
            act_bits: the quantized layers' activation rounding in our int8-dot kernels, 16 or
                8 (``--quantized-activation-bits``).

        Raises:
            ValueError: a required weight is missing (named).
        """
        dtype, device = self.norm.weight.dtype, self.norm.weight.device

        def tensor(name: str) -> torch.Tensor:
            """A weight as a float tensor (4-bit blocks dequantized: embeddings, norms)."""
            if name not in state:
                raise ValueError(f"the checkpoint has no {name}")
            value = state[name]
            return value.dequantize() if isinstance(value, GroupedInt4) else value

        def linear(names: list[str], bias: bool = False) -> LinearMethod:
            parts = [state.get(n + ".weight") for n in names]
            if any(p is None for p in parts):
                raise ValueError(f"the checkpoint has no {names[parts.index(None)]}.weight")
            if all(isinstance(p, GroupedInt4) for p in parts):  # fused without dequantizing
                w = GroupedInt4.cat(parts) if len(parts) > 1 else parts[0]
            elif len(names) == 1:
                w = tensor(names[0] + ".weight")
            else:  # float, or 4-bit mixed with other types: dequantized
                w = torch.cat([tensor(n + ".weight") for n in names])
            b = torch.cat([tensor(n + ".bias") for n in names]) if bias else None
            return make_linear(w, b, quantization, dtype, device, act_bits)

        with torch.no_grad():
            self.embed_tokens.weight.copy_(tensor("model.embed_tokens.weight"))
            self.norm.weight.copy_(tensor("model.norm.weight"))
            if self.config.tie_word_embeddings or "lm_head.weight" not in state:
                # The head is the embedding: quantized from the parameter itself, which an fp32
                # model's head then uses for its dense rows with no second copy, unless the
                # dense copy is bf16 (CPUs with native bf16: a 57 MB copy for SmolLM2; its
                # logits from 24 rows are bf16-rounded, as the int8 kernel's are below that).
                # bf16 activations: from the checkpoint's values, not their bf16 rounding.
                embedding = (self.embed_tokens.weight if dtype == torch.float32
                             else tensor("model.embed_tokens.weight"))
                self.lm_head = (DenseLinear(self.embed_tokens.weight) if quantization is None
                                else make_linear(embedding, None, quantization, dtype, device,
                                                 act_bits))
            else:
                self.lm_head = linear(["lm_head"])
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                layer.qkv = linear([p + f"self_attn.{n}_proj" for n in "qkv"],
                                   bias=self.config.attention_bias)
                layer.o = linear([p + "self_attn.o_proj"])
                layer.gate_up = linear([p + "mlp.gate_proj", p + "mlp.up_proj"])
                layer.down = linear([p + "mlp.down_proj"])
                layer.input_layernorm.weight.copy_(tensor(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(
                    tensor(p + "post_attention_layernorm.weight"))
