"""Token sampling, batched as tensors: grammar masks (structured output), logit bias,
min_tokens, penalties, greedy, temperature, top-k, top-p, per-request seeds, logprobs (OpenAI /
vLLM v1 semantics).

Per step the work is a few [num_seqs, vocab_size] tensor operations whatever the mix of settings;
Python only loops over the requests to gather their settings (and to draw from a seeded request's
own generator), never over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.request import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.structured_output import fill_allowed


class SamplingInput(Protocol):
    """What the sampler reads of a request (``engine.request.Request`` provides it)."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_token_ids: frozenset[int]  # eos (unless ignore_eos) and stop_token_ids
    grammar: Any  # an llguidance matcher (structured output), or None


@dataclass(frozen=True)
class SamplerOutput:
    """One token per row, and its logprobs where the row asked for them (else None)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def gather_logprobs(logits: torch.Tensor, token_ids: Sequence[int],
                    num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Logprob, rank and top alternatives of one token per row, from raw logits.

    Args:
        logits: [num_rows, vocab_size] fp32, as the model produced them.
        token_ids: the token of each row whose logprob is wanted.
        num_top: alternatives wanted per row (0..20).

    Returns:
        One ``TokenLogprobs`` per row (``log_softmax``, as Hugging Face and vLLM's
        ``raw_logprobs``; rank 1 = the most likely token).
    """
    lp = logits.float().log_softmax(dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids[:, None])
    ranks = (lp > chosen).sum(dim=-1).add_(1).tolist()
    chosen_l = chosen.squeeze(1).tolist()
    k = max(num_top, default=0)
    top_v: list[list[float]] = [[] for _ in token_ids]
    top_i: list[list[int]] = [[] for _ in token_ids]
    if k:
        v, i = lp.topk(k, dim=-1)
        top_v, top_i = v.tolist(), i.tolist()
    return [TokenLogprobs(t, chosen_l[r], ranks[r],
                          tuple(zip(top_i[r][:num_top[r]], top_v[r][:num_top[r]])))
            for r, t in enumerate(token_ids)]


def _apply_grammars(logits: torch.Tensor, rows: Sequence[SamplingInput]) -> torch.Tensor:
    """Tokens a row's grammar does not allow next are set to -inf (structured output)."""
    constrained = [i for i, r in enumerate(rows) if getattr(r, "grammar", None) is not None]
    if not constrained:
        return logits
    vocab = logits.shape[-1]
    words = torch.full((len(constrained), (vocab + 31) // 32), -1, dtype=torch.int32)
    for j, i in enumerate(constrained):
        fill_allowed(rows[i].grammar, words[j])
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().reshape(len(constrained), -1)[:, :vocab]
    logits = logits.clone()
    idx = torch.tensor(constrained, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed.to(logits.device), float("-inf"))
    return logits


def _apply_bias_and_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingInput]
                               ) -> torch.Tensor:
    """``logit_bias`` added; eos and stop ids at -inf while ``min_tokens`` is not reached."""
    r_idx: list[int] = []
    t_idx: list[int] = []
    vals: list[float] = []
    for i, row in enumerate(rows):
        p = row.sampling_params
        for tid, bias in p.logit_bias.items():
            r_idx.append(i)
            t_idx.append(tid)
            vals.append(bias)
        if p.min_tokens and len(row.output_token_ids) < p.min_tokens:
            for tid in row.stop_token_ids:
                r_idx.append(i)
                t_idx.append(tid)
                vals.append(float("-inf"))
    if not r_idx:
        return logits
    dev = logits.device
    logits = logits.clone()
    logits.index_put_((torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)),
                      torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)
    return logits


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingInput]) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties,
    as vLLM's ``apply_penalties``."""
    pen = [i for i, r in enumerate(rows) if r.sampling_params.has_penalties]
    if not pen:
        return logits
    dev, vocab = logits.device, logits.shape[-1]
    n = len(pen)
    counts = torch.zeros(n, vocab, dtype=logits.dtype, device=dev)
    out_r = [j for j, i in enumerate(pen) for _ in rows[i].output_token_ids]
    out_t = [t for i in pen for t in rows[i].output_token_ids]
    if out_t:
        counts.index_put_((torch.tensor(out_r, device=dev), torch.tensor(out_t, device=dev)),
                          torch.ones(len(out_t), dtype=logits.dtype, device=dev),
                          accumulate=True)
    params = [rows[i].sampling_params for i in pen]
    sub = logits[pen]
    rep = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in rep):
        seen = counts > 0
        pr_r = [j for j, i in enumerate(pen) for _ in rows[i].prompt_token_ids]
        pr_t = [t for i in pen for t in rows[i].prompt_token_ids]
        if pr_t:
            seen[torch.tensor(pr_r, device=dev), torch.tensor(pr_t, device=dev)] = True
        rep_t = torch.tensor(rep, dtype=logits.dtype, device=dev)[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep_t, sub * rep_t), sub)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=dev)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=dev)
    sub = sub - freq[:, None] * counts - pres[:, None] * (counts > 0).to(logits.dtype)
    logits = logits.clone()
    logits[pen] = sub
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks tokens outside each row's top-k, then outside its top-p mass (vLLM, HF order).

    One descending sort of the rows; the most likely token is always kept (a ``top_p`` below
    fp32's smallest subnormal, e.g. 5e-324, would otherwise drop every token).
    """
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in top_p):
        return logits
    dev = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    pos = torch.arange(vocab, device=dev)[None, :]
    drop = pos >= torch.tensor(ks, device=dev)[:, None]
    if any(p < 1.0 for p in top_p):
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        p_t = torch.tensor(top_p, dtype=probs.dtype, device=dev)[:, None]
        # Drop a token when the mass before it already reaches top_p.
        drop |= probs.cumsum(dim=-1) - probs >= p_t
    drop[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample(logits: torch.Tensor, rows: Sequence[SamplingInput],
           generators: Sequence[torch.Generator | None]) -> SamplerOutput:
    """Picks one token per row.

    Args:
        logits: [num_seqs, vocab_size] fp32, raw model output.
        rows: one request per row (its ``SamplingParams`` and tokens so far).
        generators: per-row RNG (seeded requests) or None (the global RNG).

    Returns:
        The tokens, and each row's logprobs when its ``logprobs`` is set.

    Sampled rows draw with the exponential race (argmax of probs / Exp(1) noise, as vLLM), so
    unseeded rows share one draw and a seeded row only advances its own generator.
    """
    params = [r.sampling_params for r in rows]
    x = _apply_penalties(_apply_bias_and_min_tokens(_apply_grammars(logits, rows), rows), rows)
    tokens = x.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        dev = x.device
        temps = torch.tensor([params[i].temperature for i in sampled], dtype=x.dtype, device=dev)
        y = _top_k_top_p(x[sampled] / temps[:, None], [params[i].top_k for i in sampled],
                         [params[i].top_p for i in sampled])
        probs = y.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()
        for j, i in enumerate(sampled):
            if generators[i] is not None:
                q[j].exponential_(generator=generators[i])
        tokens[sampled] = (probs / q).argmax(dim=-1)
    token_ids = tokens.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        got = gather_logprobs(logits[want], [token_ids[i] for i in want],
                              [params[i].logprobs or 0 for i in want])
        for i, lp in zip(want, got):
            logprobs[i] = lp
    return SamplerOutput(token_ids, logprobs)
