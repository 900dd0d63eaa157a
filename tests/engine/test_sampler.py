"""Sampler: greedy, temperature, top-k, top-p and per-request seeds."""

from __future__ import annotations

import math

import torch

from engine.sampler import sample
from engine.sampling_params import SamplingParams


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
    # Regression (found by tests/app/test_fuzz_schema.py): top_p=5e-324 rounded to 0 in the fp32
    # comparison, dropped every token and the NaN probabilities killed the engine loop.
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
