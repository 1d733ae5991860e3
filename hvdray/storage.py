"""``storage_path``: where a job keeps what outlives its workers (Ray-free; pyarrow filesystems only).

One ``storage_path`` serves a whole job, as Ray Train's does: a local directory or any URI pyarrow's
filesystems open (``s3://bucket/run``, ``gs://...``, ``file:///...``). Reported checkpoints go to
``<storage_path>/checkpoint_<n>`` (six digits, counting on from those already there) and elastic
commits to ``<storage_path>/elastic_state/``.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

import pyarrow.fs

if TYPE_CHECKING:
    from ray.train import Checkpoint

_CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d+)$")


def normalize_storage_path(value: Any) -> str:
    """``value`` checked and made absolute (a local path; a URI is kept as it is), so that workers, whose
    working directory differs from the driver's, find the same place. A clear ``ValueError`` naming
    ``storage_path`` when it is not a string, its URI cannot be opened, or it names a file."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ValueError(f"storage_path must be a non-empty directory path or URI, got {value!r}")
    text = str(value)
    path = text if "://" in text else os.path.abspath(os.path.expanduser(text))
    fs, base = resolve(path)
    try:
        info = fs.get_file_info(base)
    except OSError as exc:
        raise ValueError(f"storage_path {text!r} cannot be read: {exc}") from exc
    if info.type not in (pyarrow.fs.FileType.Directory, pyarrow.fs.FileType.NotFound):
        raise ValueError(f"storage_path {text!r} exists and is not a directory")
    return path


def resolve(storage_path: str) -> tuple[pyarrow.fs.FileSystem, str]:
    """The filesystem and the path inside it (no trailing slash) of ``storage_path``."""
    if "://" in storage_path:
        try:
            fs, base = pyarrow.fs.FileSystem.from_uri(storage_path)
        except (pyarrow.ArrowInvalid, OSError) as exc:
            raise ValueError(f"storage_path {storage_path!r} is not a filesystem URI pyarrow can open: {exc}") from exc
    else:
        fs, base = pyarrow.fs.LocalFileSystem(), os.path.abspath(os.path.expanduser(storage_path))
    return fs, base.rstrip("/") or "/"


def checkpoint_name(index: int) -> str:
    """The directory name of checkpoint number ``index`` (``checkpoint_000003``)."""
    return f"checkpoint_{index:06d}"


def next_checkpoint_index(fs: pyarrow.fs.FileSystem, base: str) -> int:
    """One past the highest ``checkpoint_<n>`` under ``base`` (0 when there is none): a new run on the
    same storage_path never overwrites an earlier run's checkpoints."""
    info = fs.get_file_info(base)
    if info.type == pyarrow.fs.FileType.NotFound:
        return 0
    found = fs.get_file_info(pyarrow.fs.FileSelector(base))
    numbers = [int(m.group(1)) for f in found if (m := _CHECKPOINT_NAME.match(os.path.basename(f.path)))]
    return max(numbers, default=-1) + 1


def persist_checkpoint(checkpoint: "Checkpoint", storage_path: str, index: int) -> str:
    """Copy ``checkpoint`` (a ``ray.train.Checkpoint``, e.g. a local directory a worker wrote) to
    ``<storage_path>/checkpoint_<index>``; returns that path inside the storage filesystem."""
    fs, base = resolve(storage_path)
    destination = f"{base}/{checkpoint_name(index)}"
    fs.create_dir(destination, recursive=True)
    pyarrow.fs.copy_files(
        checkpoint.path, destination, source_filesystem=checkpoint.filesystem, destination_filesystem=fs
    )
    return destination
