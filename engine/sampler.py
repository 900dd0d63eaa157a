"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds (OpenAI/vLLM semantics)."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """Picks one token per row.

    Args:
        logits: [num_seqs, vocab_size] fp32.
        params: one ``SamplingParams`` per row.
        generators: per-row RNG (seeded requests) or None (the global RNG).

    Returns:
        num_seqs token ids.

    Top-k is applied before top-p, as in vLLM and Hugging Face ``generate``.
    """
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if 0 < p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            # Drop a token when the mass before it already reaches top_p (keeps at least one).
            drop = probs.cumsum(-1) - probs >= p.top_p
            # Always keep the most likely token: a top_p below fp32's smallest subnormal
            # (e.g. 5e-324) rounds to 0 in the comparison and would drop every token.
            drop[0] = False
            row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = row.softmax(-1)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
