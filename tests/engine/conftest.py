"""Engine test fixtures shared by several modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """The bundled model in Hugging Face transformers (fp32, eval): the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
