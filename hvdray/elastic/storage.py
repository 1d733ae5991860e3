"""Committed elastic state in storage: what outlives every worker and the driver.

With ``storage_path`` set (a local directory or any URI pyarrow's filesystems open, as Ray Train's
``storage_path``: ``s3://bucket/run``, ``gs://...``, ``file:///...``), rank 0 writes each commit under
it as ``elastic_state/commit-<n>.pkl``: first under a temporary name, then moved into place, so that a reader sees whole
commits only; the newest two are kept. A job started on the same path, with every worker new, resumes
from the newest one.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any, Optional

import pyarrow.fs

from hvdray.storage import resolve

_NAME = re.compile(r"^commit-(\d+)\.pkl$")
_KEEP = 2
SUBDIR = "elastic_state"


class CommitStorage:
    """The commits of one elastic job under ``path`` (in its ``elastic_state`` directory)."""

    def __init__(self, path: str) -> None:
        if not isinstance(path, str) or not path:
            raise ValueError(f"storage_path must be a non-empty directory path or URI, got {path!r}")
        self.fs, base = resolve(path)
        self.root = f"{base}/{SUBDIR}"
        self.path = path

    def write(self, commit: int, payload: Any) -> None:
        """Persist commit number ``commit`` (its state as a picklable object), then drop older ones."""
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        self.fs.create_dir(self.root, recursive=True)
        final = f"{self.root}/commit-{commit}.pkl"
        partial = f"{self.root}/.commit-{commit}.pkl.partial"
        with self.fs.open_output_stream(partial) as out:
            out.write(data)
        self.fs.move(partial, final)
        for older in self._commits()[:-_KEEP]:
            self.fs.delete_file(f"{self.root}/commit-{older}.pkl")

    def latest(self) -> Optional[tuple[int, Any]]:
        """The newest commit as (number, state), or None when there is none."""
        commits = self._commits()
        if not commits:
            return None
        newest = commits[-1]
        with self.fs.open_input_stream(f"{self.root}/commit-{newest}.pkl") as stream:
            payload = pickle.load(io.BytesIO(stream.read()))
        return newest, payload

    def _commits(self) -> list[int]:
        """Commit numbers present, oldest first."""
        info = self.fs.get_file_info(self.root)
        if info.type == pyarrow.fs.FileType.NotFound:
            return []
        if info.type != pyarrow.fs.FileType.Directory:
            raise ValueError(f"storage_path {self.path!r} exists and is not a directory")
        found = self.fs.get_file_info(pyarrow.fs.FileSelector(self.root))
        return sorted(int(m.group(1)) for f in found if (m := _NAME.match(os.path.basename(f.path))))
