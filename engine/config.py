"""Engine configuration (frozen; flag names follow vLLM) and runtime-derived cache sizing.

``EngineConfig`` is the one source for engine settings: ``app.settings.Settings`` (env vars
``SALTSERVE_<FIELD>``) and ``saltserve serve`` flags (``--<field-with-dashes>``) are generated
from its fields. Each field's ``metadata`` holds ``help`` (one line, with units and the vLLM flag
when one exists), optionally ``choices`` (the allowed values) and ``unset`` (what the default
None means).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.block_hash import HASH_ALGOS

ATTENTION_BACKENDS = ("auto", "torch", "triton")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # names engine.model_runner.resolve_dtype maps
DEVICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "bfloat16")  # auto = the model's dtype (vLLM --kv-cache-dtype)
# Weight-only quantization (engine.quantization): int8 per channel; gguf = the GGUF's own 4-bit
QUANTIZATIONS = ("int8", "gguf")
# Activation rounding of the quantized layers' int8-dot kernels on CPU (engine.quantization):
# 16 = int8 plus an int8 residual in 1/256 steps; 8 = int8 alone (llama.cpp's Q8_1).
ACTIVATION_BITS = (16, 8)
SCHEDULING_POLICIES = ("fair", "fcfs")  # engine.scheduler.Scheduler(policy=...)
# When the local offload tiers take a block (SGLang's --hicache-write-policy values):
# engine.kv_offload.manager; the shared tier is always write-through.
KV_OFFLOAD_WRITE_POLICIES = ("write_through", "write_back")


# Sampling defaults read from a generation config (vLLM reads the same keys; max_new_tokens
# is not used: OpenAI's own max_tokens defaults apply).
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


def parse_generation_overrides(text: str) -> dict[str, float]:
    """``--override-generation-config`` as a dict.

    Raises:
        ValueError: not a JSON object of numbers keyed by ``GENERATION_CONFIG_KEYS``.
    """
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError("--override-generation-config must be a JSON object") from None
    if not isinstance(value, dict):
        raise ValueError("--override-generation-config must be a JSON object")  # noqa: TRY004 - a bad flag value
    for k, v in value.items():
        if k not in GENERATION_CONFIG_KEYS:
            raise ValueError(f"--override-generation-config: unknown key {k!r}; known: "
                             f"{', '.join(GENERATION_CONFIG_KEYS)}")
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"--override-generation-config: {k} must be a number")  # noqa: TRY004
    return value


def sampling_defaults(config: EngineConfig, model_dir: Path) -> dict[str, float]:
    """The sampling defaults a request that omits a field gets (vLLM ``default_sampling_params``).

    Raises:
        FileNotFoundError: ``--generation-config`` names a folder without generation_config.json.
    """
    defaults: dict[str, float] = {}
    source = config.generation_config
    if source != "vllm":
        folder = model_dir if source == "auto" else Path(source)
        path = folder / "generation_config.json"
        if path.exists():
            data = json.loads(path.read_text())
            defaults = {k: data[k] for k in GENERATION_CONFIG_KEYS if data.get(k) is not None}
        elif source != "auto":
            raise FileNotFoundError(f"--generation-config {source}: no generation_config.json")
    if config.override_generation_config:
        defaults.update(parse_generation_overrides(config.override_generation_config))
    return defaults


@dataclass(frozen=True)
class EngineConfig:
    """Static engine settings; per-field help, units and choices are in each field's metadata."""

    model: str = field(metadata={
        "help": "Hugging Face folder with config.json, tokenizer and *.safetensors (vLLM --model)."})
    served_model_name: str | None = field(default=None, metadata={
        "help": "Model id reported by /v1/models (vLLM --served-model-name).",
        "unset": "the model folder name"})
    block_size: int = field(default=16, metadata={
        "help": "Tokens per KV block, in [1, 256]; Triton needs a multiple of 16 "
                "(vLLM --block-size)."})
    max_model_len: int | None = field(default=None, metadata={
        "help": "Prompt + output tokens per request (vLLM --max-model-len).",
        "unset": "the model's max_position_embeddings"})
    max_num_seqs: int = field(default=64, metadata={
        "help": "Running requests per engine step (vLLM --max-num-seqs)."})
    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "Tokens per engine step, bounding chunked prefill (vLLM --max-num-batched-tokens)."})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "Automatic prefix caching of KV blocks (vLLM --enable-prefix-caching)."})
    prefix_caching_hash_algo: str = field(default="sha256", metadata={
        "help": "Block hash function (vLLM --prefix-caching-hash-algo).",
        "choices": HASH_ALGOS})
    num_gpu_blocks_override: int | None = field(default=None, metadata={
        "help": "Exact number of KV blocks, overriding memory sizing; for tests "
                "(vLLM --num-gpu-blocks-override).",
        "unset": "sized from the KV budget"})
    kv_cache_memory_bytes: int | None = field(default=None, metadata={
        "help": "KV cache budget in bytes (or with a unit: 4GiB); on CUDA it replaces "
                "--gpu-memory-utilization (vLLM --kv-cache-memory-bytes).",
        "unset": "1 GiB on CPU, --gpu-memory-utilization on CUDA", "bytes": True})
    kv_offload_size: int | None = field(default=None, metadata={
        "help": "Bytes (or 8GiB, 500MB) of KV blocks kept on local disk behind the pool (the "
                "disk tier: blocks the pool evicts, sealed per tenant with AES-256-GCM; 0 = "
                "off; docs/prefix-caching.md).",
        "unset": "served: 8 GiB or half the free disk, whichever is less; offline: off",
        "bytes": True})
    kv_offload_dir: str | None = field(default=None, metadata={
        "help": "Directory of the disk tier (created 0700; its files 0600).",
        "unset": "served: <data dir>/kv-offload"})
    kv_offload_host_size: int = field(default=0, metadata={
        "help": "Bytes of KV blocks kept in host memory behind a CUDA pool (the host tier, "
                "before the disk tier; 0 = off). On CPU the pool already is host memory and "
                "this is ignored.", "bytes": True})
    kv_offload_redis_url: str | None = field(default=None, metadata={
        "help": "Redis of the tier shared by every replica (redis://host:6379/0): a tenant's "
                "offloaded prefixes follow it to any replica.",
        "unset": "served: --redis-url; offline: none"})
    kv_offload_redis_size: int = field(default=1 << 30, metadata={
        "help": "Bytes of this deployment's KV blocks in the shared Redis tier (0 = off).",
        "bytes": True})
    kv_offload_redis_namespace: str = field(default="saltserve", metadata={
        "help": "Key prefix of the shared tier in Redis.", "flag": False,
        "unset": "served: --redis-namespace"})
    kv_offload_write_policy: str = field(default="write_through", metadata={
        "help": "When the local tiers take a block: write_through (as soon as a step computes "
                "it: the next round of a working set larger than the pool finds it, and a kill "
                "-9 loses only the writes still queued) or write_back (only when the pool "
                "evicts it: fewer writes when the working set fits the pool). SGLang's "
                "--hicache-write-policy; the shared tier is always write-through.",
                "choices": KV_OFFLOAD_WRITE_POLICIES})
    kv_offload_owner_key: bytes | None = field(default=None, repr=False, metadata={
        "help": "Secret key of the owner tags the tiers store (a keyed digest of the tenant "
                "id, so the blobs of one tenant are grouped without naming it).", "flag": False,
        "unset": "served: derived from the master key; offline: a key file in the disk "
                 "tier's directory, or for Redis one derived from the namespace"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "Fraction in (0, 1] of free GPU memory for the KV cache on CUDA "
                "(vLLM --gpu-memory-utilization)."})
    dtype: str = field(default="auto", metadata={
        "help": "Model and KV cache dtype; auto = float32 on CPU, bfloat16 on CUDA "
                "(vLLM --dtype).",
        "choices": DTYPES})
    quantization: str | None = field(default=None, metadata={
        "help": "Weight-only quantized linear layers on CPU, for decode (vLLM "
                "--quantization): int8 = per-channel int8 of the safetensors weights; gguf = "
                "the model's GGUF 4-bit blocks (Q4_1/Q4_0) as they are, other GGUF types as "
                "int8. Their kernels run in bfloat16; with float32 activations (--dtype auto "
                "on CPU) longer forwards use a dense copy: fp32 from 32 tokens (4 with our CPU "
                "kernels), or bf16 from 24 on CPUs with avx512_bf16. Not token-identical to "
                "float32 (docs/benchmarks.md).",
        "choices": QUANTIZATIONS, "unset": "none: the float weights in --dtype"})
    quantized_activation_bits: int = field(default=16, metadata={
        "help": "With --quantization on CPU: how our int8-dot kernels round each group of 32 "
                "activations. 16 = int8 plus a 1/256 residual (16-bit fixed point, the most "
                "faithful); 8 = int8 alone, the Q8_1 rounding of llama.cpp's and vLLM's GGUF "
                "kernels: half the multiply-adds (4-bit layers 1.6x faster at 16 rows on an AMD "
                "EPYC), lower fidelity, and a prefix hit may then change a greedy token "
                "(docs/benchmarks.md). 16 or 8."})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV cache dtype (vLLM --kv-cache-dtype): auto = the model's --dtype; bfloat16 "
                "under --dtype float32 (auto on CPU) halves a block's bytes: twice the blocks "
                "in the same budget (under --dtype bfloat16 it is what auto gives). Attention stays fp32 over the cached bf16 values (on CPUs "
                "with avx512_bf16 through bf16 products of split high and low parts); rounding "
                "K and V makes it not token-identical to float32 (docs/benchmarks.md).",
        "choices": KV_CACHE_DTYPES})
    device: str = field(default="auto", metadata={
        "help": "Device; auto = cuda when available, else cpu (vLLM --device).",
        "choices": DEVICES})
    attention_backend: str = field(default="auto", metadata={
        "help": "Attention implementation; auto = triton for CUDA tensors, torch otherwise.",
        "choices": ATTENTION_BACKENDS})
    seed: int = field(default=0, metadata={
        "help": "Global seed for unseeded sampling (vLLM --seed)."})
    scheduling_policy: str = field(default="fair", metadata={
        "help": "How a step's token budget is shared: fair = weighted fair queuing between "
                "tenants (FCFS within one); fcfs = plain first come, first served "
                "(vLLM --scheduling-policy fcfs).",
        "choices": SCHEDULING_POLICIES})
    interactive_step_tokens: int | None = field(default=None, metadata={
        "help": "With the fair policy: tokens a step may add to the running decodes while one "
                "tenant decodes and another prefills, so one tenant's long prompts cannot "
                "stretch another's inter-token latency (stall-free batching, Sarathi-Serve); "
                "0 turns it off.",
        "unset": "measured while serving: what a step can add without doubling a decode step"})
    generation_config: str = field(default="auto", metadata={
        "help": "Sampling defaults for requests that omit them: auto = the model folder's "
                "generation_config.json; vllm = none (temperature 1, top_p 1); or a folder "
                "holding a generation_config.json (vLLM --generation-config)."})
    override_generation_config: str | None = field(default=None, metadata={
        "help": "JSON object of sampling defaults over --generation-config, e.g. "
                "'{\"temperature\": 0.5}'; keys: " + ", ".join(GENERATION_CONFIG_KEYS)
                + " (vLLM --override-generation-config).",
        "unset": "no override"})
    max_consecutive_step_failures: int = field(default=3, metadata={
        "help": "Failed batched forwards in a row before the engine is declared dead "
                "(/health 503, the server exits non-zero); one failure only fails that "
                "step's requests."})
    one_token_step_threads: int | None = field(default=None, metadata={
        "help": "CPU: torch threads for engine steps of one token (a single decoding stream), "
                "leaving the other cores to the server's event loop and network; 0 = the same "
                "threads as every other step (docs/benchmarks.md).",
        "unset": "when served (saltserve serve), the faster of torch's threads and one "
                 "fewer, timed on the one-token steps themselves; 0 in-process"})

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 256:
            raise ValueError(f"--block-size must be in [1, 256], got {self.block_size}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"--prefix-caching-hash-algo must be one of {HASH_ALGOS}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend must be one of {ATTENTION_BACKENDS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        bits = self.quantized_activation_bits
        if type(bits) is not int or bits not in ACTIVATION_BITS:  # not 8.0, not True
            raise ValueError(f"--quantized-activation-bits must be 16 or 8, got {bits!r}")
        if bits != 16 and self.quantization is None:
            raise ValueError("--quantized-activation-bits 8 rounds the activations of quantized "
                             "layers: it needs --quantization int8 or gguf")
        if bits != 16 and self.dtype in ("bfloat16", "float16"):
            raise ValueError("--quantized-activation-bits 8 applies to fp32 activations (our "
                             "int8-dot kernels): it needs --dtype auto or float32")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES} (no fp8 "
                             f"here), got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "bfloat16" and self.dtype == "float16":
            raise ValueError("--kv-cache-dtype bfloat16 needs --dtype float32 or bfloat16")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {DEVICES}, got {self.device!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("--num-gpu-blocks-override must be at least 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-seqs and --max-num-batched-tokens must be at least 1")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"--scheduling-policy must be one of {SCHEDULING_POLICIES}")
        if self.interactive_step_tokens is not None and self.interactive_step_tokens < 0:
            raise ValueError("--interactive-step-tokens must be >= 0")
        if self.override_generation_config is not None:
            parse_generation_overrides(self.override_generation_config)
        if self.one_token_step_threads is not None and self.one_token_step_threads < 0:
            raise ValueError("--one-token-step-threads must be at least 0")
        for name in ("kv_offload_size", "kv_offload_host_size", "kv_offload_redis_size"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 0")
        if self.kv_offload_write_policy not in KV_OFFLOAD_WRITE_POLICIES:
            raise ValueError(f"--kv-offload-write-policy must be one of "
                             f"{KV_OFFLOAD_WRITE_POLICIES}")
        if self.kv_offload_owner_key is not None and len(self.kv_offload_owner_key) < 16:
            raise ValueError("kv_offload_owner_key must be at least 16 bytes")
        if self.kv_offload_size and not self.kv_offload_dir:
            raise ValueError("--kv-offload-size needs --kv-offload-dir")
        if self.max_consecutive_step_failures < 1:
            raise ValueError("--max-consecutive-step-failures must be at least 1")


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
    kv_cache_dtype: str
