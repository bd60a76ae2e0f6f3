"""The README's first screen gives exactly two commands, and they are the ones the Makefile and CI run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def first_screen_commands() -> list[str]:
    """Shell lines of the first ```bash block of the README, before its second heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first_screen = text.split("\n## ", 2)[1]
    block = re.search(r"```bash\n(.*?)```", first_screen, flags=re.S)
    assert block, "the README's first section has no ```bash block"
    return [line.split("#")[0].strip() for line in block[1].splitlines() if line.split("#")[0].strip()]


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(encoding="utf-8"), flags=re.M))


def test_readme_first_screen_has_exactly_the_two_make_commands():
    assert first_screen_commands() == ["make run", "make test"]
    assert {"run", "test"} <= make_targets()


def test_ci_runs_the_readme_test_command():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    assert any(line.split("#")[0].strip() == "make test" for line in ci)


def test_make_run_is_the_smoke_matrix_and_make_test_the_suite():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^run: setup\n\t\$\(BIN\)/rcpu-bench run --matrix smoke$", makefile, flags=re.M)
    assert re.search(r"^test: setup setup-gguf\n\t\$\(BIN\)/python -m pytest tests plugins", makefile, flags=re.M)
