"""README.md's promises that need no Ray: every Python snippet compiles (the docs pages' too), the
README stays a front door (at most 300 lines), and every docs page it links to exists.
tests/e2e/test_readme_quick_start.py runs the quick starts."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

sys.path.insert(0, str(ROOT / "tests"))
from markdown_snippets import python_snippets  # noqa: E402 - shared with e2e/test_readme_quick_start.py


def test_every_python_snippet_of_the_readme_compiles():
    snippets = python_snippets(README.read_text())
    assert {"Quick start: PyTorch", "Quick start: TensorFlow and Keras", "Quick start: elastic training",
            "Quick start: Ray Tune, every trial a distributed job"} <= set(snippets)
    for heading, code in snippets.items():
        compile(code, f"README.md, {heading}", "exec")  # a SyntaxError names the section


def test_every_python_snippet_of_the_docs_compiles():
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert sum(len(python_snippets(page.read_text())) for page in pages) >= 5
    for page in pages:
        for heading, code in python_snippets(page.read_text()).items():
            compile(code, f"{page.relative_to(ROOT)}, {heading}", "exec")


def test_snippet_extraction_sees_a_broken_snippet():
    text = "## One\n\n```python\nx = 1\n```\n\n## Two\n\n```python\ndef f(:\n```\n"
    snippets = python_snippets(text)
    assert snippets == {"One": "x = 1\n", "Two": "def f(:\n"}
    try:
        compile(snippets["Two"], "Two", "exec")
    except SyntaxError:
        return
    raise AssertionError("a broken snippet compiled")


def test_readme_is_a_front_door():
    assert len(README.read_text().splitlines()) <= 300


def test_every_docs_link_of_the_readme_names_a_page():
    links = re.findall(r"\]\((docs/[^)#]+)", README.read_text())
    assert links
    for link in links:
        assert (ROOT / link).is_file(), link


def test_readme_install_commands_are_make_installs():
    """The README's pinned install is what ``make install`` runs (Makefile variables expanded)."""
    makefile = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^(\w+) :?= (\S+)$", makefile, re.MULTILINE))
    make_commands = [
        re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], line.split("pip install --quiet ", 1)[1])
        for line in makefile.splitlines() if "pip install --quiet -c constraints.txt" in line
    ]
    readme = README.read_text()
    assert len(make_commands) == 2
    for command in make_commands:
        assert f"pip install {command}\n" in readme, command
