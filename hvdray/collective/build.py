"""What this build of hvdray can do, in Horovod's build queries (``hvd.gloo_built()`` ...), answered once for
every frontend and for ``hvdrayrun --check-build``.

hvdray's collectives run on the CPU over Gloo from ``torch.distributed``; it has no MPI, NCCL, oneCCL,
DDL, CUDA or ROCm code of its own, so those queries answer False (``nccl_built``: 0, Horovod's "no
NCCL version").
"""

from __future__ import annotations

__all__ = [
    "gloo_built", "gloo_enabled", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built",
]


def gloo_built() -> bool:
    """True: hvdray's collectives are Gloo's (from torch.distributed)."""
    return True


def gloo_enabled() -> bool:
    """True: Gloo is the only controller and data transport hvdray runs with."""
    return True


def mpi_built() -> bool:
    """False: hvdray has no MPI support."""
    return False


def mpi_enabled() -> bool:
    """False: hvdray never runs with MPI."""
    return False


def mpi_threads_supported() -> bool:
    """Raises ``ValueError``, as Horovod does when MPI is not enabled (it never is in hvdray)."""
    raise ValueError("MPI is not enabled: hvdray runs its collectives over Gloo, so mpi_threads_supported() "
                     "has no answer (check hvd.mpi_enabled() first)")


def nccl_built() -> int:
    """0 (Horovod's "built without NCCL"; with NCCL it is the NCCL version code)."""
    return 0


def ddl_built() -> bool:
    """False: no IBM DDL support."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL support."""
    return False


def cuda_built() -> bool:
    """False: hvdray's collectives take CPU tensors (GPU workers copy to the CPU)."""
    return False


def rocm_built() -> bool:
    """False: no ROCm support."""
    return False


def summary() -> list[tuple[str, bool]]:
    """(feature, available) rows as ``hvdrayrun --check-build`` prints them."""
    return [
        ("Gloo (torch.distributed)", gloo_built()), ("MPI", mpi_built()),
        ("NCCL", bool(nccl_built())), ("oneCCL", ccl_built()), ("DDL", ddl_built()), ("CUDA", cuda_built()),
        ("ROCm", rocm_built()),
    ]
