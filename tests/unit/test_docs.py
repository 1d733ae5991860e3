"""The docs site builds with ``mkdocs build --strict`` (a broken link or anchor, a page outside the nav, a
reference to a name that does not exist fails), and every public name has a docstring, so the reference
generated from the docstrings (docs/reference.md) has no holes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PUBLIC_NAMES = Path(__file__).with_name("public_names.json")


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.update(NO_MKDOCS_2_WARNING="1", TF_CPP_MIN_LOG_LEVEL="3")
    return env


def _mkdocs_build(project: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(project / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=project, capture_output=True, text=True, env=_env(), timeout=240,
    )


def test_docs_site_builds_strict(tmp_path):
    build = _mkdocs_build(ROOT, tmp_path / "site")
    assert build.returncode == 0, build.stdout + build.stderr
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Quick start: PyTorch" in home  # the home page is the README
    assert 'href="elastic/"' in home  # its docs/ links made site links
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    for name in ("hvdray.driver.executor.RayExecutor.run", "hvdray.torch.ops.allreduce", "hvdray.collective.ops.synchronize"):
        assert f'id="{name}"' in reference, f"{name} missing from the API reference"


def _project_copy(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    for name in ("mkdocs.yml", "mkdocs_hooks.py", "README.md"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(ROOT / "docs", project / "docs")
    (project / "hvdray").symlink_to(ROOT / "hvdray")  # the reference reads the package beside mkdocs.yml
    return project


def test_a_broken_link_fails_the_build(tmp_path):
    """The strict build can fail, and names each fault: a dead anchor, a missing page, a README link the
    site cannot serve (one build reports all three)."""
    project = _project_copy(tmp_path)
    faults = {
        "README.md": ("[x](docs/api.md#no-such-section)", "no-such-section"),
        "docs/elastic.md": ("[x](no_such_page.md)", "no_such_page.md"),
        "docs/api.md": ("[x](#nor-this-one)", "nor-this-one"),
    }
    for where, (link, _) in faults.items():
        page = project / where
        page.write_text(page.read_text() + f"\nSee {link}.\n")
    build = _mkdocs_build(project, tmp_path / "site")
    assert build.returncode != 0
    for _, complaint in faults.values():
        assert complaint in build.stdout + build.stderr


def test_a_readme_link_outside_docs_fails_the_build(tmp_path):
    project = _project_copy(tmp_path)
    (project / "README.md").write_text((project / "README.md").read_text() + "\n[x](examples/pytorch_digits.py)\n")
    build = _mkdocs_build(project, tmp_path / "site")
    assert build.returncode != 0
    assert "README.md links to 'examples/pytorch_digits.py', outside docs/" in build.stdout + build.stderr


_UNDOCUMENTED = r"""
import importlib, inspect, json, sys

def own_members(cls):
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if inspect.isfunction(function) or isinstance(value, property):
            # an override may inherit its base's docstring (inspect.getdoc), as the reference shows it
            doc = function.__doc__ if isinstance(value, property) else inspect.getdoc(getattr(cls, name))
            yield f"{cls.__module__}.{cls.__qualname__}.{name}", doc

missing, seen = [], set()
for module_name in json.loads(sys.argv[1]):
    module = importlib.import_module(module_name)
    if not (module.__doc__ or "").strip():
        missing.append(module_name)
    for name in getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]:
        obj = getattr(module, name)
        if not (inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if not (obj.__doc__ or "").strip():
            missing.append(f"{module_name}.{name}")
        if inspect.isclass(obj) and obj.__module__.split(".")[0] == module_name.split(".")[0]:
            missing.extend(path for path, doc in own_members(obj) if not (doc or "").strip())
print(json.dumps(missing))
"""


def _undocumented(module_names: list[str], extra_path: Path | None = None) -> list[str]:
    env = _env()
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env["PYTHONPATH"]])
    run = subprocess.run([sys.executable, "-c", _UNDOCUMENTED, json.dumps(module_names)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_public_name_has_a_docstring():
    """Every name a user imports (the frontends' public names, ``hvdray``, ``hvdray.tune``) and every
    public method of hvdray's classes among them says what it does."""
    modules = [*json.loads(PUBLIC_NAMES.read_text()), "hvdray", "hvdray.tune", "hvdray.ray_logger"]
    assert _undocumented(modules) == []


def test_the_docstring_check_finds_an_undocumented_name(tmp_path):
    (tmp_path / "careless.py").write_text(
        '"""A module."""\n__all__ = ["Documented", "bare"]\n'
        'class Documented:\n    """Has one."""\n    def method(self):\n        pass\n'
        'def bare():\n    pass\n'
    )
    assert _undocumented(["careless"], extra_path=tmp_path) == ["careless.Documented.method", "careless.bare"]
