"""Tiny random-weight checkpoints of every family we serve, written with transformers' own config
classes and ``save_pretrained`` (so ``config.json`` and weight names are the real ones)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

VOCAB = 256
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
         "pad_token_id": 0, "tie_word_embeddings": False}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 500000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "rope_theta": 1000000.0}

# name -> (transformers config class, its arguments beyond SMALL). Each registry architecture
# has at least one entry (test_every_registered_architecture_has_a_parity_case).
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama3": ("LlamaConfig", {"rope_parameters": LLAMA3}),
    "llama-linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                         "rope_theta": 10000.0}}),
    "qwen2-yarn": ("Qwen2Config", {"rope_parameters": YARN}),
    "mistral-window": ("MistralConfig", {"sliding_window": 24}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True}),
    "qwen3-moe": ("Qwen3MoeConfig", {"num_experts": 6, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 48, "norm_topk_prob": True,
                                     "mlp_only_layers": [1]}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gemma2": ("Gemma2Config", {"sliding_window": 24, "query_pre_attn_scalar": 16,
                                "attn_logit_softcapping": 5.0,
                                "final_logit_softcapping": 3.0}),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 24, "query_pre_attn_scalar": 16,
                                    "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "phi3": ("Phi3Config", {}),
    "phi4-mini": ("Phi3Config", {"rope_parameters": {"rope_type": "default",
                                                     "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.75}}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {"embedding_multiplier": 6.0, "attention_multiplier": 0.2,
                                  "residual_multiplier": 0.5, "logits_scaling": 4.0}),
    "smollm3": ("SmolLM3Config", {}),
    "gpt-oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                 "sliding_window": 24,
                                 "rope_parameters": {**YARN, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "truncate": False}}),
}


class StubTokenizer:
    """What the engine needs of a tokenizer: ``decode`` and ``eos_token_id``."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def build_checkpoint(name: str, root: Path, tokenizer_dir: Path | None = None) -> Path:
    """Writes the family's tiny random-weight checkpoint with transformers (fp32), weights
    drawn with a wider spread than transformers' init (std 0.02 makes every logit nearly
    equal, and greedy decoding of a near-tie tests rounding, not the model). With
    ``tokenizer_dir``, its tokenizer files are copied in and the vocabulary is that
    tokenizer's (a checkpoint ``saltserve serve`` can serve)."""
    import transformers

    cls_name, extra = FAMILIES[name]
    shape = dict(SMALL)
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        shape.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id or 0)
    cfg = getattr(transformers, cls_name)(**{**shape, **extra})
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5 * (2.0 if "embed" not in pname else 8.0))
            elif "norm" in pname or "sinks" in pname:
                p.uniform_(0.5, 1.5) if "gemma" not in name else p.uniform_(-0.5, 0.5)
    out = root / name
    model.save_pretrained(out)
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, out / f.name)
    return out


