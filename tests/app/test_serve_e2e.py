"""End to end: ``saltserve serve`` as a real process (uvicorn), driven by the official OpenAI SDK."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pydantic
import pytest
from serve_process import serve

from kernels import cpu_linear


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("serve")
    # 2,048-token context and 256 blocks: room for `bench validate`'s 1,000-token prefixes.
    with serve(model_dir, data_dir, "--log-format", "json", "--replica-id", "r1",
               "--max-model-len", "2048", "--num-gpu-blocks-override", "256") as proc:
        yield proc.base, data_dir
    assert "Traceback" not in proc.output, proc.output
    # stdout is a pipe (a log), not a terminal: the demo key's file is named, the key never.
    key = (data_dir / "demo-api-key").read_text().strip()
    assert key not in proc.output and "not printed: stdout is not a terminal" in proc.output
    # JSON log lines (click's own messages stay plain text), uvicorn's access log included,
    # each with the replica id, and the request and tenant ids while serving a request.
    logs = [json.loads(line) for line in proc.output.splitlines() if line.startswith("{")]
    assert logs, proc.output[-2000:]
    assert all(r["replica_id"] == "r1" and {"timestamp", "level", "logger",
                                                      "message"} <= set(r) for r in logs)
    access = [r for r in logs if r["logger"] == "uvicorn.access"]
    served = [r for r in access if r["path"] in ("/v1/chat/completions", "/v1/completions")
              and r["status"] == 200]
    assert served and all(len(r["request_id"]) == 32 and len(r["tenant_id"]) == 32
                          for r in served)
    assert "capital of France" not in proc.output  # prompts are never logged
    # The startup heap is frozen before serving (app.cli.serve._freeze_startup_heap): a full
    # garbage collection of it stalled the engine thread for about 180 ms.
    frozen = [r for r in logs if r["logger"] == "app.cli" and "startup objects" in r["message"]]
    assert len(frozen) == 1 and int(frozen[0]["message"].split()[1]) > 100_000, frozen


def test_openai_sdk_against_real_server(server):
    base, data_dir = server
    key_file = data_dir / "demo-api-key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert (data_dir / "saltserve.db").exists()
    client = openai.OpenAI(base_url=base + "/v1", api_key=key_file.read_text().strip())
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct"

    messages = [{"role": "system", "content": "You are a helpful assistant who answers in "
                 "one short sentence, without lists, about geography and capitals."},
                {"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                           max_tokens=20)
    assert "Paris" in first.choices[0].message.content
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    n = first.usage.prompt_tokens

    stream = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                            max_tokens=20, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0].choices == []
    assert usage_chunks[0].usage.prompt_tokens_details.cached_tokens == 16 * ((n - 1) // 16)

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=messages, temperature=5)
    assert e.value.body["param"] == "temperature"
    bad = openai.OpenAI(base_url=base + "/v1", api_key="ss-000000000000-wrong")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()

    # Structured output: the SDK's parse() with a pydantic model returns a parsed object.
    # (Bounds matter on a 135M model: an unbounded JSON number can take digits forever.)
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=40)
        country: str = pydantic.Field(max_length=40)
        population_millions: int = pydantic.Field(ge=0, le=100_000)
        is_capital: bool

    parsed = client.chat.completions.parse(
        model=model, response_format=City, max_tokens=200, temperature=0,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.name
    # Logprobs through the SDK.
    lp = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                        max_tokens=5, logprobs=True, top_logprobs=2)
    assert len(lp.choices[0].logprobs.content) == lp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in lp.choices[0].logprobs.content)


WEATHER_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}}}]


def test_openai_sdk_tool_calling_round_trip(server):
    base, data_dir = server
    client = openai.OpenAI(base_url=base + "/v1",
                           api_key=(data_dir / "demo-api-key").read_text().strip())
    model = "SmolLM2-135M-Instruct"
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=model, messages=messages, tools=WEATHER_TOOLS,
                                           tool_choice="required", parallel_tool_calls=False,
                                           temperature=0, max_tokens=60)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments)["city"], str)

    named = client.chat.completions.create(
        model=model, messages=messages, tools=WEATHER_TOOLS, temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_time"]

    # Streamed: the SDK assembles delta.tool_calls.
    stream = client.chat.completions.create(model=model, messages=messages,
                                            tools=WEATHER_TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, temperature=0,
                                            max_tokens=60, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    streamed_calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert streamed_calls and streamed_calls[0].function.name == call.function.name
    assert deltas[-1].finish_reason == "tool_calls"

    # The call and its result go back into the history; the model answers in text.
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees Celsius."}]
    final = client.chat.completions.create(model=model, messages=history, tools=WEATHER_TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=40)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    alone = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    # The call (its JSON) and the result (<tool_response>) were rendered, not dropped.
    assert final.usage.prompt_tokens >= alone.usage.prompt_tokens + 30


def test_cli_cache_commands_talk_to_the_running_server(server):
    from click.testing import CliRunner

    from app.cli.main import main

    base, data_dir = server
    runner = CliRunner(env={"SALTSERVE_MASTER_KEY": ""})
    common = ["--data-dir", str(data_dir), "--url", base]
    client = openai.OpenAI(base_url=base + "/v1",
                           api_key=(data_dir / "demo-api-key").read_text().strip())
    long_prompt = "Tell me about bridges. " * 8
    for _ in range(2):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=long_prompt,
                                  max_tokens=1)
    stats = runner.invoke(main, ["cache", "stats", *common])
    assert stats.exit_code == 0, stats.output
    assert "blocks:" in stats.output and "demo: resident=" in stats.output
    reset = runner.invoke(main, ["cache", "reset", "--tenant", "demo", *common])
    assert reset.exit_code == 0, reset.output
    assert int(reset.output.split(":")[1]) > 0
    down = runner.invoke(main, ["cache", "stats", "--data-dir", str(data_dir), "--url",
                                "http://127.0.0.1:9"])
    assert down.exit_code != 0 and "no server at" in down.output


def test_bench_validate_passes_with_caching_and_fails_without(server, tmp_path):
    """``saltserve bench validate`` (the seed's cold / warm / negative-control test) against
    the real server: the demo tenant passes; a tenant with prefix caching off fails the warm
    gates while its negative control still behaves."""
    import httpx
    from click.testing import CliRunner

    from app.cli.main import main
    from tenants.tokens import JWTConfig, issue_token, load_or_create_platform_key

    base, data_dir = server
    out = tmp_path / "validate.json"
    demo = (data_dir / "demo-api-key").read_text().strip()
    admin = {"Authorization": "Bearer " + issue_token(
        load_or_create_platform_key(data_dir), JWTConfig(), subject="bench-test",
        role="admin", tenant_id=None, ttl_s=600)}
    r = CliRunner().invoke(main, ["bench", "validate", "--url", base, "--api-key", demo,
                                  "--rounds", "2", "--out", str(out), "--metrics-token",
                                  admin["Authorization"][7:]])  # an admin JWT reads /metrics
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert report["passed"] and report["gates"]["warm_drop"]["value"] >= 0.3
    assert report["cached_tokens"]["cold"] == [0, 0]
    assert report["cached_tokens"]["negative"] == [0, 0]
    assert all(c >= 960 for c in report["cached_tokens"]["warm"])
    assert report["prompt_tokens"]["cold"] >= 1000
    assert (report["block_size"], report["num_gpu_blocks"], report["device"]) == (16, 256, "cpu")
    assert report["negative_control_first_changed_token"] == 0
    assert len(report["tokenizer_hash"]) == 16 and report["model"] == "SmolLM2-135M-Instruct"

    t = httpx.post(base + "/admin/tenants", headers=admin,
                   json={"name": "no-cache", "enable_prefix_caching": False}).json()
    key = httpx.post(base + f"/admin/tenants/{t['id']}/keys", headers=admin, json={}).json()
    r = CliRunner().invoke(main, ["bench", "validate", "--url", base, "--api-key", key["key"],
                                  "--rounds", "2", "--out", str(out)])
    assert r.exit_code == 1, r.output
    report = json.loads(out.read_text())
    gates = {name: g["passed"] for name, g in report["gates"].items()}
    assert gates["warm_drop"] is False and gates["hit_rate"] is False
    assert gates["cold_is_cold"] and gates["negative_control"]
    assert "FAILED" in r.output
    # The gates' thresholds come from the flags: a p99 bound no run can meet, the cold gate off.
    r = CliRunner().invoke(main, ["bench", "validate", "--url", base, "--api-key", demo,
                                  "--rounds", "1", "--out", str(out), "--max-p99-ratio", "0",
                                  "--no-require-cold"])
    assert r.exit_code == 1, r.output
    report = json.loads(out.read_text())
    assert report["gates"]["p99"]["passed"] is False
    assert report["gates"]["p99"]["gate"] == "warm p99 <= 0 x cold p99"
    assert report["gates"]["cold_is_cold"]["gate"] == "off"
    assert report["gates"]["cold_is_cold"]["passed"] and report["gates"]["warm_drop"]["passed"]


def test_bench_profiles_compare_caching_on_and_off(server, tmp_path, model_dir):
    """``saltserve bench profiles`` on the real server: the shared system prompt hits with
    caching on and never with it off, and the server's own counters agree with the responses'
    ``cached_tokens``. Beside them, the same prompts on a peer (this server again, as another
    tenant: the plumbing of ``--peer``) and through Hugging Face ``generate``, with a plot of
    them all. One request at a time, so the on run's TTFT median is a warm request. (The
    unique profile, rounds, peers and the report's ratios: ``test_bench.py``, on fake servers.)"""
    import httpx
    from click.testing import CliRunner

    from app.cli.main import main
    from tenants.tokens import JWTConfig, issue_token, load_or_create_platform_key

    base, data_dir = server
    admin_jwt = issue_token(load_or_create_platform_key(data_dir), JWTConfig(),
                            subject="bench-test", role="admin", tenant_id=None, ttl_s=600)
    admin = {"Authorization": f"Bearer {admin_jwt}"}
    t = httpx.post(base + "/admin/tenants", headers=admin,
                   json={"name": "profiles-off", "enable_prefix_caching": False}).json()
    off = httpx.post(base + f"/admin/tenants/{t['id']}/keys", headers=admin, json={}).json()
    t = httpx.post(base + "/admin/tenants", headers=admin, json={"name": "profiles-peer"}).json()
    peer = httpx.post(base + f"/admin/tenants/{t['id']}/keys", headers=admin, json={}).json()
    out, png = tmp_path / "profiles.json", tmp_path / "profiles.png"
    r = CliRunner().invoke(main, [
        "bench", "profiles", "--url", base, "--api-key",
        (data_dir / "demo-api-key").read_text().strip(), "--api-key-no-cache", off["key"],
        "--profile", "shared_system", "--requests", "3",
        "--concurrency", "1", "--max-tokens", "4", "--metrics-token", admin_jwt,
        "--seed", "3", "--run-nonce", "prof1",
        "--peer", f"self={base}/v1,{peer['key']}", "--hf-baseline", "--hf-model",
        str(model_dir), "--out", str(out), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert (report["seed"], report["nonce"]) == (3, "prof1")  # the prompts, replayable
    shared = report["profiles"]["shared_system"]
    assert shared["on"]["prompt_tokens"] // 3 >= 1500  # the seed's >= 1,500-token prompt
    # The first of the three is cold, the other two hit all but their question's blocks
    # (2/3 x 1,536/1,555 = 0.66; one hit alone would be 0.33).
    assert shared["on"]["hit_rate"] > 0.6 and shared["off"]["hit_rate"] == 0
    assert shared["on"]["ttft_p50_s"] < shared["off"]["ttft_p50_s"]
    for run in (shared["on"], shared["off"]):
        assert run["metrics"]["hit_rate_agrees"], run["metrics"]
        assert 0 < run["metrics"]["kv_usage_peak"] <= 1
    assert report["cache_config"]["block_size"] == "16"
    assert report["cache_config"]["cache_dtype"] == "float32"  # --kv-cache-dtype auto, fp32
    assert "ours (cache on) vs caching off: throughput" in r.output
    # The peer (a tenant of its own: its first prompt is cold) hits like ours; generate never.
    peer_run, hf = shared["peers"]["self"], shared["hf_generate"]
    assert peer_run["prompt_tokens"] == hf["prompt_tokens"] == shared["on"]["prompt_tokens"]
    assert peer_run["hit_rate"] > 0.6 and hf["hit_rate"] == 0
    assert hf["output_tokens_per_s"] > 0 and hf["ttft_p50_s"] < hf["wall_s"]
    assert set(shared["ours_vs"]) == {"caching off", "self", "hf_generate"}
    assert "ours (cache on) vs hf_generate: throughput" in r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_tenants_reports_each_tenants_hits_beside_a_flood(server, tmp_path, monkeypatch):
    import click
    from click.testing import CliRunner

    from app.cli.main import main
    from tenants.tokens import JWTConfig, issue_token, load_or_create_platform_key

    base, data_dir = server
    admin_jwt = issue_token(load_or_create_platform_key(data_dir), JWTConfig(),
                            subject="bench-test", role="admin", tenant_id=None, ttl_s=600)
    out = tmp_path / "tenants.json"
    bars: list[list[int]] = []  # [length, updates] of each progress bar drawn
    real_bar = click.progressbar

    def counted(*args, **kwargs):
        bar = real_bar(*args, **kwargs)
        seen = [kwargs["length"], 0]
        bars.append(seen)
        update = bar.update

        def counting(n, *rest):
            seen[1] += n
            return update(n, *rest)

        bar.update = counting
        return bar

    monkeypatch.setattr(click, "progressbar", counted)
    r = CliRunner().invoke(main, ["bench", "tenants", "--url", base, "--admin-token",
                                  admin_jwt, "--tenants", "2", "--requests", "3",
                                  "--flood-requests", "6", "--flood-concurrency", "2",
                                  "--max-tokens", "2", "--run-nonce", "fl00d", "--out",
                                  str(out), "--plot", str(tmp_path / "tenants.png")])
    assert r.exit_code == 0, r.output
    # One tick per completion: each tenant's warm-up and 3 requests, and the flood's 6.
    assert bars == [[2 * (1 + 3) + 6, 2 * (1 + 3) + 6]]
    report = json.loads(out.read_text())
    assert report["nonce"] == "fl00d"
    assert len(report["per_tenant"]) == 2
    assert (tmp_path / "tenants.png").read_bytes()[:4] == b"\x89PNG"
    for name, t in report["per_tenant"].items():
        assert t["hit_rate"] > 0.8, (name, t)  # warm before the flood, still hitting during it
        assert t["evicted_by_flooder"] <= t["evicted_blocks"]
    # The run's tenants are disabled afterwards.
    import httpx

    tenants = httpx.get(base + "/admin/tenants", headers={
        "Authorization": f"Bearer {admin_jwt}"}).json()["data"]
    run = [t for t in tenants
           if t["name"].startswith(f"bench-{report['nonce']}-{report['run_id']}-")]
    assert len(run) == 3 and all(t["disabled"] for t in run)
    # The same nonce again on the same server replays the prompts under new tenant names.
    again = tmp_path / "again.json"
    r = CliRunner().invoke(main, ["bench", "tenants", "--url", base, "--admin-token",
                                  admin_jwt, "--tenants", "1", "--requests", "1",
                                  "--flood-requests", "1", "--flood-concurrency", "1",
                                  "--max-tokens", "1", "--run-nonce", "fl00d", "--seed", "4",
                                  "--out", str(again)])
    assert r.exit_code == 0, r.output
    replay = json.loads(again.read_text())
    assert (replay["nonce"], replay["seed"]) == ("fl00d", 4)
    assert replay["run_id"] != report["run_id"]


def test_bench_sweep_prefix_length_draws_the_curves(server, tmp_path):
    import httpx
    from click.testing import CliRunner

    from app.cli.main import main
    from tenants.tokens import JWTConfig, issue_token, load_or_create_platform_key

    base, data_dir = server
    admin = {"Authorization": "Bearer " + issue_token(
        load_or_create_platform_key(data_dir), JWTConfig(), subject="bench-test",
        role="admin", tenant_id=None, ttl_s=600)}
    t = httpx.post(base + "/admin/tenants", headers=admin,
                   json={"name": "sweep-off", "enable_prefix_caching": False}).json()
    off = httpx.post(base + f"/admin/tenants/{t['id']}/keys", headers=admin, json={}).json()
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    r = CliRunner().invoke(main, [
        "bench", "sweep", "--url", base, "--api-key",
        (data_dir / "demo-api-key").read_text().strip(), "--api-key-no-cache", off["key"],
        "--values", "300,900", "--rounds", "1", "--out", str(out), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    points = json.loads(out.read_text())["points"]
    assert [round(p["prefix_tokens"], -2) for p in points] == [300, 900]
    for p in points:
        assert p["warm_s"] < p["cold_s"] and p["warm_cached_tokens"][0] > 0
    # A longer prefix costs more to prefill cold, and the warm share falls with it.
    assert points[1]["off_s"] > points[0]["off_s"]
    assert points[1]["warm_over_cold"] < points[0]["warm_over_cold"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bench_sweep_pool_size_starts_its_own_servers(model_dir, tmp_path):
    """``saltserve bench sweep --axis pool_size`` starts a real server per pool size: with two
    300-token documents (19 blocks each) taken in turn, a 24-block pool cannot keep both: each
    request evicts most of the other's blocks (tail first, as vLLM does, so a few head blocks
    survive and a little still hits); a 100-block pool keeps both, so the second round hits
    every whole block."""
    from click.testing import CliRunner

    from app.cli.main import main

    out, png = tmp_path / "pool.json", tmp_path / "pool.png"
    r = CliRunner().invoke(main, [
        "bench", "sweep", "--axis", "pool_size", "--values", "24,100", "--requests", "4",
        "--documents", "2", "--prefix-tokens", "300", "--max-tokens", "2", "--model-dir",
        str(model_dir), "--out", str(out), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    small, large = json.loads(out.read_text())["points"]
    assert (small["value"], large["value"]) == (24, 100)
    assert small["on"]["hit_rate"] < 0.2
    # Requests 3 and 4 reuse their document's whole blocks: about half of all prompt tokens.
    assert 0.4 < large["on"]["hit_rate"] < 0.5
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("kv_cache_dtype,act_bits", [("auto", 16), ("bfloat16", 16),
                                                     ("auto", 8)])
def test_serve_with_the_gguf_4bit_weights(model_dir, tmp_path, kv_cache_dtype, act_bits):
    """``saltserve serve --quantization gguf`` serves the bundled GGUF's own 4-bit weights and
    its Q8_0 embedding as the tied head (fp32 activations; 97 MB a token): the OpenAI SDK gets
    a correct answer, streamed and not,
    and a prefix hit; a hostile request is refused alone and the server goes on. The same over
    a bf16 KV cache (``--kv-cache-dtype bfloat16``: half the bytes a block), and with 8-bit
    activations (``--quantized-activation-bits 8``, llama.cpp's rounding)."""
    with serve(model_dir, tmp_path, "--quantization", "gguf", "--kv-cache-dtype",
               kv_cache_dtype, "--quantized-activation-bits", str(act_bits),
               wait_for_children=True) as proc:
        key = (tmp_path / "demo-api-key").read_text().strip()
        client = openai.OpenAI(base_url=proc.base + "/v1", api_key=key)
        # Not "What is the capital of France?": fp32's first two tokens there are 0.09 apart
        # (25.33 and 25.24), and 4-bit weights under bf16 GEMM (CPUs with native bf16) or
        # 16-token chunks under AVX2 kernels take the second, which starts "L'Étoile, ...".
        messages = [{"role": "user", "content": "Name the capital of France."}]
        first = client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                               messages=messages, temperature=0, max_tokens=16)
        assert "Paris" in first.choices[0].message.content
        with pytest.raises(openai.BadRequestError):  # over --max-model-len 512
            client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8,
                                           messages=[{"role": "user", "content": "hi " * 600}])
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=16,
            stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == first.choices[0].message.content
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert "cpu float32, quantization gguf (97 MB of weights read per token)" in proc.output, \
        proc.output[-2000:]
    if cpu_linear.load():  # our int8-dot kernels run every 4-bit forward, at these bits
        assert f", {act_bits}-bit activations) at every row count" in proc.output
    kv, elem = {"auto": ("float32", 4), "bfloat16": ("bfloat16", 2)}[kv_cache_dtype]
    mib = 96 * 30 * 2 * 16 * 3 * 64 * elem / 2**20  # 96 blocks, 30 layers, K and V, 3 x 64
    assert f"engine ready: 96 KV blocks x 16 tokens ({mib:.1f} MiB, {kv})" in proc.output
    assert "Traceback" not in proc.output
    # Stopped by SIGTERM after serving (the parse pool was running): the pool is shut down
    # before uvicorn ends the process with that signal, so none of its semaphores is left.
    assert proc.process.returncode == -signal.SIGTERM
    assert "leaked semaphore" not in proc.output, proc.output[-1000:]


def test_serve_finds_evicted_and_pre_restart_prefixes_on_disk(model_dir, tmp_path):
    """``saltserve serve --kv-offload-size``: four ~430-token documents overflow the 96-block
    pool, so the first leaves it; asked again, its whole prefix comes back from the disk tier
    (``cached_tokens``) with the same greedy answer; after a restart on the same data dir the
    first request on it hits the whole prefix too (tenant isolation of the tier:
    tests/engine/test_kv_offload.py)."""
    docs = [f"Document {i}. " + " ".join(f"word{i}x{j}" for j in range(80)) for i in range(4)]

    def ask(client, doc):
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", temperature=0, max_tokens=8,
            messages=[{"role": "user", "content": doc + "\nSummarize."}])
        return r.choices[0].message.content, r.usage.prompt_tokens, \
            r.usage.prompt_tokens_details.cached_tokens

    def cli(proc, *args):
        out = subprocess.run([sys.executable, "-m", "app.cli", "cache", *args, "--url",
                              proc.base, "--data-dir", str(tmp_path)], capture_output=True,
                             text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        return out.stdout

    flags = ("--kv-offload-size", "256MiB")
    with serve(model_dir, tmp_path, *flags) as proc:
        key = (tmp_path / "demo-api-key").read_text().strip()
        client = openai.OpenAI(base_url=proc.base + "/v1", api_key=key)
        first = [ask(client, d) for d in docs]
        # (cold but for the chat template's shared opening block)
        assert all(400 < n < 500 and cached <= 16 for _, n, cached in first), first
        text, n, cached = ask(client, docs[0])
        assert text == first[0][0] and cached == n // 16 * 16, (n, cached)
        stats = cli(proc, "stats")  # the operator's view: the tier, the tenant's tier hits
        assert "tier disk: " in stats and "of 256 MiB" in stats, stats
        loaded = int(re.search(r"loaded (\d+)", stats).group(1))
        assert loaded > 0 and f"tier_hits={16 * loaded} disk=" in stats, stats
    assert (tmp_path / "kv-offload").is_dir()
    assert "KV offload disk tier" in proc.output
    with serve(model_dir, tmp_path, *flags) as proc:
        client = openai.OpenAI(base_url=proc.base + "/v1", api_key=key)
        text, n, cached = ask(client, docs[1])
        assert text == first[1][0] and cached == n // 16 * 16, (n, cached)
        proc.process.kill()  # kill -9: the writer thread may be mid-write
        proc.process.wait(30)
    # What a write cut short can leave: a temporary file, and (on a file system without an
    # atomic rename) a truncated blob under a block's name. Neither is ever loaded.
    blobs = sorted((tmp_path / "kv-offload").rglob("*.kv"))
    assert blobs
    for blob in blobs:
        blob.with_name(blob.name + ".tmp").write_bytes(blob.read_bytes()[:100])
        blob.write_bytes(blob.read_bytes()[:-1])
    with serve(model_dir, tmp_path, *flags) as proc:
        client = openai.OpenAI(base_url=proc.base + "/v1", api_key=key)
        text, n, cached = ask(client, docs[2])  # computed again, never a 500
        assert text == first[2][0] and cached <= 16, (n, cached)
        reset = cli(proc, "reset")
        assert "blocks dropped" in reset
    assert not list((tmp_path / "kv-offload").rglob("*.tmp"))
    assert "Traceback" not in proc.output
