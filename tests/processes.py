"""Servers the tests start in their own process group (an MLflow server, a Ray head), and how they are stopped."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_group(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM to ``process``'s group, SIGKILL if it has not exited after ``timeout`` seconds."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
