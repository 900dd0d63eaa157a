"""The decoder: one implementation for every architecture's ``DecoderSpec`` over the paged KV
cache (``engine.models.spec``; each family's file declares its spec).

Numerics follow Hugging Face transformers' modeling code for each family (fp32 RMSNorm, fp32
rotary tables, the same order of residual adds) so greedy outputs match ``generate`` token for
token. The batch is flattened: ``num_tokens`` rows from all sequences.

Two ways through a step, chosen per step and giving the same bits where both can run:

- the per-op path (``DecoderLayer.forward``), which runs any spec on any backend and device;
- the fused CPU decode, one C++ call per layer (``kernels.cpu_ops.decode_layer``) or per step
  (``decode_layers``), for a step of decodes only with fp32 activations on CPU, where the spec
  is the Llama layer (``DecoderSpec.fused_decode_blockers`` names what keeps a spec off it; the
  start-up log says so once).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from operator import attrgetter

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.rotary import RopeConfig, RotaryEmbedding, apply_rotary_
from engine.models.spec import DecoderSpec, LayerSpec, MoESpec
from engine.quantization import (
    DEFAULT_ACT_BITS,
    DenseLinear,
    GroupedInt4,
    KernelPolicy,
    KQuantWeight,
    LinearMethod,
    QuantizationMethod,
    Unquantized,
    get_quantization_method,
)
from engine.quantization.base import nbytes
from kernels import cpu_ops

logger = logging.getLogger(__name__)

_OWN_BELOW = attrgetter("own_below")

__all__ = ["DecoderForCausalLM", "ModelConfig"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 like transformers' ``LlamaRMSNorm`` (``kernels.cpu_ops``: our
    fused CPU kernel in fp32, equal to it to fp32 rounding; torch ops elsewhere)."""
    return cpu_ops.rms_norm(x, weight, eps)


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``; a ``1 + w`` checkpoint weight (Gemma) is stored as ``1 + w``.

    ``weight32``: set (by the loader) for families whose norm multiplies by the weight in fp32
    and rounds once (transformers' ``Gemma2RMSNorm``, ``Olmo2RMSNorm``; Llama's rounds before
    the multiply): with activations other than fp32 the product is then taken in fp32 against
    this fp32 weight [size]. fp32 activations take the same path either way.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.weight32: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight32 is not None and x.dtype != torch.float32:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return (h * self.weight32).to(x.dtype)
        return rms_norm(x, self.weight, self.eps)

    def add(self, residual: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + x, norm(residual + x))``: the residual add fused into the norm
        (``kernels.cpu_ops.add_rms_norm``), or in two steps where ``weight32`` applies."""
        if self.weight32 is not None and x.dtype != torch.float32:
            s = residual + x
            return s, self(s)
        return cpu_ops.add_rms_norm(residual, x, self.weight, self.eps)


def _gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh GELU (Gemma's ``gelu_pytorch_tanh``): ``gelu(x[:, :d]) * x[:, d:]``."""
    d = x.shape[-1] // 2
    return F.gelu(x[:, :d], approximate="tanh") * x[:, d:]


def _swiglu_oai(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU over interleaved gate/up columns (``GptOssExperts._apply_gate``),
    here on [gate | up] halves (the loader de-interleaves them)."""
    d = x.shape[-1] // 2
    gate = x[:, :d].clamp(min=None, max=limit)
    up = x[:, d:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


_ACTIVATIONS = {"silu": cpu_ops.silu_and_mul, "gelu_tanh": _gelu_tanh_and_mul,
                "swiglu_oai": _swiglu_oai}


class MixtureOfExperts:
    """A mixture-of-experts MLP: a router picks ``top_k`` experts per token and their SwiGLU
    outputs are summed with the routing weights (Mixtral, Qwen3-MoE, gpt-oss; Hugging Face's
    ``*SparseMoeBlock`` order: experts in index order, each over its tokens). On any device
    only the selected experts run; each expert's projections are ``LinearMethod``s, so they may
    be quantized like any linear.

    Args:
        spec: routing and sizes.
        router: [num_experts, hidden] logits (dense).
        experts: per expert (gate_up, down).
    """

    def __init__(self, spec: MoESpec, router: LinearMethod,
                 experts: list[tuple[LinearMethod, LinearMethod]], activation: str) -> None:
        self.spec, self.router, self.experts = spec, router, experts
        self.act = _ACTIVATIONS[activation]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], x's dtype."""
        logits = self.router(x)
        k = self.spec.top_k
        if self.spec.routing == "softmax_topk":
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, index = torch.topk(probs, k, dim=-1)
            if self.spec.renormalize:
                weights /= weights.sum(dim=-1, keepdim=True)
            if self.spec.weights_in_activation_dtype:
                weights = weights.to(x.dtype)
        else:  # gpt-oss: the top k logits, softmax over them
            top, index = torch.topk(logits, k, dim=-1)
            weights = torch.softmax(top, dim=1, dtype=top.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(index).tolist():
            tokens, slot = torch.where(index == e)
            gate_up, down = self.experts[e]
            y = down(self.act(gate_up(x[tokens]))) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

    @property
    def linears(self) -> list[LinearMethod]:
        return [self.router] + [m for pair in self.experts for m in pair]


_NORM_ROLES = ("attn_in_norm", "attn_out_norm", "mlp_in_norm", "mlp_out_norm")


class BlockEmbedding(nn.Module):
    """A GGUF's quantized embedding table kept as stored (``GroupedInt4`` or ``KQuantWeight``,
    [vocab, hidden]): a lookup dequantizes only its rows, with the bits of the whole table's
    dequantization; an 8B model's fp32 table (2.1 GB) is never held.

    Args:
        blocks: the table's blocks, one tensor.
        dtype: the activations' dtype.
    """

    def __init__(self, blocks: GroupedInt4 | KQuantWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.blocks, self.dtype = blocks, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] int64 -> [num_tokens, hidden] in ``dtype``."""
        return self.blocks.rows(input_ids.cpu()).dequantize().to(self.dtype)

    @property
    def held_bytes(self) -> int:
        """Bytes the table holds (codes and scales)."""
        b = self.blocks
        if isinstance(b, GroupedInt4):
            return nbytes(b.codes, b.scale, b.minimum)
        return sum(nbytes(p.codes, p.d, p.sc, p.dmin, p.m) for p in b.parts)


class DecoderLayer(nn.Module):
    """One decoder layer as its ``LayerSpec`` declares it. Its projections are
    ``LinearMethod``s (dense or weight-only quantized, ``engine.quantization``), fused at load
    time: q/k/v into ``qkv`` and gate/up into ``gate_up``; ``DecoderForCausalLM.load_weights``
    sets them. Its norms are modules named as in the checkpoint (``input_layernorm``, ...)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rotary_dim: int,
                 max_position: int) -> None:
        super().__init__()
        self.spec = spec
        # A window at least max_position wide never binds: full attention (the fast paths).
        window = spec.sliding_window
        self.sliding_window = window if window is not None and window < max_position else None
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.rotary_dim = rotary_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = spec.scale
        self.eps = cfg.rms_norm_eps
        for role in _NORM_ROLES:
            name = getattr(spec, role)
            if name is not None:
                self.add_module(name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        if spec.qk_norm is not None:
            width = spec.qk_norm == "full"
            self.q_norm = RMSNorm(self.q_size if width else self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size if width else self.head_dim, cfg.rms_norm_eps)
        self.sinks: torch.Tensor | None = None
        self.qkv: LinearMethod | None = None
        self.o: LinearMethod | None = None
        self.gate_up: LinearMethod | None = None
        self.down: LinearMethod | None = None
        self.moe: MixtureOfExperts | None = None
        self.intermediate_size = cfg.intermediate_size
        self.act = _ACTIVATIONS[spec.activation]
        # (attn_in, attn_out, mlp_in, mlp_out) norms or None, looked up once: the per-op
        # forward runs every layer of every step (a tuple, so not registered twice).
        self._norms = tuple(self.norm(role) for role in _NORM_ROLES)

    def norm(self, role: str) -> RMSNorm | None:
        """The layer's norm for ``role`` (``attn_in_norm``, ...), or None."""
        name = getattr(self.spec, role)
        return None if name is None else getattr(self, name)

    def linears(self) -> list[LinearMethod]:
        """Every projection of the layer (experts included)."""
        mlp = self.moe.linears if self.moe is not None else [self.gate_up, self.down]
        return [self.qkv, self.o, *mlp]

    def bind_weights(self) -> None:
        """Caches plain references to the weights (call after loading and after ``.to()``), so
        the hot path skips ``nn.Module.__call__``/``__getattr__`` overhead (~15% of a CPU decode
        step of the 135M model)."""
        attn_in, _, mlp_in, _ = self._norms
        self._w = (None if attn_in is None else attn_in.weight, self.qkv, self.o,
                   None if mlp_in is None else mlp_in.weight, self.gate_up, self.down)
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
                                   self.eps, weights, kinds, groups, cos, sin,
                                   key_cache, value_cache, meta, self.num_heads,
                                   self.intermediate_size, self.scale)
        return out, residual

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor | None, sin: torch.Tensor | None, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend,
                residual_multiplier: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual convention: the residual stream is ``residual + hidden`` (``hidden``
        alone for the first layer, ``residual`` None), and each residual add is fused into the
        RMSNorm after it where the layer has one there (``kernels.cpu_ops.add_rms_norm``).

        Args:
            hidden, residual: [num_tokens, hidden_size].
            cos, sin: [num_tokens, 1, rotary_dim] for this layer's rotary (None: no rotary).
            residual_multiplier: scales each sublayer's output before its residual add
                (Granite's ``residual_multiplier``).

        Returns:
            (this layer's MLP output, scaled, the residual stream before it); their sum is
            the layer's output.
        """
        attn_in, attn_out, mlp_in, mlp_out = self._norms
        if attn_in is None:  # OLMo 2: the stream itself goes into attention
            x = hidden if residual is None else residual + hidden
            residual = x
        elif residual is None:
            residual, x = hidden, attn_in(hidden)
        else:
            residual, x = attn_in.add(residual, hidden)
        a = self._attention(x, cos, sin, key_cache, value_cache, meta, attn)
        if attn_out is not None:
            a = attn_out(a)
        if residual_multiplier != 1.0:
            a = a * residual_multiplier
        if mlp_in is None:
            residual = x = residual + a
        else:
            residual, x = mlp_in.add(residual, a)
        m = self.moe(x) if self.moe is not None else self.down(self.act(self.gate_up(x)))
        if mlp_out is not None:
            m = mlp_out(m)
        if residual_multiplier != 1.0:
            m = m * residual_multiplier
        return m, residual

    def _attention(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                   attn: AttentionBackend) -> torch.Tensor:
        """Self-attention of the normed stream ``x`` [T, hidden] -> [T, hidden]."""
        spec = self.spec
        T = x.shape[0]
        y = self.qkv(x)  # [T, q_size + 2 * kv_size]: q heads, k heads, v heads
        qk = y[:, :self.q_size + self.kv_size]
        if spec.qk_norm == "full":  # OLMo 2: over the whole projections
            q2 = self.q_norm(y[:, :self.q_size].contiguous())
            k2 = self.k_norm(y[:, self.q_size:self.q_size + self.kv_size].contiguous())
            qk = torch.cat((q2, k2), dim=1)
        elif spec.qk_norm == "head":  # Qwen3, Gemma 3: over each head
            q2 = self.q_norm(y[:, :self.q_size].reshape(-1, self.head_dim).contiguous())
            k2 = self.k_norm(y[:, self.q_size:self.q_size + self.kv_size]
                             .reshape(-1, self.head_dim).contiguous())
            qk = torch.cat((q2.view(T, self.q_size), k2.view(T, self.kv_size)), dim=1)
        if cos is not None:
            if self.rotary_dim == self.head_dim:
                # q and k rotated in one pass, in place.
                cpu_ops.rotary_neox_(qk, cos, sin, self.num_heads + self.num_kv_heads,
                                     self.head_dim)
            else:
                apply_rotary_(qk.view(T, self.num_heads + self.num_kv_heads, self.head_dim),
                              cos, sin)
        q = qk[:, :self.q_size].view(T, self.num_heads, self.head_dim)
        k = qk[:, self.q_size:].view(T, self.num_kv_heads, self.head_dim)
        v = y[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        attn.write_kv(k, v, key_cache, value_cache, meta)
        variants = {}
        if self.sliding_window is not None:
            variants["sliding_window"] = self.sliding_window
        if spec.logit_softcap is not None:
            variants["logit_softcap"] = spec.logit_softcap
        if self.sinks is not None:
            variants["sinks"] = self.sinks
        out = attn.forward(q, key_cache, value_cache, meta, self.scale, **variants)
        return self.o(out.reshape(T, self.q_size))


class DecoderForCausalLM(nn.Module):
    """Decoder over a paged KV cache, built from ``cfg``'s ``DecoderSpec``.

    ``kv_caches`` is one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].

    Args:
        cfg: the model's shape and spec (``ModelConfig.decoder_spec``).
        max_position: rotary table length (tokens; the engine's max_model_len).
        attn: the attention backend every layer calls (``engine.attention``).
        policy: the engine's kernel choices (default: this CPU's, ``KernelPolicy.detect``);
            ``policy.fused_decode`` / ``fused_decode_whole`` are read every step.
    """

    def __init__(self, cfg: ModelConfig, max_position: int, attn: AttentionBackend,
                 policy: KernelPolicy | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.policy = policy if policy is not None else KernelPolicy.detect()
        self.spec: DecoderSpec = cfg.decoder_spec()
        # ``_weight`` skips nn.Embedding's random init (the loaded weights replace it): 113 MB
        # of normal_ draws, and on the meta device an import of torch._dynamo (0.5 s).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, layer, self.spec.rotary_dim, max_position)
                                    for layer in self.spec.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head: LinearMethod | None = None
        self.max_position = max_position
        # One table per distinct rotary (Gemma 3's local and global layers differ).
        ropes = list(dict.fromkeys(layer.rope for layer in self.spec.layers
                                   if layer.rope is not None))
        self.rotaries = nn.ModuleList(RotaryEmbedding(r, self.spec.rotary_dim, max_position)
                                      for r in ropes)
        self._rope_index: dict[RopeConfig, int] = {r: i for i, r in enumerate(ropes)}
        self._layer_rope = [None if layer.rope is None else self._rope_index[layer.rope]
                            for layer in self.spec.layers]
        self.attn = attn
        blockers = self.spec.fused_decode_blockers(cfg.head_dim, max_position)
        self.fused_decode_supported = not blockers
        if blockers:
            logger.info("%s: fused CPU decode off for this model (%s); decode steps run the "
                        "per-op layers", cfg.architecture, ", ".join(blockers))

    @property
    def rotary(self) -> RotaryEmbedding:
        """The rotary of the first layer that rotates (every layer's, for most families)."""
        return self.rotaries[0]

    def bind_weights(self) -> None:
        for layer in self.layers:
            layer.bind_weights()
        # Per row count: (bound weights, thresholds, their holders, _fused_decode_args' value).
        self._step_args: dict[int, tuple[list, tuple, list, tuple | None]] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Args: input_ids, positions: [num_tokens] int64. Returns hidden [num_tokens, hidden]."""
        hidden = self.embed_tokens(input_ids)
        spec = self.spec
        if spec.embedding_scale is not None:
            hidden = hidden * torch.tensor(spec.embedding_scale, dtype=hidden.dtype)
        tables = [r.cos_sin(positions, hidden.dtype) for r in self.rotaries]
        cos, sin = tables[0] if tables else (None, None)
        residual = None
        fused = self._fused_decode_args(hidden, kv_caches, meta)
        if fused is not None and self.policy.fused_decode_whole:
            first = self.layers[0]
            norms, weights, kinds, groups = fused[1]
            hidden, residual = cpu_ops.decode_layers(
                hidden, norms, first.eps, weights, kinds, groups,
                cos, sin, kv_caches, meta, first.num_heads, first.intermediate_size,
                first.scale)
            return cpu_ops.add_rms_norm(residual, hidden, self.norm.weight, self.norm.eps)[1]
        rm = spec.residual_multiplier
        for i, layer in enumerate(self.layers):
            if fused is not None:
                hidden, residual = layer.forward_decode(hidden, residual, cos, sin,
                                                        kv_caches[i, 0], kv_caches[i, 1], meta,
                                                        fused[0][i])
            else:
                r = self._layer_rope[i]
                c, s = (None, None) if r is None else tables[r]
                hidden, residual = layer.forward(hidden, residual, c, s, kv_caches[i, 0],
                                                 kv_caches[i, 1], meta, self.attn, rm)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.add(residual, hidden)[1]

    def _fused_decode_args(self, hidden: torch.Tensor, kv_caches: torch.Tensor,
                           meta: AttentionMetadata) -> tuple[list[tuple], tuple] | None:
        """When this step can run fused: (every layer's ``decode_args``, the same joined as
        ``cpu_ops.decode_layers`` takes them: (norms, weights, kinds, groups)); else None.
        Checked once a step: the spec is the Llama layer, no autograd
        (``ModelRunner.execute`` runs in inference mode), fp32 CPU activations, and the
        backend (every row a decode) and every projection supporting it."""
        if (not self.policy.fused_decode or not self.fused_decode_supported
                or torch.is_grad_enabled()
                or hidden.dtype != torch.float32 or hidden.device.type != "cpu"
                or not self.layers
                or not self.attn.fused_cpu_decode_usable(kv_caches[0, 0], kv_caches[0, 1], meta,
                                                         self.config.num_attention_heads)):
            return None
        return self._step_decode_args(hidden.shape[0])

    def _step_decode_args(self, num_tokens: int) -> tuple[list[tuple], tuple] | None:
        """``_fused_decode_args``' value for ``num_tokens`` rows, kept per row count. An entry
        holds while every layer's bound weights are the same objects (a layer's
        ``bind_weights`` after replacing a weight makes new ones) and the 4-bit layers'
        ``own_below`` are unchanged (``_thresholds``; the rest of what ``decode_args`` depends
        on is the frozen ``KernelPolicy``): one check a step in place of 30 layers' cache keys
        (0.09 ms of Python a one-stream step)."""
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
        """What a projection's ``decode_spec`` depends on besides its rows and its policy:
        each 4-bit layer's ``own_below`` (tests change it)."""
        return tuple(map(_OWN_BELOW, holders))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab_size] fp32, with the family's final scaling (Granite's
        ``logits_scaling``, Gemma 2's final soft-cap) applied as Hugging Face does."""
        logits = self.lm_head(hidden)
        spec = self.spec
        if spec.logits_divisor != 1.0:
            logits = logits / spec.logits_divisor
        if spec.final_logit_softcap is not None:
            cap = spec.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every projection and the LM head (the
        embedding reads one row per token; norms are negligible). For a mixture of experts,
        every expert's (an upper bound: a step reads the selected ones)."""
        linears = [self.lm_head] + [m for layer in self.layers for m in layer.linears()]
        return sum(m.weight_bytes for m in linears)

    def load_weights(self, state: Mapping[str, torch.Tensor | GroupedInt4 | KQuantWeight],
                     quantization: str | None = None,
                     act_bits: int = DEFAULT_ACT_BITS) -> None:
        """Loads Hugging Face weight names as the spec declares them, fusing q/k/v and gate/up
        projections into one ``LinearMethod`` each (the quantization method's
        ``create_linear``), in the dtype and on the device of this module's parameters (call
        after ``.to()``).

        Args:
            state: name -> float tensor, or a GGUF's blocks (``GroupedInt4``, ``KQuantWeight``).
            quantization: None (dense), or one of ``engine.quantization.QUANTIZATIONS``.
            act_bits: the quantized layers' activation rounding in our int8-dot kernels, 16 or
                8 (``--quantized-activation-bits``).

        Raises:
            ValueError: a required weight is missing (named), or is not a float tensor (a
                quantized checkpoint's codes).
        """
        dtype, device = self.norm.weight.dtype, self.norm.weight.device
        spec = self.spec
        prefix = spec.prefix
        method = get_quantization_method(quantization, self.policy, act_bits)
        self._method = method

        def tensor(name: str) -> torch.Tensor:
            """A weight as a float tensor (4-bit blocks dequantized: embeddings, norms)."""
            if name not in state:
                raise ValueError(f"the checkpoint has no {name}")
            return as_float(name, state[name])

        def as_float(name: str, value: torch.Tensor | GroupedInt4 | KQuantWeight
                     ) -> torch.Tensor:
            if isinstance(value, (GroupedInt4, KQuantWeight)):
                return value.dequantize()
            if value.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"{name} is {str(value.dtype).removeprefix('torch.')}: a "
                                 "quantized checkpoint's codes, which we cannot read as weights")
            return value

        def linear(names: list[str] | tuple[str, ...], bias: bool = False,
                   quant: QuantizationMethod = method) -> LinearMethod:
            parts = [state.get(n + ".weight") for n in names]
            if any(p is None for p in parts):
                raise ValueError(f"the checkpoint has no {names[parts.index(None)]}.weight")
            if all(isinstance(p, GroupedInt4) for p in parts):  # fused without dequantizing
                w = GroupedInt4.cat(parts) if len(parts) > 1 else parts[0]
            elif all(isinstance(p, KQuantWeight) for p in parts):  # any mix of K-quant types
                w = KQuantWeight.cat(parts) if len(parts) > 1 else parts[0]
            else:  # float, or blocks mixed with other types: dequantized (each decoded once)
                floats = [as_float(n + ".weight", p) for n, p in zip(names, parts, strict=True)]
                w = floats[0] if len(floats) == 1 else torch.cat(floats)
            b = torch.cat([tensor(n + ".bias") for n in names]) if bias else None
            return quant.create_linear(w, b, dtype, device)

        def norm_weight(module: RMSNorm, name: str) -> None:
            raw = tensor(name)
            # Gemma: 1 + w in fp32, as its RMSNorm.
            module.weight.copy_(raw.float() + spec.norm_offset if spec.norm_offset else raw)
            if spec.norm_in_fp32:  # the product in fp32 against the model dtype's weight
                module.weight32 = (raw.to(dtype).float() + spec.norm_offset).to(device)

        with torch.no_grad():
            stored_embedding = state.get(prefix + "embed_tokens.weight")
            if quantization is not None and isinstance(stored_embedding,
                                                       (GroupedInt4, KQuantWeight)):
                # A GGUF's quantized embedding stays as stored; each step dequantizes only the
                # rows it looks up (the same bits as the whole table's dequantization).
                self.embed_tokens = BlockEmbedding(stored_embedding, dtype)
            else:
                self.embed_tokens.weight.copy_(tensor(prefix + "embed_tokens.weight"))
            norm_weight(self.norm, prefix + "norm.weight")
            if self.config.tie_word_embeddings or "lm_head.weight" not in state:
                # The head is the embedding: quantized from the parameter itself, which an fp32
                # model's head then uses for its dense rows with no second copy, unless the
                # dense copy is bf16 (CPUs with native bf16: a 57 MB copy for SmolLM2; its
                # logits from 24 rows are bf16-rounded, as the int8 kernel's are below that).
                # bf16 activations: from the checkpoint's values, not their bf16 rounding.
                # A GGUF's quantized embedding (Q8_0, Q6_K, ...) is the head as the file
                # stores it, not a second rounding of its dequantization.
                if quantization is None:
                    self.lm_head = DenseLinear(self.embed_tokens.weight, policy=self.policy)
                elif isinstance(self.embed_tokens, BlockEmbedding):
                    self.lm_head = linear([prefix + "embed_tokens"])
                else:
                    embedding = (self.embed_tokens.weight if dtype == torch.float32
                                 else tensor(prefix + "embed_tokens.weight"))
                    self.lm_head = method.create_linear(embedding, None, dtype, device)
            else:
                self.lm_head = linear(["lm_head"])
            for i, layer in enumerate(self.layers):
                p = f"{prefix}layers.{i}."
                ls = layer.spec
                layer.qkv = linear([p + n for n in ls.qkv], bias=ls.attention_bias)
                layer.o = linear([p + ls.o], bias=ls.o_bias)
                if ls.moe is None:
                    layer.gate_up = linear([p + n for n in ls.gate_up], bias=ls.mlp_bias)
                    layer.down = linear([p + ls.down], bias=ls.mlp_bias)
                else:
                    layer.moe = self._load_moe(ls.moe, p, linear, tensor, ls.activation)
                for role in _NORM_ROLES:
                    name = getattr(ls, role)
                    if name is not None:
                        norm_weight(getattr(layer, name), p + name + ".weight")
                if ls.qk_norm is not None:
                    norm_weight(layer.q_norm, p + ls.q_norm + ".weight")
                    norm_weight(layer.k_norm, p + ls.k_norm + ".weight")
                if ls.sinks:
                    layer.sinks = tensor(p + ls.sinks_name).to(device=device,
                                                               dtype=torch.float32)

    def _load_moe(self, moe: MoESpec, p: str, linear, tensor, activation: str
                  ) -> MixtureOfExperts:
        """The layer's router (dense, as Hugging Face runs it) and experts (quantized like
        any linear)."""
        router = linear([p + moe.router], bias=moe.router_bias,
                        quant=Unquantized(self.policy))
        experts = []
        if moe.packed:  # gpt-oss: [E, hidden, 2I] with gate/up columns interleaved
            q = p + moe.expert.format(e="")
            gate_up, gate_up_bias = tensor(q + "gate_up_proj"), tensor(q + "gate_up_proj_bias")
            down, down_bias = tensor(q + "down_proj"), tensor(q + "down_proj_bias")
            dtype, device = self.norm.weight.dtype, self.norm.weight.device
            for e in range(moe.num_experts):
                w = gate_up[e].t()
                w = torch.cat((w[0::2], w[1::2])).contiguous()
                b = torch.cat((gate_up_bias[e][0::2], gate_up_bias[e][1::2]))
                experts.append((self._method.create_linear(w, b, dtype, device),
                                self._method.create_linear(down[e].t().contiguous(),
                                                           down_bias[e], dtype, device)))
            return MixtureOfExperts(moe, router, experts, activation)
        for e in range(moe.num_experts):
            q = p + moe.expert.format(e=e)
            gate_up = (linear([q + moe.gate]) if moe.gate == moe.up
                       else linear([q + moe.gate, q + moe.up]))
            experts.append((gate_up, linear([q + moe.down])))
        return MixtureOfExperts(moe, router, experts, activation)
