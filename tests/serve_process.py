"""``saltserve serve`` as a real process (uvicorn) on a free port, for end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """The process's child processes (Linux: /proc/PID/task/TID/children)."""
    found: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(c) for c in children.read_text().split()]
        except OSError:
            pass
    return found


def _running(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass
class ServerProcess:
    base: str  # http://127.0.0.1:<port>
    data_dir: Path
    process: subprocess.Popen
    port: int
    output: str = ""  # everything it printed, once it has stopped


@contextmanager
def serve(model_dir: Path, data_dir: Path, *args: str, port: int | None = None,
          startup_timeout_s: float = 180.0, wait_for_children: bool = False
          ) -> Iterator[ServerProcess]:
    """Starts the server on the bundled model (``--max-model-len 512``,
    ``--num-gpu-blocks-override 96`` and ``args``) on ``port`` (default: a free one), waits
    for ``/health``; on exit stops it (SIGTERM, then SIGKILL after 30 s) and keeps its output
    in ``.output``; with ``wait_for_children``, read once the processes it had started (its parse
    workers, multiprocessing's resource tracker, which prints on its own way out) have ended too
    (up to 30 s more). The output goes to a file while it runs: a pipe nobody reads fills after
    64 KiB of log lines and then blocks the server's event loop on its next log write."""
    port = port or free_port()
    env = {**os.environ, "SALTSERVE_DATA_DIR": str(data_dir)}
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--model",
           str(model_dir), "--max-model-len", "512", "--num-gpu-blocks-override", "96", *args]
    log = tempfile.TemporaryFile(mode="w+", prefix=f"serve-{port}-")  # noqa: SIM115 (closed in finally)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            text=True)
    server = ServerProcess(f"http://127.0.0.1:{port}", data_dir, proc, port)

    def output() -> str:
        log.seek(0)
        return log.read()

    try:
        deadline = time.time() + startup_timeout_s
        while time.time() < deadline:
            assert proc.poll() is None, output()
            try:
                if httpx.get(server.base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise AssertionError("server did not become healthy")
        yield server
    finally:
        children = _children(proc.pid) if wait_for_children else []
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        deadline = time.time() + 30
        while any(_running(pid) for pid in children) and time.time() < deadline:
            time.sleep(0.1)
        server.output = output()
        log.close()
