"""``saltserve bench ... --in-process``: the bench drives our engine in its own process through
the engine interface (no server, no keys), on the real bundled model."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from app.bench.in_process import InProcessEngine
from app.cli.main import main
from engine.config import EngineConfig


def test_bench_validate_in_process_passes_on_the_real_model(model_dir, tmp_path):
    out = tmp_path / "validate.json"
    r = CliRunner().invoke(main, ["bench", "validate", "--in-process", "--model-dir",
                                  str(model_dir), "--rounds", "1", "--max-tokens", "2",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert report["passed"] and report["url"] == "in-process"
    assert report["model"] == model_dir.name and report["block_size"] == 16
    assert report["device"] == "cpu" and report["num_gpu_blocks"] > 0
    cached = report["cached_tokens"]
    assert cached["cold"] == [0] and cached["negative"] == [0]
    # The warm prompt reuses every whole block of the shared prefix (at least 1,000 tokens).
    assert cached["warm"][0] >= 992 and cached["warm"][0] % 16 == 0


def test_bench_profiles_in_process_reads_the_engines_own_counters(model_dir, tmp_path):
    """Caching on hits the shared system prompt, the "off" tenant never does (and never hits
    the "on" tenant's blocks), and the engine's counters agree with the responses."""
    out = tmp_path / "profiles.json"
    r = CliRunner().invoke(main, ["bench", "profiles", "--in-process", "--model-dir",
                                  str(model_dir), "--profile", "shared_system", "--requests",
                                  "2", "--concurrency", "1", "--max-tokens", "2", "--out",
                                  str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    shared = report["profiles"]["shared_system"]
    assert shared["off"]["cached_tokens"] == 0  # caching off: not even its own repeats hit
    # The off run went first; the on run's first request is cold, its repeat hits.
    assert 0.4 < shared["on"]["hit_rate"] < 0.5
    metrics = shared["on"]["metrics"]
    assert metrics["hit_rate_agrees"] and metrics["evicted_blocks_per_request"] == 0
    assert 0 < metrics["kv_usage_peak"] <= 1
    assert report["cache_config"]["block_size"] == "16"
    assert report["cache_config"]["cache_dtype"] == "float32"


def test_a_refused_request_fails_alone_and_the_engine_goes_on(model_dir):
    """A request the engine refuses (over max_model_len) is a RuntimeError for its caller; the
    next one is served, and no block stays pinned."""
    with InProcessEngine(EngineConfig(model=str(model_dir), max_model_len=64)) as engine:
        ep = engine.endpoint("t")
        with pytest.raises(RuntimeError, match="max_model_len|64"):
            ep.complete("word " * 200, 2)
        sample = ep.complete("Hello", 2)
        assert sample.completion_tokens == 2 and sample.prompt_tokens > 0
        stats = engine.run(engine.client.stats())
        assert stats.num_blocks_used == 0
