"""The frontends' public names are exactly what they were: ``dir()`` and ``__all__`` of every import path a
user writes (``import hvdray.torch as hvd`` ...), against the list stored in public_names.json.

Each module's names are read right after it is imported, in the stored order, in a fresh interpreter:
what ``dir(hvd)`` shows depends on which submodules were imported before it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

STORED = Path(__file__).with_name("public_names.json")

_READ_NAMES = """
import importlib, json, sys
names = {}
for module_name in json.loads(sys.argv[1]):
    module = importlib.import_module(module_name)
    exported = getattr(module, "__all__", None)
    names[module_name] = {"dir": sorted(dir(module)), "__all__": None if exported is None else sorted(exported)}
print(json.dumps(names))
"""


def test_public_names_are_unchanged():
    stored = json.loads(STORED.read_text())
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    run = subprocess.run(
        [sys.executable, "-c", _READ_NAMES, json.dumps(list(stored))],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )
    found = json.loads(run.stdout.strip().splitlines()[-1])
    for module_name, expected in stored.items():
        for kind in ("dir", "__all__"):
            missing = sorted(set(expected[kind] or ()) - set(found[module_name][kind] or ()))
            added = sorted(set(found[module_name][kind] or ()) - set(expected[kind] or ()))
            assert found[module_name][kind] == expected[kind], f"{kind}({module_name}): missing {missing}, added {added}"
