"""``EngineConfig`` is the one source of engine settings: adding a field adds the ``Settings``
field (env ``SALTSERVE_<FIELD>``) and the ``serve`` flag, with its default, help and choices."""

from __future__ import annotations

import os
from dataclasses import MISSING, fields
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from app.cli.options import serve_options, settings_from_options
from app.cli.serve import serve
from app.settings import Settings
from engine.block_hash import HASH_ALGOS
from engine.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_OFFLOAD_WRITE_POLICIES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    EngineConfig,
)

# Every field but the model and those the server fills from its own settings ("flag": False).
ENGINE_FIELDS = [f for f in fields(EngineConfig)
                 if f.name != "model" and f.metadata.get("flag") is not False]
CHOICE_CONSTANTS = {"prefix_caching_hash_algo": HASH_ALGOS, "dtype": DTYPES, "device": DEVICES,
                    "attention_backend": ATTENTION_BACKENDS,
                    "scheduling_policy": SCHEDULING_POLICIES, "quantization": QUANTIZATIONS,
                    "kv_cache_dtype": KV_CACHE_DTYPES,
                    "kv_offload_write_policy": KV_OFFLOAD_WRITE_POLICIES}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in os.environ:
        if name.startswith("SALTSERVE_"):
            monkeypatch.delenv(name)


def _serve_option(name: str) -> click.Option:
    flag = "--" + name.replace("_", "-")
    matches = [p for p in serve.params if flag in p.opts]
    assert len(matches) == 1, f"serve has no single {flag} option"
    return matches[0]  # type: ignore[return-value]


@pytest.mark.parametrize("f", ENGINE_FIELDS, ids=lambda f: f.name)
def test_engine_field_is_a_setting_with_the_same_default(f):
    assert f.default is not MISSING
    setting = Settings.model_fields[f.name]
    assert setting.default == f.default
    assert setting.description == f.metadata["help"]


def test_default_settings_give_the_default_engine_config(tmp_path):
    """The same defaults, but the disk tier the server turns on (in its data dir, 8 GiB or
    half the free disk) and the Redis namespace it shares with the cluster."""
    served = Settings(data_dir=tmp_path).engine_config(tmp_path)
    assert 0 < served.kv_offload_size <= 8 << 30
    assert served.kv_offload_dir == str(tmp_path / "kv-offload")
    assert served.kv_offload_redis_url is None  # no --redis-url: no shared tier
    assert served == EngineConfig(model=str(tmp_path), kv_offload_size=served.kv_offload_size,
                                  kv_offload_dir=served.kv_offload_dir)
    assert Settings().max_model_len is None  # the model's max_position_embeddings
    with_redis = Settings(data_dir=tmp_path, redis_url="redis://h:1/0", redis_namespace="ns",
                          kv_offload_size="0").engine_config(tmp_path)
    assert with_redis.kv_offload_redis_url == "redis://h:1/0" and with_redis.kv_offload_size == 0
    assert with_redis.kv_offload_redis_namespace == "ns"


def test_sizes_take_units(tmp_path):
    config = Settings(data_dir=tmp_path, kv_offload_size="2GiB",
                      kv_offload_redis_size="500MB").engine_config(tmp_path)
    assert config.kv_offload_size == 2 << 30 and config.kv_offload_redis_size == 500_000_000
    opt = _serve_option("kv_offload_size")
    assert opt.type.convert("1.5GiB", opt, None) == 3 << 29
    with pytest.raises(click.BadParameter, match="is not a size"):
        opt.type.convert("lots", opt, None)


@pytest.mark.parametrize("f", ENGINE_FIELDS, ids=lambda f: f.name)
def test_engine_field_is_a_serve_flag_with_help(f):
    opt = _serve_option(f.name)
    assert opt.name == f.name
    assert opt.default is None  # unset flags fall back to Settings (env, then the default)
    help_ = f.metadata["help"]
    assert help_ and "\n" not in help_ and opt.help.startswith(help_)
    shown = f.metadata.get("unset") if f.default is None else f.default
    if f.metadata.get("bytes") and f.default == 1 << 30:
        shown = "1GiB"
    if f.default is True:
        shown = "on"
    assert f"[{shown}; env SALTSERVE_{f.name.upper()}]" in opt.help
    if isinstance(f.default, bool):
        assert opt.is_bool_flag and opt.secondary_opts == ["--no-" + f.name.replace("_", "-")]
    if "choices" in f.metadata:
        assert isinstance(opt.type, click.Choice)


def test_choice_flags_use_the_code_constants():
    assert {f.name for f in ENGINE_FIELDS if "choices" in f.metadata} == set(CHOICE_CONSTANTS)
    for name, constant in CHOICE_CONSTANTS.items():
        assert tuple(_serve_option(name).type.choices) == constant, name
        with pytest.raises(ValueError, match="--" + name.replace("_", "-")):
            EngineConfig(model="m", **{name: "bogus"})


def test_bool_field_keeps_its_flag_pair():
    opt = _serve_option("enable_prefix_caching")
    assert opt.opts == ["--enable-prefix-caching"]
    assert opt.secondary_opts == ["--no-enable-prefix-caching"]


def _run_serve_options(args: list[str], model_dir: Path) -> EngineConfig:
    """Parses ``args`` with ``serve``'s options and builds the config as ``serve`` does."""
    seen: list[EngineConfig] = []

    @click.command()
    @serve_options
    def fake_serve(**opts):
        seen.append(settings_from_options(**opts).engine_config(model_dir))

    assert [p.name for p in fake_serve.params] == [p.name for p in serve.params]
    r = CliRunner().invoke(fake_serve, args)
    assert r.exit_code == 0, r.output
    return seen[0]


def test_env_reaches_engine_config_and_flags_win(monkeypatch, tmp_path):
    monkeypatch.setenv("SALTSERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("SALTSERVE_ENABLE_PREFIX_CACHING", "false")
    assert Settings().engine_config(tmp_path).max_num_seqs == 7

    cfg = _run_serve_options([], tmp_path)
    assert cfg.max_num_seqs == 7 and cfg.enable_prefix_caching is False
    assert cfg.block_size == 16 and cfg.max_model_len is None

    cfg = _run_serve_options(["--max-num-seqs", "9", "--enable-prefix-caching",
                              "--dtype", "float16", "--max-model-len", "256"], tmp_path)
    assert cfg.max_num_seqs == 9 and cfg.enable_prefix_caching is True
    assert cfg.dtype == "float16" and cfg.max_model_len == 256


def test_bad_choice_flag_is_refused_by_click(tmp_path):
    @click.command()
    @serve_options
    def fake_serve(**opts):  # pragma: no cover - never reached
        raise AssertionError

    r = CliRunner().invoke(fake_serve, ["--device", "tpu"])
    assert r.exit_code == 2 and "--device" in r.output
