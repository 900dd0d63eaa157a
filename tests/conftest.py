"""Suite-wide set-up. TRITON_INTERPRET must be set before the first ``import triton``."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
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
