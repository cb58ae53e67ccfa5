"""pplx-kernels' NVSHMEM set-up calls, for code that moves from pplx-kernels: epcomm's backends set up their own
transport when an AllToAll is created, so these only keep that code running unchanged.

    from epcomm.nvshmem import nvshmem_alloc_empty_unique_id, nvshmem_get_unique_id, nvshmem_init, nvshmem_finalize

The unique id is a zero-filled CPU uint8 tensor of NVSHMEM's size (128 bytes), so broadcasting it through a
torch.distributed group works as before.
"""

from __future__ import annotations

from typing import Any

__all__ = ["nvshmem_get_unique_id", "nvshmem_alloc_empty_unique_id", "nvshmem_unique_id_size", "nvshmem_init",
           "nvshmem_finalize"]

_UNIQUE_ID_BYTES = 128


def nvshmem_unique_id_size() -> int:
    return _UNIQUE_ID_BYTES


def nvshmem_alloc_empty_unique_id() -> Any:
    import torch

    return torch.zeros(_UNIQUE_ID_BYTES, dtype=torch.uint8, device="cpu")


def nvshmem_get_unique_id() -> Any:
    return nvshmem_alloc_empty_unique_id()


def nvshmem_init(uid: Any, rank: int, world_size: int) -> int:
    """Nothing to initialise (the AllToAll objects do it); returns 0 like pplx-kernels' status."""
    return 0


def nvshmem_finalize() -> None:
    """Nothing to finalise."""
