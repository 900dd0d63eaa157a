"""Greedy output of our engine == Hugging Face's greedy decoding (fp32, CPU) on the bundled
model, token for token: cold, warm, caching off, chunked prefill, and under preemption."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.llm import run_to_completion
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from kernels import cpu_linear, cpu_ops
from kernels.cpu import build

MAX_NEW = 40
SHARED = ("You are a careful assistant for a company that builds bridges. Answer with facts, "
          "cite sources when you can, and keep answers short.\n\n")
PROMPTS = [
    SHARED + "The history of the Roman Empire begins",
    SHARED + "def fibonacci(n):\n",
    "Here is a long story about a dragon who lived in a cave near the sea. One day,",
    "<|im_start|>user\nExplain photosynthesis in detail.<|im_end|>\n<|im_start|>assistant\n",
    SHARED + "1, 2, 3, 4, 5,",
]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


def hf_greedy(hf, prompts: list[list[int]], outputs: list[list[int]], max_new: int,
              ignore_eos: bool = False) -> list[list[int]]:
    """Hugging Face's greedy continuation of each prompt (fp32), checked along ``outputs``.

    One forward over each prompt + its output (a right-padded batch) gives HF's argmax after
    every prefix; each row is cut after its first eos (unless ``ignore_eos``) or at ``max_new``
    tokens. Where ``outputs`` are HF's greedy tokens this is exactly what
    ``generate(do_sample=False)`` returns (greedy decoding is the argmax after each prefix), in
    one forward instead of ``max_new`` steps. Where an output first departs from HF (a
    different token, a missed or early stop), the row holds HF's choice there instead, so
    ``outputs == hf_greedy(...)`` fails at that token. Shapes: token ids, lists of ints.
    """
    eos = set(hf.generation_config.eos_token_id if isinstance(
        hf.generation_config.eos_token_id, list) else [hf.generation_config.eos_token_id])
    rows = [p + o for p, o in zip(prompts, outputs, strict=True)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        argmax = hf(ids, attention_mask=mask).logits.argmax(-1).tolist()
    refs = []
    for p, o, best in zip(prompts, outputs, argmax, strict=True):
        # best[i] is HF's choice after the first i + 1 tokens: prompt + o[:k] -> best[len(p)-1+k]
        ref = best[len(p) - 1:len(p) + len(o)][:max_new]
        if not ignore_eos:
            ref = ref[:next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))]
        refs.append(ref)
    return refs


@pytest.fixture(scope="module")
def hf_outputs(make_llm_engine, hf_model, prompt_ids) -> list[list[int]]:
    """HF's greedy tokens for PROMPTS (``MAX_NEW``), found along a cold run of our engine and
    checked by ``hf_greedy``: one HF forward (1.4 s here) instead of ``generate`` (7.5 s)."""
    ours, _ = run(make_llm_engine(), prompt_ids, "ref")
    outs = hf_greedy(hf_model, prompt_ids, ours, MAX_NEW)
    assert ours == outs, "our engine's greedy tokens differ from Hugging Face's"
    assert all(len(o) >= 32 for o in outs), "reference prompts must yield >= 32 new tokens"
    return outs


def test_hf_greedy_catches_a_wrong_token_an_early_stop_and_a_missed_stop(hf_model, tokenizer,
                                                                       prompt_ids, hf_outputs):
    """The check itself can fail: each kind of departure from HF's greedy tokens shows."""
    right = hf_outputs[0][:8]
    eos = tokenizer.eos_token_id
    wrong = right[:3] + [right[3] + 1] + right[4:]
    early = right[:7]  # stops before max_new without an eos
    early_eos = right[:5] + [eos]  # an eos HF would not choose
    refs = hf_greedy(hf_model, [prompt_ids[0]] * 4, [right, wrong, early, early_eos], 8)
    assert refs[0] == right
    assert refs[1][:4] == right[:4] != wrong[:4]  # HF's own token where ours departed
    assert refs[2] == right != early  # HF goes on past the early stop
    assert refs[3][5] == right[5] != eos
    # HF ends this answer (its greedy next token is eos): a run past it shows as a missed stop.
    done = tokenizer.encode("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
                            "2+2 equals 4.")
    assert hf_greedy(hf_model, [done, done], [[eos], [right[0], eos]], 8) == [[eos], [eos]]


def run(engine, prompt_ids, tag: str, max_new: int = MAX_NEW
        ) -> tuple[list[list[int]], list[int]]:
    """Runs all prompts concurrently (continuous batching). Returns (tokens, cached tokens)."""
    params = SamplingParams(max_tokens=max_new, temperature=0)
    results = run_to_completion(
        engine, [EngineRequest(f"{tag}-{i}", tuple(ids), params, tenant_id="t")
                 for i, ids in enumerate(prompt_ids)],
        on_step=lambda _: engine.kv_cache_manager.check_integrity(), max_steps=10_000)
    pool = engine.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks, "idle engine must hold no blocks"
    return [r.token_ids for r in results], [r.num_cached_tokens for r in results]


def test_cold_and_warm_match_hf(make_llm_engine, prompt_ids, hf_outputs):
    engine = make_llm_engine()
    cold, cold_cached = run(engine, prompt_ids, "cold")
    assert cold == hf_outputs
    warm, warm_cached = run(engine, prompt_ids, "warm")
    assert warm == hf_outputs
    # Every warm prompt reuses all its full blocks but the one holding its last token.
    assert warm_cached == [16 * ((len(ids) - 1) // 16) for ids in prompt_ids]
    assert sum(warm_cached) > sum(cold_cached)


def test_prefix_caching_off_matches_hf(make_llm_engine, prompt_ids, hf_outputs):
    engine = make_llm_engine(enable_prefix_caching=False)
    out, cached = run(engine, prompt_ids, "off")
    assert out == hf_outputs and cached == [0] * len(prompt_ids)
    # The repeat gets no hit and decodes on reused (unhashed) blocks; 8 tokens show both.
    again, cached = run(engine, prompt_ids, "off2", max_new=8)
    assert again == [o[:8] for o in hf_outputs] and cached == [0] * len(prompt_ids)
    assert engine.block_pool.get_num_cached_blocks() == 0


def test_chunked_prefill_matches_hf(make_llm_engine, prompt_ids, hf_outputs):
    engine = make_llm_engine(max_num_batched_tokens=16, enable_prefix_caching=False)
    seen_chunks = []
    orig = engine.runner.execute

    def spy(sched):
        seen_chunks.extend(s.num_new_tokens for s in sched.scheduled if s.num_new_tokens > 1)
        assert sched.total_num_scheduled_tokens <= 16
        return orig(sched)

    engine.runner.execute = spy
    out, _ = run(engine, prompt_ids, "chunk")
    assert out == hf_outputs
    assert len(seen_chunks) >= 2 * len(prompt_ids)  # every prompt (>16 tokens) took >= 2 chunks


def test_preemption_with_tiny_pool_matches_hf(make_llm_engine, prompt_ids, hf_outputs):
    engine = make_llm_engine(num_gpu_blocks_override=16, max_model_len=256)
    out, _ = run(engine, prompt_ids, "tiny")
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.scheduler.stats.num_recomputed_tokens > 0
    assert out == hf_outputs


@pytest.mark.parametrize("path", ["cascade", "kernel", "fused"])
def test_cascade_decode_over_a_long_shared_prefix_matches_hf(make_llm_engine, tokenizer,
                                                             hf_model, monkeypatch, path,
                                                             fused_layer_calls):
    """Decodes sharing a long prefix: without our CPU kernels the per-op layers split attention
    at it (cascade); with them our decode kernel reads the shared chunks once itself, from the
    per-op layers and from the fused ones (kernels/cpu/decode_layer.cpp)."""
    from engine.attention import torch_backend as attention

    if path == "cascade":
        monkeypatch.setitem(build._state, "ok", False)
    elif not cpu_linear.load():
        pytest.skip("our CPU kernels are not built")
    calls = []
    real = attention._decode_cascade
    monkeypatch.setattr(attention, "_decode_cascade",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    fused_calls = fused_layer_calls
    kernel_calls = []
    real_kernel = cpu_ops.decode_attention
    monkeypatch.setattr(cpu_ops, "decode_attention",
                        lambda *a, **k: kernel_calls.append(1) or real_kernel(*a, **k))
    system = " ".join(f"Rule {i}: keep bridge {i} inspected and painted." for i in range(24))
    prompts = [tokenizer.encode(system + q) for q in
               (" Summary:", " Question: which rule is first?", " The most important rule is",
                " In short,")]
    assert min(map(len, prompts)) > 280
    engine = make_llm_engine()
    engine.model.policy = replace(engine.model.policy, fused_decode=path == "fused")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = run_to_completion(engine, [EngineRequest(f"cascade-{i}", tuple(ids), params,
                                                   tenant_id="t")
                                     for i, ids in enumerate(prompts)])
    outputs = [r.token_ids for r in got]
    assert outputs == hf_greedy(hf_model, prompts, outputs, 8, ignore_eos=True)
    assert all(len(o) == 8 for o in outputs)
    if path == "fused":  # every layer of a step in one call, no cascade split
        assert not calls and len(fused_calls) >= 30 * 6
        assert {kind for kind, _ in fused_calls} == {"whole"}
    elif path == "kernel":
        assert not calls and not fused_calls and len(kernel_calls) >= 30 * 6
    else:
        assert len(calls) >= 30 * 6  # every layer of (nearly) every decode step: cascade


def test_shared_chunk_decode_keeps_tenants_apart_and_matches_hf(make_llm_engine, tokenizer,
                                                                hf_model, fused_layer_calls):
    """Two tenants send the same long system prompt in one batch. Our decode kernel attends a
    chunk once for every sequence that holds it in the same blocks; salted hashes give tenant
    B its own blocks, so within a step A's three decodes share their prefix blocks and B's
    never share one with A's. Every output is HF's greedy one; B's first request gets 0 cached
    tokens on the prompt A has cached, and B's own repeat does hit."""
    if not cpu_linear.load():
        pytest.skip("our CPU kernels are not built")
    system = " ".join(f"Rule {i}: keep bridge {i} inspected and painted." for i in range(24))
    questions = (" Summary:", " The first rule is", " In short,")
    prompts = [tokenizer.encode(system + q) for q in questions]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    salt_a, salt_b = b"a" * 16, b"b" * 16
    engine = make_llm_engine()
    run_to_completion(engine, [EngineRequest("warm-a", tuple(prompts[0]), params,
                                             tenant_id="a", cache_salt=salt_a)])
    batch = [EngineRequest(f"{t}-{i}", tuple(p), params, tenant_id=t, cache_salt=salt)
             for t, salt in (("a", salt_a), ("b", salt_b)) for i, p in enumerate(prompts)]
    got = run_to_completion(engine, batch)
    tables = [[meta.block_tables[i, :meta.seq_lens_cpu[i] // 16].tolist() for i in range(6)]
              for _, meta in fused_layer_calls if meta.num_seqs == 6][:1]
    outputs = [r.token_ids for r in got]
    assert outputs == hf_greedy(hf_model, prompts * 2, outputs, 6, ignore_eos=True)
    assert all(r.num_cached_tokens > 256 for r in got[:3])
    assert got[3].num_cached_tokens == 0  # B's first: none of A's cached blocks
    (seen,) = tables  # the six decode rows of one step, in the scheduler's order
    shared = len(prompts[0]) // 16 - 1
    classes: dict[tuple, list[list[int]]] = {}
    for t in seen:
        classes.setdefault(tuple(t[:shared]), []).append(t)
    assert max(map(len, classes.values())) >= 3  # A's three decodes hold one prefix's blocks
    sets = [{b for t in rows for b in t} for rows in classes.values()]
    assert all(not (x & y) for i, x in enumerate(sets) for y in sets[i + 1:])  # none across
    (again,) = run_to_completion(engine, [EngineRequest("b-again", tuple(prompts[1]), params,
                                                        tenant_id="b", cache_salt=salt_b)])
    assert again.num_cached_tokens > 256 and again.token_ids == outputs[4]
