"""Sampling defaults from the generation config (vLLM ``--generation-config`` and
``--override-generation-config``)."""

from __future__ import annotations

import json

import pytest

from engine.config import EngineConfig, sampling_defaults


def _folder(tmp_path, **values):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "do_sample": True, **values}))
    return tmp_path


def test_auto_reads_the_model_folder_and_override_wins(tmp_path):
    model = _folder(tmp_path, temperature=0.3, top_k=20, max_new_tokens=99)
    assert sampling_defaults(EngineConfig(model=str(model)), model) == {"temperature": 0.3,
                                                                      "top_k": 20}
    cfg = EngineConfig(model=str(model), override_generation_config='{"temperature": 0.9, '
                                                                    '"top_p": 0.5}')
    assert sampling_defaults(cfg, model) == {"temperature": 0.9, "top_k": 20, "top_p": 0.5}


def test_vllm_ignores_the_model_folder_and_a_folder_can_be_named(tmp_path):
    (tmp_path / "m").mkdir()
    model = _folder(tmp_path / "m", temperature=0.3)
    assert sampling_defaults(EngineConfig(model=str(model), generation_config="vllm"),
                             model) == {}
    other = tmp_path / "other"
    other.mkdir()
    _folder(other, repetition_penalty=1.1)
    cfg = EngineConfig(model=str(model), generation_config=str(other))
    assert sampling_defaults(cfg, model) == {"repetition_penalty": 1.1}
    with pytest.raises(FileNotFoundError):
        sampling_defaults(EngineConfig(model=str(model), generation_config=str(tmp_path / "x")),
                          model)


@pytest.mark.parametrize("text", ["not json", "[1]", '{"min_p": 0.1}', '{"temperature": "hot"}',
                                  '{"top_k": true}'])
def test_a_bad_override_is_refused_at_start_up(tmp_path, text):
    with pytest.raises(ValueError, match="--override-generation-config"):
        EngineConfig(model=str(tmp_path), override_generation_config=text)


def test_the_bundled_model_ships_its_authors_sampling_defaults(model_dir):
    cfg = EngineConfig(model=str(model_dir))
    assert sampling_defaults(cfg, model_dir) == {"temperature": 0.2, "top_p": 0.9}
