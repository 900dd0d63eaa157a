"""Model runner: turns a ``SchedulerOutput`` into tensors, runs the model, samples tokens."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine.attention import AttentionMetadata, get_attention_backend
from engine.config import EngineConfig
from engine.executor import ExecuteOutput
from engine.faults import fire
from engine.models.config import ModelConfig
from engine.models.loader import load_model
from engine.quantization import KernelPolicy, check_quantization
from engine.request import Request, TokenLogprobs
from engine.sampler import gather_logprobs, sample
from engine.scheduler import SchedulerOutput
from engine.thread_tuner import ThreadTuner
from kernels import cpu_linear, cpu_ops

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bf16 on CUDA, fp32 elsewhere. Raises ValueError for an unknown name."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"--dtype must be auto or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, attention_backend: str
                           ) -> torch.dtype:
    """``--kv-cache-dtype`` (vLLM's flag): ``auto`` -> the model's dtype; ``bfloat16`` -> bf16.

    Raises:
        ValueError: an unknown name; bf16 under a model dtype other than fp32 or bf16 (the
            torch path reads the cache in the model's dtype); bf16 under an fp32 model on the
            triton backend (its kernels take the cache in the model's dtype).
    """
    if name == "auto":
        return dtype
    if name != "bfloat16":
        raise ValueError(f"--kv-cache-dtype must be auto or bfloat16, got {name!r}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("--kv-cache-dtype bfloat16 needs --dtype float32 or bfloat16")
    if attention_backend == "triton" and dtype != torch.bfloat16:
        raise ValueError("--kv-cache-dtype bfloat16 on the triton attention backend needs "
                         "--dtype bfloat16 (its kernels read the cache in the model's dtype); "
                         "or use --attention-backend torch")
    return torch.bfloat16


class ModelRunner:
    """The torch ``ModelExecutor``: owns the model, its attention backend and the KV cache.

    The KV cache is one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    in ``--kv-cache-dtype`` (the model's dtype, or bf16), allocated by ``initialize_kv_cache``.

    Args:
        model: a loaded model from ``engine.models.loader.load_model``.
        config: the engine settings (KV budget flags).
        device, dtype: where and how the model and KV cache live.
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.model = model
        self.config = config
        self.torch_device, self.torch_dtype = device, dtype
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, model.attn.name)
        self.kv_cache_dtype = str(self.kv_dtype).removeprefix("torch.")
        if (device.type == "cpu" and dtype == torch.float32 and self.kv_dtype == torch.bfloat16
                and model.attn.name == "torch" and cpu_linear.loaded()
                and not cpu_ops.bf16_decode_attention_usable(model.config.head_dim)):
            logger.warning("--kv-cache-dtype bfloat16: our bf16 decode attention does not run "
                           "here (it needs avx512_bf16 and a head_dim multiple of 32); the "
                           "torch path reads the cache widened to fp32, more slowly")
        # CPU steps of one token run on one_token_step_threads torch threads, others on
        # this thread's count at load (see EngineConfig.one_token_step_threads).
        self.step_threads = torch.get_num_threads()
        self.one_token_threads = ((config.one_token_step_threads or 0)
                                  if device.type == "cpu" else 0)
        self._threads_now = self.step_threads
        self.thread_tuner: ThreadTuner | None = None  # see tune_one_token_threads
        self.device = str(device)
        self.dtype = str(dtype).removeprefix("torch.")
        self.attn = model.attn
        self.attention_backend = self.attn.name
        # Which dense copy quantized layers hold, for the start-up log (engine.quantization).
        policy: KernelPolicy = model.policy
        self.dense_note = policy.dense_copy_note(config.quantization, dtype,
                                                 config.quantized_activation_bits) \
            if device.type == "cpu" else ""
        if config.quantized_activation_bits != 16 and not (
                device.type == "cpu" and policy.int8_dot_serves(config.quantization, dtype)):
            logger.warning("--quantized-activation-bits %d: our int8-dot kernels are off "
                           "here (no CPU build of them, or switched off), so the quantized layers "
                           "use torch's kernels and the flag changes nothing",
                           config.quantized_activation_bits)
        self.block_size = config.block_size
        self.kv_caches: torch.Tensor | None = None
        self.generators: dict[str, torch.Generator] = {}

    @classmethod
    def load(cls, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
             kernel_policy: KernelPolicy | None = None) -> ModelRunner:
        """Resolves device, dtype and attention backend, seeds torch, loads the weights.
        ``kernel_policy``: the kernel choices (default: this CPU's, detected once our CPU
        kernels are loaded or found unavailable).

        Raises:
            ValueError: unknown dtype, a quantization this device cannot run, or
                triton off CUDA without the interpreter.
            FileNotFoundError: no safetensors (or, for ``gguf``, no GGUF) in ``config.model``.
        """
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        check_quantization(config.quantization, device)
        if device.type == "cpu" and dtype == torch.float32:
            cpu_linear.load()  # our small-batch fp32 kernel; F.linear if it cannot be built
        attn = get_attention_backend(config.attention_backend, device)
        resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, attn.name)  # raises before loading
        policy = kernel_policy if kernel_policy is not None else KernelPolicy.detect()
        model = load_model(config.model, model_config, max_model_len, dtype, device, attn,
                           config.quantization, config.quantized_activation_bits, policy)
        torch.manual_seed(config.seed)
        return cls(model, config, device, dtype)

    def kv_bytes_per_block(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return self.model.config.kv_bytes_per_block(block_size, elem)

    def kv_cache_budget_bytes(self) -> int:
        budget = self.config.kv_cache_memory_bytes
        if budget is not None:
            return budget
        if self.torch_device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.torch_device)
            return int(free * self.config.gpu_memory_utilization)
        return _DEFAULT_CPU_KV_BYTES

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        cfg = self.model.config
        self.block_size = block_size
        self.kv_caches = torch.zeros(cfg.num_hidden_layers, 2, num_blocks, block_size,
                                     cfg.num_key_value_heads, cfg.head_dim,
                                     device=self.torch_device, dtype=self.kv_dtype)

    def read_block(self, block_id: int) -> bytes:
        """One block's KV in every layer ([layers, 2, block_size, kv_heads, head_dim] in the
        cache dtype), as bytes (the offload tier's payload)."""
        block = self.kv_caches[:, :, block_id].contiguous().cpu()
        return block.view(torch.uint8).numpy().tobytes()

    def write_block(self, block_id: int, data: bytes) -> None:
        """Writes ``read_block``'s bytes back into block ``block_id``, bit for bit. Called on
        the offload loader thread while steps run: on CPU the copy is one numpy copy on that
        thread (a torch copy there would start a second OpenMP team beside the step's and
        slow both on a small machine).

        Raises:
            ValueError: ``data`` is not one block's bytes.
        """
        dst = self.kv_caches[:, :, block_id]
        if len(data) != dst.numel() * dst.element_size():
            raise ValueError("not one KV block's bytes")
        if dst.device.type == "cpu":
            view = dst.view(torch.uint8).numpy()  # a strided view of the cache, no copy
            np.copyto(view, np.frombuffer(data, dtype=np.uint8).reshape(view.shape))
            return
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        dst.copy_(src.view(self.kv_dtype).view(dst.shape))

    def release(self, request_id: str) -> None:
        """Drops per-request state (the seeded RNG) when a request finishes."""
        self.generators.pop(request_id, None)

    def restore_threads(self) -> None:
        """Puts torch back on the load-time thread count (torch's count is process-wide: an
        engine that stops after a one-token step must not leave the process on fewer)."""
        if self._threads_now != self.step_threads:
            torch.set_num_threads(self.step_threads)
            self._threads_now = self.step_threads

    def tune_one_token_threads(self) -> None:
        """From now on, CPU steps of one token run on the faster of ``step_threads - 1`` and
        ``step_threads`` torch threads, timed while serving (``engine.thread_tuner``). What an
        unset ``--one-token-step-threads`` means when served. No-op on a GPU, on one thread,
        or with a fixed ``--one-token-step-threads``."""
        if self.torch_device.type == "cpu" and not self.one_token_threads \
                and self.step_threads >= 2:
            self.thread_tuner = ThreadTuner((self.step_threads - 1, self.step_threads))

    def _threads_for(self, one: bool) -> int | None:
        """torch's thread count for a step (``one``: of exactly one token), or None to leave it
        (no switching set up)."""
        if one and self.thread_tuner is not None:
            return self.thread_tuner.threads()
        if one and self.one_token_threads:
            return self.one_token_threads
        if self.thread_tuner is not None or self.one_token_threads:
            return self.step_threads
        return None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ExecuteOutput:
        """Runs one step: batched forward, then sampling (see ``ModelExecutor.execute``).

        A failure in sampling is retried row by row, so only the requests whose own sampling
        fails are reported in ``failed``; a failure in the forward pass raises.
        """
        one = out.total_num_scheduled_tokens == 1
        want = self._threads_for(one)
        if want is not None and want != self._threads_now:
            torch.set_num_threads(want)
            self._threads_now = want
        timed = one and self.thread_tuner is not None
        start = time.perf_counter()
        result = self._execute(out)
        if timed:
            self.thread_tuner.record(self._threads_now, time.perf_counter() - start)
        return result

    def _execute(self, out: SchedulerOutput) -> ExecuteOutput:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[tuple[int, ...]] = []
        sample_rows: list[int] = []
        sampled_reqs = []
        # (request, its first row in the batch, first position) of chunks whose positions
        # predict prompt tokens of a ``prompt_logprobs`` request, and how many positions.
        prompt_lp: list[tuple[Request, int, int, int]] = []
        bs = self.block_size
        for s in out.scheduled:
            req = s.request
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            if req.sampling_params.prompt_logprobs is not None:
                # Position p predicts token p + 1: prompt tokens up to the last one.
                num = min(end, req.num_prompt_tokens - 1) - start
                if num > 0:
                    prompt_lp.append((req, len(input_ids), start, num))
            input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            table = s.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(s.num_new_tokens)
            seq_lens.append(end)
            tables.append(table)
            if s.samples:
                sample_rows.append(len(input_ids) - 1)
                sampled_reqs.append(req)
        if not input_ids:
            return ExecuteOutput({})
        dev = self.torch_device
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor([(*t, *(0,) * (max_blocks - len(t))) for t in tables],
                                    dtype=torch.int32)  # padded with 0 (one call, not a row's)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        meta = self.attn.build_metadata(AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            query_lens_cpu=tuple(query_lens), seq_lens_cpu=tuple(seq_lens), block_size=bs),
            tables)
        fire("forward")
        hidden = self.model(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                            torch.tensor(positions, dtype=torch.int64, device=dev),
                            self.kv_caches, meta)
        failed: dict[str, str] = {}
        prompt_logprobs = {}
        for req, row, start, num in prompt_lp:
            try:
                prompt_logprobs[req.request_id] = (start + 1, self._prompt_logprobs(
                    hidden[row:row + num], req.all_token_ids[start + 1:start + 1 + num],
                    req.sampling_params.prompt_logprobs or 0))
            except Exception as e:  # noqa: BLE001 - this request's fault only
                logger.error("prompt logprobs failed for request %s: %s", req.request_id,
                             type(e).__name__)
                failed[req.request_id] = "prompt logprobs failed for this request"
        if not sample_rows:
            return ExecuteOutput({}, failed, prompt_logprobs=prompt_logprobs)
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        rng_states = {r.request_id: self.generators[r.request_id].get_state()
                      for r in sampled_reqs if r.request_id in self.generators}
        try:
            self._sample(logits, sampled_reqs, sampled, logprobs)
        except Exception:  # noqa: BLE001 - find whose fault it is, one row at a time
            sampled.clear()
            logprobs.clear()
            for r in sampled_reqs:  # seeded rows draw again from where they were
                if r.request_id in rng_states:
                    self.generators[r.request_id].set_state(rng_states[r.request_id])
                else:
                    self.generators.pop(r.request_id, None)
            for i, r in enumerate(sampled_reqs):
                try:
                    self._sample(logits[i:i + 1], [r], sampled, logprobs)
                except Exception as e:  # noqa: BLE001 - this request's fault only
                    logger.error("sampling failed for request %s: %s", r.request_id,
                                 type(e).__name__)
                    failed[r.request_id] = "sampling failed for this request"
        for r in sampled_reqs:  # structured output: the grammar takes the chosen token
            token = sampled.get(r.request_id)
            if r.grammar is not None and token is not None \
                    and not r.grammar.consume_token(token):
                del sampled[r.request_id]
                logprobs.pop(r.request_id, None)
                failed[r.request_id] = "the output could not continue its grammar"
        return ExecuteOutput(sampled, failed, logprobs, prompt_logprobs)

    _PROMPT_LOGPROBS_ROWS = 256  # logits rows at once: 256 x vocab 49152 x 4 bytes = 48 MiB

    def _prompt_logprobs(self, hidden: torch.Tensor, targets: list[int],
                         num_top: int) -> list[TokenLogprobs]:
        """Logprobs of ``targets`` (the prompt tokens that ``hidden``'s positions predict)."""
        result: list[TokenLogprobs] = []
        step = self._PROMPT_LOGPROBS_ROWS
        for i in range(0, len(targets), step):
            logits = self.model.compute_logits(hidden[i:i + step])
            chunk = targets[i:i + step]
            result.extend(gather_logprobs(logits, chunk, [num_top] * len(chunk)))
        return result

    def _sample(self, logits: torch.Tensor, reqs: list[Request], sampled: dict[str, int],
                logprobs: dict[str, TokenLogprobs]) -> None:
        """Samples one token per row of ``logits`` [len(reqs), vocab] (float32) into
        ``sampled`` (and ``logprobs`` for requests that asked)."""
        for r in reqs:
            fire("logits", r.request_id)
            fire("sample", r.request_id)
        gens = [self._generator(r.request_id, r.sampling_params.seed) for r in reqs]
        result = sample(logits, reqs, gens)
        for r, t, lp in zip(reqs, result.token_ids, result.logprobs):
            sampled[r.request_id] = t
            if lp is not None:
                logprobs[r.request_id] = lp

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.torch_device).manual_seed(seed)
            self.generators[request_id] = gen
        return gen
