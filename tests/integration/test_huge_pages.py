"""``huge_pages``: workers back large tensors with transparent huge pages when asked.

Checked in the worker's own memory map: the mapping that holds a fresh 64 MB tensor has huge pages
(``AnonHugePages`` in ``/proc/self/smaps``) with ``huge_pages=True``, none by default, and a worker
whose environment sets torch's ``THP_MEM_ALLOC_ENABLE`` keeps that value.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ray.cloudpickle

from hvdray import RayExecutor

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(
    not THP_MODE.exists() or "[madvise]" not in THP_MODE.read_text(),
    reason="the kernel's transparent huge pages are not in madvise mode (asked for per mapping) here",
)


def _fresh_tensor_huge_kb() -> tuple[object, int]:
    """The worker's THP_MEM_ALLOC_ENABLE and the kB of huge pages backing a fresh, filled 64 MB tensor."""
    import os

    import torch

    tensor = torch.empty(16 << 20)
    tensor.fill_(1.0)
    address, huge_kb, inside = tensor.data_ptr(), 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: start-end perms offset dev inode
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "AnonHugePages:":
                huge_kb = int(fields[1])
    return os.environ.get("THP_MEM_ALLOC_ENABLE"), huge_kb


@pytest.mark.parametrize(
    "settings_kwargs,env,expected_variable,huge",
    [
        ({"huge_pages": True}, None, "1", True),
        ({}, None, None, False),
        ({"huge_pages": True}, {"THP_MEM_ALLOC_ENABLE": "0"}, "0", False),
    ],
    ids=["huge_pages-true", "default", "the-workers-environment-wins"],
)
def test_large_tensors_get_huge_pages_when_asked(ray_local, settings_kwargs, env, expected_variable, huge):
    settings = RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=60, **settings_kwargs)
    with RayExecutor(settings, num_workers=1) as executor:
        executor.start(extra_env_vars=env)
        [(variable, huge_kb)] = executor.run(_fresh_tensor_huge_kb)
    assert variable == expected_variable
    assert (huge_kb > 0) == huge, f"{huge_kb} kB of huge pages behind a fresh 64 MB tensor"
