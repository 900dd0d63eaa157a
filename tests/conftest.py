"""Suite-wide set-up. TRITON_INTERPRET must be set before the first ``import triton``."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import functools
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

POSTGRES_URL = os.environ.get(
    "SALTSERVE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@functools.cache
def _postgres_unreachable_reason() -> str | None:
    from sqlalchemy import text
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    from tenants.db import make_engine

    engine = make_engine(POSTGRES_URL)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except (SQLAlchemyError, ImportError, OSError) as exc:  # driver or network: not available
        return f"PostgreSQL not reachable at {make_url(POSTGRES_URL).render_as_string()}: " + (
            type(exc).__name__
        )
    finally:
        engine.dispose()
    return None


def _drop_all(engine) -> None:
    from sqlalchemy import text

    from tenants.models import Base

    Base.metadata.drop_all(engine)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE IF EXISTS alembic_version"))


@pytest.fixture(autouse=True)
def _restore_umask() -> Iterator[None]:
    """``saltserve``'s CLI sets umask 077 for its process; CliRunner runs it in this one, so
    each test gets the umask it started with back (no test passes because of an earlier one)."""
    mask = os.umask(0o022)
    os.umask(mask)
    yield
    os.umask(mask)


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database URL with an empty database (nothing migrated yet): SQLite in tmp_path, or a
    throw-away schema on PostgreSQL (skipped cleanly when PostgreSQL is unreachable)."""
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    from tenants.db import make_engine

    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tenants.db'}"
        return
    reason = _postgres_unreachable_reason()
    if reason is not None:
        pytest.skip(reason)
    schema = f"t_{secrets.token_hex(6)}"
    admin = make_engine(POSTGRES_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    scoped = make_engine(url)
    try:
        _drop_all(scoped)
        yield url.render_as_string(hide_password=False)
    finally:
        _drop_all(scoped)
        scoped.dispose()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()

TEST_DATA_DIR = REPO_ROOT / ".cache" / "test-data"


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct, converted once per checkout into .cache/test-data."""
    from engine.weights import ensure_default_model

    return ensure_default_model(TEST_DATA_DIR)


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def make_llm_engine(model_dir: Path, tokenizer) -> Callable:
    """Builds an ``LLMEngine`` on the bundled model with ``EngineConfig`` overrides (fp32, CPU)."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    def make(**overrides):
        kwargs = {"max_model_len": 1024, "device": "cpu", "dtype": "float32",
                  "num_gpu_blocks_override": 256, **overrides}
        return LLMEngine(EngineConfig(model=str(model_dir), **kwargs), tokenizer=tokenizer)

    return make


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """The bundled model in Hugging Face transformers (fp32, eval): the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture
def fused_layer_calls(monkeypatch) -> list:
    """Spies on the fused CPU decode layers (``kernels.cpu_ops``): one entry per layer run
    fused, ``("whole", meta)`` through ``decode_layers`` (every layer of the step in one call)
    or ``("one", meta)`` through ``decode_layer`` (one layer a call), with the step's
    ``AttentionMetadata``."""
    from kernels import cpu_ops

    calls: list = []
    one, whole = cpu_ops.decode_layer, cpu_ops.decode_layers

    def spy_one(*args, **kw):
        calls.append(("one", args[13]))
        return one(*args, **kw)

    def spy_whole(*args, **kw):
        calls.extend([("whole", args[9])] * args[8].shape[0])
        return whole(*args, **kw)

    monkeypatch.setattr(cpu_ops, "decode_layer", spy_one)
    monkeypatch.setattr(cpu_ops, "decode_layers", spy_whole)
    return calls


# -- test tiers -----------------------------------------------------------------------------
# `make test` runs everything; `make test-fast` runs `-m "not slow"`: unit, engine and API tests
# on the fake model. Each test below gets its kind's marker and `slow` (registered in
# pyproject.toml). Kinds come from the test's file or function (keys relative to tests/,
# tests/test_tiers.py checks that each still exists), or from the fixtures it reaches.
SLOW_TESTS: dict[str, tuple[str, ...]] = {
    "app/test_console_browser.py": ("browser",),         # Playwright + Debian's chromium
    "app/test_cluster_haproxy.py": ("cluster", "real_model"),  # HAProxy + `saltserve serve`s
    "app/test_cluster.py": ("cluster",),                 # two replicas over PostgreSQL + Redis
    "app/test_limits_redis.py": ("cluster",),            # replicas' shared limits in Redis
    "engine/test_kv_offload_redis.py": ("cluster",),     # the shared KV tier in Redis
    "app/test_serve_e2e.py": ("real_model",),            # `saltserve serve` / `bench` processes
    "app/test_serve_families.py": ("real_model",),       # `saltserve serve` on tiny checkpoints
    "engine/test_model_families.py": ("real_model",),    # Hugging Face parity of every family
    "engine/test_gguf_families.py": ("real_model",),     # tiny checkpoints of every family as GGUFs
    "engine/test_gguf_kquants.py": ("real_model",),      # K-quant GGUFs against their fp32 twin
    "app/test_bench_in_process.py": ("real_model",),
    "app/test_timing_side_channel.py": ("real_model",),  # real_model=True
    "app/test_fuzz_schema.py": (),                       # schemathesis over every route
    # These build our C++ kernels when their module is imported (cpu_linear.load()).
    "engine/test_fused_decode.py": ("native",),
    "engine/test_kv_cache_dtype.py": ("native",),
    "engine/test_quantization.py": ("native",),
    "kernels/test_cpu_linear.py": ("native",),
    "kernels/test_cpu_ops.py": ("native",),
    "kernels/test_kernel_compile.py": ("native",),       # Triton kernels compiled to cubins
    "engine/test_step_threads.py::test_a_served_engine_times_both_counts_and_gives_the_threads_back":
        ("real_model",),                                 # AsyncLLM.from_config on the model
}
# The real bundled model: an engine on it, the HF reference, or an app serving it.
REAL_MODEL_FIXTURES = frozenset({"make_llm_engine", "hf_model", "real_app_env"})
# Reaches make_llm_engine for its real_model=True option; on its own it builds the fake model.
FAKE_MODEL_BUILDERS = frozenset({"app_env_builder"})


def _reached_fixtures(item: pytest.Item) -> set[str]:
    """The fixtures ``item`` requests, directly or through other fixtures, without looking
    inside ``FAKE_MODEL_BUILDERS``."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set(getattr(item, "fixturenames", ()))
    seen: set[str] = set()
    todo = list(info.initialnames)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        defs = info.name2fixturedefs.get(name)
        if defs and name not in FAKE_MODEL_BUILDERS:
            todo.extend(defs[-1].argnames)
    return seen


def pytest_configure(config: pytest.Config) -> None:
    """With ``-m "not slow"`` (the fast tier) our CPU kernels stay off, as ``make test-fast``
    sets: several engine and kernel test modules build them when imported, which an edited .cpp
    turns into minutes of compiling at collection. An explicit ``SALTSERVE_CPU_KERNELS`` wins."""
    if "not slow" in (config.getoption("markexpr", "") or ""):
        os.environ.setdefault("SALTSERVE_CPU_KERNELS", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests_dir = Path(__file__).resolve().parent
    for item in items:
        try:
            rel = item.path.resolve().relative_to(tests_dir).as_posix()
        except ValueError:
            continue
        name = getattr(item, "originalname", item.name)
        found = [SLOW_TESTS[k] for k in (rel, f"{rel}::{name}") if k in SLOW_TESTS]
        marks = {kind for kinds in found for kind in kinds}
        if REAL_MODEL_FIXTURES & _reached_fixtures(item):
            marks.add("real_model")
        if found or marks:
            for mark in sorted(marks | {"slow"}):
                item.add_marker(mark)
