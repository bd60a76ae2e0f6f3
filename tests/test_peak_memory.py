"""The CPU peak of a run is its own: the high-water mark restarts at each run, on Linux."""

from __future__ import annotations

import sys

import pytest
import torch

from rcpu_bench import peak_memory

CPU = torch.device("cpu")
MIB = 2**20


def _touch(n_bytes: int) -> None:
    buffer = torch.ones(n_bytes // 4, dtype=torch.float32)  # written, so resident
    assert buffer[-1] == 1.0
    del buffer


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resettable high-water mark is Linux's")
def test_the_cpu_peak_restarts_at_reset_and_sees_what_follows():
    _touch(512 * MIB)
    before_reset = peak_memory.peak_bytes(CPU)
    peak_memory.reset(CPU)
    after_reset = peak_memory.peak_bytes(CPU)
    assert after_reset <= before_reset - 384 * MIB  # the freed 512 MiB no longer counts
    _touch(256 * MIB)
    assert peak_memory.peak_bytes(CPU) >= after_reset + 192 * MIB  # a new allocation does
