"""The GPU backends the torch tests run on, each with the environment its ranks need on one host (no numpy, no torch
at import: importable in spawned children).

Rank r runs on CUDA device r % device_count (as the library picks it), so W = 2 ranks share the GPU of a one-GPU
machine: their contexts take turns on it (no MPS), which is slow but correct. The bound of every wait
(EPCOMM_TIMEOUT_MS) is raised for that unless the environment sets it.
"""

import os
from typing import Dict, List, Optional, Tuple

# id -> (backend, variables the id stands for (always set), variables set unless the environment has them)
GPU_BACKENDS: Dict[str, Tuple[str, Dict[str, str], Dict[str, str]]] = {
    "nvlink": ("nvlink", {}, {}),
    # One host: NVLink/P2P only (no remote transport to probe), no NVLS multicast, the unique-ID rendezvous over
    # loopback; what tests/gpu/nvshmem_test.cc sets for its ranks.
    "nvshmem": ("nvshmem", {}, {"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_DISABLE_NVLS": "1",
                                "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo"}),
    # Every peer over the fabric (EPCOMM_PROXY_LOCAL_SIZE=1), on each of the two providers one host has.
    "proxy-shm": ("proxy", {"EPCOMM_FABRIC_PROVIDER": "shm", "EPCOMM_PROXY_LOCAL_SIZE": "1"}, {}),
    "proxy-tcp": ("proxy", {"EPCOMM_FABRIC_PROVIDER": "tcp", "EPCOMM_PROXY_LOCAL_SIZE": "1"}, {}),
}
IDS: List[str] = list(GPU_BACKENDS)

_COMMON_DEFAULTS = {"EPCOMM_TIMEOUT_MS": "60000"}


def backend(backend_id: str) -> str:
    """The backend name to pass to AllToAll / deep_ep.Buffer for `backend_id`."""
    return GPU_BACKENDS[backend_id][0]


def environment(backend_id: str) -> Dict[str, str]:
    """The variables to set in each rank of `backend_id` before it imports epcomm."""
    _, forced, defaults = GPU_BACKENDS[backend_id]
    env = {k: v for k, v in dict(_COMMON_DEFAULTS, **defaults).items() if k not in os.environ}
    env.update(forced)
    return env


def skip_reason(torch, epcomm, backend_id: str) -> Optional[str]:
    """Why `backend_id` cannot run here (no GPU, or its backend is not in this build); None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    name = backend(backend_id)
    if name not in epcomm.built_backends():
        return f"the {name} backend is not in this build (built: {epcomm.built_backends()})"
    return None

