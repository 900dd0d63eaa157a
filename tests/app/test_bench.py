"""``saltserve bench`` without a server: peers and baselines, the sweep axes, the plots and the
refusals of bad options, against a server double (the end-to-end runs on the real model are in
``test_serve_e2e.py``)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner

from app.bench.baselines import Peer, parse_peer, summarise
from app.bench.profiles import format_profiles, profile_prompts, run_profiles
from app.bench.sweep import match_rate_prompts, parse_values, run_sweep
from app.bench.validate import Gates, Sample, run_validate
from app.cli.main import main

PNG = b"\x89PNG\r\n\x1a\n"


class FakeServer:
    """An OpenAI-compatible server double: one token per word; with caching, a prompt reuses
    the longest run of whole 16-word blocks an earlier prompt opened with (never the last
    token); prefill costs 10 µs per uncached token (slept, so throughput is real). It records
    the most requests it had in flight and each request's ``max_tokens`` and ``ignore_eos``."""

    def __init__(self, url: str = "http://fake", caching: bool = True, block_size: int = 16):
        self.url, self.model, self.metrics_token = url, "fake-model", None
        self.caching, self.block_size = caching, block_size
        self.blocks: set[tuple[str, ...]] = set()
        self.lock = threading.Lock()
        self.model_dir = url  # as HFGenerate reports its model
        self.in_flight = self.peak_in_flight = 0
        self.asked: list[tuple[int, bool]] = []  # (max_tokens, ignore_eos) per request

    def tokenize(self, text: str) -> list[str]:
        return text.split()

    def complete(self, prompt: str, max_tokens: int, ignore_eos: bool = False) -> Sample:
        words = prompt.split()
        cached = 0
        with self.lock:
            self.asked.append((max_tokens, ignore_eos))
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            if self.caching:
                b = self.block_size
                while cached + b < len(words) and tuple(words[:cached + b]) in self.blocks:
                    cached += b
                self.blocks.update(tuple(words[:n]) for n in range(b, len(words) + 1, b))
        ttft = 1e-5 * (len(words) - cached)
        time.sleep(max(ttft, 0.002))  # long enough for concurrent requests to overlap
        with self.lock:
            self.in_flight -= 1
        return Sample(ttft, ttft + 1e-4 * max_tokens, len(words), cached, max_tokens)

    def cache_config(self) -> dict[str, str]:
        return {"block_size": str(self.block_size)}


def test_peer_specs_parse_and_bad_ones_are_refused():
    assert parse_peer("vllm=http://127.0.0.1:8001/v1,sk-x,SmolLM2") == Peer(
        "vllm", "http://127.0.0.1:8001", "sk-x", "SmolLM2")
    assert parse_peer("llamacpp = https://h:9/ ") == Peer("llamacpp", "https://h:9", "EMPTY",
                                                          None)
    for bad in ("http://127.0.0.1:8001", "vllm=", "=http://h", "vllm=ftp://h",
                "vllm=http://h,k,m,extra", "hf_generate=http://h", "caching off=http://h"):
        with pytest.raises(ValueError):
            parse_peer(bad)
    # On the command line: a clear usage error before anything is sent.
    r = CliRunner().invoke(main, ["bench", "profiles", "--url", "http://127.0.0.1:9",
                                  "--api-key", "k", "--api-key-no-cache", "k2",
                                  "--peer", "no-url-here"])
    assert r.exit_code == 2 and "NAME=URL" in r.output
    r = CliRunner().invoke(main, ["bench", "profiles", "--url", "http://127.0.0.1:9",
                                  "--api-key", "k", "--api-key-no-cache", "k2",
                                  "--peer", "a=http://h", "--peer", "a=http://g"])
    assert r.exit_code == 2 and "peer names must differ" in r.output
    r = CliRunner().invoke(main, ["bench", "working-set", "--url", "http://127.0.0.1:9",
                                  "--api-key", "k", "--peer", "saltserve=http://h"])
    assert r.exit_code == 2 and "peer names must differ" in r.output  # ours is "saltserve"


def test_profiles_run_peers_and_the_generate_baseline_on_the_same_prompts():
    on, off = FakeServer(), FakeServer(caching=False)
    peer = FakeServer("http://peer", block_size=32)
    hf = FakeServer("hf", caching=False)
    report = run_profiles(on, off, requests=4, concurrency=2, max_tokens=3,
                          profiles=("shared_system", "unique"), peers={"peer": peer}, hf=hf,
                          nonce="n1")
    shared, unique = report["profiles"]["shared_system"], report["profiles"]["unique"]
    # Every run saw the same prompts: the same prompt tokens.
    assert (shared["on"]["prompt_tokens"] == shared["off"]["prompt_tokens"]
            == shared["peers"]["peer"]["prompt_tokens"] == shared["hf_generate"]["prompt_tokens"])
    assert shared["on"]["hit_rate"] > 0.6 and shared["peers"]["peer"]["hit_rate"] > 0.6
    assert shared["off"]["hit_rate"] == shared["hf_generate"]["hit_rate"] == 0
    assert unique["on"]["hit_rate"] < 0.05
    assert set(shared["ours_vs"]) == {"caching off", "peer", "hf_generate"}
    assert shared["ours_vs"]["hf_generate"]["throughput"] > 1
    assert shared["throughput_on_vs_off"] == shared["ours_vs"]["caching off"]["throughput"]
    assert report["peers"]["peer"]["cache_config"]["block_size"] == "32"
    text = format_profiles(report)
    assert "block size: ours 16, peer 32 (differs" in text
    assert "ours (cache on) vs hf_generate: throughput" in text
    # Blocks reused over blocks requested, each at its own server's block size.
    assert 0.6 < shared["on"]["block_hit_rate"] <= shared["on"]["hit_rate"]
    assert shared["peers"]["peer"]["block_size"] == 32 and shared["on"]["block_size"] == 16
    assert shared["off"]["block_hit_rate"] == 0
    assert "blk hit" in text and "evict/req" in text


def test_block_hit_rate_counts_whole_blocks_reused_over_blocks_requested():
    # 40 tokens = 3 blocks of 16 (the last one partial), 32 cached = 2 reused; 16 tokens = 1
    # block, none cached; 20 tokens = 2 blocks, 17 cached = 1 whole block: (2 + 0 + 1) / 6.
    samples = [Sample(0.1, 0.2, 40, 32, 4), Sample(0.1, 0.2, 16, 0, 4),
               Sample(0.1, 0.2, 20, 17, 4)]
    out = summarise(samples, 1.0, block_size=16)
    assert out["block_hit_rate"] == pytest.approx(3 / 6)
    assert out["hit_rate"] == pytest.approx(49 / 76)  # tokens, not blocks
    assert summarise(samples, 1.0)["block_hit_rate"] is None  # no block size, no figure


def test_seed_and_nonce_replay_the_same_prompts():
    """``--seed`` with ``--run-nonce``: a later run sends exactly the earlier run's prompts, so
    on the same server they hit the cache it left; another nonce or seed sends new ones."""
    for name in ("shared_system", "rag_document", "few_shot", "unique"):
        assert profile_prompts(name, 4, 7, "n") == profile_prompts(name, 4, 7, "n")
        assert profile_prompts(name, 4, 7, "n") != profile_prompts(name, 4, 8, "n")
        assert profile_prompts(name, 4, 7, "n") != profile_prompts(name, 4, 7, "m")
    server = FakeServer()
    first = run_profiles(server, FakeServer(caching=False), requests=3, concurrency=1,
                         max_tokens=1, seed=5, profiles=("unique",), nonce="again")
    again = run_profiles(server, FakeServer(caching=False), requests=3, concurrency=1,
                         max_tokens=1, seed=5, profiles=("unique",), nonce="again")
    other = run_profiles(server, FakeServer(caching=False), requests=3, concurrency=1,
                         max_tokens=1, seed=5, profiles=("unique",), nonce="other")
    assert first["profiles"]["unique"]["on"]["hit_rate"] < 0.05
    assert again["profiles"]["unique"]["on"]["hit_rate"] > 0.9  # the very same prompts
    assert other["profiles"]["unique"]["on"]["hit_rate"] < 0.05
    assert first["nonce"] == again["nonce"] == "again" and first["seed"] == 5


def test_validate_gates_are_configurable():
    """The seed's gates on a server double: the defaults pass; a stricter p99 gate fails; a
    replayed run (same seed and nonce) finds its cold prefixes cached, which ``require_cold``
    flags and ``--no-require-cold`` lets through."""
    server = FakeServer()
    report = run_validate(server, rounds=2, seed=1, run_nonce="v")
    assert report["passed"], report["gates"]
    g = report["gates"]
    assert g["warm_drop"]["percent"] == pytest.approx(100 * g["warm_drop"]["value"])
    assert g["warm_drop"]["value"] > 0.9 and g["p99"]["gate"] == "warm p99 <= 1 x cold p99"
    strict = run_validate(FakeServer(), rounds=2, seed=1, run_nonce="v",
                          gates=Gates(max_p99_ratio=0.0))
    assert not strict["passed"] and not strict["gates"]["p99"]["passed"]
    assert strict["gates"]["warm_drop"]["passed"] and strict["gates"]["cold_is_cold"]["passed"]
    replay = run_validate(server, rounds=2, seed=1, run_nonce="v")
    assert min(replay["cached_tokens"]["cold"]) > 700  # the same prefixes, cached before
    assert not replay["gates"]["cold_is_cold"]["passed"] and not replay["passed"]
    lax = run_validate(server, rounds=2, seed=1, run_nonce="v", gates=Gates(require_cold=False))
    assert lax["gates"]["cold_is_cold"]["passed"] and lax["gates"]["cold_is_cold"]["gate"] == "off"
    fresh = run_validate(server, rounds=2, seed=1, run_nonce="w")
    assert fresh["cached_tokens"]["cold"] == [0, 0] and fresh["passed"]


def test_validate_warms_up_the_first_long_prefill_before_round_0():
    """A server whose first long prompt pays a one-time cost (allocator growth, kernel set-up)
    would make round 0's cold TTFT alone slow and the negative control fast against it: the
    warm-up sends a prompt as long as the test's, on a prefix of its own, before round 0."""

    class FirstLongIsSlow(FakeServer):
        long_prompts = 0

        def complete(self, prompt, max_tokens, ignore_eos=False):
            sample = super().complete(prompt, max_tokens, ignore_eos)
            if sample.prompt_tokens >= 500:
                self.long_prompts += 1
                if self.long_prompts == 1:  # 5x a 1,000-token prefill, once
                    sample.ttft_s += 0.05
            return sample

    server = FirstLongIsSlow()
    report = run_validate(server, rounds=1, seed=2, run_nonce="wu")
    assert server.long_prompts == 4  # the warm-up, cold, warm, negative
    assert report["cached_tokens"]["cold"] == [0]  # the warm-up's prefix shares no block
    assert report["gates"]["negative_control"]["value"]["ttft_ratio_to_cold"] > 0.95
    assert report["passed"], report["gates"]


def test_rag_profile_reuses_each_of_its_three_documents():
    """``rag_document``: requests cycle through 3 documents, so with caching on request i + 3
    reuses request i's whole document and the first three are cold: 3 of 6 requests hit about
    all of their prompt (the question is the only new part); caching off never hits."""
    prompts = profile_prompts("rag_document", 6, 0, "r1")
    docs = [p.split("\nQuestion")[0] for p in prompts]
    assert docs[:3] == docs[3:] and len(set(docs)) == 3 and len(set(prompts)) == 6
    report = run_profiles(FakeServer(), FakeServer(caching=False), requests=6, concurrency=1,
                          max_tokens=2, profiles=("rag_document",), nonce="r1")
    rag = report["profiles"]["rag_document"]
    assert 0.4 < rag["on"]["hit_rate"] < 0.5 and rag["off"]["hit_rate"] == 0
    assert rag["on"]["prompt_tokens"] == rag["off"]["prompt_tokens"]

def test_profile_rounds_interleave_on_and_off_and_pool_them():
    """``--rounds``: each round a new prompt set (its own nonce), off and on in alternating
    order, peers every round, HF generate once (round 0's prompts); figures pool the rounds."""
    log: list[tuple[str, str]] = []  # (server, the prompt's opening "Run NONCE.")

    class Logged(FakeServer):
        def complete(self, prompt, max_tokens, ignore_eos=False):
            log.append((self.url, prompt.split()[1]))
            return super().complete(prompt, max_tokens, ignore_eos)

    on, off = Logged("on"), Logged("off", caching=False)
    peer, hf = Logged("peer"), Logged("hf", caching=False)
    report = run_profiles(on, off, requests=3, concurrency=1, max_tokens=2,
                          profiles=("shared_system",), peers={"peer": peer}, hf=hf,
                          nonce="n", rounds=3)
    sent = [entry for entry in log if entry[1] != "say"]  # not the warm-ups
    servers = [url for url, _ in sent]
    assert servers == (["off"] * 3 + ["on"] * 3 + ["peer"] * 3  # round 0
                       + ["on"] * 3 + ["off"] * 3 + ["peer"] * 3  # round 1: on first
                       + ["off"] * 3 + ["on"] * 3 + ["peer"] * 3
                       + ["hf"] * 3)  # once, on round 0's prompts
    assert [n for url, n in sent if url == "hf"] == ["n."] * 3
    assert [n for url, n in sent if url == "on"] == ["n."] * 3 + ["n-1."] * 3 + ["n-2."] * 3
    shared = report["profiles"]["shared_system"]
    assert shared["on"]["requests"] == shared["off"]["requests"] == 9
    assert shared["peers"]["peer"]["requests"] == 9 and shared["hf_generate"]["requests"] == 3
    # A new nonce per round: each round's first request misses, the other two hit.
    assert 0.5 < shared["on"]["hit_rate"] < 0.67 and shared["off"]["hit_rate"] == 0
    assert len(shared["rounds_on_vs_off"]) == 3 and report["rounds"] == 3
    assert "throughput on/off per round:" in format_profiles(report)
    one = run_profiles(FakeServer(), FakeServer(caching=False), requests=2, concurrency=1,
                       max_tokens=1, profiles=("unique",), nonce="u")
    assert "rounds_on_vs_off" not in one["profiles"]["unique"]
    with pytest.raises(ValueError, match="rounds"):
        run_profiles(on, off, rounds=0)


def test_match_rate_prompts_share_the_prefix_in_the_asked_proportion():
    shared, prompts = match_rate_prompts(0.25, 8, 40, seed=3, nonce="n")
    assert sum(p.startswith(shared + "\n") for p in prompts) == 2
    assert len({p.split("\n")[0] for p in prompts}) == 7  # the shared one and six of their own
    assert match_rate_prompts(0.25, 8, 40, seed=3, nonce="n")[1] == prompts  # seeded


def test_client_side_sweep_axes_measure_on_and_off():
    on, off = FakeServer(), FakeServer(caching=False)
    match = run_sweep("match_rate", (0.0, 1.0), on, off, requests=4, prefix_tokens=64,
                      nonce="m")
    none, every = match["points"]
    assert none["on"]["hit_rate"] == 0 and every["on"]["hit_rate"] > 0.7
    assert none["off"]["hit_rate"] == every["off"]["hit_rate"] == 0
    for c in (1, 3):  # each point really runs at its concurrency
        one_on, one_off = FakeServer(), FakeServer(caching=False)
        conc = run_sweep("concurrency", (c,), one_on, one_off, requests=6, max_tokens=5,
                         nonce=f"c{c}")
        assert one_on.peak_in_flight == one_off.peak_in_flight == c
        assert conc["points"][0]["on"]["hit_rate"] > 0.5
        assert set(one_on.asked[1:]) == {(5, False)}  # after the warm-up
    on2, off2 = FakeServer(), FakeServer(caching=False)
    out = run_sweep("output_length", (1, 7), on2, off2, requests=2, nonce="o")
    # Each point asks for exactly its length, past EOS, at the default concurrency of 4.
    assert off2.asked == [(1, True), (1, True), (7, True), (7, True)]
    assert [p["on"]["output_tokens_per_s"] > 0 for p in out["points"]] == [True, True]
    assert out["points"][1]["on"]["requests"] == 2 and out["concurrency"] == 4
    with pytest.raises(ValueError, match="needs a server"):
        run_sweep("concurrency", (1,), None, None)
    with pytest.raises(ValueError, match="needs a model"):
        run_sweep("pool_size", (64,))


def test_sweep_values_are_checked_per_axis():
    assert parse_values("match_rate", "0,0.5,1") == (0.0, 0.5, 1.0)
    assert parse_values("pool_size", "80,160") == (80, 160)
    for axis, bad in (("match_rate", "1.5"), ("concurrency", "0"), ("output_length", "2.5"),
                      ("prefix_length", "a,b")):
        with pytest.raises(ValueError):
            parse_values(axis, bad)
    r = CliRunner().invoke(main, ["bench", "sweep", "--axis", "match_rate", "--values", "2",
                                  "--api-key", "k", "--api-key-no-cache", "k2"])
    assert r.exit_code == 2 and "between 0 and 1" in r.output
    r = CliRunner().invoke(main, ["bench", "sweep", "--axis", "concurrency"])
    assert r.exit_code == 2 and "give --api-key and --api-key-no-cache" in r.output


def test_every_plot_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    from app.bench.plots import plot_profiles, plot_sweep, plot_tenants, plot_working_set
    from app.bench.working_set import run_working_set

    on, off = FakeServer(), FakeServer(caching=False)
    profiles = run_profiles(on, off, requests=2, concurrency=1, max_tokens=2,
                            profiles=("few_shot", "unique"), peers={"p": FakeServer()},
                            hf=FakeServer(caching=False), nonce="p")
    plot_profiles(json.loads(json.dumps(profiles)), tmp_path / "profiles.png")
    for axis, values in (("match_rate", (0.0, 1.0)), ("concurrency", (1, 2)),
                         ("output_length", (1, 2))):
        plot_sweep(run_sweep(axis, values, on, off, requests=2, prefix_tokens=32, nonce=axis),
                   tmp_path / f"{axis}.png")
    plot_sweep({"axis": "pool_size", "model": "m", "points": [
        {"value": 80, "on": {"hit_rate": 0.0}}, {"value": 240, "on": {"hit_rate": 0.5}}]},
        tmp_path / "pool_size.png")
    plot_tenants({"flood_requests": 8, "per_tenant": {
        "bench-x-t0": {"hit_rate": 0.98, "evicted_by_flooder": 0},
        "bench-x-t1": {"hit_rate": 0.97, "evicted_by_flooder": 3}}}, tmp_path / "tenants.png")
    plot_working_set(json.loads(json.dumps(run_working_set(
        {"whole": FakeServer(), "small": LRUServer(capacity=2)}, prompts=4, tokens=100,
        rounds=2, concurrency=1, max_tokens=2, seed=0, nonce="w"))),
        tmp_path / "working_set.png")
    for name in ("profiles", "match_rate", "concurrency", "output_length", "pool_size",
                 "tenants", "working_set"):
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == PNG and png.stat().st_size > 10_000, name


class LRUServer(FakeServer):
    """A ``FakeServer`` whose cache holds the blocks of at most ``capacity`` prompts (least
    recently used out first): a pool too small for the working set."""

    def __init__(self, capacity: int, **kw):
        super().__init__(**kw)
        self.capacity, self.order = capacity, []

    def complete(self, prompt: str, max_tokens: int, ignore_eos: bool = False) -> Sample:
        head = prompt.split("\n\n")[0]
        sample = super().complete(prompt, max_tokens, ignore_eos)
        with self.lock:
            if head in self.order:
                self.order.remove(head)
            self.order.append(head)
            if len(self.order) > self.capacity:
                gone = tuple(self.order.pop(0).split()[:7])  # the prompt's own opening
                self.blocks = {b for b in self.blocks if b[:7] != gone}
        return sample


def test_working_set_rounds_show_a_cache_that_holds_it_and_one_that_does_not():
    from app.bench.working_set import format_working_set, run_working_set

    whole, small = FakeServer(url="http://whole"), LRUServer(4, url="http://small")
    report = run_working_set({"whole": whole, "small": small}, prompts=8, tokens=200,
                             rounds=3, concurrency=1, max_tokens=2, seed=1, nonce="n")
    rates = {name: [r["hit_rate"] for r in s["rounds"]]
             for name, s in report["servers"].items()}
    assert rates["whole"][0] < 0.1 and min(rates["whole"][1:]) > 0.85  # all but the tail
    assert max(rates["small"]) < 0.1  # LRU: each prompt evicted just before it comes back
    assert report["servers"]["whole"]["warm_wall_ratio"] == 1.0
    assert all(ignore_eos and n == 2 for n, ignore_eos in whole.asked)
    text = format_working_set(report)
    assert "| small | 3 | 0.0" in text and "small: warm rounds' wall time" in text
