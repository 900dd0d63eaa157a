"""docs/models.md cannot drift from the registry: one row per registered architecture, no row
for an unregistered one, and its "fused CPU decode" column matches what each family's spec
says for transformers' default config of that family (shaped small)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tiny_checkpoints import SMALL

from engine.models.config import ModelConfig
from engine.models.registry import supported_architectures

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
# transformers' config class of each architecture, and what its real checkpoints set that the
# class leaves off (a mixture of experts' sizes).
CONFIGS = {
    "LlamaForCausalLM": ("LlamaConfig", {}), "MistralForCausalLM": ("MistralConfig", {}),
    "Qwen2ForCausalLM": ("Qwen2Config", {}), "Qwen3ForCausalLM": ("Qwen3Config", {}),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", {"num_experts": 4, "moe_intermediate_size": 32}),
    "MixtralForCausalLM": ("MixtralConfig", {"num_local_experts": 4}),
    "Gemma2ForCausalLM": ("Gemma2Config", {}), "Gemma3ForCausalLM": ("Gemma3TextConfig", {}),
    "Phi3ForCausalLM": ("Phi3Config", {}), "Olmo2ForCausalLM": ("Olmo2Config", {}),
    "GraniteForCausalLM": ("GraniteConfig", {"embedding_multiplier": 12.0}),
    "SmolLM3ForCausalLM": ("SmolLM3Config", {}),
    "GptOssForCausalLM": ("GptOssConfig", {"num_local_experts": 4}),
}


def doc_rows(text: str) -> dict[str, list[str]]:
    """Architecture -> its row's cells, from the table under "## Families"."""
    rows = {}
    for line in text.split("## Families", 1)[1].split("\n## ", 1)[0].splitlines():
        m = re.match(r"\| `(\w+)` \|(.*)\|$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def test_every_registered_architecture_has_one_row_and_no_more():
    rows = doc_rows(DOC.read_text())
    assert sorted(rows) == sorted(supported_architectures())
    assert set(CONFIGS) == set(supported_architectures())


def test_the_check_would_notice_a_missing_row():
    text = DOC.read_text()
    cut = "\n".join(line for line in text.splitlines() if not line.startswith("| `Qwen3"))
    assert sorted(doc_rows(cut)) != sorted(supported_architectures())


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_fused_decode_column_matches_the_spec(arch):
    import transformers

    cls_name, extra = CONFIGS[arch]
    hf = getattr(transformers, cls_name)(**{**SMALL, **extra}).to_dict()
    hf["architectures"] = [arch]
    spec = ModelConfig.from_hf_config(hf).spec
    fused = not spec.fused_decode_blockers(16, max_position=512)
    cell = doc_rows(DOC.read_text())[arch][1]
    assert cell.startswith("yes") == fused, (arch, cell, spec.fused_decode_blockers(16, 512))
