"""Sampler: greedy, temperature, top-k, top-p, per-request seeds, logit bias, min_tokens,
penalties and logprobs, all batched."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampler import gather_logprobs
from engine.sampler import sample as sample_rows
from engine.sampling_params import SamplingParams


@dataclass
class Row:
    """A request as the sampler reads it."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()
    grammar: object = None
    penalty_state: object = None


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    return sample_rows(logits, [Row(p) for p in params], generators).token_ids


def _logits() -> torch.Tensor:
    return torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.5, 2.9]])


def test_greedy_is_argmax():
    greedy = SamplingParams(temperature=0)
    assert sample(_logits(), [greedy, greedy], [None, None]) == [1, 0]


def test_top_k_1_and_tiny_top_p_reduce_to_argmax():
    gen = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(top_p=0.01)):
        picks = {tuple(sample(_logits(), [params, params], [gen, gen])) for _ in range(50)}
        assert picks == {(1, 0)}


def test_top_p_below_fp32_range_still_keeps_the_argmax():
    # Found by tests/app/test_fuzz_schema.py: top_p=5e-324 must not round to 0 in the fp32
    # comparison, or every token is dropped and the NaN probabilities kill the engine loop.
    gen = torch.Generator().manual_seed(0)
    for top_p in (5e-324, 1e-46, 1e-45):
        params = SamplingParams(temperature=1.0, top_p=top_p)
        assert sample(_logits(), [params, params], [gen, gen]) == [1, 0]


def test_top_k_never_leaves_the_top_k():
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=2.0, top_k=2)
    seen = {sample(_logits()[:1], [params], [gen])[0] for _ in range(300)}
    assert seen == {1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probs = [0.5, 0.3, 0.2]; top_p 0.7 keeps tokens 0 and 1 only.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    gen = torch.Generator().manual_seed(2)
    params = SamplingParams(top_p=0.7)
    seen = {sample(logits, [params], [gen])[0] for _ in range(300)}
    assert seen == {0, 1}


def test_temperature_1_matches_softmax_frequencies():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # p = [0.25, 0.75]
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0)
    draws = [sample(logits, [params], [gen])[0] for _ in range(4000)]
    assert abs(sum(draws) / len(draws) - 0.75) < 0.03


def test_same_seed_same_tokens_other_seed_differs():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0)

    def draws(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [sample(logits, [params], [gen])[0] for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def _sorted_reference(logits, top_k, top_p):
    """The sampler's mask before it ranked only a row's top K, op for op: one full descending
    sort, the top-k, then the top-p mass over the top-k's renormalised fp32 probabilities; the
    kept token ids of each row."""
    vocab = logits.shape[-1]
    kept = []
    for row, k, p in zip(logits, top_k, top_p):
        vals, order = row.sort(descending=True)
        k = k if 0 < k < vocab else vocab
        drop = torch.arange(vocab) >= k
        if p < 1.0:
            probs = vals.masked_fill(drop, float("-inf")).softmax(-1)
            drop |= probs.cumsum(-1) - probs >= p
        drop[0] = False
        kept.append(set(order[~drop].tolist()))
    return kept


def test_candidates_keep_what_a_full_sort_keeps_on_a_vocabulary_sized_row():
    """Real-size rows (49,152 tokens): the kept sets of ``_candidates`` equal a full sort's at
    chat temperatures (a few tokens), with a top-k, and on near-flat rows whose top-p mass
    spans most of the vocabulary (the candidates grow x4, then one sort)."""
    from engine.sampler import _candidates
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(6, 49152, generator=gen) * 3
    cases = [([0] * 6, [0.9] * 6, 0.2), ([0] * 6, [0.95] * 6, 1.0), ([40] * 6, [1.0] * 6, 1.0),
             ([40, 0, 300, 0, 5, 0], [0.5, 0.9, 0.99, 1.0, 0.9, 0.8], 0.7),
             ([0] * 6, [0.9] * 6, 50.0)]  # near flat: most of the row
    for top_k, top_p, temp in cases:
        z = base / temp
        vals, order = _candidates(z, top_k, top_p)
        got = [set(o[torch.isfinite(v)].tolist()) for v, o in zip(vals, order)]
        want = _sorted_reference(z, top_k, top_p)
        for g, w in zip(got, want):
            if len(w) < 1000:
                assert g == w, (top_k, top_p, temp)
            else:  # thousands of fp32 terms: the cut may move by their rounding, a token or two
                assert (g <= w or w <= g) and abs(len(g) - len(w)) <= len(w) // 1000, \
                    (top_k, top_p, temp, len(g), len(w))
    assert max(len(k) for k in want) > 20000  # the near-flat case reached the sort
    assert _candidates(base, [0] * 6, [1.0] * 6)[1] is None  # nothing truncates: the whole row


def test_a_seeded_row_draws_the_same_tokens_alone_and_in_any_batch():
    """A seeded top-p row gets one noise per token id from its own generator, so its token is
    the same alone, beside an untruncated row (the batch then ranks whole rows) and beside a
    row with a small top-k; unseeded rows follow the shared RNG."""
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(3, 49152, generator=gen)
    seeded = Row(SamplingParams(temperature=1.0, top_p=0.9, seed=3))
    others = [Row(SamplingParams(temperature=1.0)), Row(SamplingParams(temperature=1.0, top_k=2))]

    def draws(batch):
        g = torch.Generator().manual_seed(3)
        return [sample_rows(logits[:len(batch)], batch, [g] + [None] * (len(batch) - 1)
                            ).token_ids[0] for _ in range(12)]

    alone = draws([seeded])
    assert len(set(alone)) > 3  # it samples
    assert draws([seeded, others[0]]) == alone
    assert draws([seeded, others[1]]) == alone
    assert draws([seeded, *others]) == alone


def test_rows_without_top_k_or_top_p_draw_from_the_whole_softmax_and_never_a_masked_token():
    """Rows with neither top-k nor top-p are drawn by inverse CDF (one uniform a row): the
    frequencies of the whole softmax, a -inf token never (first, inside, last), and a seeded
    row the same tokens alone and beside other rows."""
    logits = torch.full((1, 1000), float("-inf"))
    logits[0, 1:4] = torch.tensor([0.0, math.log(2.0), math.log(5.0)])  # p = 1/8, 2/8, 5/8
    params = SamplingParams(temperature=1.0, top_p=1.0)
    draws = [sample(logits, [params], [None])[0] for _ in range(4000)]
    assert set(draws) == {1, 2, 3}
    for token, p in ((1, 1 / 8), (2, 2 / 8), (3, 5 / 8)):
        assert abs(draws.count(token) / len(draws) - p) < 0.03, token
    gen = torch.Generator().manual_seed(13)
    wide = torch.randn(3, 49152, generator=gen)
    seeded = Row(SamplingParams(temperature=1.0, top_p=1.0, seed=4))
    beside = [Row(SamplingParams(temperature=0.7, top_p=1.0)),
              Row(SamplingParams(temperature=1.0, top_p=0.5))]

    def draws_of(batch):
        g = torch.Generator().manual_seed(4)
        return [sample_rows(wide[:len(batch)], batch, [g] + [None] * (len(batch) - 1)
                            ).token_ids[0] for _ in range(10)]

    alone = draws_of([seeded])
    assert len(set(alone)) > 5
    assert draws_of([seeded, beside[0]]) == alone == draws_of([seeded, *beside])


def test_top_p_frequencies_follow_the_renormalised_kept_probabilities():
    """probs [0.6, 0.3, 0.1] (and 997 tokens at 1e-9): top_p 0.8 keeps tokens 0 and 1, drawn
    2:1 (the race over the candidates is exact sampling from the truncated distribution)."""
    probs = torch.full((1, 1000), 1e-9)
    probs[0, :3] = torch.tensor([0.6, 0.3, 0.1])
    params = SamplingParams(temperature=1.0, top_p=0.8)
    draws = [sample(probs.log(), [params], [None])[0] for _ in range(3000)]
    assert set(draws) == {0, 1}
    assert abs(draws.count(0) / len(draws) - 2 / 3) < 0.035


def test_rows_with_different_settings_in_one_batch_each_keep_their_own_rules():
    # One batch: greedy, top-k 2, top-p 0.7 and a seeded row; each row obeys only its settings.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]] * 4))
    rows = [Row(SamplingParams(temperature=0)), Row(SamplingParams(top_k=2)),
            Row(SamplingParams(top_p=0.7)), Row(SamplingParams(temperature=2.0, seed=5))]
    gen = torch.Generator().manual_seed(5)
    seen: list[set[int]] = [set(), set(), set(), set()]
    for _ in range(300):
        for i, t in enumerate(sample_rows(logits, rows, [None, None, None, gen]).token_ids):
            seen[i].add(t)
    assert seen[0] == {0}
    assert seen[1] == {0, 1}
    assert seen[2] == {0, 1}
    assert seen[3] == {0, 1, 2}  # 1e-9 at temperature 2 is never drawn in 300 tries


def test_logit_bias_adds_to_the_logit():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    assert sample(logits, [SamplingParams(temperature=0, logit_bias={3: 5.0})], [None]) == [3]
    assert sample(logits, [SamplingParams(temperature=0, logit_bias={1: -100.0})], [None]) == [2]
    # -100 bans a token also when sampling.
    gen = torch.Generator().manual_seed(0)
    banned = SamplingParams(temperature=2.0, logit_bias={1: -100.0, 2: -100.0})
    assert {sample(logits, [banned], [gen])[0] for _ in range(200)} == {0, 3}


def test_min_tokens_masks_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 5.0, 1.0, -1.0]])  # token 1 is "eos" and the argmax
    params = SamplingParams(temperature=0, min_tokens=2)
    row = Row(params, stop_token_ids=frozenset({1}))
    assert sample_rows(logits, [row], [None]).token_ids == [2]
    row.output_token_ids = [2]
    assert sample_rows(logits, [row], [None]).token_ids == [2]
    row.output_token_ids = [2, 2]  # min_tokens reached: eos allowed again
    assert sample_rows(logits, [row], [None]).token_ids == [1]


def test_frequency_and_presence_penalties_follow_openai():
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0]])
    out = [0, 0]  # token 0 twice in the output
    # frequency 0.3: 3.0 - 2 * 0.3 = 2.4 < 2.5 -> token 1; 0.2: 2.6 > 2.5 -> token 0.
    assert sample_rows(logits, [Row(SamplingParams(temperature=0, frequency_penalty=0.3),
                                    output_token_ids=out)], [None]).token_ids == [1]
    assert sample_rows(logits, [Row(SamplingParams(temperature=0, frequency_penalty=0.2),
                                    output_token_ids=out)], [None]).token_ids == [0]
    # presence counts once: 0.6 -> 2.4 -> token 1; 0.4 -> 2.6 -> token 0.
    assert sample_rows(logits, [Row(SamplingParams(temperature=0, presence_penalty=0.6),
                                    output_token_ids=out)], [None]).token_ids == [1]
    assert sample_rows(logits, [Row(SamplingParams(temperature=0, presence_penalty=0.4),
                                    output_token_ids=out)], [None]).token_ids == [0]
    # A negative penalty encourages repetition; prompt tokens are not penalised.
    assert sample_rows(logits, [Row(SamplingParams(temperature=0, frequency_penalty=-1.0),
                                    prompt_token_ids=[0], output_token_ids=[1])],
                       [None]).token_ids == [1]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, 1.5, -1.0, -1.2]])
    # Token 0 in the prompt: 2.0 / 2 = 1.0 < 1.5.
    assert sample_rows(logits, [Row(SamplingParams(temperature=0, repetition_penalty=2.0),
                                    prompt_token_ids=[0])], [None]).token_ids == [1]
    # Only negative logits left: token 2 seen -> -2.0, so token 3 (-1.2) wins.
    neg = torch.tensor([[-1.0, -1.2]])
    assert sample_rows(neg, [Row(SamplingParams(temperature=0, repetition_penalty=2.0),
                                 output_token_ids=[0])], [None]).token_ids == [1]


def test_penalised_and_plain_rows_in_one_batch_do_not_mix():
    logits = torch.tensor([[3.0, 2.5], [3.0, 2.5]])
    rows = [Row(SamplingParams(temperature=0, frequency_penalty=1.0), output_token_ids=[0]),
            Row(SamplingParams(temperature=0), output_token_ids=[0])]
    assert sample_rows(logits, rows, [None, None]).token_ids == [1, 0]


def test_logprobs_are_log_softmax_of_the_raw_logits_with_rank_and_top():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    expected = torch.log_softmax(logits, -1)[0]
    # Greedy with a bias: token 3 is picked, its logprob is still the model's raw one.
    params = SamplingParams(temperature=0, logit_bias={3: 10.0}, logprobs=2)
    out = sample_rows(logits, [Row(params)], [None])
    lp = out.logprobs[0]
    assert out.token_ids == [3] and lp is not None
    assert lp.token_id == 3 and lp.rank == 4
    assert lp.logprob == pytest.approx(expected[3].item(), abs=1e-6)
    assert [t for t, _ in lp.top] == [1, 2]
    assert [v for _, v in lp.top] == pytest.approx([expected[1].item(), expected[2].item()])
    # Rows without logprobs get None; logprobs=0 gives the token's own logprob only.
    out = sample_rows(logits.repeat(2, 1), [Row(SamplingParams(temperature=0)),
                                            Row(SamplingParams(temperature=0, logprobs=0))],
                      [None, None])
    assert out.logprobs[0] is None
    assert out.logprobs[1] is not None and out.logprobs[1].top == ()
    assert out.logprobs[1].rank == 1


def test_gather_logprobs_rows_take_their_own_top_count():
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    got = gather_logprobs(logits, [0, 0], [1, 3])
    assert [lp.rank for lp in got] == [3, 1]
    assert [len(lp.top) for lp in got] == [1, 3]
    assert got[0].top[0][0] == 2 and got[1].top[0][0] == 0


@pytest.mark.parametrize("kwargs, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logit_bias": {1: 101.0}}, "logit_bias"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_out_of_range_settings_are_refused_naming_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_penalty_state_kept_across_steps_equals_a_fresh_count():
    torch.manual_seed(0)
    params = SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=0.3,
                            repetition_penalty=1.4)
    kept = Row(params, prompt_token_ids=[1, 2, 3])
    for step in range(12):
        logits = torch.randn(1, 16)
        fresh = Row(params, prompt_token_ids=[1, 2, 3], output_token_ids=list(
            kept.output_token_ids))
        got = sample_rows(logits, [kept], [None]).token_ids
        assert got == sample_rows(logits, [fresh], [None]).token_ids, step
        kept.output_token_ids.append(got[0])
    assert kept.penalty_state.num_counted == 11
    assert kept.penalty_state.counts.sum().item() == 11
