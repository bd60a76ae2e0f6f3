"""``rcpu-bench`` run in the test's own process, as the bad-input tests call it."""

from __future__ import annotations

from rcpu_bench.cli import main


def cli_run(argv: list[str], capsys) -> tuple[int, str]:
    """Exit code and stderr of ``rcpu-bench ARGV`` run in-process (argparse's own errors exit through SystemExit)."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err
