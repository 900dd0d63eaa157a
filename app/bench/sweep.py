"""``saltserve bench sweep --axis prefix_length``: TTFT against the shared prefix's length, with
prefix caching on (cold and warm) and off, plotted.

For each length, ``rounds`` times on a prefix no server has seen: a cold request and a warm one
(same prefix, another question) from the tenant with caching on, and one request from the tenant
with caching off (every request of theirs is a full prefill). Medians per length; the report
gives warm / cold per length (the issue's target: at most 5% at 2,000 tokens). The plot (PNG,
matplotlib) draws the three curves.

Only the prefix-length axis is built; match rate, concurrency, output length and pool size are
not yet.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

from app.bench.validate import Endpoint, make_prefix, words_for

AXES = ("prefix_length",)


def run_sweep(on: Endpoint, off: Endpoint, lengths: tuple[int, ...] = (250, 500, 1000, 2000),
              rounds: int = 3, max_tokens: int = 4, seed: int = 0, nonce: str | None = None,
              progress: Any = None) -> dict[str, Any]:
    """The prefix-length sweep; the report (JSON-serialisable)."""
    nonce = nonce or f"{random.SystemRandom().getrandbits(32):08x}"
    rng = random.Random(seed)
    on.complete("Warm-up: say hello.", 2)
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
        point = {"prefix_tokens": statistics.median(prompt), "cold_s": statistics.median(cold),
                 "warm_s": statistics.median(warm), "off_s": statistics.median(off_t),
                 "warm_cached_tokens": cached}
        point["warm_over_cold"] = point["warm_s"] / point["cold_s"]
        points.append(point)
        if progress is not None:
            progress(length)
    return {"test": "sweep", "axis": "prefix_length", "url": on.url, "model": on.model,
            "rounds": rounds, "max_tokens": max_tokens, "seed": seed, "nonce": nonce,
            "cache_config": on.cache_config(), "points": points}


def plot_sweep(report: dict[str, Any], path: Path) -> None:
    """TTFT vs prefix length, caching on (cold, warm) and off, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    x = [p["prefix_tokens"] for p in report["points"]]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for key, label, style in (("off_s", "caching off", "o-"), ("cold_s", "caching on, cold",
                                                               "s--"),
                              ("warm_s", "caching on, warm", "^-")):
        ax.plot(x, [p[key] for p in report["points"]], style, label=label)
    ax.set_xlabel("prompt tokens (shared prefix + question)")
    ax.set_ylabel("TTFT, median (s)")
    ax.set_title(f"TTFT vs prefix length: {report['model']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def format_sweep(report: dict[str, Any]) -> str:
    lines = [f"{'prompt tokens':>13} {'off':>8} {'cold':>8} {'warm':>8} {'warm/cold':>9}"]
    for p in report["points"]:
        lines.append(f"{p['prefix_tokens']:13.0f} {p['off_s']:7.3f}s {p['cold_s']:7.3f}s "
                     f"{p['warm_s']:7.3f}s {100 * p['warm_over_cold']:8.1f}%")
    return "\n".join(lines)
