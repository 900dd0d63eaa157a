"""Engine configuration (frozen; flag names follow vLLM) and runtime-derived cache sizing."""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_hash import HASH_ALGOS

ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """Static engine settings.

    Attributes:
        model: Hugging Face folder with config.json, tokenizer and *.safetensors.
        served_model_name: the id reported by /v1/models (defaults to the folder name).
        block_size: tokens per KV block (vLLM ``--block-size``; Triton needs a multiple of 16).
        max_model_len: prompt + output tokens per request (``--max-model-len``); None = model max.
        max_num_seqs: running requests per step (``--max-num-seqs``).
        max_num_batched_tokens: tokens per step, bounding chunked prefill
            (``--max-num-batched-tokens``).
        enable_prefix_caching: ``--enable-prefix-caching / --no-enable-prefix-caching``.
        prefix_caching_hash_algo: ``sha256`` | ``sha256_cbor`` | ``xxhash``.
        num_gpu_blocks_override: exact number of KV blocks (tests); overrides memory sizing.
        kv_cache_memory_bytes: KV cache budget in bytes on CPU (and on GPU when set).
        gpu_memory_utilization: fraction of free GPU memory for the KV cache when on CUDA.
        dtype: "float32" | "bfloat16" | "float16" | "auto" (fp32 on CPU, bf16 on CUDA).
        device: "cpu" | "cuda" | "auto".
        attention_backend: ``auto`` (triton for CUDA tensors, torch otherwise) | torch | triton.
        seed: global seed for unseeded sampling.
    """

    model: str
    served_model_name: str | None = None
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 256:
            raise ValueError(f"--block-size must be in [1, 256], got {self.block_size}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"--prefix-caching-hash-algo must be one of {HASH_ALGOS}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend must be one of {ATTENTION_BACKENDS}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("--num-gpu-blocks-override must be at least 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-seqs and --max-num-batched-tokens must be at least 1")


@dataclass(frozen=True)
class CacheInfo:
    """Runtime-derived values, computed once at start-up."""

    num_blocks: int
    block_size: int
    max_model_len: int
    bytes_per_block: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    attention_backend: str
