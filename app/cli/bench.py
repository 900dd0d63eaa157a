"""``saltserve bench ...``: prefix-caching benchmarks against a running server or in-process
(docs/benchmarks.md)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import click

from app.bench import IN_PROCESS_URL, PROFILES, SWEEP_AXES
from app.cli.options import settings_from_options


@click.group()
def bench() -> None:
    """Benchmark prefix caching against a running server, or in-process (docs/benchmarks.md)."""


def _bench_report(url: str, out: Path | None, run: Any, fmt: Any, plot: Path | None = None,
                  draw: Any = None) -> dict:
    """Runs a bench (``run()``: its report), writes the JSON report to ``out``, prints
    ``fmt(report)`` and, with ``plot``, draws it there (``draw(report, plot)``); an unreachable
    or refusing server is a one-line error."""
    import httpx

    try:
        report = run()
    except (httpx.HTTPError, RuntimeError) as e:
        raise click.ClickException(f"{url}: {e}") from None
    except (OSError, ValueError) as e:  # a bad --hf-model folder, a peer's bad JSON
        raise click.ClickException(str(e)) from None
    if out is not None:
        out.write_text(json.dumps(report, indent=2))
    click.echo(fmt(report))
    if plot is not None:
        draw(report, plot)
    return report


def _check_plot(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    import importlib.util

    if value is not None and importlib.util.find_spec("matplotlib") is None:
        raise click.BadParameter("needs matplotlib: pip install 'saltserve[bench]'")
    return value


def _bench_plot(fn):  # --plot for the bench commands that draw one (checked before the run)
    return click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
                        callback=_check_plot,
                        help="Also draw the results into this PNG (matplotlib: pip install "
                             "'saltserve[bench]').")(fn)


def _bench_target(fn):  # --url and --out for every bench command
    fn = click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
                      help="Write the full JSON report here.")(fn)
    return click.option("--url", envvar="SALTSERVE_URL", default="http://127.0.0.1:8000",
                        show_default=True, help="The server. [$SALTSERVE_URL]")(fn)


def _bench_in_process(fn):  # --in-process, --model-dir and --data-dir: ours without a server
    fn = click.option("--data-dir", type=click.Path(path_type=Path), default=None,
                      help="Where the bundled model is converted. [./.saltserve; env "
                           "SALTSERVE_DATA_DIR]")(fn)
    fn = click.option("--model-dir", type=click.Path(exists=True, file_okay=False,
                                                     path_type=Path), default=None,
                      help="The model folder that --in-process loads (and sweep's pool_size "
                           "servers, and profiles' --hf-baseline). [the bundled "
                           "SmolLM2-135M-Instruct, converted in --data-dir]")(fn)
    return click.option("--in-process", is_flag=True,
                        help="No server: run our engine in this process, through its engine "
                             "interface (no HTTP, auth or database), on --model-dir with "
                             "serve's engine settings (SALTSERVE_* env, e.g. "
                             "SALTSERVE_QUANTIZATION=gguf); --url and the keys are unused.")(fn)


def _bench_seeded(fn):  # --seed and --run-nonce: a prompt set a later run can replay
    fn = click.option("--run-nonce", default=None,
                      help="Opens every prompt, so none is cached from an earlier run; give a "
                           "report's nonce and --seed to send the same prompts again. [random; "
                           "the report records it]")(fn)
    return click.option("--seed", type=int, default=0, show_default=True,
                        help="Draws the prompt texts (with --run-nonce: the same prompts).")(fn)


def _model_dir(model_dir: Path | None, data_dir: Path | None) -> Path:
    from engine.weights import ensure_default_model

    return model_dir or ensure_default_model(settings_from_options(data_dir=data_dir).data_dir)


def _ours(stack: Any, in_process: bool, model_dir: Path | None, data_dir: Path | None,
          url: str, api_key: str | None, api_key_no_cache: str | None, model: str | None,
          metrics_token: str | None) -> tuple[Any, Any, Any]:
    """Our endpoints with caching on and off (``off`` None without ``api_key_no_cache``) and
    the probe of our cache counters (None without a metrics token): a server's, or, with
    ``in_process``, an engine's in this process, closed with ``stack``."""
    from app.bench.profiles import MetricsProbe
    from app.bench.validate import Endpoint

    if in_process:
        from app.bench.in_process import InProcessEngine

        settings = settings_from_options(data_dir=data_dir)
        engine = stack.enter_context(InProcessEngine(
            settings.engine_config(_model_dir(model_dir, data_dir))))
        return engine.endpoint("bench-on"), engine.endpoint("bench-off", False), engine.probe()
    on = Endpoint(url, api_key, model, metrics_token=metrics_token)
    off = Endpoint(url, api_key_no_cache, on.model) if api_key_no_cache else None
    return on, off, MetricsProbe(url, metrics_token) if metrics_token else None


def _peers(specs: tuple[str, ...], taken: tuple[str, ...] = ()) -> list:
    """The ``--peer`` options as ``Peer`` records; a bad spec, or names that repeat (or are
    in ``taken``), is a usage error."""
    from app.bench.baselines import parse_peer

    try:
        peers = [parse_peer(spec) for spec in specs]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--peer") from None
    names = [p.name for p in peers] + list(taken)
    if len(set(names)) != len(names):
        raise click.BadParameter("peer names must differ", param_hint="--peer")
    return peers


def _need_keys(in_process: bool, **keys: str | None) -> None:
    missing = [name for name, value in keys.items() if not value]
    if not in_process and missing:
        raise click.UsageError("without --in-process, give "
                               + " and ".join("--" + m.replace("_", "-") for m in missing))


@bench.command("validate")
@_bench_target
@_bench_in_process
@click.option("--api-key", envvar="SALTSERVE_API_KEY", default=None,
              help="A tenant's API key. [$SALTSERVE_API_KEY]")
@click.option("--model", default=None, help="[the server's first model]")
@click.option("--prefix-tokens", type=click.IntRange(min=1000), default=1000,
              show_default=True, help="Length of the shared prefix.")
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True,
              help="Cold / warm / negative triples, each on a new prefix.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=8, show_default=True)
@_bench_seeded
@click.option("--min-warm-drop", type=float, default=0.30, show_default=True,
              help="Gate: warm TTFT at least this much below cold.")
@click.option("--min-hit-rate", type=float, default=0.60, show_default=True,
              help="Gate: warm cached_tokens / prompt tokens.")
@click.option("--neg-min-ratio", type=float, default=0.70, show_default=True,
              help="Gate: negative-control TTFT at least this share of cold.")
@click.option("--max-p99-ratio", type=float, default=1.0, show_default=True,
              help="Gate: warm TTFT p99 at most this multiple of cold p99 (no regression).")
@click.option("--require-cold/--no-require-cold", default=True, show_default=True,
              help="Gate: the cold requests get cached_tokens 0 (a prefix new to the server).")
@click.option("--metrics-token", envvar="SALTSERVE_METRICS_TOKEN", default=None,
              help="Reads block size, pool size and device from /metrics. "
                   "[$SALTSERVE_METRICS_TOKEN]")
def bench_validate(url: str, api_key: str, model: str | None, prefix_tokens: int,
                   rounds: int, max_tokens: int, seed: int, min_warm_drop: float,
                   min_hit_rate: float, neg_min_ratio: float, max_p99_ratio: float,
                   require_cold: bool, metrics_token: str | None,
                   out: Path | None, run_nonce: str | None, in_process: bool,
                   model_dir: Path | None, data_dir: Path | None) -> None:
    """The seed's cold / warm / negative-control test of prefix caching, with gates; exits 1
    when a gate fails."""

    from app.bench.validate import Gates, format_report, run_validate

    _need_keys(in_process, api_key=api_key)

    def run() -> dict:
        with contextlib.ExitStack() as stack:
            endpoint, _, _ = _ours(stack, in_process, model_dir, data_dir, url, api_key, None,
                                   model, metrics_token)
            with click.progressbar(length=rounds, label="rounds", file=sys.stderr) as bar:
                return run_validate(endpoint, prefix_tokens, rounds, seed, max_tokens,
                                    Gates(min_warm_drop, min_hit_rate, neg_min_ratio, max_p99_ratio,
                                          require_cold),
                                    progress=lambda done, total: bar.update(1),
                                    run_nonce=run_nonce)

    report = _bench_report(IN_PROCESS_URL if in_process else url, out, run, format_report)
    if not report["passed"]:
        raise SystemExit(1)


@bench.command("profiles")
@_bench_target
@_bench_in_process
@click.option("--api-key", envvar="SALTSERVE_API_KEY", default=None,
              help="Key of a tenant with prefix caching on. [$SALTSERVE_API_KEY]")
@click.option("--api-key-no-cache", default=None,
              help="Key of a tenant with prefix caching off (saltserve tenants create "
                   "bench-off --no-prefix-caching), for the off runs.")
@click.option("--model", default=None, help="[the server's first model]")
@click.option("--profile", "profiles", multiple=True,
              type=click.Choice(list(PROFILES)),
              help="Run only these. [all four]")
@click.option("--requests", type=click.IntRange(min=2), default=16, show_default=True,
              help="Requests per run.")
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@_bench_seeded
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Interleaved rounds per profile: each sends a new prompt set to caching off "
                   "and on (in alternating order) and to each peer, and the report pools them "
                   "and lists each round's on/off ratio, so machine drift hits both sides.")
@click.option("--metrics-token", envvar="SALTSERVE_METRICS_TOKEN", default=None,
              help="Adds the server's own cache figures from /metrics. "
                   "[$SALTSERVE_METRICS_TOKEN]")
@click.option("--peer", "peer_specs", multiple=True, metavar="NAME=URL[,KEY,MODEL]",
              help="Also run every profile against this OpenAI-compatible server (e.g. vLLM "
                   "with --enable-prefix-caching --enable-prompt-tokens-details); repeatable.")
@click.option("--hf-baseline", is_flag=True,
              help="Also run every profile through Hugging Face transformers generate in this "
                   "process, one prompt at a time (loads the model: --hf-model).")
@click.option("--hf-model", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, help="Hugging Face folder for --hf-baseline. [--model-dir]")
@_bench_plot
def bench_profiles(url: str, api_key: str, api_key_no_cache: str, model: str | None,
                   profiles: tuple[str, ...], requests: int, concurrency: int,
                   max_tokens: int, seed: int, run_nonce: str | None, rounds: int,
                   metrics_token: str | None, out: Path | None, peer_specs: tuple[str, ...],
                   hf_baseline: bool,
                   hf_model: Path | None, data_dir: Path | None, plot: Path | None,
                   in_process: bool, model_dir: Path | None) -> None:
    """The seed's four workload profiles (shared system prompt, RAG document, few-shot,
    mostly unique), each with prefix caching on and off, beside any peers and HF generate."""

    import httpx

    from app.bench.baselines import HFGenerate
    from app.bench.plots import plot_profiles
    from app.bench.profiles import format_profiles, run_profiles
    from app.bench.validate import Endpoint

    _need_keys(in_process, api_key=api_key, api_key_no_cache=api_key_no_cache)
    chosen = profiles or PROFILES
    peers = _peers(peer_specs)

    def run() -> dict:
        with contextlib.ExitStack() as stack:  # an in-process engine is closed at the end
            on, off, probe = _ours(stack, in_process, model_dir, data_dir, url, api_key,
                                   api_key_no_cache, model, metrics_token)
            peer_eps = {}
            for p in peers:
                try:
                    peer_eps[p.name] = Endpoint(p.url, p.api_key, p.model,
                                                metrics_token=p.api_key)
                except httpx.HTTPError as e:
                    raise RuntimeError(f"peer {p.name} at {p.url}: {e}") from None
            hf = None
            if hf_baseline:
                from engine.weights import DEFAULT_MODEL_NAME

                if hf_model is None and model_dir is None and on.model != DEFAULT_MODEL_NAME:
                    raise RuntimeError(f"the server serves {on.model}; give --hf-model (its "
                                       "Hugging Face folder) for the generate baseline")
                hf = HFGenerate(hf_model or _model_dir(model_dir, data_dir))
            with click.progressbar(length=len(chosen), label="profiles", file=sys.stderr) as bar:
                return run_profiles(on, off, requests, concurrency, max_tokens, seed, chosen,
                                    progress=lambda name: bar.update(1), peers=peer_eps, hf=hf,
                                    probe=probe, rounds=rounds, nonce=run_nonce)

    _bench_report(IN_PROCESS_URL if in_process else url, out, run, format_profiles, plot,
                  plot_profiles)


@bench.command("working-set")
@_bench_target
@click.option("--api-key", envvar="SALTSERVE_API_KEY", required=True,
              help="A tenant's key. [$SALTSERVE_API_KEY]")
@click.option("--model", default=None, help="[the server's first model]")
@click.option("--prompts", type=click.IntRange(min=1), default=24, show_default=True,
              help="Distinct system prompts (the working set).")
@click.option("--tokens", type=click.IntRange(min=16), default=1500, show_default=True,
              help="Tokens of each system prompt (about).")
@click.option("--rounds", type=click.IntRange(min=2), default=3, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=8, show_default=True)
@_bench_seeded
@click.option("--peer", "peer_specs", multiple=True, metavar="NAME=URL[,KEY,MODEL]",
              help="Also run it against this OpenAI-compatible server (llama.cpp's "
                   "llama-server, vLLM), after ours; repeatable.")
@_bench_plot
def bench_working_set(url: str, api_key: str, model: str | None, prompts: int, tokens: int,
                      rounds: int, concurrency: int, max_tokens: int, seed: int,
                      run_nonce: str | None, peer_specs: tuple[str, ...],
                      out: Path | None, plot: Path | None) -> None:
    """A working set larger than the KV pool (distinct long system prompts, several rounds):
    hit rate, wall time and TTFT per round, ours beside any peers (the offload tiers'
    workload, docs/prefix-caching.md)."""
    from app.bench.plots import plot_working_set
    from app.bench.validate import Endpoint
    from app.bench.working_set import format_working_set, run_working_set

    peers = _peers(peer_specs, taken=("saltserve",))

    def run() -> dict:
        endpoints = {"saltserve": Endpoint(url, api_key, model)}
        for p in peers:
            endpoints[p.name] = Endpoint(p.url, p.api_key, p.model)
        return run_working_set(endpoints, prompts, tokens, rounds, concurrency, max_tokens,
                               seed, run_nonce, progress=lambda s: click.echo(s, err=True))

    _bench_report(url, out, run, format_working_set, plot, plot_working_set)


@bench.command("tenants")
@_bench_target
@click.option("--admin-token", envvar="SALTSERVE_ADMIN_TOKEN", required=True,
              help="An admin JWT: creates the run's tenants (disabled afterwards) and reads "
                   "/metrics. [$SALTSERVE_ADMIN_TOKEN]")
@click.option("--tenants", "n_tenants", type=click.IntRange(min=1), default=4,
              show_default=True, help="Tenants with their own system prompt.")
@click.option("--requests", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests per tenant, one at a time.")
@click.option("--flood-requests", type=click.IntRange(min=1), default=32, show_default=True,
              help="Unique prompts the flooding tenant sends meanwhile.")
@click.option("--flood-concurrency", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=8, show_default=True)
@_bench_seeded
@_bench_plot
def bench_tenants(url: str, admin_token: str, n_tenants: int, requests: int,
                  flood_requests: int, flood_concurrency: int, max_tokens: int, seed: int,
                  run_nonce: str | None, out: Path | None, plot: Path | None) -> None:
    """N tenants share the pool while one floods unique prompts: per-tenant hit rate, TTFT and
    the blocks the flood evicted from each."""

    from app.bench.plots import plot_tenants
    from app.bench.tenants import format_tenants, run_tenants

    def run() -> dict:
        total = n_tenants * (requests + 1) + flood_requests
        with click.progressbar(length=total, label="requests", file=sys.stderr) as bar:
            return run_tenants(url, admin_token, n_tenants, requests, flood_requests,
                               flood_concurrency, max_tokens, seed, nonce=run_nonce,
                               progress=lambda: bar.update(1))

    _bench_report(url, out, run, format_tenants, plot, plot_tenants)


@bench.command("sweep")
@_bench_target
@_bench_in_process
@click.option("--api-key", envvar="SALTSERVE_API_KEY", default=None,
              help="Key of a tenant with prefix caching on (every axis but pool_size). "
                   "[$SALTSERVE_API_KEY]")
@click.option("--api-key-no-cache", default=None,
              help="Key of a tenant with prefix caching off (every axis but pool_size).")
@click.option("--axis", type=click.Choice(list(SWEEP_AXES)), default="prefix_length",
              show_default=True, help="What varies (docs/benchmarks.md).")
@click.option("--values", default=None,
              help="Comma-separated values of the axis. [prefix_length 250,500,1000,2000 "
                   "tokens; match_rate 0,0.25,0.5,0.75,1; concurrency 1,2,4,8; output_length "
                   "1,16,64,128 tokens; pool_size 80,160,240,320 blocks]")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="prefix_length: cold / warm / off triples per value.")
@click.option("--requests", type=click.IntRange(min=1), default=12, show_default=True,
              help="Requests per run (every other axis).")
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True,
              help="output_length: requests in flight.")
@click.option("--prefix-tokens", type=click.IntRange(min=16), default=1000, show_default=True,
              help="match_rate, pool_size: length of each prefix / document.")
@click.option("--documents", type=click.IntRange(min=1), default=3, show_default=True,
              help="pool_size: documents asked about in turn.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=4, show_default=True)
@_bench_seeded
@click.option("--metrics-token", envvar="SALTSERVE_METRICS_TOKEN", default=None,
              help="Adds block size, pool and device to the report.")
@_bench_plot
def bench_sweep(url: str, api_key: str | None, api_key_no_cache: str | None, axis: str,
                values: str | None, rounds: int, requests: int, concurrency: int,
                prefix_tokens: int, documents: int, max_tokens: int, seed: int,
                run_nonce: str | None, metrics_token: str | None, model_dir: Path | None,
                data_dir: Path | None,
                out: Path | None, plot: Path | None, in_process: bool) -> None:
    """One axis at a time (prefix length, match rate, concurrency, output length, pool size),
    caching on and off; pool_size starts its own servers and needs no --url."""

    from app.bench.plots import plot_sweep
    from app.bench.sweep import DEFAULT_VALUES, format_sweep, parse_values, run_sweep

    try:
        chosen = parse_values(axis, values or DEFAULT_VALUES[axis])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--values") from None
    if axis != "pool_size":
        _need_keys(in_process, api_key=api_key, api_key_no_cache=api_key_no_cache)

    def run() -> dict:
        with click.progressbar(length=len(chosen), label=axis, file=sys.stderr) as bar:
            kwargs = {"rounds": rounds, "max_tokens": max_tokens, "seed": seed,
                      "requests": requests, "concurrency": concurrency,
                      "prefix_tokens": prefix_tokens, "documents": documents,
                      "progress": lambda _: bar.update(1), "nonce": run_nonce}
            if axis == "pool_size":  # its own servers, one per size
                return run_sweep(axis, chosen, model_dir=_model_dir(model_dir, data_dir),
                                 **kwargs)
            with contextlib.ExitStack() as stack:
                on, off, _ = _ours(stack, in_process, model_dir, data_dir, url, api_key,
                                   api_key_no_cache, None, metrics_token)
                return run_sweep(axis, chosen, on, off, **kwargs)

    _bench_report(IN_PROCESS_URL if in_process else url, out, run, format_sweep, plot,
                  plot_sweep)
