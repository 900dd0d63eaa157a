"""Tenant-affinity routing vs round-robin: 8 tenants, each with its own ~1,000-token system
prompt, through HAProxy (``deploy/haproxy/haproxy.cfg``) to 2 replicas of the bundled model,
against one replica with the memory of both. Prints, for each: aggregate prefix-cache hit rate
(cached / prompt tokens), TTFT p50 / p95 and throughput, and the ratios between them.

Every replica gets ``--blocks`` KV blocks (the single replica twice as many), so round-robin,
which caches every tenant on every replica, has half the room per tenant that affinity has.
Each tenant's client thread sends ``--requests`` chats (its system prompt + a varying
question), all 8 tenants at once. Caches are reset between runs.

Usage: ``python benchmarks/bench_cluster_affinity.py [--requests 6] [--blocks 320]`` (needs
the machine's PostgreSQL and Redis, and Debian's haproxy; a scratch schema is dropped after).
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
from sqlalchemy import text
from sqlalchemy.engine import make_url

from tenants.db import make_engine
from tenants.tokens import JWTConfig, issue_token, load_or_create_platform_key

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
TENANTS = 8
QUESTIONS = ["Which port handles the most containers?", "When does the next ship leave?",
             "What is the weight limit for a pallet?", "Who signs the customs forms?",
             "How long is the quarantine check?", "Where are reefer units plugged in?",
             "Can hazardous cargo share a hold?", "What is the berth fee per day?"]


def system_prompt(tenant: int) -> str:
    """About 1,000 tokens of tenant-specific instructions."""
    rules = " ".join(f"Rule {tenant}.{i}: shipments of class {i % 9} through terminal "
                     f"{(tenant * 7 + i) % 13} need form {1000 + tenant * 37 + i} signed by the "
                     f"duty officer before {6 + i % 12} o'clock." for i in range(28))
    return f"You are the assistant of shipping company number {tenant}. {rules}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ok(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} never became healthy")


def start_replica(name: str, port: int, data_dir: Path, db_url: str, namespace: str,
                  blocks: int) -> subprocess.Popen:
    env = {**os.environ, "SALTSERVE_DATA_DIR": str(data_dir),
           "SALTSERVE_REDIS_NAMESPACE": namespace}
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--replica-id", name,
         "--database-url", db_url, "--redis-url", "redis://127.0.0.1:6379/0",
         "--num-gpu-blocks-override", str(blocks), "--max-model-len", "2048",
         "--log-level", "warning"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    wait_ok(f"http://127.0.0.1:{port}/health", proc)
    return proc


def haproxy(balance: str, lb_port: int, ports: list[int], work: Path) -> subprocess.Popen:
    """HAProxy with the shipped config, or the same with ``balance roundrobin``."""
    cfg = (ROOT / "deploy" / "haproxy" / "haproxy.cfg").read_text()
    if balance == "roundrobin":
        cfg = cfg.replace("balance hash req.fhdr(authorization)", "balance roundrobin")
        cfg = cfg.replace("    hash-type consistent\n", "").replace(
            "    hash-balance-factor 150\n", "")
    path = work / f"haproxy-{balance}.cfg"
    path.write_text(cfg)
    env = {**os.environ, "SALTSERVE_LB_BIND": f"127.0.0.1:{lb_port}",
           "SALTSERVE_REPLICA_1": f"127.0.0.1:{ports[0]}",
           "SALTSERVE_REPLICA_2": f"127.0.0.1:{ports[1]}"}
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ok(f"http://127.0.0.1:{lb_port}/health", proc, 20)
    return proc


def run(base: str, keys: list[str], requests: int) -> dict:
    """All tenants at once, each sending ``requests`` streamed chats in turn."""
    ttfts: list[float] = []
    prompt = cached = completion = 0
    lock = threading.Lock()

    def tenant(i: int) -> None:
        nonlocal prompt, cached, completion
        client = openai.OpenAI(base_url=base + "/v1", api_key=keys[i], max_retries=0,
                               timeout=300)
        for r in range(requests):
            messages = [{"role": "system", "content": system_prompt(i)},
                        {"role": "user", "content": QUESTIONS[(i + r) % len(QUESTIONS)]}]
            start = time.perf_counter()
            first = None
            usage = None
            for chunk in client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
                    stream_options={"include_usage": True}):
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - start
                if chunk.usage is not None:
                    usage = chunk.usage
            with lock:
                ttfts.append(first if first is not None else time.perf_counter() - start)
                prompt += usage.prompt_tokens
                cached += usage.prompt_tokens_details.cached_tokens
                completion += usage.completion_tokens

    start = time.perf_counter()
    threads = [threading.Thread(target=tenant, args=(i,)) for i in range(len(keys))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttfts.sort()
    return {"hit_rate": cached / prompt, "ttft_p50_s": statistics.median(ttfts),
            "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
            "requests_per_s": len(ttfts) / wall, "completion_tok_per_s": completion / wall,
            "requests": len(ttfts)}


def evictions(bases: list[str], admin: dict[str, str]) -> dict[str, int]:
    """Evicted blocks by reason, summed over the replicas (``GET /admin/cache``)."""
    out: dict[str, int] = {}
    for base in bases:
        for reason, n in httpx.get(base + "/admin/cache", headers=admin).json()[
                "evictions"].items():
            out[reason] = out.get(reason, 0) + n
    return {k: v for k, v in out.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=6, help="chats per tenant per run")
    ap.add_argument("--blocks", type=int, default=384, help="KV blocks per replica")
    ap.add_argument("--postgres-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    args = ap.parse_args()

    schema = f"bench_{secrets.token_hex(4)}"
    with make_engine(args.postgres_url).begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    db = make_url(args.postgres_url).update_query_dict({"options": f"-csearch_path={schema}"})
    db_url = db.render_as_string(hide_password=False)
    procs: list[subprocess.Popen] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            ports = [free_port(), free_port(), free_port()]
            # The single replica first (it also migrates and bootstraps the shared data dir),
            # with both replicas' memory; then the pair.
            single = start_replica("single", ports[2], work / "data", db_url, schema,
                                   2 * args.blocks)
            procs.append(single)
            admin = {"Authorization": "Bearer " + issue_token(
                load_or_create_platform_key(work / "data"), JWTConfig(), subject="bench",
                role="admin", tenant_id=None, ttl_s=3600)}
            base1 = f"http://127.0.0.1:{ports[2]}"
            keys = []
            for i in range(TENANTS):
                t = httpx.post(base1 + "/admin/tenants", headers=admin,
                               json={"name": f"shipping-{i}"}).json()
                keys.append(httpx.post(base1 + f"/admin/tenants/{t['id']}/keys",
                                       headers=admin, json={}).json()["key"])
            results = {"single replica (2x blocks)": run(base1, keys, args.requests)}
            results["single replica (2x blocks)"]["evictions"] = evictions([base1], admin)
            single.terminate()
            single.wait(60)
            procs.remove(single)
            pair = [start_replica(f"r{i + 1}", ports[i], work / "data", db_url, schema,
                                  args.blocks) for i in range(2)]
            procs += pair
            for balance, label in (("hash", "2 replicas, consistent hash (affinity)"),
                                   ("roundrobin", "2 replicas, round-robin")):
                for port in ports[:2]:
                    httpx.post(f"http://127.0.0.1:{port}/admin/cache/reset", headers=admin)
                lb_port = free_port()
                lb = haproxy(balance, lb_port, ports[:2], work)
                procs.append(lb)
                before = evictions([f"http://127.0.0.1:{p}" for p in ports[:2]], admin)
                results[label] = run(f"http://127.0.0.1:{lb_port}", keys, args.requests)
                after = evictions([f"http://127.0.0.1:{p}" for p in ports[:2]], admin)
                results[label]["evictions"] = {k: v - before.get(k, 0) for k, v in after.items()
                                               if v - before.get(k, 0)}
                lb.terminate()
                lb.wait(10)
                procs.remove(lb)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)
        with make_engine(args.postgres_url).begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))

    print(f"{TENANTS} tenants x {args.requests} chats, ~1,000-token system prompts, "
          f"{args.blocks} KV blocks per replica")
    print(f"{'setup':42} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p95':>9} {'req/s':>7} "
          f"{'tok/s':>7}")
    for label, r in results.items():
        print(f"{label:42} {100 * r['hit_rate']:8.1f}% {r['ttft_p50_s']:8.2f}s "
              f"{r['ttft_p95_s']:8.2f}s {r['requests_per_s']:7.2f} "
              f"{r['completion_tok_per_s']:7.1f}  evicted blocks: {r['evictions'] or 0}")
    single, hashed, rr = results.values()
    print(f"affinity vs single replica: hit rate {100 * (hashed['hit_rate'] - single['hit_rate']):+.1f} "
          f"points; affinity vs round-robin: {100 * (hashed['hit_rate'] - rr['hit_rate']):+.1f} "
          f"points, TTFT p50 {rr['ttft_p50_s'] / hashed['ttft_p50_s']:.2f}x lower, "
          f"throughput {hashed['requests_per_s'] / rr['requests_per_s']:.2f}x")


if __name__ == "__main__":
    main()
