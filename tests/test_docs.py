"""The documentation stays true: every command line and code block of the README and the site parses, names what
exists and runs where it can; the generated parts (the architecture page's module list, the command-line reference)
are current; every ``docs/methods.md §N`` citation names a section; every link of the README resolves."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import shlex
import types
from functools import cache
from pathlib import Path

import pytest
import yaml

from rcpu_bench import package_layout

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PLUGIN_SOURCES = {"README.md": README, "tutorial": DOCS / "plugins" / "tutorial.md"}  # blocks with @hookimpl
# Commands of other tools the docs show; what follows them is theirs to check.
OTHER_TOOLS = {"lm_eval", "llama-cli", "mkdocs", "tox", "pre-commit", "ray", "mlflow", "wandb", "."}
# Options of other tools named in the docs (pytest, pip, lm-eval, llama.cpp, git, mlflow, wandb).
OTHER_OPTIONS = {"--benchmark-only", "--benchmark-sort", "--benchmark-columns", "--benchmark-json", "--model_args",
                 "--strict", "--temp", "--quiet", "--upgrade", "--no-optional-locks", "--backend-store-uri",
                 "--summary", "--no-cache-dir", "--force-reinstall", "--no-deps"}
# Words that look like options: a module docstring's "the --flag of a command", and the abbreviation the docs show
# being refused ("--eval 4 is an error, not --eval-batch-size 4").
NOT_OPTIONS = {"--flag", "--eval"}


def documents() -> list[Path]:
    """The README, every page of the site, the plugin and benchmark READMEs."""
    pages = [p for p in DOCS.rglob("*.md") if "hooks" not in p.parts]
    return [README, *sorted(pages), ROOT / "plugins" / "README.md", *sorted(ROOT.glob("plugins/*/README.md")),
            ROOT / "benchmarks" / "README.md"]


@cache
def text_of(path: Path) -> str:
    """A document as the site renders it: ``--8<-- "file"`` lines replaced by that file."""
    def include(match: re.Match[str]) -> str:
        return (ROOT / match[1]).read_text(encoding="utf-8")
    return re.sub(r'^--8<-- "([^"]+)"$', include, path.read_text(encoding="utf-8"), flags=re.M)


def blocks(language: str) -> list[tuple[str, str]]:
    """(``document: line``, source) of every fenced block of ``language``."""
    found = []
    for path in documents():
        text = text_of(path)
        for match in re.finditer(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M):
            line = text[: match.start()].count("\n") + 1
            found.append((f"{path.relative_to(ROOT)}:{line}", match[1]))
    return found


def split_commands(line: str) -> list[list[str]]:
    """The commands of one shell line (``a && b; c``), each as its argv, quotes and comments as the shell reads them."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in (";", "&&"):
            commands.append([])
        else:
            commands[-1].append(token)
    return commands


def shell_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every command of every ```bash block and of every inline `rcpu-bench ...` span."""
    commands = []
    for where, source in blocks("bash"):
        for line in source.replace("\\\n", " ").splitlines():
            for argv in split_commands(line):
                while argv and re.fullmatch(r"[A-Z_]+=.*", argv[0]):  # VAR=value before a command
                    argv = argv[1:]
                if argv:
                    commands.append((where, argv))
    return commands


def inline_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every inline `rcpu-bench ...` span: often a command's name with some of its options."""
    return [(f"{path.relative_to(ROOT)}", shlex.split(span)) for path in documents()
            for span in re.findall(r"`(rcpu-bench [^`]+)`", text_of(path))]


@cache
def registry():
    """The built-ins, the two plugin packages and the plugin of the README and the tutorial."""
    from rcpu_bench.plugins import plugin_manager
    from rcpu_bench.registry import build_registry

    plugins = [(name, plugin_module(name)) for name in ("rcpu_example.plugin", "rcpu_slicegpt.plugin")]
    return build_registry(plugin_manager([*plugins, ("my_plugin", doc_plugin("README.md"))], entry_points=False))


PLUGIN_PACKAGES = ("rcpu_example", "rcpu_slicegpt")  # plugins/*: installed by make, else the tests that need one skip


def plugin_module(name: str) -> types.ModuleType:
    """A module of the plugin packages in plugins/, or a skip where they are not installed."""
    if name.split(".")[0] in PLUGIN_PACKAGES and importlib.util.find_spec(name.split(".")[0]) is None:
        pytest.skip(f"{name.split('.')[0]} is not installed (pip install -e plugins/...)")
    return importlib.import_module(name)


def doc_plugin(name: str) -> types.ModuleType:
    """The ```python block with ``@hookimpl`` of the README or the tutorial, as a module."""
    source = PLUGIN_SOURCES[name]
    found = [b for b in re.findall(r"```python\n(.*?)```", text_of(source), flags=re.S) if "@hookimpl" in b]
    assert len(found) == 1, f"{source.name} should hold one plugin block, found {len(found)}"
    module = types.ModuleType("my_plugin")
    exec(compile(found[0], str(source), "exec"), module.__dict__)
    return module


# ------------------------------------------------------------------------------------ generated parts


def test_architecture_layout_is_current():
    text = package_layout.DOCUMENT.read_text(encoding="utf-8")
    (block,) = re.findall(re.escape(package_layout.BEGIN) + r"\n(.*?)\n" + re.escape(package_layout.END), text,
                          flags=re.S)
    assert block == package_layout.markdown_layout(), "run: python -m rcpu_bench.package_layout"


def test_summary_is_the_first_sentence_in_markdown(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Scores (paper eq. gamma) of :class:`Stats`, ``x``.\n\nMore. Text."""\n')
    assert package_layout.summary(module) == "Scores (paper eq. gamma) of `Stats`, `x`"
    (tmp_path / "empty.py").write_text("x = 1\n")
    assert package_layout.markdown_layout(tmp_path) == "- `m.py`: Scores (paper eq. gamma) of `Stats`, `x`"


@cache
def hook(name: str) -> types.ModuleType:
    """A module of docs/hooks/, the site's build code (mkdocs loads it by path, not as a package)."""
    spec = importlib.util.spec_from_file_location(name, DOCS / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cli_reference() -> types.ModuleType:
    return hook("cli_reference")


def test_cli_reference_holds_every_command_and_option_of_the_parsers():
    from rcpu_bench.commands import COMMANDS, build_parser, subcommand_parser

    page = cli_reference().render()
    for name in COMMANDS:
        assert f"\n## rcpu-bench {name}\n" in page
        for action in subcommand_parser(name)._actions:
            if not isinstance(action, argparse._HelpAction):
                shown = action.option_strings[0] if action.option_strings else action.metavar
                assert f"`{shown}" in page, f"rcpu-bench {name}: {shown} is missing from the reference"
    assert "`--version`" in page and "`--debug`" in page and build_parser().prog == "rcpu-bench"


def test_cli_reference_tables_are_the_declared_ones():
    from rcpu_bench import experiment as experiment_options
    from rcpu_bench.matrix.spec import key_table
    from rcpu_bench.pruning import options

    page, reference = cli_reference().render(), cli_reference()
    for table in (options.markdown_table(), experiment_options.markdown_table(), key_table()):
        assert reference.declared_table(table) in page
    assert len(re.findall(r"^\| `--", reference.declared_table(options.markdown_table()), flags=re.M)) == len(
        options.OPTIONS)


def test_api_pages_show_sphinx_roles_as_code():
    strip = hook("sphinx_roles").strip_roles
    assert strip("see :class:<code>~rcpu_bench.records.Record</code> and :func:<code>a.f</code>") == (
        "see <code>Record</code> and <code>a.f</code>")


def test_cli_reference_escapes_what_markdown_would_read_as_markup():
    reference = cli_reference()
    assert reference._prose("results/<name>, the *-other kinds, SOURCE[:N] `a\\|b` x|y") == (
        "results/&lt;name&gt;, the \\*-other kinds, SOURCE\\[:N] `a|b` x\\|y")


# ------------------------------------------------------------------------------------ citations and links


def test_methods_citations_name_existing_sections():
    sections = set(re.findall(r"^## (\d+)\. ", (DOCS / "methods.md").read_text(encoding="utf-8"), flags=re.M))
    cited = {}
    for path in [*ROOT.glob("rcpu_bench/**/*.py"), *ROOT.glob("plugins/*/rcpu_*/**/*.py"), *ROOT.glob("tests/*.py"),
                 *ROOT.glob("benchmarks/*"), *documents()]:
        if path.is_file():
            for number in re.findall(r"docs/methods\.md`? §(\d+)", path.read_text(encoding="utf-8")):
                cited.setdefault(number, path)
    assert cited, "no citation of docs/methods.md found"
    assert not {n: str(p) for n, p in cited.items() if n not in sections}


@pytest.mark.parametrize("path", [README, ROOT / "plugins" / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8"))
    local = [link for link in links if "://" not in link]
    assert local and not [link for link in local if not (path.parent / link).exists()]


def test_readme_is_short_and_its_first_screen_speaks_of_the_product():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    first_screen = "\n".join(text.splitlines()[:40])
    assert not re.search(r"\.ci/|\bCI\b|floors|mypy|ruff", first_screen)
    assert not re.search(r"\bissue \d+|\b[0-9a-f]{7,40}\b.*commit|UTC", text)


PRODUCT_TEXT = [*documents(), ROOT / "CHANGELOG.md", *ROOT.glob("results/**/*.md"), ROOT / "results" / "regenerate.sh",
                *ROOT.glob("rcpu_bench/matrix/shipped/*.yaml"), *ROOT.glob("benchmarks/*.py"),
                ROOT / "benchmarks" / "gpu_checks.sh",
                *[ROOT / "rcpu_bench" / m for m in ("tables/generalisation.py", "tables/main_effects.py",
                                                    "statistics/flops.py", "compensation/diagnostics.py")],
                ROOT / "tests" / "test_statistics_paths.py", ROOT / "tests" / "test_cli_hygiene.py"]


@pytest.mark.parametrize("path", PRODUCT_TEXT, ids=lambda p: str(p.relative_to(ROOT)))
def test_product_language(path):
    """What the product says speaks of the product: no issue numbers, work stops or time stamps of a session."""
    text = path.read_text(encoding="utf-8")
    assert not re.findall(r"\b[Ii]ssue[- ]\d+|\bstop \d+\b|\d\d:\d\d(?:-\d\d:\d\d)? UTC", text)


def test_changelog_has_one_heading_per_release_the_newest_the_package_version():
    """Changes not yet released go under an "Unreleased" heading at the top, if anywhere."""
    from rcpu_bench import __version__

    headings = re.findall(r"^## (\S+)$", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), flags=re.M)
    releases = headings[1:] if headings[0] == "Unreleased" else headings
    assert releases[0] == __version__ and len(releases) == len(set(releases)) and "Unreleased" not in releases


# ------------------------------------------------------------------------------------ commands


def check_rcpu_bench(argv: list[str]) -> None:
    """Parse with the real parser, then check what the parser leaves to later: names, profiles, sources, matrices."""
    from rcpu_bench import data
    from rcpu_bench.commands import build_parser
    from rcpu_bench.evaluation.perplexity import get_profile
    from rcpu_bench.matrix.spec import shipped_matrices
    from rcpu_bench.model.real_models import MODELS

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as error:
        raise AssertionError(f"rcpu-bench {' '.join(argv)} does not parse (exit {error.code})") from None
    if args.command == "prune":
        from rcpu_bench.pruning import options

        options.from_args(args).validate(registry())
    for profile in getattr(args, "ppl", None) or []:
        get_profile(profile)
    if getattr(args, "calib", None):
        data.parse_calib(args.calib)
    matrix = getattr(args, "matrix", None)
    if matrix and not matrix.endswith((".yaml", ".yml")):
        assert matrix in shipped_matrices(), f"--matrix {matrix}: not a shipped matrix ({shipped_matrices()})"
    models = getattr(args, "model", None)
    for model in models if isinstance(models, list) else [models] if models else []:
        if model.startswith("../shared/"):
            assert (ROOT / model).exists() or not (ROOT.parent / "shared").is_dir(), f"--model {model}: no such fixture"
        elif "/" not in model:
            assert model in MODELS, f"--model {model}: not a real model ({', '.join(MODELS)})"


def flags_of(path: Path) -> set[str]:
    return set(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", path.read_text(encoding="utf-8")))


def check_command(argv: list[str]) -> None:
    """One command line of the docs: ours parse; files, targets, extras and flags of the repository's own exist."""
    program, args = argv[0], argv[1:]
    if program == "rcpu-bench":
        check_rcpu_bench(args)
    elif program == "make":
        targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(encoding="utf-8"), flags=re.M))
        assert set(a for a in args if "=" not in a) <= targets
    elif program == "bash":
        assert (ROOT / args[0]).is_file(), args[0]
    elif program in ("python", "python3") and args[:2] == ["-m", "pytest"]:
        paths = [a.split("::")[0] for a in args[2:] if not a.startswith("-") and "/" in a]
        assert all((ROOT / p).exists() for p in paths), paths
    elif program in ("python", "python3") and args[:1] == ["-m"]:
        assert args[1] in ("venv", "rcpu_bench.package_layout", "pip"), args
    elif program in ("python", "python3") and args[:1] == ["-c"]:
        compile(args[1], "python -c", "exec")
    elif program in ("python", "python3"):
        script = ROOT / args[0]
        assert script.is_file(), args[0]
        unknown = {a.split("=")[0] for a in args if a.startswith("--")} - flags_of(script)
        assert not unknown, f"{args[0]} has no option {sorted(unknown)}"
    elif program == "pip":
        tomllib = pytest.importorskip("tomllib")  # Python 3.11+
        extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
            "optional-dependencies"])
        for arg in args[1:]:
            requested = re.fullmatch(r"""\.\[([a-z,]+)\]|'?rcpu-bench\[([a-z,]+)\]'?""", arg)
            if requested:
                assert set((requested[1] or requested[2]).split(",")) <= extras, arg
            elif arg.startswith(("plugins/", ".")):
                assert (ROOT / arg).exists(), arg
    else:
        assert program in OTHER_TOOLS, f"a command the doc tests do not know: {' '.join(argv)}"


def cases(found: list[tuple[str, object]]) -> list:
    """Parameters named by where they stand and what they say."""
    def name(where: str, what: object) -> str:
        text = " ".join(what) if isinstance(what, list) else str(what).split("\n")[0]
        return f"{where}: {text[:60]}"
    return [pytest.param(where, what, id=name(where, what)) for where, what in found]


@pytest.mark.parametrize(("where", "argv"), cases(shell_commands()))
def test_every_command_of_the_docs_is_valid(where, argv):
    check_command(argv)


@pytest.mark.parametrize(("where", "argv"), cases(inline_commands()))
def test_every_command_named_in_the_text_exists_with_its_options(where, argv):
    from rcpu_bench.commands import COMMANDS, build_parser, subcommand_parser

    top = {flag for action in build_parser()._actions for flag in action.option_strings}
    words = [word for word in argv[1:] if word not in top]
    if not words or not re.fullmatch(r"[a-z]+", words[0]):  # rcpu-bench --version, rcpu-bench COMMAND
        assert set(argv[1:]) & top or words[0].isupper(), argv
        return
    assert words[0] in COMMANDS, f"no command rcpu-bench {words[0]}"
    flags = {flag for action in subcommand_parser(words[0])._actions for flag in action.option_strings}
    assert {word.split("=")[0] for word in words if word.startswith("--")} <= flags, argv


def test_every_option_named_in_the_docs_exists():
    from rcpu_bench.commands import COMMANDS, build_parser, subcommand_parser

    known = {flag for action in build_parser()._actions for flag in action.option_strings}
    known |= {flag for name in COMMANDS for action in subcommand_parser(name)._actions
              for flag in action.option_strings}
    known |= {flag for path in [*ROOT.glob("benchmarks/*.py"), ROOT / "benchmarks" / "gpu_checks.sh"]
              for flag in flags_of(path)} | {"--deps-only", "--here"} | OTHER_OPTIONS | NOT_OPTIONS  # .ci's own
    named = {}
    for path in documents():
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*[a-z0-9])", text_of(path)):
            named.setdefault(flag, str(path.relative_to(ROOT)))
    assert not {flag: where for flag, where in named.items() if flag not in known}


# ------------------------------------------------------------------------------------ code blocks


@pytest.mark.parametrize(("where", "source"), cases(blocks("python")))
def test_every_python_block_compiles_and_its_imports_resolve(where, source):
    tree = ast.parse(source, where)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                plugin_module(alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = plugin_module(node.module)
            missing = [a.name for a in node.names if not hasattr(module, a.name)
                       and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
            assert not missing, f"{where}: {node.module} has no {missing}"


@pytest.mark.parametrize(("where", "source"), cases(blocks("yaml")))
def test_every_matrix_in_the_docs_loads(where, source, tmp_path):
    from rcpu_bench.matrix.spec import TOP_KEYS, expand, load_matrix

    given = yaml.safe_load(source)
    assert set(given) <= {key.name for key in TOP_KEYS}, f"{where}: unknown keys {set(given)}"
    if "models" in given:
        path = tmp_path / "matrix.yaml"
        path.write_text(source, encoding="utf-8")
        assert expand(load_matrix(str(path)), registry())


@pytest.mark.parametrize(("where", "source"), cases(blocks("toml")))
def test_every_toml_block_parses_and_declares_the_entry_point_group(where, source):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    assert "rcpu_bench" in tomllib.loads(source)["project"]["entry-points"]


@pytest.mark.slow
def test_the_python_api_example_runs(capsys, monkeypatch):
    (source,) = [s for w, s in blocks("python") if "run_experiment(" in s and w.startswith("docs/reference")]
    if not (ROOT.parent / "shared" / "models" / "stories260K").is_dir():
        pytest.skip("the shared fixtures are not beside the checkout")
    monkeypatch.chdir(ROOT)  # the example's paths are relative to the checkout
    exec(compile(source, "python-api.md", "exec"), {"__name__": "example"})
    parameters, ppl = capsys.readouterr().out.split()
    assert int(parameters) > 0 and 1 < float(ppl) < 100



# ------------------------------------------------------------------------ numbers that cannot drift


def generated() -> types.ModuleType:
    return hook("generated")


GENERATED = [(page, number) for page in documents() for number in range(len(generated().blocks(page)))]
COMMITTED_OUTPUTS = [line for line in (ROOT / "results" / "outputs.txt").read_text(encoding="utf-8").splitlines()
                     if line and not line.startswith("#")]


@pytest.mark.slow  # bootstrap rankings of the real-model stores: seconds each
@pytest.mark.parametrize(("page", "number"), GENERATED, ids=lambda v: v.name if isinstance(v, Path) else str(v))
def test_every_generated_table_of_the_readme_and_site_is_its_commands_output_on_the_committed_stores(page, number):
    block = generated().blocks(page)[number]
    assert block.output() == block.expected(), f"{page.name}: `{block.command}` prints another table"


def test_the_pages_show_every_committed_table_through_a_command_that_names_it():
    """A committed table of a store included in a page sits in a generated block whose command is the one that writes
    it (``results/benchmarks/`` holds the benchmark scripts' outputs, written by the commands its page shows)."""
    commands = {shlex.join(shlex.split(line)[:-2]): shlex.split(line)[-1] for line in COMMITTED_OUTPUTS
                if " tables " in line}
    for page in documents():
        blocks = generated().blocks(page)
        for include in re.findall(r'^--8<-- "(results/(?!benchmarks/)[^"]+)"$', page.read_text(encoding="utf-8"),
                                  flags=re.M):
            owner = [b for b in blocks if b.included == ROOT / include]
            assert owner, f"{page.name} includes {include} outside a generated block"
            command = shlex.join(shlex.split(owner[0].command))
            assert any(command == written.replace(" --format md", "") and path == include
                       for written, path in commands.items()), f"{page.name}: {include} is not written by {command}"


def test_every_figure_quoted_in_the_results_prose_is_in_a_file_it_names_or_a_table_of_its_page():
    for page, section in generated().PAGES.items():
        assert generated().figures(page, section) == [], page.name


@pytest.mark.slow  # every table of every committed store
@pytest.mark.parametrize("line", [line for line in COMMITTED_OUTPUTS if " tables " in line])
def test_every_committed_table_is_its_commands_output_on_the_committed_stores(line, capsys, monkeypatch):
    from rcpu_bench.commands import main

    monkeypatch.chdir(ROOT)
    words = shlex.split(line)
    assert words[0] == "rcpu-bench" and words[-2] == "--out"
    assert main(words[1:-2]) == 0
    assert capsys.readouterr().out == (ROOT / words[-1]).read_text(encoding="utf-8"), line


@pytest.mark.slow  # every figure of every committed store: minutes
def test_every_committed_figure_is_its_commands_output_byte_for_byte(tmp_path, monkeypatch):
    from rcpu_bench.commands import main

    monkeypatch.chdir(ROOT)
    for line in (line for line in COMMITTED_OUTPUTS if " plots " in line):
        words = shlex.split(line)
        assert words[-2] == "--out-dir"
        committed, fresh = ROOT / words[-1], tmp_path / words[-1]
        assert main([*words[1:-1], str(fresh)]) == 0
        names = sorted(p.name for p in committed.iterdir())
        assert sorted(p.name for p in fresh.iterdir()) == names, line
        for name in names:
            assert (fresh / name).read_bytes() == (committed / name).read_bytes(), f"{line}: {name}"
