"""``saltserve bench sweep``: one axis at a time, with prefix caching on and off, plotted.

Axes (values are comma-separated on the command line):

- ``prefix_length`` (tokens): for each length, ``rounds`` times on a prefix no server has seen,
  a cold and a warm request (same prefix, another question) from the tenant with caching on,
  and one request from the tenant with caching off. Medians; warm / cold per length (the
  issue's target: at most 5% at 2,000 tokens).
- ``match_rate`` (0 to 1): ``requests`` prompts, one at a time, of which this share open with a
  prefix the server has already cached (``prefix_tokens`` long) and the rest with a prefix of
  their own; TTFT, hit rate and requests/s on and off.
- ``concurrency`` (requests in flight): the shared-system-prompt profile at each concurrency,
  on and off; requests/s and TTFT.
- ``output_length`` (``max_tokens``): the shared-system-prompt profile at ``concurrency``, on
  and off, each request generating exactly that many tokens (``ignore_eos``); output tokens/s
  and inter-token latency.
- ``pool_size`` (KV blocks): for each size, a server of our own (``saltserve serve
  --num-gpu-blocks-override``, no offload tier, on a free loopback port, in a temporary data
  dir) runs
  ``requests`` questions over ``documents`` documents taken in turn, one at a time; hit rate
  against pool size. It needs no ``--url``.

Every value's prompts open with a new nonce, so no value reuses another's cache. Each point of
the client-side axes holds ``on`` and ``off`` runs with ``bench profiles``' figures.
"""

from __future__ import annotations

import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from app.bench import SWEEP_AXES as AXES
from app.bench.profiles import profile_prompts, run_profile
from app.bench.validate import Endpoint, make_prefix, random_text, words_for

DEFAULT_VALUES = {"prefix_length": "250,500,1000,2000", "match_rate": "0,0.25,0.5,0.75,1",
                  "concurrency": "1,2,4,8", "output_length": "1,16,64,128",
                  "pool_size": "80,160,240,320"}


def parse_values(axis: str, text: str) -> tuple[float, ...]:
    """``text`` (comma-separated) as the axis' values.

    Raises:
        ValueError: not numbers, a match rate outside [0, 1], or another axis' value below 1
            (or not whole).
    """
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError("comma-separated numbers") from None
    if axis == "match_rate":
        if not all(0 <= v <= 1 for v in values):
            raise ValueError("match rates lie between 0 and 1")
        return values
    if not all(v >= 1 and v.is_integer() for v in values):
        raise ValueError("whole numbers of at least 1")
    return tuple(int(v) for v in values)


def _nonce() -> str:
    return f"{random.SystemRandom().getrandbits(32):08x}"


def _prefix_length(on: Endpoint, off: Endpoint, lengths: tuple[int, ...], rounds: int,
                   max_tokens: int, seed: int, nonce: str, progress: Any) -> list[dict]:
    rng = random.Random(seed)
    points = []
    for length in lengths:
        words = words_for(on, length, seed, nonce)
        cold, warm, off_t, cached, prompt = [], [], [], [], []
        for r in range(rounds):
            text = " ".join(make_prefix(rng, nonce, words))
            c = on.complete(f"{text}\nQuestion {r}A: which berth?", max_tokens)
            w = on.complete(f"{text}\nQuestion {r}B: which crane?", max_tokens)
            o = off.complete(f"{text}\nQuestion {r}C: which gate?", max_tokens)
            cold.append(c.ttft_s)
            warm.append(w.ttft_s)
            off_t.append(o.ttft_s)
            cached.append(w.cached_tokens)
            prompt.append(w.prompt_tokens)
        point = {"value": length, "prefix_tokens": statistics.median(prompt),
                 "cold_s": statistics.median(cold), "warm_s": statistics.median(warm),
                 "off_s": statistics.median(off_t), "warm_cached_tokens": cached}
        point["warm_over_cold"] = point["warm_s"] / point["cold_s"]
        points.append(point)
        progress(length)
    return points


def match_rate_prompts(rate: float, requests: int, words: int, seed: int,
                       nonce: str) -> tuple[str, list[str]]:
    """The shared prefix (to warm first) and ``requests`` prompts, ``round(rate * requests)``
    of them on that prefix and the others on prefixes of their own, in a seeded order."""
    rng = random.Random(f"{seed}:{rate}")
    shared = " ".join(make_prefix(rng, nonce, words))
    matches = [i < round(rate * requests) for i in range(requests)]
    rng.shuffle(matches)
    return shared, [(shared if m else " ".join(make_prefix(rng, nonce, words)))
                    + f"\nQuestion {i}: {random_text(rng, 6)}?" for i, m in enumerate(matches)]


def _on_off(on: Endpoint, off: Endpoint, prompts: list[str], concurrency: int,
            max_tokens: int, ignore_eos: bool = False) -> dict[str, Any]:
    return {"off": run_profile(off, prompts, concurrency, max_tokens, ignore_eos=ignore_eos),
            "on": run_profile(on, prompts, concurrency, max_tokens, ignore_eos=ignore_eos)}


def _client_axis(axis: str, on: Endpoint, off: Endpoint, values: tuple, requests: int,
                 concurrency: int, prefix_tokens: int, max_tokens: int, seed: int, nonce: str,
                 progress: Any) -> list[dict]:
    points = []
    for v in values:
        value_nonce = f"{nonce}-{v}"
        if axis == "match_rate":
            words = words_for(on, prefix_tokens, seed, value_nonce)
            shared, prompts = match_rate_prompts(v, requests, words, seed, value_nonce)
            on.complete(shared + "\nQuestion: warm-up?", max_tokens)
            point = _on_off(on, off, prompts, 1, max_tokens)
        else:
            prompts = profile_prompts("shared_system", requests, seed, value_nonce)
            if axis == "concurrency":
                point = _on_off(on, off, prompts, v, max_tokens)
            else:  # output_length: every request generates exactly v tokens
                point = _on_off(on, off, prompts, concurrency, v, ignore_eos=True)
        points.append({"value": v, **point})
        progress(v)
    return points


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_server(model_dir: Path, num_blocks: int, max_model_len: int = 2048,
                 startup_timeout_s: float = 300.0) -> Iterator[Endpoint]:
    """``saltserve serve`` on ``model_dir`` with a pool of ``num_blocks`` KV blocks, on a free
    loopback port and a temporary data dir; its demo tenant's endpoint. Stopped on exit.
    ``--max-model-len`` is ``max_model_len`` or what the pool holds (16-token blocks), if less:
    the server refuses a pool smaller than one request.

    Raises:
        RuntimeError: it exited or did not answer ``/health`` in time (its last output).
    """
    with tempfile.TemporaryDirectory(prefix="saltserve-sweep-") as data_dir:
        port = _free_port()
        cmd = [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port",
               str(port), "--model", str(model_dir), "--block-size", "16", "--max-model-len",
               str(min(max_model_len, 16 * num_blocks)),
               "--num-gpu-blocks-override", str(num_blocks),
               "--kv-offload-size", "0"]  # the pool alone: a disk tier would hide its size
        # Embedded defaults only: none of the operator's SALTSERVE_* settings (a real database,
        # Redis, no demo tenant) may reach this throwaway server.
        env = {k: v for k, v in os.environ.items() if not k.startswith("SALTSERVE_")}
        log = Path(data_dir) / "server.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env={**env, "SALTSERVE_DATA_DIR": data_dir},
                                    stdout=out, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + startup_timeout_s
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text()[-600:]
                    raise RuntimeError(f"a server with {num_blocks} blocks did not start: {tail}")
                try:
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
            key_file = Path(data_dir) / "demo-api-key"
            if not key_file.exists():
                raise RuntimeError(f"the server with {num_blocks} blocks made no demo tenant")
            yield Endpoint(base, key_file.read_text().strip())
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _pool_size(model_dir: Path, sizes: tuple[int, ...], requests: int, documents: int,
               prefix_tokens: int, max_tokens: int, seed: int, nonce: str,
               progress: Any) -> list[dict]:
    points = []
    for blocks in sizes:
        with local_server(model_dir, blocks) as ep:
            words = words_for(ep, prefix_tokens, seed, nonce)
            rng = random.Random(seed)
            docs = [" ".join(make_prefix(rng, nonce, words)) for _ in range(documents)]
            prompts = [f"{docs[i % documents]}\nQuestion {i}: {random_text(rng, 6)}?"
                       for i in range(requests)]
            points.append({"value": blocks, "on": run_profile(ep, prompts, 1, max_tokens)})
        progress(blocks)
    return points


def run_sweep(axis: str, values: tuple, on: Endpoint | None = None, off: Endpoint | None = None,
              rounds: int = 3, max_tokens: int = 4, seed: int = 0, requests: int = 12,
              concurrency: int = 4, prefix_tokens: int = 1000, documents: int = 3,
              model_dir: Path | None = None, nonce: str | None = None,
              progress: Any = None) -> dict[str, Any]:
    """The sweep of ``axis`` over ``values``; the report (JSON-serialisable). ``on`` / ``off``
    are the tenants with caching on and off (every axis but ``pool_size``); ``model_dir`` the
    model the ``pool_size`` servers load.

    Raises:
        ValueError: an unknown axis, or a missing endpoint or model for it.
    """
    nonce = nonce or _nonce()
    progress = progress or (lambda _: None)
    report: dict[str, Any] = {"test": "sweep", "axis": axis, "seed": seed, "nonce": nonce,
                              "max_tokens": max_tokens}
    if axis == "pool_size":
        if model_dir is None:
            raise ValueError("the pool_size axis needs a model folder")
        report.update(model=Path(model_dir).name, requests=requests, documents=documents,
                      prefix_tokens=prefix_tokens,
                      points=_pool_size(Path(model_dir), values, requests, documents,
                                        prefix_tokens, max_tokens, seed, nonce, progress))
        return report
    if axis not in AXES:
        raise ValueError(f"axis must be one of {', '.join(AXES)}")
    if on is None or off is None:
        raise ValueError(f"the {axis} axis needs a server and keys with caching on and off")
    on.complete("Warm-up: say hello.", 2)
    if axis == "prefix_length":
        points = _prefix_length(on, off, values, rounds, max_tokens, seed, nonce, progress)
        report["rounds"] = rounds
    else:
        points = _client_axis(axis, on, off, values, requests, concurrency, prefix_tokens,
                              max_tokens, seed, nonce, progress)
        report.update(requests=requests, concurrency=concurrency, prefix_tokens=prefix_tokens)
    report.update(url=on.url, model=on.model, cache_config=on.cache_config(), points=points)
    return report


def format_sweep(report: dict[str, Any]) -> str:
    points, axis = report["points"], report["axis"]
    if axis == "prefix_length":
        lines = [f"{'prompt tokens':>13} {'off':>8} {'cold':>8} {'warm':>8} {'warm/cold':>9}"]
        for p in points:
            lines.append(f"{p['prefix_tokens']:13.0f} {p['off_s']:7.3f}s {p['cold_s']:7.3f}s "
                         f"{p['warm_s']:7.3f}s {100 * p['warm_over_cold']:8.1f}%")
        return "\n".join(lines)
    lines = [(f"{axis:>13} {'run':4} {'TTFT p50':>9} {'req/s':>6} {'out tok/s':>9} "
             f"{'ITL ms':>7} {'hit rate':>8}")]
    for p in points:
        for run in ("off", "on"):
            if run in p:
                x = p[run]
                itl = (f"{1000 * x['itl_mean_s']:7.1f}" if x["itl_mean_s"] is not None
                       else "      -")
                lines.append(f"{p['value']:>13} {run:4} {x['ttft_p50_s']:8.3f}s "
                             f"{x['requests_per_s']:6.2f} {x['output_tokens_per_s']:9.1f} "
                             f"{itl} {100 * x['hit_rate']:7.1f}%")
    return "\n".join(lines)
