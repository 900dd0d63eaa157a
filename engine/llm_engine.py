"""The synchronous engine: scheduler + KV cache manager + model runner + detokenizers.

Request lifecycle: ``add_request`` -> waiting -> admitted by ``Scheduler.schedule`` (prefix-cache
lookup, slot allocation) -> ``ModelRunner.execute`` (prefill chunks and decodes in one batch) ->
``Scheduler.update_from_output`` (token stop rules) -> detokenize (stop strings) -> ``RequestOutput``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from engine.block_hash import get_hash_fn
from engine.block_pool import BlockPool
from engine.config import CacheInfo, EngineConfig, sampling_defaults
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import EngineDeadError
from engine.executor import ModelExecutor
from engine.faults import fire
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.kv_offload import BlockCipher, DiskStore, KVOffloader, MemoryStore, RedisStore
from engine.models.config import ModelConfig
from engine.protocol import ModelInfo, attach_grammar, validate_request
from engine.request import EngineRequest, Request, RequestOutput, RequestStatus, TokenLogprobs
from engine.scheduler import Scheduler, SchedulerOutput
from engine.stats import OPERATOR_EVICTION_REASONS, EngineStatsSnapshot
from engine.stats_snapshot import take_snapshot
from engine.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)


def _generation_config_eos(model_dir: Path) -> set[int]:
    path = model_dir / "generation_config.json"
    if not path.exists():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


class StepCostModel:
    """Finds the stall-free cap (``Scheduler.interactive_step_tokens``) from measured step times.

    A decode-only step (at most ``SMALL`` tokens) costs ``t_small`` (moving average): on CPU,
    and for decode on GPU, mostly reading the weights. The cap is the number of extra tokens a
    step may carry beside another tenant's decodes while staying within ``TARGET`` x
    ``t_small``: it starts at ``c0 / c1`` of a linear fit between small steps and large ones
    (at least ``LARGE`` tokens), then follows the capped steps actually measured (x0.85 when one
    was too long, x1.05 when not), since small chunks cost more per token than the fit says.
    """

    SMALL, LARGE, ALPHA, TARGET = 32, 128, 0.2, 1.8

    def __init__(self) -> None:
        self.small: tuple[float, float] | None = None  # (mean tokens, mean seconds)
        self.large: tuple[float, float] | None = None
        self.cap: float | None = None

    def observe(self, num_tokens: int, seconds: float, capped: bool = False) -> None:
        """Records one step; ``capped``: the stall-free cap limited it."""
        if capped and self.cap is not None and self.small is not None:
            too_long = seconds > self.TARGET * self.small[1]
            self.cap = max(4.0, self.cap * (0.85 if too_long else 1.05))
            return
        if num_tokens <= self.SMALL:
            self.small = self._ema(self.small, num_tokens, seconds)
        elif num_tokens >= self.LARGE:
            self.large = self._ema(self.large, num_tokens, seconds)
        if self.cap is None and self.small is not None and self.large is not None:
            (ns, ts), (nl, tl) = self.small, self.large
            c1 = (tl - ts) / (nl - ns)
            c0 = ts - c1 * ns
            if c1 > 0 and c0 > 0:
                self.cap = c0 / c1

    def _ema(self, old: tuple[float, float] | None, n: float, t: float) -> tuple[float, float]:
        if old is None:
            return n, t
        a = self.ALPHA
        return (1 - a) * old[0] + a * n, (1 - a) * old[1] + a * t

    def interactive_tokens(self) -> int | None:
        """The cap in tokens, or None until a small and a large step were seen."""
        return None if self.cap is None else max(1, int(self.cap))


class LLMEngine:
    """Synchronous engine; not thread-safe (``engine.async_engine.AsyncLLM`` wraps it).

    Imports no torch itself: the model lives behind a ``ModelExecutor`` (by default
    ``engine.model_runner.ModelRunner``, loaded from ``config.model``).

    Args:
        config: engine settings.
        tokenizer: a Hugging Face tokenizer; default: loaded from ``config.model``.
        executor: runs the model; default: ``ModelRunner.load`` (tests pass a fake).
        kernel_policy: the model's kernel choices (an
            ``engine.quantization.KernelPolicy``; default: this CPU's).

    Raises:
        ValueError: misconfiguration (unknown dtype, unsupported architecture naming the supported
            ones, pool smaller than one max-length request, ...).
    """

    def __init__(self, config: EngineConfig, tokenizer: Any = None,
                 executor: ModelExecutor | None = None, kernel_policy: Any = None) -> None:
        self.config = config
        model_dir = Path(config.model)
        model_cfg = ModelConfig.from_pretrained(model_dir)
        if tokenizer is None:
            from engine.weights import load_tokenizer

            tokenizer = load_tokenizer(model_dir)
        self.tokenizer = tokenizer
        max_model_len = config.max_model_len or model_cfg.max_position_embeddings
        if max_model_len > model_cfg.max_position_embeddings:
            raise ValueError(f"--max-model-len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {model_cfg.max_position_embeddings}")
        if executor is None:
            from engine.model_runner import ModelRunner

            executor = ModelRunner.load(config, model_cfg, max_model_len, kernel_policy)
        self.runner = executor
        self.model = getattr(executor, "model", None)  # None for executors without a module

        bs = config.block_size
        per_block = executor.kv_bytes_per_block(bs)
        num_blocks = (config.num_gpu_blocks_override
                      or max(1, executor.kv_cache_budget_bytes() // per_block))
        if cdiv(max_model_len, bs) > num_blocks:
            raise ValueError(f"the KV cache holds {num_blocks} blocks ({num_blocks * bs} tokens), "
                             f"fewer than one request of --max-model-len {max_model_len}; raise "
                             "the KV cache budget or lower --max-model-len")
        executor.initialize_kv_cache(num_blocks, bs)
        # Stop ids: config.json's, generation_config.json's (e.g. Llama 3's <|eot_id|>) and the
        # tokenizer's eos (vLLM reads the same three sources).
        eos = set(model_cfg.eos_token_ids) | _generation_config_eos(model_dir)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.cache_info = CacheInfo(num_blocks, bs, max_model_len, per_block, tuple(sorted(eos)),
                                    executor.dtype, executor.device, executor.attention_backend,
                                    getattr(executor, "kv_cache_dtype", executor.dtype))
        self.offloader = self._offloader(config, executor, model_cfg, per_block)
        self.block_pool = BlockPool(num_blocks, config.enable_prefix_caching,
                                    on_evict=self.offloader.on_evict if self.offloader else None)
        self.kv_cache_manager = KVCacheManager(self.block_pool, bs,
                                               get_hash_fn(config.prefix_caching_hash_algo),
                                               config.enable_prefix_caching, self.offloader)
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, max_model_len, eos,
                                   policy=config.scheduling_policy,
                                   interactive_step_tokens=config.interactive_step_tokens)
        self.step_costs = StepCostModel()
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.consecutive_step_failures = 0
        self.served_model_name = config.served_model_name or model_dir.name
        self.model_info = ModelInfo(
            served_model_name=self.served_model_name, max_model_len=max_model_len,
            vocab_size=model_cfg.vocab_size, block_size=bs, num_blocks=num_blocks,
            eos_token_ids=tuple(sorted(eos)), tokenizer=tokenizer,
            device=str(executor.device), enable_prefix_caching=config.enable_prefix_caching,
            cache_dtype=self.cache_info.kv_cache_dtype,
            kv_offload_tiers=tuple(t.name for t in self.offloader.tiers) if self.offloader
            else (),
            default_sampling=sampling_defaults(config, model_dir),
            grammar_compiler=GrammarCompiler(tokenizer, model_cfg.vocab_size))
        if self.model_info.default_sampling:
            logger.info("sampling defaults from the generation config: %s",
                        self.model_info.default_sampling)
        weights = (f"{self.model.weight_bytes() / 1e6:.0f} MB of weights read per token"
                   if self.model is not None and hasattr(self.model, "weight_bytes") else "")
        dense_note = getattr(executor, "dense_note", "")
        kv_dtype = self.cache_info.kv_cache_dtype
        logger.info("engine ready: %d KV blocks x %d tokens (%.1f MiB, %s), max_model_len %d, "
                    "prefix caching %s (%s), attention %s, %s %s, quantization %s%s%s",
                    num_blocks, bs, num_blocks * per_block / 2**20, kv_dtype, max_model_len,
                    "on" if config.enable_prefix_caching else "off",
                    config.prefix_caching_hash_algo, executor.attention_backend,
                    executor.device, executor.dtype, config.quantization or "none",
                    f" ({weights})" if weights else "", f", {dense_note}" if dense_note else "")

    @staticmethod
    def _offloader(config: EngineConfig, executor: Any, model_cfg: ModelConfig,
                   per_block: int) -> KVOffloader | None:
        """The tiers behind the pool (``--kv-offload-*``), nearest first, or None."""
        sizes = (config.kv_offload_host_size, config.kv_offload_size,
                 config.kv_offload_redis_url and config.kv_offload_redis_size)
        if not any(sizes) or not config.enable_prefix_caching:
            return None
        if not hasattr(executor, "read_block"):
            logger.warning("--kv-offload-*: this executor cannot copy KV blocks; no tiers")
            return None
        # Everything that changes the KV a prompt computes: a blob of another layout (another
        # model, weights dtype, quantization or KV dtype) never opens (BlockCipher).
        layout = (f"{Path(config.model).name}|{getattr(executor, 'kv_cache_dtype', '')}|"
                  f"{config.dtype}|{config.quantization}/{config.quantized_activation_bits}|"
                  f"{model_cfg.num_hidden_layers}x2x{config.block_size}x"
                  f"{model_cfg.num_key_value_heads}x{model_cfg.head_dim}").encode()
        tiers: list = []
        through = config.kv_offload_write_policy == "write_through"
        if config.kv_offload_host_size:
            if str(executor.device).startswith("cpu"):
                logger.info("--kv-offload-host-size: on CPU the pool already is host memory; "
                            "no host tier")
            else:
                tiers.append(MemoryStore(config.kv_offload_host_size, write_through=through))
        if config.kv_offload_size:
            tiers.append(DiskStore(config.kv_offload_dir, config.kv_offload_size,
                                   owner_key=config.kv_offload_owner_key, write_through=through))
        if config.kv_offload_redis_url and config.kv_offload_redis_size:
            tiers.append(RedisStore(config.kv_offload_redis_url, config.kv_offload_redis_size,
                                    config.kv_offload_redis_namespace, layout,
                                    owner_key=config.kv_offload_owner_key))
        if not tiers:
            return None
        for tier in tiers:
            u = tier.usage()
            scan = getattr(tier, "scan_seconds", None)
            logger.info("KV offload %s tier: %.2f GiB, %d blocks found (%.2f GiB)%s%s",
                        tier.name, u.capacity_bytes / 2**30, u.blobs, u.used_bytes / 2**30,
                        "" if scan is None else f" in {scan:.2f} s",
                        "" if u.up else " (unreachable now)")
        return KVOffloader(tiers, BlockCipher(layout, per_block), executor)

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """Validates and queues a request (the offline path; see ``enqueue``).

        Raises:
            InvalidRequestError: from ``engine.protocol.validate_request``.
            ValueError: duplicate request id.
        """
        validate_request(req, self.model_info)
        self.enqueue(attach_grammar(req, self.model_info))

    def enqueue(self, req: EngineRequest) -> None:
        """Queues a request the caller has already validated (``AsyncLLM`` validates on the
        caller's thread, vLLM's input-processor split). Raises ValueError for a duplicate id."""
        request = Request(req)
        self.scheduler.add_request(request)
        self.block_pool.set_tenant_share(req.tenant_id, req.tenant_share)
        if self.offloader is not None:
            self.offloader.set_tenant_share(req.tenant_id, req.tenant_share,
                                            self.cache_info.num_blocks)
        self.detokenizers[req.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, req.sampling_params.stop,
            req.sampling_params.skip_special_tokens, req.sampling_params.min_tokens)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        """Aborts requests wherever they are; their blocks are freed at once."""
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [self._output(r, [], "") for r in done]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        """Drops every cached block; running requests are unharmed.

        Each dropped block counts as an eviction of its owner with reason ``reset``.

        Returns:
            Blocks dropped.
        """
        if self.offloader is not None:
            self.offloader.drop_all()
            self.scheduler.discard_loads(None, every=True)
        return self.block_pool.reset_prefix_cache()

    def evict_tenant_cache(self, tenant_id: str | None, reason: str) -> int:
        """Drops every cached block owned by ``tenant_id``; running requests are unharmed.

        Used by salt rotation (``reason="salt_rotation"``) and per-tenant cache resets
        (``reason="reset"``). Never touches another tenant's blocks or any ref count.

        Returns:
            Blocks dropped (each counted as an eviction of ``tenant_id`` for ``reason``).

        Raises:
            ValueError: ``reason`` is not "salt_rotation" or "reset".
        """
        if reason not in OPERATOR_EVICTION_REASONS:
            raise ValueError(f"reason must be one of {OPERATOR_EVICTION_REASONS}, got {reason!r}")
        if reason == "salt_rotation":
            # In-flight requests carry the old salt: they finish unharmed but stop adding to
            # the cache (a recompute after preemption would re-cache old-salt blocks).
            for req in self.scheduler.requests.values():
                if req.tenant_id == tenant_id:
                    req.enable_prefix_caching = False
        if self.offloader is not None:
            self.offloader.drop_tenant(tenant_id)
            self.scheduler.discard_loads(tenant_id)
        return self.block_pool.evict_cached_blocks(lambda b: b.owner == tenant_id, reason)

    def stats_snapshot(self) -> EngineStatsSnapshot:
        """Frozen copy of the engine's counters and gauges (see ``engine.stats``).

        Call on the engine thread (``await AsyncLLM.stats()`` does).
        """
        return take_snapshot(self.scheduler)

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and runs one batch. Returns outputs for requests that got new tokens or
        finished (also with finish_reason ``"error"``).

        Fault containment (DESIGN "Multi-tenant capacity"): a fault in one request's block
        allocation, sampling, stop checks or detokenisation fails that request alone. A failed
        batched forward fails that step's requests, drops the prefix-cache entries of the blocks
        it was filling, checks the pool's integrity and goes on.

        Raises:
            EngineDeadError: ``max_consecutive_step_failures`` forwards failed in a row, or the
                pool's integrity check failed after a failed forward.
        """
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            self.kv_cache_manager.step_done(ok=False)
            if self.scheduler.loads_pending:  # only loads in flight: wait, do not spin
                self.offloader.wait_loads(0.05)
            return self._failed_outputs()
        t0 = time.perf_counter()
        try:
            result = self.runner.execute(sched)
        except Exception as e:  # noqa: BLE001 - the whole step failed; maybe only this once
            self.kv_cache_manager.step_done(ok=False)
            return self._fail_step(sched, e)
        self.kv_cache_manager.step_done(ok=True)
        self.consecutive_step_failures = 0
        self.step_costs.observe(sched.total_num_scheduled_tokens, time.perf_counter() - t0,
                                capped=sched.capped)
        if self.config.interactive_step_tokens is None:  # measured, not configured
            self.scheduler.interactive_step_tokens = self.step_costs.interactive_tokens()
        for rid, reason in result.failed.items():
            self.scheduler.fail_request(self.scheduler.requests[rid], reason)
        for rid, (first, entries) in result.prompt_logprobs.items():
            req = self.scheduler.requests.get(rid)
            if req is None:  # failed above, in this very step
                continue
            collected = req.prompt_logprobs
            # A recompute after preemption covers positions already collected: keep the first.
            collected.extend(entries[len(collected) - first:])
        outputs = []
        for req in self.scheduler.update_from_output(sched, result.sampled):
            try:
                outputs.append(self._detokenize(req, result.logprobs.get(req.request_id)))
            except Exception as e:  # noqa: BLE001 - this request's fault only
                logger.error("detokenisation failed for request %s: %s", req.request_id,
                             type(e).__name__)
                req.pop_output_token()  # never delivered: not billed
                reason = "detokenisation failed for this request"
                if req.status.finished:  # finished by a token rule this step: already freed
                    req.status = RequestStatus.FINISHED_ERROR
                    outputs.append(self._output(req, [], "", error=reason))
                else:
                    self.scheduler.fail_request(req, reason)
        return outputs + self._failed_outputs()

    def _detokenize(self, req: Request, logprobs: TokenLogprobs | None) -> RequestOutput:
        fire("detokenize", req.request_id)
        new_ids = [req.output_token_ids[-1]]
        detok = self.detokenizers[req.request_id]
        # The token a request stopped on (eos, a stop token id) is not text, also where
        # special tokens are kept (vLLM's detokenizer skips it the same way).
        stopped_on = req.status == RequestStatus.FINISHED_STOPPED \
            and new_ids[0] in req.stop_token_ids
        delta = detok.add_tokens([] if stopped_on else new_ids, req.status.finished)
        if detok.stopped_by is not None:  # a stop string matched; delta holds the rest
            req.stop_reason = detok.stopped_by
            if req.status.finished:  # finished by a token rule in the same step
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        prompt_logprobs = None
        if req.sampling_params.prompt_logprobs is not None and req.num_output_tokens == 1:
            prompt_logprobs = tuple(req.prompt_logprobs)
        return self._output(req, new_ids, delta, new_logprobs=() if logprobs is None
                            else (logprobs,), prompt_logprobs=prompt_logprobs)

    def _fail_step(self, sched: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        self.consecutive_step_failures += 1
        n, limit = self.consecutive_step_failures, self.config.max_consecutive_step_failures
        logger.error("engine step failed (%d in a row, limit %d): %s", n, limit,
                     type(error).__name__)
        for s in sched.scheduled:  # (also when the engine dies: nothing saves them later)
            if s.request.status == RequestStatus.RUNNING:
                # The KV this step was writing is not trustworthy: no one may hit those blocks.
                self.kv_cache_manager.drop_hashes_from(s.request, s.num_computed_tokens)
        if n >= limit:
            raise EngineDeadError(f"{n} engine steps failed in a row") from error
        for s in sched.scheduled:
            req = s.request
            if req.status == RequestStatus.RUNNING:
                self.scheduler.fail_request(req, "the engine step computing this request "
                                                 "failed")
        try:
            self.kv_cache_manager.check_integrity()
        except AssertionError as e:
            raise EngineDeadError("the KV block pool is inconsistent after a failed step") \
                from e
        return self._failed_outputs()

    def _failed_outputs(self) -> list[RequestOutput]:
        failed, self.scheduler.failed = self.scheduler.failed, []
        return [self._output(req, [], "", error=reason) for req, reason in failed]

    def _output(self, req: Request, new_ids: list[int], delta: str, error: str | None = None,
                new_logprobs: tuple[TokenLogprobs, ...] = (),
                prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
                ) -> RequestOutput:
        finished = req.status.finished
        if finished:
            self.detokenizers.pop(req.request_id, None)
            self.runner.release(req.request_id)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=tuple(new_ids), new_text=delta,
            finished=finished, finish_reason=req.status.value if finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=req.num_output_tokens, stop_reason=req.stop_reason, error=error,
            new_logprobs=new_logprobs, prompt_logprobs=prompt_logprobs,
            num_tier_tokens=req.num_tier_tokens if req.num_cached_tokens > 0 else 0,
            num_cache_write_tokens=min(req.num_cache_write_tokens, req.num_prompt_tokens
                                       - max(req.num_cached_tokens, 0)))
