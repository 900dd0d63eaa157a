"""Attention backend selection for the model: the Triton paged-attention kernels.

``engine.llm_engine.LLMEngine`` calls ``use_triton_backend`` for ``--attention-backend triton``
(and for ``auto`` on CUDA). The kernels read the cache through ``meta.block_tables`` directly, so
the per-token slot expansion the torch backend needs is switched off.
"""

from __future__ import annotations

import os

import torch

from kernels.paged_attention import paged_attention
from kernels.store_kv_cache import store_kv_cache


def triton_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     meta, scale: float) -> torch.Tensor:
    """``AttentionFn`` adapter: ``paged_attention`` over an ``engine.attention.AttentionMetadata``.

    Args:
        query: [num_tokens, num_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], this step's
            K/V already written.
        meta: the step's ``AttentionMetadata`` (``query_start_loc``, ``seq_lens``,
            ``block_tables`` on the device; host-side lengths pick the launch shape).
        scale: softmax scale.

    Returns:
        [num_tokens, num_heads, head_dim], ``query``'s dtype.
    """
    return paged_attention(query, key_cache, value_cache, meta.query_start_loc, meta.seq_lens,
                           meta.block_tables, scale,
                           max_query_len=max(meta.query_lens_cpu, default=0),
                           max_seq_len=max(meta.seq_lens_cpu, default=0))


def use_triton_backend(model) -> None:
    """Switches ``model`` (an ``engine.models.llama.LlamaForCausalLM``) to the Triton kernels.

    Sets ``attn_fn`` to ``triton_attention``, both KV write hooks to ``store_kv_cache`` (which
    skips -1 padding slots itself) and ``uses_token_slots`` to False.

    Raises:
        ValueError: the model is not on a CUDA device and the Triton interpreter is off.
    """
    param = next(model.parameters(), None)
    on_cuda = param is not None and param.device.type == "cuda"
    if not on_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ValueError("--attention-backend triton needs a CUDA device (or TRITON_INTERPRET=1, "
                         "the slow CPU interpreter used by the tests); use --attention-backend "
                         "torch on CPU")
    model.attn_fn = triton_attention
    model.kv_write_fn = store_kv_cache
    model.kv_write_no_padding_fn = store_kv_cache
    model.uses_token_slots = False
