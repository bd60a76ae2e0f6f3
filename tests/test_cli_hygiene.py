"""CLI hygiene: no abbreviated options, --version, one name per batch option, --quiet quiet,
plain timestamped lines when the output is not a terminal, Ctrl-C ends with one line and exit 130."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import STORIES_MHA, needs_stories

from rcpu_bench import console
from rcpu_bench.cli import build_parser, main
from rcpu_bench.commands import COMMANDS, subcommand_parser

ROOT = Path(__file__).resolve().parent.parent
STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")
PRUNE = ["prune", "--model", str(STORIES_MHA), "--calib", "tinystories:8x64", "--ppl", "tinystories[900:930]"]


class Terminal(io.StringIO):
    """A stream that says it is a terminal, to see what a user at one sees."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def fresh_console():
    yield
    console.reset()


def subcommands() -> dict:
    parser = build_parser()
    return {"": parser, **{name: subcommand_parser(name, parser) for name in COMMANDS}}


@pytest.mark.parametrize("name", ["", "plugins", "prune", "run", "tables", "plots", "eval", "generate", "speed"])
def test_every_parser_refuses_abbreviations(name):
    assert subcommands()[name].allow_abbrev is False


@pytest.mark.parametrize("argv, abbreviated", [
    (["eval", "--model", "m", "--eval", "4"], "--eval"),  # was silently --eval-batch-size 4
    (["prune", "--rat", "0.3"], "--rat"),
    (["run", "--mat", "smoke"], "--mat"),
    (["--vers"], "--vers"),
])
def test_an_abbreviated_option_is_an_error(capsys, argv, abbreviated):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert abbreviated in capsys.readouterr().err


def test_version_is_the_declared_one(capsys):
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M)[1]
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"rcpu-bench {declared}"


def options(command: str) -> set[str]:
    return {option for action in subcommands()[command]._actions for option in action.option_strings}


@pytest.mark.parametrize("command", ["", "plugins", "run", "tables", "plots", "eval", "generate", "speed",
                                     "prune"])
def test_no_command_takes_an_ambiguous_batch_size(command):
    """A batch option names what it batches: --calib-batch-size (calibration), --eval-batch-size (evaluation)."""
    assert "--batch-size" not in options(command)


def test_evaluation_batches_are_eval_batch_size():
    assert all("--eval-batch-size" in options(command) for command in ("eval", "speed"))


def test_progress_on_a_terminal_is_a_bar_and_quiet_shows_nothing():
    shown, silent = Terminal(), Terminal()
    console.configure(out=shown)
    assert list(console.progress(range(3), desc="outer")) == [0, 1, 2]
    console.configure(quiet=True, out=silent)
    assert list(console.progress(range(3), desc="outer")) == [0, 1, 2]
    console.info("an info line")
    assert "outer" in shown.getvalue() and "\r" in shown.getvalue()
    assert silent.getvalue() == ""


def test_off_a_terminal_progress_is_timestamped_lines_without_carriage_returns():
    log = io.StringIO()
    console.configure(out=log)
    for _ in console.progress(range(4), desc="outer", unit="batch"):
        assert list(console.progress(range(2), desc="inner")) == [0, 1]  # nested: no lines of its own
    console.info("a message")
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and lines and all(STAMP.match(line) for line in lines)
    assert [STAMP.sub("", line) for line in lines][-1] == "a message"
    assert re.fullmatch(r"outer: 4/4 batch done in \d+\.\d s", STAMP.sub("", lines[0]))
    assert not any("inner" in line for line in lines)


@pytest.mark.slow
@needs_stories
def test_quiet_prune_draws_no_bar_on_a_terminal(monkeypatch, tmp_path):
    """--quiet silences the inner bars too (perplexity, model loading), not just the pipeline's."""
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main([*PRUNE, "--quiet", "--out", str(tmp_path / "r.jsonl")]) == 0
    assert terminal.getvalue() == ""


@pytest.mark.slow
@needs_stories
def test_prune_on_a_terminal_draws_the_perplexity_bar(monkeypatch, tmp_path):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main([*PRUNE, "--out", str(tmp_path / "r.jsonl")]) == 0
    assert "ppl tinystories[900:930]" in terminal.getvalue()


@pytest.mark.slow
@needs_stories
def test_prune_into_a_log_file_writes_timestamped_lines_only(tmp_path):
    done = subprocess.run([sys.executable, "-m", "rcpu_bench.cli", *PRUNE], capture_output=True, text=True,
                          cwd=tmp_path, env=os.environ, check=True)
    lines = done.stderr.splitlines()
    assert "\r" not in done.stderr and lines and all(STAMP.match(line) for line in lines), done.stderr


def test_ctrl_c_in_a_command_is_one_line_and_130(monkeypatch, capsys):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr("rcpu_bench.commands.plugins.default_registry", interrupted)
    assert main(["plugins"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "rcpu-bench: interrupted\n" and captured.out == ""


SIGINT_DURING_EVALUATION = """
import signal, sys, time
from rcpu_bench import cli
from rcpu_bench.evaluation import perplexity

def interrupt(*args, **kwargs):  # a real SIGINT, as Ctrl-C sends, once pruning is done
    # raise_signal delivers it to this (the main) thread, where Python runs its handler before returning;
    # os.kill could land in a torch worker thread and a following signal.pause() then waited for ever.
    signal.raise_signal(signal.SIGINT)
    for _ in range(600):  # the handler runs in the main thread at its next check: wait for it, boundedly
        time.sleep(0.05)
    raise AssertionError("SIGINT did not interrupt the command")

perplexity.sequence_nll = interrupt
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
@needs_stories
def test_sigint_during_prune_exits_130_without_traceback_or_record(tmp_path):
    out = tmp_path / "r.jsonl"
    # The child starts with SIGINT at its default, as under a terminal: a suite run as a background job (`make
    # test &`, nohup) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
    done = subprocess.run([sys.executable, "-c", SIGINT_DURING_EVALUATION, *PRUNE, "--quiet", "--out", str(out),
                           "--save", str(tmp_path / "pruned")], capture_output=True, text=True, env=os.environ,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 130
    assert done.stderr == "rcpu-bench: interrupted\n" and "Traceback" not in done.stdout
    assert not out.exists() and not (tmp_path / "pruned").exists()


VERSION_WITHOUT_LIBRARIES = """
import sys
from rcpu_bench.cli import main
try:
    main(["--version"])
finally:
    heavy = sorted({"torch", "transformers", "lm_eval", "matplotlib"} & set(sys.modules))
    print("loaded:", ",".join(heavy), file=sys.stderr)
"""


def test_version_and_help_load_no_model_library():
    """``--version`` stays fast: the subcommands' modules (torch, transformers, ...) load only when one runs."""
    done = subprocess.run([sys.executable, "-c", VERSION_WITHOUT_LIBRARIES], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0 and done.stdout.startswith("rcpu-bench ")
    assert done.stderr.strip() == "loaded:"


def test_bad_input_is_one_line_naming_the_command_and_debug_shows_the_traceback(tmp_path, capsys):
    assert main(["tables", "--results", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"rcpu-bench tables: error: no results store {tmp_path / 'records.jsonl'} (expected " \
                           "records.jsonl in the --results directory)\n"
    with pytest.raises(FileNotFoundError, match="no results store"):
        main(["--debug", "tables", "--results", str(tmp_path)])


def test_every_evaluating_command_has_the_same_eval_batch_size_default():
    parsers = subcommands()
    defaults = {command: parsers[command].get_default("eval_batch_size") for command in ("prune", "eval", "speed")}
    assert set(defaults.values()) == {8}, defaults
