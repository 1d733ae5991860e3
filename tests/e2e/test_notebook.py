"""examples/notebooks/interactive_training.ipynb executed headless with nbclient, as a user runs it.

The kernel is this interpreter's ipykernel, registered in a temporary Jupyter path under the name the
notebook asks for (the one docs/examples.md tells users to register), so the notebook runs in the same
environment (hvdray, torch, Ray) as the tests wherever they run.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
kernelspec = pytest.importorskip("ipykernel.kernelspec")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "notebooks" / "interactive_training.ipynb"


def _documented_kernel() -> tuple[str, str]:
    """The kernel name and display name of the ``ipykernel install`` command in docs/examples.md."""
    command = re.search(r'ipykernel install --user --name (\S+) --display-name "([^"]+)"',
                        (ROOT / "docs" / "examples.md").read_text())
    assert command, "docs/examples.md no longer says how to register the notebook's kernel"
    return command.group(1), command.group(2)


def test_notebook_asks_for_the_documented_kernel():
    """Opened in Jupyter, the notebook picks the kernel of the environment the docs have users register,
    not whatever "python3" Jupyter runs in."""
    spec = nbformat.read(NOTEBOOK, as_version=4).metadata["kernelspec"]
    name, display_name = _documented_kernel()
    assert (spec["name"], spec["display_name"], spec["language"]) == (name, display_name, "python")


@pytest.fixture
def jupyter_kernel(tmp_path, monkeypatch):
    """A kernelspec for ``sys.executable`` under the documented name, in a private Jupyter data dir."""
    prefix = tmp_path / "jupyter"
    name, display_name = _documented_kernel()
    kernelspec.install(kernel_name=name, display_name=display_name, prefix=str(prefix))
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(NOTEBOOK.parents[2]), os.environ.get("PYTHONPATH", "")]))
    return name


def _cell(notebook, tag: str):
    (cell,) = [c for c in notebook.cells if tag in c.metadata.get("tags", [])]
    return cell


def _text(cell) -> str:
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif "data" in output and "text/plain" in output.data:
            parts.append(output.data["text/plain"])
    return "\n".join(parts)


def test_interactive_notebook_trains_plots_changes_lr_and_keeps_its_workers(tmp_path, jupyter_kernel):
    work = tmp_path / "run"
    work.mkdir()
    shutil.copy(NOTEBOOK, work / NOTEBOOK.name)
    notebook = nbformat.read(work / NOTEBOOK.name, as_version=4)
    assert notebook.metadata.kernelspec.name == jupyter_kernel
    client = nbclient.NotebookClient(notebook, timeout=300,  # the kernel the notebook itself names
                                     resources={"metadata": {"path": str(work)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails

    for tag in ("first-curve", "second-curve"):
        images = [o for o in _cell(notebook, tag).outputs if "data" in o and "image/png" in o.data]
        assert len(images) == 1, f"{tag}: no inline plot"
    before = ast.literal_eval(_text(_cell(notebook, "workers-before")))
    summary = _text(_cell(notebook, "workers-after"))
    after = ast.literal_eval(summary.strip().splitlines()[-1])
    assert len(before) == 2 and before == after
    assert "same workers: True" in summary
    first, last = map(float, re.search(r"after epoch 1: ([\d.]+), after epoch 10: ([\d.]+)", summary).groups())
    assert last < first * 0.5
    assert (work / "interactive_history.png").read_bytes()[:4] == b"\x89PNG"
    assert (work / "interactive_history.csv").read_text().count("\n") == 11
