"""mkdocs hook: show the Sphinx roles of the docstrings (``:class:`~pkg.Name```) as plain code (``Name``).

The package's docstrings are Google style with a few Sphinx cross-reference roles; mkdocstrings renders
those as ``:class:<code>~pkg.Name</code>``. This keeps the code and drops the role, like Sphinx's output.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:py:)?(?:class|meth|func|data|attr|mod|exc|obj):<code>(~?)([^<]+)</code>")


def _plain(match: re.Match[str]) -> str:
    short, target = match[1], match[2]
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    """Rewrite the roles of one page's HTML."""
    return ROLE.sub(_plain, html)
