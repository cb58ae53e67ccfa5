"""epcomm: Mixture-of-Experts expert-parallel dispatch and combine.

    import epcomm
    a2a = epcomm.AllToAll(max_num_tokens=128, num_experts=64, experts_per_token=6, rank=r, world_size=w,
                          dp_size=1, hidden_dim=2048, hidden_dim_bytes=4096, hidden_dim_scale_bytes=0,
                          group=torch.distributed.group.WORLD)
    num, x, scale = a2a.alloc_dispatch_outputs(torch.bfloat16)
    a2a.dispatch(num, x, scale, tokens, None, indices)
    ... experts ...
    a2a.combine(out, indices, weights, expert_y)

Tensors are taken through DLPack (torch, numpy for the host backend, CuPy, JAX); see docs/python.md.
"""

try:
    # torch first: it loads the CUDA runtime (libcudart) that libepcomm's GPU backends link against, so a
    # machine with torch's CUDA wheels but no system toolkit still resolves it.
    import torch as _torch  # noqa: F401
except ImportError:
    pass

from . import _C
from ._C import Config, Error, Layout, PlannedBuffer
from ._all_to_all import AllToAll, Plan, make_config, plan
from ._bootstrap import TorchGroupBootstrap, free_port, make_bootstrap
from ._tensors import TypedArray, typed
from ._torch_ops import HAVE_TORCH_OPS
from . import deep_ep  # noqa: E402  (DeepEP's low-latency Buffer: epcomm.deep_ep.Buffer)

__version__ = _C.version()

__all__ = [
    "AllToAll",
    "Config",
    "Error",
    "HAVE_TORCH_OPS",
    "Layout",
    "Plan",
    "PlannedBuffer",
    "TorchGroupBootstrap",
    "TypedArray",
    "built_backends",
    "deep_ep",
    "env_vars",
    "free_port",
    "make_bootstrap",
    "make_config",
    "plan",
    "standard_config",
    "standard_config_names",
    "typed",
]


def built_backends() -> "list[str]":
    """Backends compiled into this build, in preference order (e.g. ['nvlink', 'host'])."""
    return list(_C.built_backends())


def standard_config(name: str, world_size: int, rank: int = 0, dp_size: int = 1) -> Config:
    """A standard configuration by name: 'decode', 'prefill', 'small' or 'qwen3' (SPEC section 3)."""
    return _C.standard_config(name, world_size, rank, dp_size)


def standard_config_names() -> "list[str]":
    """Names accepted by standard_config."""
    return list(_C.standard_config_names())


def env_vars() -> "list[tuple[str, str, str]]":
    """Every EPCOMM_* environment variable as (name, default, description)."""
    return list(_C.env_vars())
