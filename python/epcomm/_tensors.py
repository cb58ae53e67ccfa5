"""Framework-neutral helpers for the tensors of dispatch/combine: typed numpy arrays, the written-argument check
that only Python can make, and the C++ argument names in Python spelling.

The argument contract (shapes, dtypes, strides, alignment, memory) has one source of truth: the C++ checks
(``checkDispatchArgs`` / ``checkCombineArgs`` in src/core/validate.cc), which every backend runs before anything is
launched. Python converts the tensors (DLPack) and passes them down; an error names the C++ field, which
:func:`python_names` spells as the Python argument (``outExpertX`` -> ``out_expert_x``).
"""

from __future__ import annotations

import re
import sys
from typing import Any, NamedTuple

from . import _C

__all__ = ["TypedArray", "typed", "invalid_argument", "check_writable", "python_names"]


class TypedArray(NamedTuple):
    """An array whose elements are reinterpreted as the epcomm dtype `dtype` (same item size), e.g. a numpy
    uint16 array holding bf16 bit patterns: ``TypedArray(np_u16, "bf16")``. Accepted wherever a tensor is."""

    array: Any
    dtype: str


def typed(array: Any, dtype: str) -> TypedArray:
    """Shorthand for :class:`TypedArray`: ``typed(np.zeros((4, 8), np.uint16), "bf16")``."""
    return TypedArray(array, dtype)


def error(message: str, code: str) -> "_C.Error":
    """An epcomm.Error with `code` ("invalid_argument", "invalid_config", ...) raised by the Python layer."""
    err = _C.Error(message)
    err.code = code
    err.message = message
    return err


def invalid_argument(message: str) -> "_C.Error":
    """An epcomm.Error with code 'invalid_argument' (raised by the Python layer)."""
    return error(message, "invalid_argument")


def is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def check_writable(name: str, obj: Any) -> None:
    """Refuses a written argument that the library cannot see is immutable: a JAX array exports a DLPack tensor
    that looks writable, but writing through it would change values JAX assumes constant. (A read-only numpy array
    is refused by the extension itself.)"""
    if isinstance(obj, TypedArray):
        obj = obj.array
    if type(obj).__module__.startswith(("jax", "jaxlib")):
        raise invalid_argument(f"{name} is written by this call but it is a JAX array (immutable); pass a numpy / "
                               "torch / CuPy buffer and convert the result")


# C++ field names (DispatchArgs, CombineArgs, Config) -> the Python argument names of dispatch / combine / AllToAll.
_PYTHON_NAMES = {
    "outExpertNumTokens": "out_expert_num_tokens",
    "outExpertXScale": "out_expert_x_scale",
    "outExpertX": "out_expert_x",
    "xScale": "dp_x_scale",
    "x": "dp_x",
    "outTokens": "out_tokens",
    "expertY": "expert_y",
    "boundM": "bound_m",
    "doSend": "do_send",
    "doRecv": "do_recv",
    "maxNumTokens": "max_num_tokens",
    "numExperts": "num_experts",
    "expertsPerToken": "experts_per_token",
    "worldSize": "world_size",
    "dpSize": "dp_size",
    "hiddenDimScaleBytes": "hidden_dim_scale_bytes",
    "hiddenDimBytes": "hidden_dim_bytes",
    "hiddenDim": "hidden_dim",
    "expertPadding": "expert_padding",
}
_NAME_RE = re.compile(r"\b(" + "|".join(sorted(_PYTHON_NAMES, key=len, reverse=True)) + r")\b")


def python_names(err: "_C.Error") -> "_C.Error":
    """`err` (raised by the C++ checks of a dispatch / combine) with the C++ field names spelled as the Python
    arguments; code, file and line are kept."""
    message = getattr(err, "message", "") or str(err)
    renamed = _NAME_RE.sub(lambda m: _PYTHON_NAMES[m.group(1)], message)
    if renamed == message:
        return err
    text = str(err)
    out = _C.Error(text[: len(text) - len(message)] + renamed if text.endswith(message) else renamed)
    out.code = getattr(err, "code", "invalid_argument")
    out.message = renamed
    out.file = getattr(err, "file", "")
    out.line = getattr(err, "line", 0)
    return out
