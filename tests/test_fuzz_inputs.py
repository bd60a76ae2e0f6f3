"""Bad input, generated: every command's declared flags (read from its parser, so a new flag is covered as it lands)
and every matrix key (read from the schema's declarations) given wrong types, out-of-range numbers, empty and huge
values, unknown names, and paths that are files, directories, unwritable or on a full file system, run in process
on the stories260K fixture. Whatever the input, the command ends without a Python traceback, with an exit status of
the documented set, having written nothing outside the outputs it was given and left no partial file.

The budget is fixed (``EXAMPLES`` per command, derandomized, no example database: CI sees the same inputs every
run), and each example is cheap: a valid baseline of tiny work (8 windows of 32 tokens, two perplexity windows, two
zero-shot documents, two new tokens) with one or two of its flags made bad. A full file system is the free space
reported for ``<sandbox>/full`` (``shutil.disk_usage``); an unwritable place is under ``/proc``; an example may grow
the process's address space by ``MEMORY`` at most, so that a runaway allocation fails instead of exhausting the
machine (Linux: /proc and RLIMIT_AS).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import resource
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import STORIES_MHA, needs_stories

from rcpu_bench import console
from rcpu_bench.cli import main
from rcpu_bench.commands import COMMANDS, subcommand_parser
from rcpu_bench.declaration import parse_param
from rcpu_bench.matrix import entries, spec
from rcpu_bench.model import real_models
from rcpu_bench.plugins import default_registry

pytestmark = [pytest.mark.slow, needs_stories]

EXAMPLES = 60  # per command; the matrix keys get twice as many
SECONDS = 30  # an example running longer (a valid input asking for much work) is interrupted as Ctrl-C is
MEMORY = 4 * 2**30  # an example may grow the process by this much (address space): a runaway allocation fails
EXIT = {"run": {0, 1, 2, 130}}  # run: 1 when a cell failed (recorded, the others go on)
DEFAULT_EXIT = {0, 2, 130}  # done, bad input, interrupted (the example's time ran out)
SKIPPED = {"-h", "--help", "--version", "--debug"}
PATHS = ("file", "dir", "empty-dir", "under-file", "missing", "broken-link", "unwritable", "full", "new")
NAMES = ("", " ", "bogus", "gemma3", "SmolLM2-135M", "org/no-such-model", "variance ", "none", "ALL", "-", "--ratio")
NUMBERS = ("0", "-1", "-0.5", "1", "1.0", "2", "1e-300", "1e400", "nan", "inf", "-inf", "9" * 40, "0x10", "1_0")
SHAPES = ("None", "True", "[]", "[1, 2]", "{}", "{'a': 1}", "()", "'text'", "1e-2", "x" * 3000, "a=b=c", "=",
          "tinystories:0x0", "tinystories:1000000x1000000", "rcpu128[5:1]", "file:/dev/zero")


# ------------------------------------------------------------------------------------------------ the sandbox


@dataclass
class Sandbox:
    """A fresh directory per example: the places bad paths point at, the baseline's inputs and outputs."""

    root: Path
    store: Path  # a small results store (one finished cell), for tables and plots

    def path(self, kind: str) -> str:
        return str({"file": self.root / "file.txt", "dir": self.root / "dir", "empty-dir": self.root / "empty",
                    "under-file": self.root / "file.txt" / "x", "missing": self.root / "missing" / "deeper" / "x",
                    "broken-link": self.root / "broken" / "x", "unwritable": Path("/proc/rcpu-bench-fuzz/x"),
                    "full": self.root / "full" / "x", "new": self.root / "new-output"}[kind])


def make_sandbox(root: Path, store: Path) -> Sandbox:
    (root / "file.txt").write_text("a user's file\n")
    (root / "dir").mkdir()
    (root / "dir" / "keep.txt").write_text("a user's file\n")
    (root / "empty").mkdir()
    (root / "full").mkdir()
    (root / "broken").symlink_to(root / "nowhere")
    (root / "tmp").mkdir()
    shutil.copytree(store, root / "store")
    (root / "matrix.yaml").write_text(yaml.safe_dump(matrix_baseline(root)))
    return Sandbox(root, root / "store")


def matrix_baseline(root: Path) -> dict[str, Any]:
    return {"name": "fuzz", "models": [str(STORIES_MHA)], "methods": [{"name": "m", "scorer": "variance",
                                                                        "compensator": "procrustes"}],
            "ratios": [0.2], "calib": {"source": "tinystories", "n_calib": [8], "seqlen": 32},
            "ppl_profiles": ["tinystories[900:902]"], "skip": ["speed", "sample"]}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A results store with one finished cell of the baseline matrix."""
    root = tmp_path_factory.mktemp("store-template")
    matrix = root / "m.yaml"
    matrix.write_text(yaml.safe_dump(matrix_baseline(root)))
    assert main(["run", "--matrix", str(matrix), "--results", str(root / "store"), "--quiet"]) == 0
    return root / "store"


def baseline(command: str, box: Sandbox) -> list[str]:
    """A valid invocation of ``command`` that does little work."""
    model = ["--model", str(STORIES_MHA)]
    return {
        "plugins": [],
        "models": [],
        "prune": [*model, "--calib", "tinystories:8x32", "--ppl", "tinystories[900:902]", "--quiet",
                  "--out", str(box.root / "records.jsonl")],
        "run": ["--matrix", str(box.root / "matrix.yaml"), "--results", str(box.root / "results"), "--quiet"],
        "tables": ["--results", str(box.store)],
        "plots": ["--results", str(box.store), "--out-dir", str(box.root / "plots")],
        "eval": [*model, "--tasks", "piqa", "--limit", "2", "--quiet"],
        "generate": [*model, "--prompt", "Once", "--max-new-tokens", "2", "--quiet"],
        "speed": [*model, "--prompt-tokens", "8", "--new-tokens", "2", "--repeats", "1", "--quiet"],
        "export": ["--format", "gguf", "--quiet", str(STORIES_MHA), str(box.root / "m.gguf")],
        "migrate": [str(box.store)],  # a store of today's format: nothing to change
    }.get(command, [])  # a command added later: its parser alone


# --------------------------------------------------------------------------------------- the generated inputs


@functools.cache
def flags(command: str) -> list[argparse.Action]:
    """The command's declared options and positional arguments, as its parser has them."""
    return [action for action in subcommand_parser(command)._actions
            if not set(action.option_strings) & SKIPPED and not isinstance(action, argparse._HelpAction)]


@functools.cache
def parameter_names() -> list[str]:
    """Every parameter of every registered method, and the matrix's keys: what KEY=VALUE options are given."""
    registry = default_registry()
    names = {name for kind in ("scorer", "compensator", "allocation", "model-method")
             for method in registry.methods(kind) for name in method.params}
    return sorted(names | {key.name for key in spec.TOP_KEYS} | {f"calib.{key.name}" for key in entries.CALIB_KEYS}
                  | {f"prune.{key.name}" for key in entries.PRUNE_KEYS})


Value = tuple[str, str]  # (kind, text): a path kind rendered in the sandbox, or the text itself


def values() -> st.SearchStrategy[Value]:
    """A bad (or borderline) value: a path of some kind, a name, a number, another shape, or any text."""
    text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)
    return st.one_of(st.sampled_from(PATHS).map(lambda kind: ("path", kind)),
                     st.sampled_from(NAMES + NUMBERS + SHAPES).map(lambda value: ("text", value)),
                     st.integers(-2**70, 2**70).map(lambda value: ("text", str(value))),
                     st.floats(allow_nan=True, allow_infinity=True).map(lambda value: ("text", repr(value))),
                     text.map(lambda value: ("text", value)))


def render(value: Value, box: Sandbox) -> str:
    kind, text = value
    return box.path(text) if kind == "path" else text


def keyed(action: argparse.Action) -> bool:
    """Whether the option takes KEY=VALUE (a method's parameter, a matrix override)."""
    return action.type is parse_param or (action.metavar or "").endswith("=VALUE")


@dataclass(frozen=True)
class Change:
    """One flag of the baseline made bad: its value (None: a flag that takes none), and for KEY=VALUE options the
    key."""

    action: argparse.Action
    value: Value | None
    key: str | None = None

    def text(self, box: Sandbox) -> str | None:
        if self.value is None:
            return None
        return render(self.value, box) if self.key is None else f"{self.key}={render(self.value, box)}"


@st.composite
def mutations(draw, command: str) -> list[Change]:
    """One or two of the command's flags, each with a bad value (flags without a value are just given)."""
    chosen = draw(st.lists(st.sampled_from(flags(command)), min_size=1, max_size=2, unique_by=id))
    return [Change(action, None) if action.nargs == 0 else
            Change(action, draw(values()), draw(st.sampled_from(parameter_names()) | st.text(max_size=8)))
            if keyed(action) else Change(action, draw(values())) for action in chosen]


def argv_of(command: str, box: Sandbox, changes: list[Change]) -> list[str]:
    """The baseline with each changed flag's value replaced (or the flag added), positionals replaced in place."""
    argv = baseline(command, box)
    for change in changes:
        text, options = change.text(box), change.action.option_strings
        if not options:  # a positional: export's model or out, migrate's paths
            argv[{"model": -2, "out": -1, "paths": -1}[change.action.dest]] = str(text)
        elif options[0] in argv and text is not None:
            argv[argv.index(options[0]) + 1] = text
        else:
            argv += [options[0]] if text is None else [options[0], text]
    return argv


# ------------------------------------------------------------------------------------------------ one example


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its modification time and size (links as links)."""
    return {str(path.relative_to(root)): (path.lstat().st_mtime_ns, path.lstat().st_size)
            for path in [root, *root.rglob("*")]}


def named_outputs(argv: list[str], root: Path) -> list[Path]:
    """The sandbox paths the command was given (any word, or a KEY=VALUE's value; relative ones from the working
    directory, the sandbox): its outputs may only be these (and the directories leading to them)."""
    named = []
    for word in argv:
        for part in {word, word.partition("=")[2].strip("'\"")} - {""}:
            path = Path(os.path.normpath(root / part))  # an absolute part replaces root
            if path.is_relative_to(root):
                named.append(path)
    return named


def allowed(path: Path, named: list[Path]) -> bool:
    return any(path == out or out in path.parents or path in out.parents for out in named)


STAGING_MARKS = (".partial", ".old")


def violations(command: str, argv: list[str], box: Sandbox, run: Callable[[list[str]], tuple[int, str]]) -> list[str]:
    """What the example broke: a traceback, an exit status outside the command's set, a write outside its named
    outputs, a partial file left anywhere in the sandbox (its temporary directory included)."""
    before = snapshot(box.root)
    code, output = run(argv)
    after = snapshot(box.root)
    found = []
    if "Traceback" in output:
        found.append(f"traceback: {output[-2000:]}")
    if code not in EXIT.get(command, DEFAULT_EXIT):
        found.append(f"exit {code}: {output[-600:]}")
    if code == 2 and "error:" not in output.rstrip().split("\n")[-1]:  # not splitlines: \x1c-\x1e are no ends
        found.append(f"exit 2 without one error line at the end: {output[-600:]}")
    named = named_outputs(argv, box.root) + [box.root / "tmp"]
    changed = [name for name in after if before.get(name) != after[name]] + [n for n in before if n not in after]
    outside = [name for name in changed if name != "." and not allowed(box.root / name, named)]
    if outside:
        found.append(f"written outside the named outputs: {outside[:5]}")
    partial = [name for name in after if Path(name).suffix in STAGING_MARKS or ".rcpu-bench-write-test" in name
               or name.startswith("tmp/") and name != "tmp"]
    if partial:
        found.append(f"partial files left: {partial[:5]}")
    return found


def virtual_size() -> int:
    """This process's virtual memory size in bytes (Linux's /proc)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmSize:"))
    return int(line.split()[1]) * 1024


class TimeUp(KeyboardInterrupt):
    """The example's time ran out: the command unwinds as on Ctrl-C."""


@contextlib.contextmanager
def inside(box: Sandbox) -> Iterator[None]:
    """The example's process state: the sandbox as working directory, temporary directory and real-model cache; the
    full file system; a time limit; the console as a fresh process has it."""
    cwd, env, temp = os.getcwd(), dict(os.environ), tempfile.tempdir
    usage = shutil.disk_usage

    def disk_usage(path):
        if Path(path).absolute().is_relative_to(box.root / "full"):
            return shutil._ntuple_diskusage(2**30, 2**30, 0)
        return usage(path)

    def time_up(signum, frame):
        raise TimeUp

    previous = signal.signal(signal.SIGALRM, time_up)
    memory = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (virtual_size() + MEMORY, memory[1]))
    os.chdir(box.root)
    os.environ[real_models.CACHE_ENV] = str(box.root / "cache")
    tempfile.tempdir = str(box.root / "tmp")
    shutil.disk_usage = disk_usage
    signal.alarm(SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, memory)
        shutil.disk_usage = usage
        tempfile.tempdir = temp
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        console.reset()


def run_main(argv: list[str]) -> tuple[int, str]:
    """Exit status and everything printed of ``rcpu-bench ARGV`` in this process; an exception escaping main is
    reported with its traceback (it is one)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 2
        except BaseException:  # noqa: BLE001 - any escape is what the test reports
            import traceback

            traceback.print_exc(file=out)
            code = -1
    return code, out.getvalue()


def check(command: str, argv_for: Callable[[Sandbox], list[str]], store: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="rcpu-fuzz-") as root:
        box = make_sandbox(Path(root), store)
        argv = [command, *argv_for(box)]
        with inside(box):
            found = violations(command, argv, box, run_main)
        assert not found, f"rcpu-bench {' '.join(argv)[:400]}\n" + "\n".join(found)


# ----------------------------------------------------------------------------------------------------- tests

FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


@pytest.mark.parametrize("command", list(COMMANDS))
def test_bad_flags_end_in_one_line_or_work_and_leave_nothing_behind(command, store):
    if not flags(command):  # nothing to make bad: the baseline itself
        check(command, lambda box: baseline(command, box), store)
        return

    @FUZZ
    @given(changes=mutations(command))
    def example(changes):
        check(command, lambda box: argv_of(command, box, changes), store)

    example()


def matrix_locations() -> list[tuple[str, ...]]:
    """Every key of a matrix, as a path into the baseline mapping (a method's keys in its custom form)."""
    return ([(key.name,) for key in spec.TOP_KEYS] + [("calib", key.name) for key in entries.CALIB_KEYS]
            + [("models", 0, key.name) for key in entries.MODEL_KEYS]
            + [("methods", 0, key.name) for key in entries.CUSTOM_KEYS]
            + [("prune", key.name) for key in entries.PRUNE_KEYS] + [("ablation", "compensate")])


def yaml_values() -> st.SearchStrategy[Any]:
    """A YAML value of any type: scalars of every kind, huge and non-finite numbers, lists and mappings."""
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                        st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(NAMES + NUMBERS + SHAPES),
                        st.sampled_from(PATHS).map(lambda kind: ("path", kind)))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["a", "name", "model", "scorer", "seqlen"]), inner, max_size=2), max_leaves=4)


def rendered(value: Any, box: Sandbox) -> Any:
    if isinstance(value, tuple):
        return box.path(value[1])
    if isinstance(value, list):
        return [rendered(item, box) for item in value]
    if isinstance(value, dict):
        return {key: rendered(item, box) for key, item in value.items()}
    return value


def with_key(raw: dict[str, Any], location: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """The mapping with the key at ``location`` set to ``value``, its parents made mappings where they are not (a
    model given as a path becomes ``{model: path}``)."""
    node: Any = raw
    for part, following in zip(location[:-1], location[1:]):
        child = node[part] if isinstance(part, int) else node.get(part)
        if isinstance(following, int):
            child = child if isinstance(child, list) and child else [{}]
        elif not isinstance(child, dict):
            child = {"model": child} if isinstance(child, str) else {}
        node[part] = child
        node = child
    node[location[-1]] = value
    return raw


@settings(FUZZ, max_examples=2 * EXAMPLES)
@given(changes=st.lists(st.tuples(st.sampled_from(matrix_locations()), yaml_values()), min_size=1, max_size=2))
def test_bad_matrix_keys_end_in_one_line_or_run_and_leave_nothing_behind(store, changes):
    def argv(box: Sandbox) -> list[str]:
        raw = matrix_baseline(box.root)
        for location, value in changes:
            raw = with_key(raw, location, rendered(value, box))
        (box.root / "bad.yaml").write_text(yaml.safe_dump(raw, allow_unicode=True))
        return ["--matrix", str(box.root / "bad.yaml"), "--results", str(box.root / "results"), "--quiet"]

    check("run", argv, store)


# What the fuzzer found on its first runs, each once a traceback or an error of several lines, kept as examples.
FOUND = [
    (["speed", "--model", str(STORIES_MHA), "--eval-batch-size", "11926955938109464", "--prompt-tokens", "8"],
     f"batch_size=11926955938109464 × (prompt_tokens + new_tokens = 40) is {11926955938109464 * 40:,} tokens in one "
     "batch; allowed: at most 2,097,152"),
    (["run", "--matrix", "{matrix}", "--dry-run", "--set", "prune.prune=[[]]"],
     "prune.prune: prune=([],) is not allowed; allowed: a subset of attention, mlp"),
    (["run", "--matrix", "{matrix}", "--dry-run", "--set", "ablation=,"],
     "--set 'ablation=,': the value is not valid YAML: expected the node content, but found ',' at line 1, column 1"),
    (["tables", "--results", "\n"], "no results store \\n/records.jsonl"),
    (["tables", "--results", "{root}", "x\x1ey"], "unrecognized arguments: x\\x1ey"),
    (["eval", "--model", str(STORIES_MHA), "--tasks", "piqa", "--limit", "315", "--quiet"],  # document 314's answer
     "a document's answer is longer than the model's context (512 tokens), which lm-eval cannot score"),
]


@pytest.mark.parametrize("argv, needle", FOUND)
def test_what_the_fuzzer_found_is_one_line(argv, needle, store):
    with tempfile.TemporaryDirectory(prefix="rcpu-fuzz-") as root:
        box = make_sandbox(Path(root), store)
        argv = [word.format(matrix=box.root / "matrix.yaml", root=box.root) for word in argv]
        with inside(box):
            code, output = run_main(argv)
    assert code == 2 and "Traceback" not in output, output[-2000:]
    assert needle in output.rstrip().split("\n")[-1], output[-2000:]
