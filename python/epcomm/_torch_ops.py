"""torch custom ops ``epcomm::dispatch``, ``epcomm::dispatch_scaled`` and ``epcomm::combine`` (registered when
torch is importable).

The ops declare the tensors they write (mutates_args), so torch.compile(fullgraph=True) keeps them in the graph
without breaks and orders them correctly, and CUDA graphs capture the kernels they launch on the current stream.
An op refers to its AllToAll through an integer handle (ops cannot take arbitrary Python objects).
"""

import threading
import weakref
from typing import Any, Dict, Optional

from ._tensors import invalid_argument

try:
    import torch
except ImportError:  # numpy-only installs
    torch = None

__all__ = ["register", "unregister", "lookup", "needs_op", "HAVE_TORCH_OPS"]

_lock = threading.Lock()
_objects: Dict[int, "weakref.ref[Any]"] = {}
_next_handle = [1]


def register(obj: Any) -> int:
    """Assigns `obj` a handle for the ops. Weak: the registry never keeps an AllToAll alive."""
    with _lock:
        handle = _next_handle[0]
        _next_handle[0] += 1
        _objects[handle] = weakref.ref(obj)
    return handle


def unregister(handle: int) -> None:
    with _lock:
        _objects.pop(handle, None)


def lookup(handle: int) -> Any:
    with _lock:
        ref = _objects.get(handle)
    obj = ref() if ref is not None else None
    if obj is None:
        raise invalid_argument(f"epcomm AllToAll handle {handle} refers to a destroyed object")
    return obj


HAVE_TORCH_OPS = torch is not None and hasattr(torch, "library") and hasattr(torch.library, "custom_op")


def needs_op(t: Any) -> bool:
    """Whether a call must go through the custom op: while torch.compile / export trace it, or for a tensor subclass
    (FakeTensor, functional wrappers). A plain eager call goes straight to the library: the op's own dispatch cost
    (~16 us of CPU per call on the CI machine) is launch latency the caller would wait for."""
    return type(t) is not torch.Tensor or _is_compiling()


if HAVE_TORCH_OPS:
    # Without torch.compiler.is_compiling (torch < 2.3) every call takes the op: tracing stays correct.
    _is_compiling = getattr(torch.compiler, "is_compiling", None) or (lambda: True)

    # Two dispatch ops instead of one with an Optional mutated scale: every mutated argument is a plain Tensor, the
    # form torch.compile's functionalization handles in every torch version that has custom_op.

    @torch.library.custom_op("epcomm::dispatch", mutates_args=("out_expert_num_tokens", "out_expert_x"))
    def dispatch_op(
        handle: int,
        out_expert_num_tokens: torch.Tensor,
        out_expert_x: torch.Tensor,
        dp_x: Optional[torch.Tensor],
        indices: Optional[torch.Tensor],
        bound_m: Optional[torch.Tensor],
        do_send: bool,
        do_recv: bool,
    ) -> None:
        lookup(handle)._dispatch_eager(out_expert_num_tokens, out_expert_x, None, dp_x, None, indices, bound_m,
                                       do_send, do_recv, None)

    @dispatch_op.register_fake
    def _dispatch_fake(handle, out_expert_num_tokens, out_expert_x, dp_x, indices, bound_m, do_send, do_recv) -> None:
        return None

    @torch.library.custom_op("epcomm::dispatch_scaled",
                             mutates_args=("out_expert_num_tokens", "out_expert_x", "out_expert_x_scale"))
    def dispatch_scaled_op(
        handle: int,
        out_expert_num_tokens: torch.Tensor,
        out_expert_x: torch.Tensor,
        out_expert_x_scale: torch.Tensor,
        dp_x: Optional[torch.Tensor],
        dp_x_scale: Optional[torch.Tensor],
        indices: Optional[torch.Tensor],
        bound_m: Optional[torch.Tensor],
        do_send: bool,
        do_recv: bool,
    ) -> None:
        lookup(handle)._dispatch_eager(out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale,
                                       indices, bound_m, do_send, do_recv, None)

    @dispatch_scaled_op.register_fake
    def _dispatch_scaled_fake(handle, out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale,
                              indices, bound_m, do_send, do_recv) -> None:
        return None

    @torch.library.custom_op("epcomm::combine", mutates_args=("out_tokens",))
    def combine_op(
        handle: int,
        out_tokens: torch.Tensor,
        indices: Optional[torch.Tensor],
        weights: Optional[torch.Tensor],
        expert_y: Optional[torch.Tensor],
        bound_m: Optional[torch.Tensor],
        do_send: bool,
        do_recv: bool,
        accumulate: bool,
    ) -> None:
        lookup(handle)._combine_eager(out_tokens, indices, weights, expert_y, bound_m, do_send, do_recv, accumulate,
                                      None)

    @combine_op.register_fake
    def _combine_fake(handle, out_tokens, indices, weights, expert_y, bound_m, do_send, do_recv, accumulate) -> None:
        return None

    # The OpOverloads: what dispatch()/combine() call, so that torch.compile sees a plain torch.ops call.
    DISPATCH = torch.ops.epcomm.dispatch.default
    DISPATCH_SCALED = torch.ops.epcomm.dispatch_scaled.default
    COMBINE = torch.ops.epcomm.combine.default

else:
    dispatch_op = None
    dispatch_scaled_op = None
    combine_op = None
    DISPATCH = None
    DISPATCH_SCALED = None
    COMBINE = None
