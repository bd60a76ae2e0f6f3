"""The README's first screen gives exactly two commands, and they are the ones the Makefile and CI run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

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


def ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def test_readme_first_screen_has_exactly_the_two_make_commands():
    assert first_screen_commands() == ["make run", "make test"]
    assert {"run", "test"} <= make_targets()


def test_ci_runs_the_readme_test_command():
    assert "make test" in ci_commands()


def test_make_run_is_the_quick_matrix_and_make_test_the_suite():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^run: setup\n\t\$\(BIN\)/rcpu-bench run --matrix quick$", makefile, flags=re.M)
    assert re.search(r"^test: setup\n\t\$\(BIN\)/python -m pytest tests plugins -m \"\(slow or not slow\) and not "
                     r"large_model\"", makefile, flags=re.M)
    assert re.search(r"^test-large: setup\n.*\n\t\$\(BIN\)/python -m pytest tests -m large_model", makefile, flags=re.M)


def test_ci_runs_make_run_in_its_fresh_clone_before_anything_writes_into_it():
    """`two-commands --here` refuses a checkout with untracked or ignored files, so it must come before the floors
    job and the setup; only the floors' dependency install runs beside it, into a venv outside the clone."""
    commands = ci_commands()
    here = commands.index("bash .ci/two-commands --here")
    assert here < commands.index("bash .ci/floors") and here < commands.index("make setup")
    beside = [i for i, line in enumerate(commands) if line.startswith("bash .ci/floors --deps-only")]
    venv = [i for i, line in enumerate(commands) if line.startswith('export RCPU_FLOORS_VENV="$floors_dir/')]
    assert beside and venv and venv[0] < beside[0] < here and 'floors_dir="$(mktemp -d)"' in commands[:venv[0]]


def copy_of_two_commands(tmp_path: Path) -> Path:
    """A git repository holding only .ci/two-commands, committed (what the script checks is the checkout)."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "two-commands", repo / ".ci" / "two-commands")
    for args in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", *args], cwd=repo, check=True)
    return repo


@pytest.mark.parametrize("leftover", [".venv/bin/python", "results/quick/records.jsonl", ".ci/two-commands"])
def test_two_commands_here_refuses_a_checkout_that_is_not_a_fresh_clone(tmp_path, leftover):
    """A left-over .venv or results/quick (or a change to a tracked file) would let `make run` reuse what an earlier
    run left: refused with the files named, before `make run`."""
    repo = copy_of_two_commands(tmp_path)
    (repo / leftover).parent.mkdir(parents=True, exist_ok=True)
    with open(repo / leftover, "a") as f:
        f.write("# left over\n")
    done = subprocess.run(["bash", ".ci/two-commands", "--here"], cwd=repo, capture_output=True, text=True,
                          env={**os.environ, "RCPU_BENCH_SHARED": str(tmp_path)})
    assert done.returncode == 2
    assert "needs a fresh clone" in done.stderr and leftover.split("/")[0] in done.stderr
    assert "make" not in done.stdout


def test_two_commands_refuses_an_unknown_argument(tmp_path):
    repo = copy_of_two_commands(tmp_path)
    done = subprocess.run(["bash", ".ci/two-commands", "--elsewhere"], cwd=repo, capture_output=True, text=True,
                          env={**os.environ, "RCPU_BENCH_SHARED": str(tmp_path)})
    assert done.returncode == 2 and "usage: bash .ci/two-commands [--here]; got --elsewhere" in done.stderr


def test_ci_runs_the_house_rules_beside_the_floors_and_waits_for_them_before_the_tests():
    commands = ci_commands()
    lint = next(i for i, line in enumerate(commands) if line.startswith("bash .ci/lint"))
    waited = next(i for i, line in enumerate(commands) if line.startswith('wait "$lint" ||'))
    floors, tests = commands.index("bash .ci/floors"), commands.index("make test")
    assert commands.index("make setup") < lint < floors < waited < tests
    assert "exit 1" in commands[waited]


def test_ci_exits_0_when_the_floors_install_beside_make_run_has_finished(tmp_path):
    """.ci/run's EXIT trap stops the floors' dependency install if it still runs and removes its folder; after the
    install has finished (the normal case) it must leave CI's exit status 0 under ``set -e``."""
    trap = next(line for line in ci_commands() if line.startswith("trap "))
    script = (f'set -euo pipefail\nfloors_dir="$(mktemp -d -p {tmp_path})"\ntrue &\nfloors_deps=$!\n'
              f'wait "$floors_deps"\n{trap}\necho done\n')
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "done\n"), done.stderr
    assert not list(tmp_path.iterdir())
