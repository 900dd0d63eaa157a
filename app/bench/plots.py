"""The PNG plots of ``saltserve bench`` (matplotlib, the ``bench`` extra: ``pip install
'saltserve[bench]'``): TTFT or throughput against a sweep's axis, hit rate against pool size,
throughput per profile, per-tenant hit rate beside a flood, and a working set's rounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.bench.profiles import profile_runs


def _figure(width: float = 7.0) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, 4.2), dpi=120)


def _save(fig: Any, ax: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# axis -> x label, y label, [(run, figure, legend)]; prefix_length's points have their own keys.
_PLOTS = {
    "match_rate": ("share of prompts on a cached prefix", "TTFT, median (s)",
                   [("off", "ttft_p50_s", "caching off"), ("on", "ttft_p50_s", "caching on")]),
    "concurrency": ("requests in flight", "requests / s",
                    [("off", "requests_per_s", "caching off"),
                     ("on", "requests_per_s", "caching on")]),
    "output_length": ("max_tokens", "output tokens / s",
                      [("off", "output_tokens_per_s", "caching off"),
                       ("on", "output_tokens_per_s", "caching on")]),
    "pool_size": ("KV pool (blocks of 16 tokens)", "hit rate (cached / prompt tokens)",
                  [("on", "hit_rate", "caching on")]),
}


def plot_sweep(report: dict[str, Any], path: Path) -> None:
    """``bench sweep``'s curves as a PNG."""
    points, axis = report["points"], report["axis"]
    fig, ax = _figure()
    if axis == "prefix_length":
        x = [p["prefix_tokens"] for p in points]
        for key, label, style in (("off_s", "caching off", "o-"),
                                  ("cold_s", "caching on, cold", "s--"),
                                  ("warm_s", "caching on, warm", "^-")):
            ax.plot(x, [p[key] for p in points], style, label=label)
        xlabel, ylabel = "prompt tokens (shared prefix + question)", "TTFT, median (s)"
    else:
        xlabel, ylabel, series = _PLOTS[axis]
        x = [p["value"] for p in points]
        for (run, key, label), style in zip(series, ("o-", "^-"), strict=False):
            ax.plot(x, [p[run][key] for p in points], style, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel} vs {axis.replace('_', ' ')}: {report['model']}")
    _save(fig, ax, path)


def plot_profiles(report: dict[str, Any], path: Path) -> None:
    """``bench profiles``: requests/s of every run (ours on and off, peers, HF generate) per
    profile, as grouped bars."""
    profiles = list(report["profiles"])
    runs = list(profile_runs(report["profiles"][profiles[0]]))

    def value(profile: dict[str, Any], run: str) -> float:
        return profile_runs(profile)[run]["requests_per_s"]

    fig, ax = _figure(max(7.0, 1.6 * len(profiles) * len(runs) / 2))
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(profiles))]
        ax.bar(xs, [value(report["profiles"][p], run) for p in profiles], width, label=run)
    ax.set_xticks(range(len(profiles)), [p.replace("_", " ") for p in profiles])
    ax.set_ylabel("requests / s")
    ax.set_title(f"Throughput per profile: {report['model']}\nconcurrency "
                 f"{report['concurrency']}, max_tokens {report['max_tokens']}, "
                 f"{report.get('rounds', 1)} round(s) of {report['requests']} requests")
    _save(fig, ax, path)


def plot_tenants(report: dict[str, Any], path: Path) -> None:
    """``bench tenants``: each tenant's hit rate and the blocks the flood evicted from it."""
    names = list(report["per_tenant"])
    fig, ax = _figure()
    xs = range(len(names))
    hits = [100 * report["per_tenant"][n]["hit_rate"] for n in names]
    evicted = [report["per_tenant"][n]["evicted_by_flooder"] for n in names]
    ax.bar([x - 0.2 for x in xs], hits, 0.4, label="hit rate (%)")
    ax.bar([x + 0.2 for x in xs], evicted, 0.4, label="blocks evicted by the flood")
    ax.set_ylim(0, 1.3 * max(*hits, *evicted, 1))  # room for the legend above the bars
    ax.set_xticks(list(xs), [n.rsplit("-", 1)[-1] for n in names])
    ax.set_title(f"Per-tenant hit rate beside a flood of {report['flood_requests']} unique "
                 "prompts")
    _save(fig, ax, path)


def plot_working_set(report: dict[str, Any], path: Path) -> None:
    """``bench working-set``: each server's wall time per round (bars, log scale: the cold
    round and the warm ones differ tenfold) with its hit rate written above each bar."""
    names = list(report["servers"])
    rounds = len(report["servers"][names[0]]["rounds"])
    fig, ax = _figure()
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        rs = report["servers"][name]["rounds"]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(rounds)]
        bars = ax.bar(xs, [r["wall_s"] for r in rs], width, label=name)
        for bar, r in zip(bars, rs, strict=True):
            if r["hit_rate"] is not None:
                ax.annotate(f"{r['hit_rate']:.2f}", (bar.get_x() + bar.get_width() / 2,
                                                     bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(rounds), [f"round {j + 1}" for j in range(rounds)])
    ax.set_ylabel("wall time of the round (s, log scale)")
    c = report["config"]
    ax.set_title(f"A working set past the pool: {c['prompts']} prompts x ~{c['tokens']} "
                 f"tokens, {c['concurrency']} in flight\n(hit rate above each bar)")
    _save(fig, ax, path)
