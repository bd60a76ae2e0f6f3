"""What the command line shows while it works: progress and log lines, in one place.

Two switches decide everything: ``quiet`` (the user's ``--quiet``) and whether the stream (standard
error) is a terminal.

- a terminal: tqdm bars; bars opened inside another bar (perplexity inside a matrix cell) are drawn
  below it and removed when they end, and log lines are written above the bars (``tqdm.write``), so
  nothing overwrites the outer bar or its ETA;
- not a terminal (a log file, a pipe): no bars and no ``\\r``; the outermost loop writes timestamped
  lines instead (one at most every ``LOG_EVERY_S`` seconds and one when it ends), as every log line is;
- quiet: no bars, no progress lines and no info lines (warnings and errors still show).

The Hugging Face libraries' own bars (model loading, downloads) follow the same switches.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")

LOGGER = logging.getLogger("rcpu_bench")
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
LOG_EVERY_S = 30.0  # at most one progress line per loop this often when the output is not a terminal


@dataclass
class _State:
    quiet: bool = False
    stream: TextIO | None = None  # None: sys.stderr at the time of writing
    depth: int = 0  # progress loops open now (nested loops are drawn below the outer one)


_state = _State()


def stream() -> TextIO:
    """Where progress and log lines go: the configured stream, else standard error."""
    return _state.stream or sys.stderr


def is_terminal(out: TextIO | None = None) -> bool:
    """Whether ``out`` (default: ``stream()``) is an interactive terminal."""
    isatty = getattr(out or stream(), "isatty", None)
    return bool(isatty and isatty())


def showing_bars() -> bool:
    """True when progress is drawn as bars: not quiet and the stream is a terminal."""
    return not _state.quiet and is_terminal()


class _Handler(logging.Handler):
    """Log lines to ``stream()``; on a terminal through ``tqdm.write`` so that they land above open bars."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            if is_terminal():
                tqdm.write(message, file=stream())
            else:
                stream().write(message + "\n")
                stream().flush()
        except Exception:  # noqa: BLE001 - logging must never take the command down (logging's own rule)
            self.handleError(record)


def configure(*, quiet: bool = False, out: TextIO | None = None) -> None:
    """Set the switches for this process: ``quiet``, and the stream (default: standard error at write time).

    Log lines of the ``rcpu_bench`` loggers are timestamped (``TIME_FORMAT``) when the stream is not a
    terminal; quiet keeps only warnings and errors. The Hugging Face libraries' bars are shown only
    when ours are.
    """
    reset()
    _state.quiet, _state.stream = quiet, out
    handler = _Handler()
    handler.setFormatter(logging.Formatter("%(message)s" if is_terminal() else "%(asctime)s %(message)s",
                                           datefmt=TIME_FORMAT))
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.WARNING if quiet else logging.INFO)
    _library_bars(showing_bars())


def reset() -> None:
    """Back to the state of a fresh import (what a library user gets): not quiet, standard error, no
    handler of ours (so info lines go nowhere), the Hugging Face bars on."""
    _state.quiet, _state.stream, _state.depth = False, None, 0
    for old in [h for h in LOGGER.handlers if isinstance(h, _Handler)]:
        LOGGER.removeHandler(old)
    LOGGER.setLevel(logging.NOTSET)
    _library_bars(True)


def _library_bars(enabled: bool) -> None:
    """Switch the bars of transformers (model loading) and huggingface_hub (downloads)."""
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    if enabled:
        hf_logging.enable_progress_bar()
        enable_progress_bars()
    else:
        hf_logging.disable_progress_bar()
        disable_progress_bars()


def add_quiet_option(parser: argparse.ArgumentParser) -> None:
    """``--quiet``: what every command that shows progress takes (read by the CLI's ``main``)."""
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bars or progress lines (inner ones too), no info lines")


def info(message: str) -> None:
    """A log line (timestamped when the stream is not a terminal; nothing when quiet)."""
    LOGGER.info(message)


def progress(iterable: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it",
             enabled: bool = True) -> Iterator[T]:
    """``iterable``, showing its progress as the switches say (module docstring); ``enabled=False`` shows none.

    ``total`` defaults to ``len(iterable)`` where it has one.
    """
    if total is None and isinstance(iterable, Sized):
        total = len(iterable)
    if not enabled or _state.quiet:
        yield from iterable
        return
    _state.depth += 1
    try:
        if is_terminal():
            # tqdm places a bar below those already open (ours or a caller's own tqdm bar) and, with
            # leave=None, removes it when done unless it is the outermost.
            yield from tqdm(iterable, desc=desc, total=total, unit=unit, file=stream(), leave=None,
                            dynamic_ncols=True)
        elif _state.depth == 1:
            yield from _logged(iterable, desc, total, unit)
        else:
            yield from iterable
    finally:
        _state.depth -= 1


def _logged(iterable: Iterable[T], desc: str, total: int | None, unit: str) -> Iterator[T]:
    """``iterable`` with a log line at most every ``LOG_EVERY_S`` seconds and one at the end."""
    of = f"/{total}" if total is not None else ""
    started = last = time.monotonic()
    done = 0
    for item in iterable:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= LOG_EVERY_S and done != total:
            info(f"{desc}: {done}{of} {unit} ({now - started:.1f} s)")
            last = now
    info(f"{desc}: {done}{of} {unit} done in {time.monotonic() - started:.1f} s")


def interrupted(what: str = "") -> None:
    """The one line a command prints on Ctrl-C (standard error, after any open bar)."""
    sys.stderr.write(f"\nrcpu-bench: interrupted{what}\n" if showing_bars() else f"rcpu-bench: interrupted{what}\n")
    sys.stderr.flush()
