"""Start and stop the real app (`python app.py`) on a free port: for the browser and API tests and the measurement
scripts. No browser here, so tests that only speak HTTP need no playwright."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]  # the repository, where app.py is
STARTUP_S = 300  # model load, with room for a busy machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serves_page(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except OSError:
        return False


def start_app(*args: str, log: Path, ready: Callable[[str], bool] = serves_page) -> tuple[subprocess.Popen, str]:
    """Start `python app.py *args` on a free port; returns once `ready(url)` (by default: it serves its page)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "app.py", "--host", "127.0.0.1", "--port", str(port), *args],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"app.py exited with code {process.returncode}:\n{log.read_text()[-3000:]}")
        if ready(url):
            return process, url
        time.sleep(1)
    stop_app(process)
    raise TimeoutError(f"app.py was not ready at {url} within {STARTUP_S} s:\n{log.read_text()[-3000:]}")


def stop_app(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
