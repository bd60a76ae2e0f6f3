"""Docstrings cite code with Sphinx roles (``:class:`Record```); the API pages show the name alone, as code.

``mkdocs.yml`` loads this module as a hook. mkdocstrings renders a role as ``:class:<code>Record</code>``; this drops
the role and, for ``~a.b.C``, the path before the last name, as Sphinx would.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):<code>(~?)([^<]*)</code>")


def strip_roles(html: str) -> str:
    """The page's HTML without Sphinx role prefixes."""
    return ROLE.sub(lambda m: f"<code>{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}</code>", html)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs hook: applied to every page's HTML."""
    return strip_roles(html)
