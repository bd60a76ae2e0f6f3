"""The ``rcpu-bench`` command line: one module per subcommand (``rcpu_bench/commands/<name>.py``), each imported
only when its subcommand runs, so ``rcpu-bench --version`` and ``rcpu-bench --help`` load no model library.

A subcommand module has ``add_arguments(parser)`` and ``run(args) -> exit code``, the latter wrapped in
:func:`command`: bad input (a ValueError, KeyError or OSError such as FileNotFoundError, or a missing optional
dependency) is one line ``rcpu-bench <name>: error: <message>`` on stderr (control characters escaped) and exit 2,
no traceback (``--debug`` shows it); Ctrl-C is one line and exit 130, and SIGTERM the same line and exit 143 (both
unwind the command, so that no staging file or directory is left). Every parser refuses abbreviated options
(``--eval 4`` is an error, not ``--eval-batch-size 4``); progress and log lines follow ``rcpu_bench.console``
(``--quiet``, timestamped lines when the output is not a terminal).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import signal
import sys
import threading
import unicodedata
from collections.abc import Callable
from typing import Any, NoReturn

from rcpu_bench import __version__

# Subcommand → its one-line help, in the order ``rcpu-bench --help`` lists them.
COMMANDS = {
    "plugins": "list the registered methods of every kind",
    "models": "list the real pretrained models known by name (--model smollm2-135m), installed and converted",
    "prune": "prune one model with one scorer x compensator and evaluate it",
    "run": "run a benchmark matrix (models x methods x ratios x calibration sizes)",
    "tables": "render the paper's tables from a results store",
    "plots": "draw the paper's figures from a results store (PNG, PDF and SVG)",
    "eval": "accuracy of a model through lm-eval: the paper's seven zero-shot tasks (default) or any lm-eval task "
            "or group",
    "generate": "greedy continuations of prompts by a model (and a second one to compare, e.g. the dense model)",
    "speed": "parameters and inference speed (prefill and decode tokens/s) of models",
    "export": "write a saved pruned model (or a model directory) as a GGUF file for llama.cpp",
    "migrate": "bring result stores and saved pruned models written by earlier releases to today's format",
}
# What a user gives wrongly: a value out of range or unknown (ValueError, KeyError), a path (OSError:
# FileNotFoundError, FileExistsError, a busy results store), an optional dependency not installed (ImportError).
INPUT_ERRORS = (ValueError, KeyError, OSError, ImportError)

Run = Callable[[argparse.Namespace], int]
INTERRUPTED, TERMINATED = 130, 128 + signal.SIGTERM  # exit codes of Ctrl-C and SIGTERM, as a shell reports them


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, so that it unwinds (its writes removing their staging) as on Ctrl-C."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated


def interrupted_code(error: KeyboardInterrupt) -> int:
    """The exit code of an interrupted command: 143 after SIGTERM, 130 after Ctrl-C."""
    return TERMINATED if isinstance(error, Terminated) else INTERRUPTED


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that refuses abbreviated options and says so in one line (``one_line``); its subcommand
    parsers are Parsers too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        super().error(one_line(message))


class _Subcommands(argparse._SubParsersAction):
    """Subcommand parsers that get their options (and their command's imports) only when chosen."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if values and values[0] in COMMANDS:
            _complete(values[0], self.choices[values[0]])
        super().__call__(parser, namespace, values, option_string)


def _complete(name: str, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add subcommand ``name``'s options and its ``run`` to its parser (once)."""
    if parser.get_default("func") is None:
        module = importlib.import_module(f"rcpu_bench.commands.{name}")
        module.add_arguments(parser)
        parser.set_defaults(func=module.run)
    return parser


def build_parser() -> Parser:
    """The ``rcpu-bench`` parser; a subcommand's options are added when it is chosen (:func:`subcommand_parser`)."""
    parser = Parser(prog="rcpu-bench", description="rcpu-bench: post-training structured pruning of LLaMA-family "
                    "models with error compensation, and its benchmark")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help="on bad input, show the traceback instead of one line")
    parser.register("action", "subcommands", _Subcommands)
    commands = parser.add_subparsers(dest="command", required=True, action="subcommands")
    for name, help_text in COMMANDS.items():
        commands.add_parser(name, help=help_text, description=help_text,
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return parser


def subcommand_parser(name: str, parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The complete parser of subcommand ``name`` (of ``parser``, default a new :func:`build_parser`)."""
    parser = parser or build_parser()
    (commands,) = [action for action in parser._actions if isinstance(action, _Subcommands)]
    return _complete(name, commands.choices[name])


def command(*, interrupted: str = "") -> Callable[[Run], Run]:
    """The one error mapping of every subcommand's ``run``: :data:`INPUT_ERRORS` → one line on stderr and exit 2
    (with ``--debug``: raised, traceback shown); Ctrl-C → ``rcpu-bench: interrupted<interrupted>`` and exit 130
    (143 after SIGTERM)."""
    def wrap(run: Run) -> Run:
        @functools.wraps(run)
        def mapped(args: argparse.Namespace) -> int:
            from rcpu_bench import console

            try:
                return run(args)
            except INPUT_ERRORS as error:
                if getattr(args, "debug", False):
                    raise
                message = error.args[0] if isinstance(error, KeyError) and error.args else error
                print(f"rcpu-bench {args.command}: error: {one_line(str(message))}", file=sys.stderr)
                return 2
            except KeyboardInterrupt as interruption:
                # Records are appended whole and only after a run ends, so nothing torn is left.
                console.interrupted(interrupted)
                return interrupted_code(interruption)
        return mapped
    return wrap


def one_line(text: str) -> str:
    """``text`` with its line breaks and other control characters escaped (a path given with a newline in it, say):
    an error is one line whatever the input it names."""
    return "".join(character.encode("unicode_escape").decode("ascii")
                   if unicodedata.category(character) in ("Cc", "Zl", "Zp") else character for character in text)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the command: its exit code, 2 on bad input, 130 on Ctrl-C and 143 on SIGTERM (one
    line, no traceback). SIGTERM is handled as Ctrl-C while the command runs (the previous handler is restored)."""
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        args = build_parser().parse_args(argv)
        from rcpu_bench import console

        console.configure(quiet=getattr(args, "quiet", False))
        return int(args.func(args))
    except KeyboardInterrupt as interruption:  # while the command's modules load
        from rcpu_bench import console

        console.interrupted()
        return interrupted_code(interruption)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
