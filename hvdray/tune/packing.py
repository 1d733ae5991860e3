"""Checkpoint directories as bytes, so they can travel between nodes through Ray's object store.

Rank 0 may run on another node than the trial's Trainable, and a restored trial's workers may run
anywhere, so a checkpoint moves as one uncompressed tar archive rather than as a path.
"""

from __future__ import annotations

import io
import os
import tarfile


def pack_directory(path: str) -> bytes:
    """Every file under ``path`` (relative names) as one tar archive."""
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory {path!r} does not exist")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in sorted(os.listdir(path)):
            tar.add(os.path.join(path, name), arcname=name)
    return buffer.getvalue()


def unpack_directory(archive: bytes, dest: str) -> str:
    """Extract an archive made by :func:`pack_directory` into ``dest`` (created if missing)."""
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")  # no absolute paths, no links that escape dest
        else:  # Python releases before the extraction filters
            root = os.path.realpath(dest)
            for member in tar.getmembers():
                target = os.path.realpath(os.path.join(dest, member.name))
                if os.path.commonpath([root, target]) != root or member.issym() or member.islnk():
                    raise ValueError(f"refusing to extract {member.name!r} outside {dest!r}")
            tar.extractall(dest)
    return dest
