"""Tables in the README and on the site that a command prints, so that they cannot drift from the committed stores.

A generated block names its command and holds its output, verbatim, or includes the committed file that
``results/regenerate.sh`` writes with it::

    <!-- generated: rcpu-bench tables --results results/real/smollm2 --table ranking --ratios 0.2 -->
    ...the command's output...
    <!-- /generated -->

``tests/test_docs.py`` runs every block's command against the committed stores and compares; ``python
docs/hooks/generated.py`` rewrites the blocks that hold the output (a block that includes a file is rewritten by
``results/regenerate.sh``). A figure quoted in the prose of these pages comes from a committed file the paragraph
names in backticks (``results/real/smollm2/tables.md``) or from a generated block of the same page (:func:`figures`).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
# The pages that quote results, and the section of each that does (None: the whole page).
PAGES = {ROOT / "README.md": "## Results", ROOT / "docs" / "results.md": None}
BLOCK = re.compile(r"<!-- generated: (?P<command>.+?) -->\n(?P<body>.*?)<!-- /generated -->", re.S)
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"\n$')
FIGURE = re.compile(r"(?<![\w.])[+\-−]?\d[\d,]*\.\d+")  # a number with decimals: 3.90, 1,207.05, −4.86
NAMED = re.compile(r"`((?:results|docs)/[^`]+\.(?:md|csv|latex|json))`")


class Block(NamedTuple):
    """One generated block of a page: its command, what the page holds, and the committed file it includes."""

    page: Path
    command: str
    body: str

    @property
    def included(self) -> Path | None:
        match = SNIPPET.match(self.body)
        return ROOT / match["path"] if match else None

    def expected(self) -> str:
        """What the block shows: the included file's text, or the body itself."""
        return self.included.read_text(encoding="utf-8") if self.included else self.body

    def output(self) -> str:
        """The command's output, run here against the committed stores (from the repository's root)."""
        from rcpu_bench.commands import main

        words = shlex.split(self.command)
        if words[0] != "rcpu-bench":
            raise ValueError(f"{self.page.name}: a generated block runs rcpu-bench, not {words[0]!r}")
        printed, here = io.StringIO(), Path.cwd()
        os.chdir(ROOT)
        try:
            with contextlib.redirect_stdout(printed):
                code = main(words[1:])
        finally:
            os.chdir(here)
        if code != 0:
            raise ValueError(f"{self.page.name}: `{self.command}` exited with {code}")
        return printed.getvalue()


def blocks(page: Path) -> list[Block]:
    return [Block(page, m["command"], m["body"]) for m in BLOCK.finditer(page.read_text(encoding="utf-8"))]


def refresh(page: Path) -> bool:
    """Rewrite the page's blocks that hold their output; whether anything changed."""
    text = page.read_text(encoding="utf-8")

    def rewrite(match: re.Match[str]) -> str:
        block = Block(page, match["command"], match["body"])
        body = block.body if block.included else block.output()
        return f"<!-- generated: {block.command} -->\n{body}<!-- /generated -->"

    new = BLOCK.sub(rewrite, text)
    if new != text:
        page.write_text(new, encoding="utf-8")
    return new != text


def paragraphs(page: Path, section: str | None = None) -> list[str]:
    """The prose paragraphs of a page (of its ``section``, from that heading to the next of its level): no generated
    block, code block, table or heading."""
    text = BLOCK.sub("", page.read_text(encoding="utf-8"))
    if section is not None:
        level = section.split(" ")[0] + " "
        text = text.split(f"\n{section}\n", 1)[1].split(f"\n{level}", 1)[0]
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [p for p in re.split(r"\n\s*\n", text)
            if p.strip() and not p.lstrip().startswith(("|", "#", "<!--", "--8<--"))]


def figures(page: Path, section: str | None = None) -> list[tuple[str, str]]:
    """(figure, paragraph) for every figure of the page's prose (of its ``section``) that neither a committed file the
    paragraph names nor a generated block of the page holds."""
    shown = "".join(block.expected() for block in blocks(page))
    missing = []
    for paragraph in paragraphs(page, section):
        sources = shown + "".join((ROOT / name).read_text(encoding="utf-8") for name in NAMED.findall(paragraph)
                                  if (ROOT / name).is_file())
        for figure in FIGURE.findall(paragraph):
            digits = figure.lstrip("+-−")
            if digits not in sources:
                missing.append((figure, paragraph.strip().replace("\n", " ")[:120]))
    return missing


if __name__ == "__main__":
    changed = [page.name for page in PAGES if refresh(page)]
    print(f"rewrote {', '.join(changed)}" if changed else "every generated block is current", file=sys.stderr)
