"""Model runner: turns a ``SchedulerOutput`` into tensors, runs the model, samples tokens."""

from __future__ import annotations

import torch

from engine.attention import (
    CASCADE_MIN_PREFIX_TOKENS,
    CASCADE_MIN_SEQS,
    AttentionMetadata,
    shared_prefix_blocks,
)
from engine.models.llama import LlamaForCausalLM
from engine.sampler import sample
from engine.scheduler import SchedulerOutput


class ModelRunner:
    """Owns the model and the KV cache tensor.

    Args:
        model: a loaded ``LlamaForCausalLM``.
        num_blocks: KV blocks in the pool.
        block_size: tokens per block.
        device, dtype: where and how the KV cache lives.

    The KV cache is one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_caches = torch.zeros(cfg.num_hidden_layers, 2, num_blocks, block_size,
                                     cfg.num_key_value_heads, cfg.head_dim,
                                     device=device, dtype=dtype)
        self.generators: dict[str, torch.Generator] = {}

    @staticmethod
    def bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
        cfg = model.config
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem

    def release(self, request_id: str) -> None:
        """Drops per-request state (the seeded RNG) when a request finishes."""
        self.generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Runs one step. Returns request id -> sampled token for chunks that reach the end."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[tuple[int, ...]] = []
        sample_rows: list[int] = []
        sampled_reqs = []
        bs = self.block_size
        for s in out.scheduled:
            req = s.request
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
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
            return {}
        dev = self.device
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.zeros(len(tables), max_blocks, dtype=torch.int32)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            query_lens_cpu=tuple(query_lens), seq_lens_cpu=tuple(seq_lens), block_size=bs,
            token_slots=(AttentionMetadata.expand_token_slots(block_tables, bs).to(dev)
                         if self.model.uses_token_slots else None),
            cascade_prefix_len=(self._cascade_prefix_len(tables, query_lens, seq_lens)
                                if self.model.uses_token_slots else 0))
        hidden = self.model(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                            torch.tensor(positions, dtype=torch.int64, device=dev),
                            self.kv_caches, meta)
        if not sample_rows:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        params = [r.sampling_params for r in sampled_reqs]
        gens = [self._generator(r.request_id, r.sampling_params.seed) for r in sampled_reqs]
        tokens = sample(logits, params, gens)
        return {r.request_id: t for r, t in zip(sampled_reqs, tokens)}

    def _cascade_prefix_len(self, tables: list[tuple[int, ...]], query_lens: list[int],
                            seq_lens: list[int]) -> int:
        """Tokens shared by every decode sequence's block table when worth a cascade, else 0."""
        decode = [i for i, q in enumerate(query_lens) if q == 1]
        if len(decode) < CASCADE_MIN_SEQS:
            return 0
        n = shared_prefix_blocks([tables[i] for i in decode], [seq_lens[i] for i in decode],
                                 self.block_size)
        return n * self.block_size if n * self.block_size >= CASCADE_MIN_PREFIX_TOKENS else 0

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self.generators[request_id] = gen
        return gen
