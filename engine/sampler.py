"""Token sampling, batched as tensors: grammar masks (structured output), logit bias,
min_tokens, penalties, greedy, temperature, top-k, top-p, per-request seeds, logprobs (OpenAI /
vLLM v1 semantics).

Per step the work is a few [num_seqs, vocab_size] tensor operations whatever the mix of settings;
Python only loops over the requests to gather their settings (and to draw from a seeded request's
own generator), never over the vocabulary. Top-k / top-p rank only each row's largest logits,
never sort the whole vocabulary unless a row's top-p mass spans most of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.request import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.structured_output import fill_allowed
from kernels.cpu_ops import argmax_rows


class SamplingInput(Protocol):
    """What the sampler reads of a request (``engine.request.Request`` provides it)."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_token_ids: frozenset[int]  # eos (unless ignore_eos) and stop_token_ids
    grammar: Any  # an llguidance matcher (structured output), or None
    penalty_state: PenaltyState | None  # the sampler's own, set on first use


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


def _apply_grammars_(x: torch.Tensor, rows: Sequence[SamplingInput],
                     constrained: list[int]) -> None:
    """In place: tokens a row's grammar does not allow next are set to -inf."""
    vocab = x.shape[-1]
    words = torch.full((len(constrained), (vocab + 31) // 32), -1, dtype=torch.int32)
    for j, i in enumerate(constrained):
        fill_allowed(rows[i].grammar, words[j])
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().reshape(len(constrained), -1)[:, :vocab]
    idx = torch.tensor(constrained, device=x.device)
    x[idx] = x[idx].masked_fill(~allowed.to(x.device), float("-inf"))


def _apply_bias_and_min_tokens_(x: torch.Tensor, rows: Sequence[SamplingInput]) -> None:
    """In place: ``logit_bias`` added; eos and stop ids at -inf until ``min_tokens``."""
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
    if r_idx:
        dev = x.device
        x.index_put_((torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)),
                     torch.tensor(vals, dtype=x.dtype, device=dev), accumulate=True)


class PenaltyState:
    """One request's penalty bookkeeping, kept on the request across steps so that each step
    only adds its new output tokens (O(new tokens), not O(context)).

    Attributes:
        prompt_seen: [vocab] bool, tokens of the prompt (repetition penalty).
        counts: [vocab] fp32, occurrences of each token in the output so far.
        num_counted: output tokens already in ``counts``.
    """

    def __init__(self, row: SamplingInput, vocab: int, device: torch.device) -> None:
        self.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        if row.prompt_token_ids:
            self.prompt_seen[torch.tensor(row.prompt_token_ids, device=device)] = True
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.num_counted = 0

    def update(self, output_token_ids: list[int]) -> None:
        new = output_token_ids[self.num_counted:]
        if new:
            ids = torch.tensor(new, device=self.counts.device)
            self.counts.index_add_(0, ids, torch.ones(len(new), device=self.counts.device))
        self.num_counted = len(output_token_ids)


def _apply_penalties_(x: torch.Tensor, rows: Sequence[SamplingInput], pen: list[int]) -> None:
    """In place: repetition (prompt and output tokens), frequency and presence (output tokens)
    penalties, as vLLM's ``apply_penalties``."""
    dev, vocab = x.device, x.shape[-1]
    states = []
    for i in pen:
        state = getattr(rows[i], "penalty_state", None)
        if state is None or state.num_counted > len(rows[i].output_token_ids):
            state = PenaltyState(rows[i], vocab, dev)
            rows[i].penalty_state = state
        state.update(rows[i].output_token_ids)
        states.append(state)
    counts = torch.stack([st.counts for st in states]).to(x.dtype)
    params = [rows[i].sampling_params for i in pen]
    sub = x[pen]
    rep = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in rep):
        seen = torch.stack([st.prompt_seen for st in states]) | (counts > 0)
        rep_t = torch.tensor(rep, dtype=x.dtype, device=dev)[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep_t, sub * rep_t), sub)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype, device=dev)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype, device=dev)
    x[pen] = sub - freq[:, None] * counts - pres[:, None] * (counts > 0).to(x.dtype)


def _process(logits: torch.Tensor, rows: Sequence[SamplingInput]) -> torch.Tensor:
    """Grammar masks, then ``logit_bias`` and the ``min_tokens`` mask, then penalties (vLLM
    v1 order), on one copy of ``logits`` (``logits`` itself is left raw for logprobs)."""
    constrained = [i for i, r in enumerate(rows) if getattr(r, "grammar", None) is not None]
    pen = [i for i, r in enumerate(rows) if r.sampling_params.has_penalties]
    biased = any(r.sampling_params.logit_bias or r.sampling_params.min_tokens for r in rows)
    if not (constrained or pen or biased):
        return logits
    x = logits.clone()
    if constrained:
        _apply_grammars_(x, rows, constrained)
    if biased:
        _apply_bias_and_min_tokens_(x, rows)
    if pen:
        _apply_penalties_(x, rows, pen)
    return x


_TOP_CANDIDATES = 64  # tokens a row's top-p cut is first looked for in (x4 until it is found)


def _truncates(top_k: int, top_p: float, vocab: int) -> bool:
    """Whether a row's top-k or top-p can drop any of its ``vocab`` tokens."""
    return 0 < top_k < vocab or top_p < 1.0


def _shifted_exp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, n] -> (m [rows, 1], exp(x - m) [rows, n]): m each row's max (a row of -inf:
    fp32's lowest, so finite), the exponents clamped at -87 so no term is an fp32 subnormal
    (torch's logsumexp takes 450 us for a row of 49,152 logits at temperature 0.2, against 43
    at 1.0: most terms underflow there). The clamp adds at most e^-87 (1.6e-38) a term to a
    sum of at least 1."""
    m = x.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(x.dtype).min)
    return m, (x - m).clamp_(min=-87.0).exp_()


def _logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """[rows, n] -> [rows, 1]: ``logsumexp`` over ``_shifted_exp``'s terms."""
    m, e = _shifted_exp(x)
    return m + e.sum(dim=-1, keepdim=True).log_()


def _candidates(logits: torch.Tensor, top_k: list[int], top_p: list[float]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's tokens left by its top-k, then its top-p mass (vLLM, HF order).

    Returns:
        (values [rows, K], token ids [rows, K] int64): each row's K largest logits in
        descending order, the dropped ones -inf; or (``logits``, None) when no row truncates.

    Tokens are taken in descending order: those at rank ``top_k`` and beyond are dropped, then
    those before which the kept probability mass already reaches ``top_p`` (the probabilities
    of the top-k, renormalised); the most likely token is always kept (a ``top_p`` below fp32's
    smallest subnormal, e.g. 5e-324, would otherwise drop every token).

    Only each row's largest ``K`` logits are ranked (``topk``), K = max(64, the rows' top_k),
    times 4 until every row's cut lies inside them (from a quarter of the row: a sort).
    Sorting a whole row of 49,152 logits takes 3.5 ms on CPU (about as long as a whole
    one-stream decode step of the bundled model), and at the temperatures chat clients use the
    top-p mass lies in a few tokens. The kept sets are those of a full sort (ties at the cut
    aside, which neither order fixes); the mass is summed in the same descending order, its
    normaliser over the whole row.
    """
    vocab = logits.shape[-1]
    if not any(_truncates(k, p, vocab) for k, p in zip(top_k, top_p, strict=True)):
        return logits, None
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    dev = logits.device
    k_t = torch.tensor(ks, device=dev)[:, None]
    nucleus = any(p < 1.0 for p in top_p)
    if nucleus:  # rows without a top-p never drop by mass (not even at fp32's 1 - ulp)
        p_t = torch.tensor([p if p < 1.0 else math.inf for p in top_p], dtype=logits.dtype,
                           device=dev)[:, None]
        whole = _logsumexp_rows(logits)  # rows without a top_k
    K = min(vocab, max([_TOP_CANDIDATES] + [k for k in ks if k < vocab]))
    while True:
        if 4 * K > vocab:  # most of the row: one sort beats topk (and topk again)
            K = vocab
            vals, order = logits.sort(dim=-1, descending=True)
        else:
            vals, order = logits.topk(K, dim=-1)  # [rows, K], descending
        drop = torch.arange(K, device=dev)[None, :] >= k_t
        if not nucleus:
            break
        kept = vals.masked_fill(drop, float("-inf"))
        norm = torch.where(k_t < vocab, torch.logsumexp(kept, dim=-1, keepdim=True), whole)
        probs = (kept - norm).exp()
        # Drop a token when the mass before it already reaches top_p.
        drop |= probs.cumsum(dim=-1) - probs >= p_t
        # Every row's cut inside: its top_k, or a position its mass drops.
        if K == vocab or bool(((k_t[:, 0] <= K) | drop.any(dim=-1)).all()):
            break
        K *= 4
    drop[:, 0] = False
    return vals.masked_fill(drop, float("-inf")), order


def _exponential(shape: tuple[int, ...], device: torch.device,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Exp(1) draws as -log(U), U uniform in [0, 1): never 0, so a token of probability 0 never
    wins the race (U = 0 gives +inf: a loss). 197 us for 49,152 on CPU against 929 for
    ``Tensor.exponential_``."""
    return torch.rand(shape, device=device, generator=generator).log_().neg_()


def _inverse_cdf(z: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``z`` [rows, vocab] (logits / temperature) drawn from its whole
    softmax with one uniform a row: the first token whose cumulative weight exceeds U times the
    row's total. Unseeded rows share one draw; a seeded row takes its U from its own generator.
    Weights are ``_shifted_exp``'s (no fp32 subnormals; at most 1.6e-38 a token). For rows
    with neither top-k nor top-p, about 3x faster than an Exp(1) noise per token and a softmax
    (0.98 against about 3 ms for 16 rows of 49,152). Returns [rows] int64."""
    weights = _shifted_exp(z)[1].cumsum_(dim=-1)
    u = torch.rand((z.shape[0], 1), device=z.device, dtype=z.dtype)
    for j, gen in enumerate(generators):
        if gen is not None:
            u[j] = torch.rand(1, device=z.device, dtype=z.dtype, generator=gen)
    pick = torch.searchsorted(weights, u * weights[:, -1:], right=True)
    return pick[:, 0].clamp_(max=z.shape[-1] - 1)


def _race(z: torch.Tensor, top_k: list[int], top_p: list[float],
          generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``z`` [rows, vocab] (logits / temperature): the exponential race
    over each row's candidates (``_candidates``), or ``_inverse_cdf`` where no row truncates.
    Unseeded rows share one draw; a seeded row takes one noise per token id from its own
    generator, so its token does not depend on the rows beside it. Returns [rows] int64."""
    vals, order = _candidates(z, top_k, top_p)
    if order is None:  # no row truncates: the inverse CDF, one uniform a row
        return _inverse_cdf(vals, generators)
    probs = vals.softmax(dim=-1)
    q = _exponential(tuple(probs.shape), z.device)
    for j, gen in enumerate(generators):
        if gen is not None:
            q[j] = _exponential((z.shape[-1],), z.device, gen)[order[j]]
    return order.gather(1, argmax_rows(probs / q)[:, None])[:, 0]


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
    unseeded rows share one draw and a seeded row only advances its own generator (one noise
    per token id, so its tokens do not depend on its batch). Rows with a top-k or top-p race
    over the tokens those leave (``_candidates``, ``_race``), apart from rows without either
    (drawn by inverse CDF, one uniform a row: ``_inverse_cdf``): unseeded truncated rows draw
    K noises, not one per vocabulary entry (0.93 ms for 49,152 with torch's
    ``exponential_``), and a whole row is never sorted for one of them.
    """
    params = [r.sampling_params for r in rows]
    x = _process(logits, rows)
    # max's indices: argmax's (the first of equal maxima, NaN rows alike); on CPU our op
    # (kernels.cpu_ops.argmax_rows: 43 us of torch's for one row of 49,152).
    tokens = argmax_rows(x)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        dev = x.device
        temps = torch.tensor([params[i].temperature for i in sampled], dtype=x.dtype, device=dev)
        z = x[sampled] / temps[:, None]
        cut = [j for j, i in enumerate(sampled)
               if _truncates(params[i].top_k, params[i].top_p, z.shape[-1])]
        whole = sorted(set(range(len(sampled))) - set(cut))
        for part in (cut, whole):  # rows that truncate race over their candidates only
            if part:
                tokens[[sampled[j] for j in part]] = _race(
                    z[part], [params[sampled[j]].top_k for j in part],
                    [params[sampled[j]].top_p for j in part],
                    [generators[sampled[j]] for j in part])
    token_ids = tokens.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        got = gather_logprobs(logits[want], [token_ids[i] for i in want],
                              [params[i].logprobs or 0 for i in want])
        for i, lp in zip(want, got):
            logprobs[i] = lp
    return SamplerOutput(token_ids, logprobs)
