"""Peak memory of one pruning run: bytes allocated on an accelerator, or the resident set on the CPU.

On the CPU the kernel keeps the process's resident high-water mark (``VmHWM`` in ``/proc/self/status``); Linux resets
it when ``5`` is written to ``/proc/self/clear_refs``, so each run of a matrix measures its own peak. Where there is
no ``/proc`` (macOS, Windows), the peak is the process's since it started (``ru_maxrss``), shared by the runs of one
process.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

PROC = Path("/proc/self")


def reset(device: torch.device) -> None:
    """Start measuring the peak from now on."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        (PROC / "clear_refs").write_text("5")
    except OSError:
        pass  # no /proc: peak_bytes reads the process's peak since it started


def peak_bytes(device: torch.device) -> int:
    """The peak since :func:`reset`: allocated bytes on the accelerator, the resident set's high-water mark on the
    CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        status = (PROC / "status").read_text()
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB elsewhere
    line = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024  # kB
