"""``hvdray.storage``: storage_path checks, checkpoint numbering and copying, local paths and URIs alike."""

from __future__ import annotations

import os

import pytest
from ray.train import Checkpoint

from hvdray.storage import checkpoint_name, next_checkpoint_index, normalize_storage_path, persist_checkpoint, resolve


@pytest.mark.parametrize("as_uri", [False, True], ids=["path", "file-uri"])
def test_a_checkpoint_directory_is_copied_whole_and_numbering_goes_on(tmp_path, as_uri):
    source = tmp_path / "written-by-rank-0"
    (source / "nested" / "deeper").mkdir(parents=True)
    (source / "model.pt").write_bytes(b"\x00weights")
    (source / "nested" / "deeper" / "opt.txt").write_text("adam")
    storage = f"file://{tmp_path}/run" if as_uri else str(tmp_path / "run")
    fs, base = resolve(storage)
    assert next_checkpoint_index(fs, base) == 0  # nothing there yet
    path = persist_checkpoint(Checkpoint.from_directory(str(source)), storage, 7)
    assert path == f"{tmp_path}/run/checkpoint_000007"
    assert (tmp_path / "run" / "checkpoint_000007" / "model.pt").read_bytes() == b"\x00weights"
    assert (tmp_path / "run" / "checkpoint_000007" / "nested" / "deeper" / "opt.txt").read_text() == "adam"
    (tmp_path / "run" / "elastic_state").mkdir()
    (tmp_path / "run" / "checkpoint_notanumber").mkdir()
    assert next_checkpoint_index(fs, base) == 8
    assert checkpoint_name(12) == "checkpoint_000012"


def test_normalize_storage_path_makes_paths_absolute_and_refuses_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert normalize_storage_path("runs/a") == str(tmp_path / "runs" / "a")
    assert normalize_storage_path(f"file://{tmp_path}/b") == f"file://{tmp_path}/b"  # a URI is kept
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="storage_path .* not a directory"):
        normalize_storage_path("f")
    with pytest.raises(ValueError, match="storage_path .*nosuch"):
        normalize_storage_path("nosuch://bucket")
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="storage_path"):
            normalize_storage_path(bad)
    assert os.path.isabs(normalize_storage_path("~/x"))
