"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over the paged KV cache.

Our own forward: RMSNorm, rotary embeddings with the model's theta, grouped-query attention,
SwiGLU MLP, optional tied embeddings and qkv bias (Qwen2). Numerics follow Hugging Face
transformers' ``LlamaForCausalLM`` (fp32 RMSNorm, fp32 rotary tables) so greedy outputs match
``generate`` token for token. The batch is flattened: ``num_tokens`` rows from all sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.models.config import ModelConfig

__all__ = ["LlamaForCausalLM", "ModelConfig"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 like transformers' ``LlamaRMSNorm`` (bit-identical in fp32)."""
    dtype = x.dtype
    if dtype != torch.float32:
        x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x if dtype == torch.float32 else x.to(dtype))


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
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                    / head_dim))
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, 1, head_dim] (looked up once per step)."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, KVH, D], cos/sin: [T, 1, D]."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.intermediate_size = cfg.intermediate_size

    def bind_weights(self) -> None:
        """Caches plain references to the weights (call after loading and after ``.to()``), so
        the hot path skips ``nn.Module.__call__``/``__getattr__`` overhead (~15% of a CPU decode
        step of the 135M model)."""
        self._w = (self.input_layernorm.weight, self.qkv_proj.weight, self.qkv_proj.bias,
                   self.o_proj.weight, self.post_attention_layernorm.weight,
                   self.gate_up_proj.weight, self.down_proj.weight)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                attn: AttentionBackend) -> torch.Tensor:
        ln1, qkv_w, qkv_b, o_w, ln2, gate_up_w, down_w = self._w
        eps = self.input_layernorm.eps
        T = hidden.shape[0]
        x = rms_norm(hidden, ln1, eps)
        q, k, v = F.linear(x, qkv_w, qkv_b).split([self.q_size, self.kv_size, self.kv_size],
                                                   dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, cos, sin)
        attn.write_kv(k, v, key_cache, value_cache, meta)
        out = attn.forward(q, key_cache, value_cache, meta, self.scale)
        hidden = hidden + F.linear(out.reshape(T, self.q_size), o_w)
        x = rms_norm(hidden, ln2, eps)
        gate, up = F.linear(x, gate_up_w).split(self.intermediate_size, dim=-1)
        return hidden + F.linear(F.silu(gate) * up, down_w)


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
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.max_position = max_position
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta)
        self.attn = attn

    def bind_weights(self) -> None:
        for layer in self.layers:
            layer.bind_weights()

    def init_non_persistent_buffers(self) -> None:
        """Rebuilds the rotary tables after ``to_empty`` (they are not in the checkpoint)."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, self.max_position, cfg.rope_theta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Args: input_ids, positions: [num_tokens] int64. Returns hidden [num_tokens, hidden]."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        for i, layer in enumerate(self.layers):
            hidden = layer.forward(hidden, cos, sin, kv_caches[i, 0], kv_caches[i, 1], meta,
                                   self.attn)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab_size] fp32."""
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Loads Hugging Face ``model.*`` weight names, fusing q/k/v and gate/up projections.

        Raises:
            KeyError: a required weight is missing.
        """
        def take(name: str) -> torch.Tensor:
            return state[name]

        with torch.no_grad():
            self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
            self.norm.weight.copy_(take("model.norm.weight"))
            if self.config.tie_word_embeddings or "lm_head.weight" not in state:
                self.lm_head.weight = self.embed_tokens.weight
            else:
                self.lm_head.weight.copy_(take("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                layer.qkv_proj.weight.copy_(torch.cat([take(p + f"self_attn.{n}_proj.weight")
                                                       for n in "qkv"]))
                if layer.qkv_proj.bias is not None:
                    layer.qkv_proj.bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias")
                                                         for n in "qkv"]))
                layer.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
                layer.gate_up_proj.weight.copy_(torch.cat([take(p + "mlp.gate_proj.weight"),
                                                           take(p + "mlp.up_proj.weight")]))
                layer.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
                layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(
                    take(p + "post_attention_layernorm.weight"))
