"""Framework-neutral tensor inspection and the argument checks of dispatch/combine.

The checks mirror src/core/validate.cc so that a wrong argument is reported in Python, naming the argument,
before anything is launched; the C++ side checks again (and also checks pointer alignment, which needs the
data pointer and is left to it so that torch.compile never traces a data_ptr() call).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple, Optional, Sequence, Tuple

from . import _C

__all__ = ["TypedArray", "typed", "TensorInfo", "describe", "invalid_argument"]


class TypedArray(NamedTuple):
    """An array whose elements are reinterpreted as the epcomm dtype `dtype` (same item size), e.g. a numpy
    uint16 array holding bf16 bit patterns: ``TypedArray(np_u16, "bf16")``. Accepted wherever a tensor is."""

    array: Any
    dtype: str


def typed(array: Any, dtype: str) -> TypedArray:
    """Shorthand for :class:`TypedArray`: ``typed(np.zeros((4, 8), np.uint16), "bf16")``."""
    return TypedArray(array, dtype)


class TensorInfo(NamedTuple):
    """What the checks need to know about one tensor."""

    shape: Tuple[int, ...]
    dtype: str  # epcomm dtype name ("bf16", "int32", ...) or "<framework name>" when epcomm has no such dtype
    strides: Tuple[int, ...]  # in elements
    device: str  # "cpu" or "cuda:N"


def error(message: str, code: str) -> "_C.Error":
    """An epcomm.Error with `code` ("invalid_argument", "invalid_config", ...) raised by a Python-side check."""
    err = _C.Error(message)
    err.code = code
    err.message = message
    return err


def invalid_argument(message: str) -> "_C.Error":
    """An epcomm.Error with code 'invalid_argument' (raised by the Python-side checks)."""
    return error(message, "invalid_argument")


_NUMPY_DTYPES = {
    "uint8": "u8",
    "int8": "u8",
    "float16": "fp16",
    "float32": "fp32",
    "int32": "int32",
    "uint32": "uint32",
    "int64": "int64",
    "bfloat16": "bf16",  # ml_dtypes
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
}

_TORCH_DTYPE_NAMES = {
    "torch.uint8": "u8",
    "torch.int8": "u8",
    "torch.float16": "fp16",
    "torch.bfloat16": "bf16",
    "torch.float32": "fp32",
    "torch.int32": "int32",
    "torch.uint32": "uint32",
    "torch.int64": "int64",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e5m2": "fp8_e5m2",
}


def is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def describe(obj: Any) -> Optional[TensorInfo]:
    """Shape, dtype, strides (elements) and device of a torch / numpy / TypedArray / DLPack object; None when the
    object cannot be inspected without importing it (the C++ side then does all checks)."""
    override = None
    if isinstance(obj, TypedArray):
        obj, override = obj.array, obj.dtype
    info = None
    if is_torch_tensor(obj):
        dev = obj.device
        device = "cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index if dev.index is not None else 0}"
        dtype = _TORCH_DTYPE_NAMES.get(str(obj.dtype), str(obj.dtype))
        info = TensorInfo(tuple(obj.shape), dtype, tuple(obj.stride()), device)
    elif type(obj).__module__ == "numpy" and hasattr(obj, "strides"):
        item = obj.dtype.itemsize
        strides = tuple(s // item if item else 0 for s in obj.strides)
        info = TensorInfo(tuple(obj.shape), _NUMPY_DTYPES.get(obj.dtype.name, "numpy." + obj.dtype.name), strides,
                          "cpu")
    if info is None:
        return None
    if override is not None:
        info = info._replace(dtype=override)
    return info


def _read_only(obj: Any) -> str:
    """Why a buffer cannot be written ("" when it can): JAX arrays are immutable (writing through their DLPack
    export would change values JAX assumes constant), numpy arrays may be flagged read-only."""
    if isinstance(obj, TypedArray):
        obj = obj.array
    module = type(obj).__module__
    if module.startswith(("jax", "jaxlib")):
        return "it is a JAX array (immutable); pass a numpy / torch / CuPy buffer and convert the result"
    if module == "numpy" and hasattr(obj, "flags") and not obj.flags.writeable:
        return "the numpy array is read-only (flags.writeable is False)"
    return ""


def _itemsize(dtype: str) -> int:
    try:
        return _C.dtype_size(dtype)
    except _C.Error:
        return 0


class _Checker:
    """Checks one call's tensors against a Config; `device` is where the backend needs them ("cpu", "cuda:N" or
    "cuda" for any CUDA device)."""

    def __init__(self, cfg: "_C.Config", device: Optional[str]):
        self.cfg = cfg
        self.device = device

    def info(self, name: str, obj: Any, required: bool, written: bool = False) -> Optional[TensorInfo]:
        if obj is None:
            if required:
                raise invalid_argument(f"{name} is required but None was given")
            return None
        if written:
            why = _read_only(obj)
            if why:
                raise invalid_argument(f"{name} is written by this call but {why}")
        info = describe(obj)
        if info is None:
            return None
        if self.device is not None:
            ok = info.device == self.device or (self.device == "cuda" and info.device.startswith("cuda"))
            if not ok:
                raise invalid_argument(f"{name} is on {info.device} but this AllToAll needs tensors on {self.device}")
        if any(s < 0 for s in info.strides):
            raise invalid_argument(f"{name} has a negative stride: strides {info.strides}")
        return info

    @staticmethod
    def dims(name: str, info: TensorInfo, expected: Sequence[int], meanings: Sequence[str]) -> None:
        if len(info.shape) != len(expected):
            raise invalid_argument(
                f"{name} must have {len(expected)} dimensions [{', '.join(meanings)}], got shape {info.shape}")
        for d, (got, want, meaning) in enumerate(zip(info.shape, expected, meanings)):
            if want >= 0 and got != want:
                raise invalid_argument(f"{name} dimension {d} must be {want} ({meaning}), got shape {info.shape}")

    @staticmethod
    def inner_contiguous(name: str, info: TensorInfo) -> None:
        if info.strides and info.strides[-1] != 1 and info.shape[-1] > 1:
            raise invalid_argument(f"{name} must be contiguous in its last dimension, got strides {info.strides}")

    @staticmethod
    def row_aligned(name: str, info: TensorInfo, align: int = 16) -> None:
        item = _itemsize(info.dtype)
        for d in range(len(info.strides) - 1):
            if info.shape[d] > 1 and (info.strides[d] * item) % align != 0:
                raise invalid_argument(
                    f"{name} stride {d} ({info.strides[d] * item} bytes) is not a multiple of {align} bytes")

    def expert_shape(self, cols: int, col_meaning: str) -> Tuple[Sequence[int], Sequence[str]]:
        c = self.cfg
        if c.layout == _C.Layout.batched:
            return ([c.num_local_experts, c.batched_rows_per_expert, cols],
                    ["local experts L", "rows per expert", col_meaning])
        return [c.packed_rows, cols], ["packed rows", col_meaning]

    def bound_m(self, obj: Any) -> None:
        info = self.info("bound_m", obj, False)
        if info is None:
            return
        if info.dtype not in ("int32", "uint32"):
            raise invalid_argument(f"bound_m must be int32 (or uint32), got {info.dtype}")
        n = 1
        for s in info.shape:
            n *= s
        if n != 1:
            raise invalid_argument(f"bound_m must hold exactly one element (0-d or shape [1]), got {info.shape}")

    def indices(self, obj: Any, m: Optional[int]) -> Optional[TensorInfo]:
        info = self.info("indices", obj, True)
        if info is None:
            return None
        self.dims("indices", info, [-1 if m is None else m, self.cfg.experts_per_token],
                  ["tokens m", "experts per token K"])
        if info.dtype not in ("int32", "uint32", "int64"):
            raise invalid_argument(f"indices must be int32, uint32 or int64, got {info.dtype}")
        return info

    def dispatch(self, out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale, indices, bound_m,
                 do_send: bool, do_recv: bool) -> None:
        c = self.cfg
        if not (do_send or do_recv):
            raise invalid_argument("dispatch called with do_send = do_recv = False")
        scale_cols = c.hidden_dim_scale_bytes // 4
        if do_send:
            x = self.info("dp_x", dp_x, True)
            m = None
            if x is not None:
                if len(x.shape) != 2:
                    raise invalid_argument(f"dp_x must have 2 dimensions [tokens, hidden], got shape {x.shape}")
                m = x.shape[0]
                if m > c.max_num_tokens:
                    raise invalid_argument(f"dp_x has {m} tokens, more than max_num_tokens = {c.max_num_tokens}")
                item = _itemsize(x.dtype)
                if item == 0:
                    raise invalid_argument(f"dp_x has an unsupported dtype {x.dtype}")
                if x.shape[1] * item != c.hidden_dim_bytes:
                    raise invalid_argument(
                        f"dp_x rows are {x.shape[1] * item} bytes ({x.dtype} x {x.shape[1]}) but hidden_dim_bytes = "
                        f"{c.hidden_dim_bytes}")
                self.inner_contiguous("dp_x", x)
                self.row_aligned("dp_x", x)
            self.indices(indices, m)
            if c.hidden_dim_scale_bytes > 0:
                s = self.info("dp_x_scale", dp_x_scale, True)
                if s is not None:
                    self.dims("dp_x_scale", s, [-1 if m is None else m, scale_cols],
                              ["tokens m", "hidden_dim_scale_bytes / 4"])
                    if _itemsize(s.dtype) != 4:
                        raise invalid_argument(f"dp_x_scale must have a 4-byte dtype (fp32), got {s.dtype}")
            elif dp_x_scale is not None:
                raise invalid_argument("dp_x_scale given but hidden_dim_scale_bytes = 0")
        if do_recv:
            n = self.info("out_expert_num_tokens", out_expert_num_tokens, True, written=True)
            if n is not None:
                self.dims("out_expert_num_tokens", n, [c.num_local_experts], ["local experts L = E / W"])
                if n.dtype != "int32":
                    raise invalid_argument(f"out_expert_num_tokens must be int32, got {n.dtype}")
                self.inner_contiguous("out_expert_num_tokens", n)
            ox = self.info("out_expert_x", out_expert_x, True, written=True)
            if ox is not None:
                item = _itemsize(ox.dtype)
                if item == 0 or c.hidden_dim_bytes % item != 0:
                    raise invalid_argument(f"out_expert_x has dtype {ox.dtype} that does not divide "
                                           f"hidden_dim_bytes = {c.hidden_dim_bytes}")
                self.dims("out_expert_x", ox,
                          *self.expert_shape(c.hidden_dim_bytes // item, "hidden_dim_bytes / itemsize"))
                self.inner_contiguous("out_expert_x", ox)
                self.row_aligned("out_expert_x", ox)
            if c.hidden_dim_scale_bytes > 0:
                os_ = self.info("out_expert_x_scale", out_expert_x_scale, True, written=True)
                if os_ is not None:
                    if _itemsize(os_.dtype) != 4:
                        raise invalid_argument(f"out_expert_x_scale must have a 4-byte dtype (fp32), got {os_.dtype}")
                    self.dims("out_expert_x_scale", os_, *self.expert_shape(scale_cols, "hidden_dim_scale_bytes / 4"))
            elif out_expert_x_scale is not None:
                raise invalid_argument("out_expert_x_scale given but hidden_dim_scale_bytes = 0")
        self.bound_m(bound_m)

    def combine(self, out_tokens, indices, weights, expert_y, bound_m, do_send: bool, do_recv: bool) -> None:
        c = self.cfg
        if not (do_send or do_recv):
            raise invalid_argument("combine called with do_send = do_recv = False")
        float_types = ("bf16", "fp16", "fp32")
        if do_send:
            y = self.info("expert_y", expert_y, True)
            if y is not None:
                if y.dtype not in float_types:
                    raise invalid_argument(f"expert_y must be bf16, fp16 or fp32, got {y.dtype}")
                self.dims("expert_y", y, *self.expert_shape(c.hidden_dim, "hidden_dim H"))
                self.inner_contiguous("expert_y", y)
                self.row_aligned("expert_y", y)
        if do_recv:
            o = self.info("out_tokens", out_tokens, True, written=True)
            m = None
            if o is not None:
                if o.dtype not in float_types:
                    raise invalid_argument(f"out_tokens must be bf16, fp16 or fp32, got {o.dtype}")
                self.dims("out_tokens", o, [-1, c.hidden_dim], ["tokens m", "hidden_dim H"])
                m = o.shape[0]
                if m > c.max_num_tokens:
                    raise invalid_argument(f"out_tokens has {m} tokens, more than max_num_tokens = {c.max_num_tokens}")
                self.inner_contiguous("out_tokens", o)
                self.row_aligned("out_tokens", o)
            self.indices(indices, m)
            w = self.info("weights", weights, True)
            if w is not None:
                self.dims("weights", w, [-1 if m is None else m, c.experts_per_token],
                          ["tokens m", "experts per token K"])
                if w.dtype != "fp32":
                    raise invalid_argument(f"weights must be fp32, got {w.dtype}")
        self.bound_m(bound_m)


def check_dispatch(cfg: "_C.Config", device: Optional[str], *args: Any) -> None:
    """Raises epcomm.Error(code='invalid_argument') naming the first bad dispatch argument."""
    _Checker(cfg, device).dispatch(*args)


def check_combine(cfg: "_C.Config", device: Optional[str], *args: Any) -> None:
    """Raises epcomm.Error(code='invalid_argument') naming the first bad combine argument."""
    _Checker(cfg, device).combine(*args)
