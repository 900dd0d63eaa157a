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


@dataclass
class ServerProcess:
    base: str  # http://127.0.0.1:<port>
    data_dir: Path
    process: subprocess.Popen
    port: int
    output: str = ""  # everything it printed, once it has stopped


@contextmanager
def serve(model_dir: Path, data_dir: Path, *args: str, port: int | None = None,
          startup_timeout_s: float = 180.0, output_after_s: float = 0.0
          ) -> Iterator[ServerProcess]:
    """Starts the server on the bundled model (``--max-model-len 512``,
    ``--num-gpu-blocks-override 96`` and ``args``) on ``port`` (default: a free one), waits
    for ``/health``; on exit stops it (SIGTERM, then SIGKILL after 30 s) and keeps its output
    in ``.output``, read ``output_after_s`` after it ended (processes it started, such as
    multiprocessing's resource tracker, print on their own way out). The output goes to a file
    while it runs: a pipe nobody reads fills after
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
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        time.sleep(output_after_s)
        server.output = output()
        log.close()
