"""MkDocs hook: the site's home page is README.md, so the front door is written once.

README links to the docs as ``docs/<page>.md`` (right on GitHub and in a checkout); on the site the
pages sit beside the home page, so that prefix is dropped. Any other relative link in the README would
point outside the site: it fails the build, naming the link.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

_LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)\s]+)\)")


def readme_as_home(text: str) -> str:
    """The README's Markdown with its ``docs/`` links made relative to the docs directory."""

    def relink(match: re.Match) -> str:
        target = match.group(1)
        if not target.startswith("docs/"):
            raise PluginError(f"README.md links to {target!r}, outside docs/: the site has no such page")
        return f"]({target[len('docs/'):]})"

    return _LINK.sub(relink, text)


def on_files(files, config):
    """Add README.md as the generated ``index.md``."""
    readme = Path(config["config_file_path"]).parent / "README.md"
    files.append(File.generated(config, "index.md", content=readme_as_home(readme.read_text())))
    return files

