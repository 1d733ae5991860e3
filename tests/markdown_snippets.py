"""The fenced ``python`` blocks of a Markdown page (README.md, docs/*.md), shared by the tests that
compile them (unit/test_readme.py) and run them (e2e/test_readme_quick_start.py)."""

from __future__ import annotations

import re

_HEADING_OR_SNIPPET = re.compile(r"^## ([^\n]+)$|^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def python_snippets(markdown: str) -> dict[str, str]:
    """Every fenced ``python`` block of a Markdown text, keyed by the ``##`` heading it sits under
    (with a counter when a section has several; ``(top)`` before the first heading)."""
    snippets: dict[str, str] = {}
    heading = "(top)"
    for block in _HEADING_OR_SNIPPET.finditer(markdown):
        if block.group(1):
            heading = block.group(1).strip()
            continue
        key, n = heading, 1
        while key in snippets:
            n += 1
            key = f"{heading} ({n})"
        snippets[key] = block.group(2)
    return snippets
