"""The README's generated Layout list is current, and every ``docs/methods.md §N`` citation names a section."""

import re
from pathlib import Path

from rcpu_bench import package_layout

ROOT = Path(__file__).resolve().parents[1]


def test_readme_layout_is_current():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    (block,) = re.findall(re.escape(package_layout.BEGIN) + r"\n(.*?)\n" + re.escape(package_layout.END), text,
                          flags=re.S)
    assert block == package_layout.markdown_layout(), "run: python -m rcpu_bench.package_layout README.md"


def test_summary_is_the_first_sentence_in_markdown(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Scores (paper eq. gamma) of :class:`Stats`, ``x``.\n\nMore. Text."""\n')
    assert package_layout.summary(module) == "Scores (paper eq. gamma) of `Stats`, `x`"
    (tmp_path / "empty.py").write_text("x = 1\n")
    assert package_layout.markdown_layout(tmp_path) == "- `m.py`: Scores (paper eq. gamma) of `Stats`, `x`"


def test_methods_citations_name_existing_sections():
    sections = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "methods.md").read_text(encoding="utf-8"), flags=re.M))
    cited = {}
    for path in [*ROOT.glob("rcpu_bench/**/*.py"), *ROOT.glob("plugins/*/rcpu_*/**/*.py"), *ROOT.glob("tests/*.py"),
                 *ROOT.glob("benchmarks/*"), ROOT / "README.md"]:
        if path.is_file():
            for number in re.findall(r"docs/methods\.md`? §(\d+)", path.read_text(encoding="utf-8")):
                cited.setdefault(number, path)
    assert cited, "no citation of docs/methods.md found"
    assert not {n: str(p) for n, p in cited.items() if n not in sections}
