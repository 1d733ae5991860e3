"""The opt-in ``horovod`` import alias: ``import horovod.torch as hvd`` gets ``hvdray.torch``.

A finder on ``sys.meta_path`` maps ``horovod`` and every ``horovod.X`` to ``hvdray`` / ``hvdray.X``,
so a script written for Horovod runs unmodified. It is never on by itself: ``hvdrayrun`` turns it on in
every rank's process, ``HVDRAY_HOROVOD_ALIAS=1`` in a process that imports hvdray (the workers of a
``RayExecutor`` started with ``extra_env_vars={"HVDRAY_HOROVOD_ALIAS": "1"}``), :func:`install`, or
``python -m hvdray.alias SCRIPT.py ARGS`` for one plain process. If a real Horovod can be imported,
the alias stays off (with a warning): hvdray never shadows it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
import warnings
from types import ModuleType
from typing import Optional, Sequence

ALIAS = "horovod"
TARGET = "hvdray"
#: the environment variable that turns the alias on when hvdray is imported
ENV_VAR = "HVDRAY_HOROVOD_ALIAS"


def target_name(fullname: str) -> str:
    """``horovod.torch.elastic`` -> ``hvdray.torch.elastic``."""
    return TARGET + fullname[len(ALIAS):]


class HorovodAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``horovod[.X]`` as the already importable ``hvdray[.X]``: the same module object, not a copy."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None):
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        real = target_name(fullname)
        try:
            real_spec = importlib.util.find_spec(real)
        except ModuleNotFoundError:
            real_spec = None
        if real_spec is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: hvdray's Horovod alias maps it to {real!r}, which hvdray does not "
                "have (see docs/horovod.md, 'Coming from Horovod', in hvdray's docs)", name=fullname,
            )
        return importlib.util.spec_from_loader(
            fullname, self, origin=real_spec.origin, is_package=real_spec.submodule_search_locations is not None
        )

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(target_name(spec.name))
        spec.loader_state = module.__spec__  # import sets module.__spec__ to the alias's; exec_module puts it back
        return module

    def exec_module(self, module: ModuleType) -> None:
        alias_spec = module.__spec__
        if alias_spec is not None and alias_spec.loader is self:
            module.__spec__ = alias_spec.loader_state


def real_horovod() -> Optional[str]:
    """Where a real Horovod installation is on ``sys.path``, or None."""
    spec = importlib.machinery.PathFinder.find_spec(ALIAS)
    return (spec.origin or ", ".join(spec.submodule_search_locations or [])) if spec is not None else None


def is_installed() -> bool:
    return any(isinstance(finder, HorovodAlias) for finder in sys.meta_path)


def install() -> bool:
    """Put the alias first on ``sys.meta_path``; True if it is on. A real Horovod keeps it off (warning once)."""
    if is_installed():
        return True
    found = real_horovod()
    if found is not None:
        warnings.warn(
            f"a real Horovod is installed ({found}): hvdray's horovod -> hvdray import alias stays off, and "
            "`import horovod` gets that Horovod. Import hvdray's modules by their own names to use hvdray.",
            RuntimeWarning, stacklevel=2,
        )
        return False
    sys.meta_path.insert(0, HorovodAlias())
    return True


def uninstall() -> None:
    """Remove the alias and forget the ``horovod`` names it made (the hvdray modules stay imported)."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, HorovodAlias)]
    for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
        if getattr(sys.modules[name], "__name__", "").startswith(TARGET):
            del sys.modules[name]


def enabled_by_environment() -> bool:
    """``HVDRAY_HOROVOD_ALIAS`` says on (1/true/yes/on); a value that is neither on nor off is an error."""
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV_VAR} must be 1/true/yes/on or 0/false/no/off, got {os.environ[ENV_VAR]!r}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m hvdray.alias SCRIPT.py ARGS``: run one script (one process, size 1) with the alias on."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        raise SystemExit("usage: python -m hvdray.alias SCRIPT.py [ARGS ...]")
    install()
    sys.argv = args
    sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":  # run as hvdray.alias, so that is_installed() and uninstall() see this finder
    from hvdray.alias import main as _main

    _main()
