"""The GGUF conversion runs on a thread of its own (``engine.weights.on_own_thread``), so the
thread that starts the server keeps no torch (OpenMP) thread pool beside the engine thread's:
with two pools on 2 cores libgomp stops spinning at its barriers and every decode op waits for a
futex wake-up (a first-started server would serve a stream markedly slower than a restart)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from engine import weights

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_parallel_op_run_on_its_own_thread_leaves_no_pool_behind_but_one_run_here_does():
    # A fresh interpreter: pytest's own thread already has a pool from earlier tests.
    code = textwrap.dedent("""
        import os, time, torch
        from engine.weights import on_own_thread
        torch.set_num_threads(2)
        x = torch.randn(1 << 22)
        tasks = lambda: len(os.listdir("/proc/self/task"))
        def settled(want):  # join() returns before the OS threads are gone: wait, up to 10 s
            deadline = time.monotonic() + 10
            while tasks() != want and time.monotonic() < deadline:
                time.sleep(0.01)
            return tasks()
        before = tasks()
        total = on_own_thread(lambda: float(torch.exp(x).sum()))
        after_own = settled(before)
        torch.exp(x).sum()  # the same op on this thread: its pool's worker stays
        time.sleep(0.2)
        print(before, after_own, tasks(), total > 0)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=False, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    before, after_own, after_direct, positive = out.stdout.split()
    assert positive == "True"
    assert int(after_own) == int(before)
    assert int(after_direct) == int(before) + 1  # so the check above can fail


def test_on_own_thread_returns_the_result_and_raises_the_error_on_the_caller():
    seen = []
    assert weights.on_own_thread(lambda: seen.append(threading.current_thread()) or 7) == 7
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(ZeroDivisionError):
        weights.on_own_thread(lambda: 1 / 0)


def test_convert_gguf_does_its_work_off_the_calling_thread(monkeypatch, tmp_path):
    ran_on = []

    def fake(gguf_path: Path, out_dir: Path) -> Path:
        ran_on.append(threading.current_thread())
        return out_dir

    monkeypatch.setattr(weights, "_convert_gguf", fake)
    out = tmp_path / "m"
    assert weights.convert_gguf(tmp_path / "x.gguf", out) == out
    assert len(ran_on) == 1 and ran_on[0] is not threading.current_thread()


def test_a_conversion_cut_off_at_exit_leaves_a_folder_the_next_one_removes(tmp_path):
    old, young, model = (tmp_path / ".convert-old", tmp_path / ".convert-young",
                         tmp_path / "SmolLM2-135M-Instruct")
    for d in (old, young, model):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x")
    now = time.time()
    os.utime(old, (now - weights.STALE_CONVERSION_S - 60,) * 2)
    assert weights.remove_stale_conversions(tmp_path, now=now) == [old]
    assert not old.exists()
    assert young.exists() and model.exists()  # maybe another process's, in progress; the model
