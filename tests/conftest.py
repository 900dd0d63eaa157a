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
