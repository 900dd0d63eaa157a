"""``saltserve tenants`` / ``keys`` commands against a real SQLite data directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from app.cli.main import main


def test_tenant_and_key_lifecycle(tmp_path):
    runner = CliRunner()
    dd = ["--data-dir", str(tmp_path)]
    r = runner.invoke(main, ["tenants", "create", "acme", *dd])
    assert r.exit_code == 0, r.output
    assert re.search(r"tenant acme id=[0-9a-f]{32} salt_version=1", r.output)
    r = runner.invoke(main, ["tenants", "create", "acme", *dd])
    assert r.exit_code == 1 and "already exists" in r.output

    r = runner.invoke(main, ["keys", "create", "--tenant", "acme", *dd])
    assert r.exit_code == 0, r.output
    key = r.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"ss-([0-9a-f]{12})-(\S{43,})", key)
    assert m, key
    key_id = m.group(1)

    r = runner.invoke(main, ["keys", "list", "--tenant", "acme", *dd])
    assert r.exit_code == 0
    assert f"ss-{key_id}-...{key[-4:]}" in r.output and "active" in r.output
    assert m.group(2) not in r.output  # the secret is never shown again

    assert runner.invoke(main, ["keys", "revoke", key_id, *dd]).exit_code == 0
    r = runner.invoke(main, ["keys", "list", "--tenant", "acme", *dd])
    assert "revoked" in r.output
    r = runner.invoke(main, ["keys", "create", "--tenant", "nobody", *dd])
    assert r.exit_code == 1 and "no tenant" in r.output

    r = runner.invoke(main, ["tenants", "list", *dd])
    assert "acme" in r.output
    assert (tmp_path / "master.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "saltserve.db").exists()


def test_serve_help_lists_engine_flags():
    r = CliRunner().invoke(main, ["serve", "--help"])
    assert r.exit_code == 0
    for flag in ("--data-dir", "--database-url", "--host", "--port", "--model", "--block-size",
                 "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                 "--enable-prefix-caching / --no-enable-prefix-caching",
                 "--prefix-caching-hash-algo", "--num-gpu-blocks-override",
                 "--kv-cache-memory-bytes", "--gpu-memory-utilization", "--attention-backend"):
        assert flag in r.output, flag


def test_an_unreachable_database_is_a_one_line_error_without_the_password(tmp_path):
    for args in (["tenants", "list"], ["serve", "--port", "1"]):
        r = CliRunner().invoke(main, [*args, "--data-dir", str(tmp_path), "--database-url",
                                      "postgresql://ops:hunter2@127.0.0.1:9/saltserve"])
        assert r.exit_code != 0, args
        error = [line for line in r.output.splitlines() if line.startswith("Error:")]
        assert len(error) == 1 and "cannot use the database at" in error[0], r.output
        assert "Connection refused" in error[0] or "connection" in error[0].lower()
        assert "hunter2" not in r.output and "Traceback" not in r.output
        assert r.exception is None or isinstance(r.exception, SystemExit)


def test_version_and_env_only_settings_in_help():
    assert CliRunner().invoke(main, ["--version"]).output.strip() == "saltserve, version 0.1.0"
    help_text = " ".join(CliRunner().invoke(main, ["serve", "--help"]).output.split())
    for setting in ("SALTSERVE_METRICS_TOKEN", "SALTSERVE_MASTER_KEY", "SALTSERVE_JWT_JWKS_URL",
                    "SALTSERVE_MAX_REQUEST_BODY_BYTES", "SALTSERVE_REDIS_NAMESPACE"):
        assert setting in help_text, setting
    for flag in ("--log-format", "--log-level", "--redis-url", "--drain-seconds",
                 "--replica-id"):
        assert flag in help_text, flag


def test_serve_with_a_model_folder_without_config_is_a_one_line_error(tmp_path):
    """A mistyped ``--model`` path: a usage error naming it, before the data dir is touched."""
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    data = tmp_path / "data"
    r = CliRunner().invoke(main, ["serve", "--port", "1", "--data-dir", str(data), "--model",
                                  str(empty)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert f"--model {empty}: not a Hugging Face model folder (no config.json" in r.output
    assert not (data / "saltserve.db").exists() and not list(data.glob("*.db"))


@pytest.mark.parametrize("flags,message", [
    (["--kv-cache-dtype", "bfloat16", "--dtype", "float16"],
     "--kv-cache-dtype bfloat16 needs --dtype float32 or bfloat16"),
    (["--block-size", "0"], "--block-size must be in [1, 256]"),
    (["--quantized-activation-bits", "4", "--quantization", "gguf"],
     "--quantized-activation-bits must be 16 or 8"),
    (["--quantized-activation-bits", "8"], "needs --quantization int8 or gguf"),
])
def test_serve_with_a_bad_engine_flag_fails_before_writing_the_data_dir(tmp_path, flags,
                                                                        message):
    """An engine flag that EngineConfig refuses is a one-line usage error, before the data dir
    gets a database, keys or a demo tenant (checked after them, it would leave a half-made data
    dir)."""
    data = tmp_path / "data"
    r = CliRunner().invoke(main, ["serve", "--port", "1", "--data-dir", str(data), *flags])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert message in r.output
    assert not data.exists() or not any(data.iterdir())


# Objects still frozen (gc.freeze) at interpreter exit are never finalised, and triton's
# nanobind bindings then print a "nanobind: leaked ..." report. `saltserve serve` freezes its
# startup heap; on its first start (which converts the model) that heap held triton objects,
# and a Ctrl-C of that start printed about 40 lines of that report.
_EXIT_AFTER_FREEZE = """
import gc, sys
import triton.language  # builds a few nanobind objects at import
if sys.argv[1] == "serve":
    from app.cli.serve import _freeze_startup_heap
    assert _freeze_startup_heap() > 0
else:
    gc.freeze()
raise SystemExit(1)  # as `serve` exits after the engine died (a Ctrl-C exits the same way)
"""


def test_the_frozen_startup_heap_is_given_back_at_exit_so_nothing_reports_leaks():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as `make serve`
    root = Path(__file__).resolve().parents[2]

    def run(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _EXIT_AFTER_FREEZE, mode], check=False,
                              cwd=root, env=env, capture_output=True, text=True, timeout=120)

    kept = run("bare")  # the control: frozen at exit, triton reports its objects as leaked
    assert kept.returncode == 1 and "nanobind: leaked" in kept.stderr, kept.stderr[-2000:]
    given_back = run("serve")
    assert given_back.returncode == 1, given_back.stderr[-2000:]
    assert "leaked" not in given_back.stderr, given_back.stderr[-2000:]


def test_serve_turns_a_busy_journal_into_one_line_and_lets_other_errors_raise(tmp_path,
                                                                              monkeypatch):
    """Another server on this data dir is a one-line error; an unexpected RuntimeError (a torch
    load error, out of memory) keeps its traceback instead of being passed off as one."""
    import app.parts
    from tenants.usage_journal import JournalInUse

    def busy(*args, **kwargs):
        raise JournalInUse("the usage journal /x is in use by another process")

    monkeypatch.setattr(app.parts, "parts_from_settings", busy)
    r = CliRunner().invoke(main, ["serve", "--data-dir", str(tmp_path)])
    assert r.exit_code == 1 and "in use by another process" in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)

    def broken(*args, **kwargs):
        raise RuntimeError("a load error")

    monkeypatch.setattr(app.parts, "parts_from_settings", broken)
    r = CliRunner().invoke(main, ["serve", "--data-dir", str(tmp_path)])
    assert isinstance(r.exception, RuntimeError) and str(r.exception) == "a load error"
