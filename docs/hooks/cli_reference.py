"""The command-line reference page (``reference/cli.md``), generated at build time from the option declarations.

One source: every subcommand's options come from its real parser (``rcpu_bench.commands.subcommand_parser``); the
run options of ``prune`` (also a matrix's ``prune:`` keys) from ``rcpu_bench.pruning.options.markdown_table``, the
experiment-level options of the commands that load a model from ``rcpu_bench.experiment.markdown_table`` and a
matrix's top-level keys from ``rcpu_bench.matrix.spec.key_table``. Nothing of the page is written by hand, so
it cannot fall behind the code. ``mkdocs.yml`` loads this module as a hook; ``python docs/hooks/cli_reference.py``
prints the page.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

PAGE = "reference/cli.md"
SHARED_TABLES = ("run options", "experiment options")


def _outside_code(text: str, change: Any) -> str:
    """Apply ``change`` to the parts of ``text`` outside `code spans`; inside them, GitHub's ``\\|`` becomes ``|``
    (Python-Markdown keeps a pipe inside a code span in its cell)."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part.replace("\\|", "|") if part.startswith("`") else change(part) for part in parts)


def _prose(text: str) -> str:
    """Help text as table-cell Markdown: ``<name>`` shown, not read as HTML; ``*``, ``|`` and ``[`` literal."""
    def escape(part: str) -> str:
        part = part.replace("\\|", "|").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        return part.replace("*", "\\*").replace("|", "\\|").replace("[", "\\[")
    return _outside_code(text, escape)


def declared_table(table: str) -> str:
    """A table of ``rcpu_bench.declaration.markdown_table`` as the site renders it."""
    lines = table.splitlines()
    return "\n".join(lines[:2] + [_outside_code(line, lambda part: part.replace("<", "&lt;").replace(">", "&gt;")
                                                .replace("*", "\\*").replace("[", "\\[")) for line in lines[2:]])


def _flag(action: argparse.Action) -> str:
    """An action as the user types it: ``--ratio RHO``, ``--format {md,latex,csv}``, ``DIR`` for a positional."""
    if not action.option_strings:
        return str(action.metavar or action.dest)
    names = " / ".join(action.option_strings)
    if action.nargs == 0:
        return names
    if action.metavar is not None:
        return f"{names} {action.metavar}"
    if action.choices is not None:
        return f"{names} {{{','.join(map(str, action.choices))}}}"
    return f"{names} {action.dest.upper()}"


def _usage(parser: argparse.ArgumentParser) -> str:
    """The usage line as ``--help`` prints it on an 88-column terminal (the same on every machine)."""
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "88"
    try:
        usage = parser.format_usage().removeprefix("usage: ").rstrip()
        return usage.replace("\n" + " " * len("usage: "), "\n")
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS) or not action.option_strings:
        return ""
    return f"`{action.default}`"


def _help(action: argparse.Action) -> str:
    text = (action.help or "").replace("%(default)s", str(action.default)).replace("%%", "%")
    if action.required:
        text = f"required; {text}" if text else "required"
    if isinstance(action, argparse._AppendAction) and "repeatable" not in text:
        text = f"{text} (repeatable)" if text else "repeatable"
    return _prose(text)


def _renamed(declared: Any) -> list[tuple[str, str]]:
    """(flag, matrix key) of the options whose matrix key is not the flag with underscores."""
    return [(o.flag, o.name) for o in declared if o.flag.removeprefix("--").replace("-", "_") != o.name]


def _recipe_options(prune: dict[str, Any]) -> str:
    return ", ".join(f"`{key}: {value}`" for key, value in prune.items()) or "—"


def declared_flags() -> dict[str, set[str]]:
    """The flags of the shared tables: the run options and the experiment-level options."""
    from rcpu_bench import experiment
    from rcpu_bench.pruning import options

    return {"run options": {option.flag for option in options.OPTIONS},
            "experiment options": {option.flag for option in experiment.OPTIONS}}


def command_section(name: str, summary: str, parser: argparse.ArgumentParser, shared: dict[str, set[str]]) -> str:
    """One subcommand: what it does, its usage and a table of its own options (the shared ones by reference)."""
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    flags = {flag for action in actions for flag in action.option_strings}
    takes = [group for group in SHARED_TABLES if shared[group] & flags]
    own = [a for a in actions if not any(set(a.option_strings) & shared[group] for group in takes)]
    lines = [f"## rcpu-bench {name}", "", f"{_prose(summary[0].upper() + summary[1:])}.", "", "```text",
             _usage(parser), "```", ""]
    if own:
        lines += ["| option | meaning | default |", "|---|---|---|"]
        lines += [f"| `{_flag(a)}` | {_help(a)} | {_default(a)} |" for a in own]
        lines.append("")
    if takes:
        links = " and the ".join(f"[{group}](#{group.replace(' ', '-')})" for group in takes)
        lines += [f"It also takes the {links}.", ""]
    return "\n".join(lines)


def render() -> str:
    """The whole page, Markdown."""
    from rcpu_bench import experiment
    from rcpu_bench.commands import COMMANDS, build_parser, subcommand_parser
    from rcpu_bench.matrix import schema
    from rcpu_bench.matrix.entries import CALIB_KEYS, MODEL_KEYS
    from rcpu_bench.matrix.spec import key_table
    from rcpu_bench.pruning import options
    from rcpu_bench.pruning.methods import RECIPES

    top = build_parser()
    shared = declared_flags()
    global_options = [a for a in top._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    parts = [
        "# Command line",
        "",
        "Every `rcpu-bench` command and option, generated from the parsers and option declarations when the site "
        "is built. `rcpu-bench COMMAND --help` prints the same.",
        "",
        "Options are never abbreviated. Bad input is one line, `rcpu-bench COMMAND: error: ...`, with exit code 2; "
        "`rcpu-bench --debug COMMAND ...` shows the traceback instead.",
        "",
        "## rcpu-bench",
        "",
        "```text",
        _usage(top),
        "```",
        "",
        "| option | meaning |",
        "|---|---|",
        *[f"| `{_flag(a)}` | {_help(a) or 'print the version and exit'} |" for a in global_options],
        "",
        "| command | what it does |",
        "|---|---|",
        *[f"| [`{name}`](#rcpu-bench-{name}) | {_prose(text)} |" for name, text in COMMANDS.items()],
        "",
    ]
    parts += [command_section(name, text, subcommand_parser(name, top), shared) for name, text in COMMANDS.items()]
    parts += [
        "## Run options",
        "",
        "The options of one pruning run (`rcpu-bench prune`), declared once in `rcpu_bench/pruning/options.py`. "
        "A matrix's `prune:` mapping and its methods take the same names with underscores "
        "(`gqa_rule: query`); these are named otherwise: " + ", ".join(
            f"`{name}` (`{flag}`)" for flag, name in _renamed(options.OPTIONS)) + ".",
        "",
        declared_table(options.markdown_table()),
        "",
        "## Experiment options",
        "",
        "The options of every command that loads a model (`prune`, `eval`, `generate`, `speed`), declared once as "
        "the fields of `Experiment` (`rcpu_bench/experiment.py`). A matrix takes `dtype`, `device` and "
        "`eval_batch_size` as top-level keys and `revision` per model.",
        "",
        declared_table(experiment.markdown_table()),
        "",
        "## Matrix keys",
        "",
        "The top-level keys of a matrix file (`rcpu-bench run --matrix FILE.yaml`), declared once as the fields of "
        "`Matrix` (`rcpu_bench/matrix/spec.py`). A bad key or value is reported with its location and what is "
        "allowed.",
        "",
        declared_table(key_table()),
        "",
        "A `models` item is a path or hub id, or a mapping of these keys:",
        "",
        declared_table(schema.markdown_table(MODEL_KEYS)),
        "",
        "`calib` is a mapping of these keys:",
        "",
        declared_table(schema.markdown_table(CALIB_KEYS)),
        "",
        "A `methods` item is a recipe key below, a custom method `{name: ..., scorer: ..., compensator: ..., "
        "<option>: ...}` with run options in their matrix spelling, or a product `{scorers: [...], compensators: "
        "[...]}` (`all`: every registered one). The recipes (`rcpu_bench/pruning/methods.py`):",
        "",
        "| recipe | label in tables | options |",
        "|---|---|---|",
        *[f"| `{key}` | {_prose(recipe.label)} | {_recipe_options(recipe.prune)} |" for key, recipe in RECIPES.items()],
        "",
    ]
    return "\n".join(parts)


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated page to the site's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files


if __name__ == "__main__":
    print(render())
