"""epcomm.AllToAll: MoE dispatch and combine with pplx-kernels' argument names, on any DLPack tensors."""

from __future__ import annotations

import operator
import sys
from typing import Any, List, Optional, Tuple, Union

from . import _C, _torch_ops
from ._bootstrap import make_bootstrap
from ._tensors import TypedArray, check_writable, error, invalid_argument, is_torch_tensor, python_names

# The module object itself (None without torch): dispatch()/combine() test isinstance against it, which
# torch.compile traces without a graph break.
_torch = _torch_ops.torch

__all__ = ["AllToAll", "make_config", "Plan", "plan"]

_TORCH_DTYPES = {
    "u8": "uint8",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "int32": "int32",
    "uint32": "uint32",
    "int64": "int64",
}
# numpy has no bf16 / fp8: those are allocated as same-size integers and wrapped in TypedArray.
_NUMPY_STORAGE = {
    "u8": ("uint8", False),
    "fp8_e4m3": ("uint8", True),
    "fp8_e5m2": ("uint8", True),
    "bf16": ("uint16", True),
    "fp16": ("float16", False),
    "fp32": ("float32", False),
    "int32": ("int32", False),
    "uint32": ("uint32", False),
    "int64": ("int64", False),
}
# torch dtypes that older DLPack exporters reject: exported as a same-size dtype with the epcomm name attached.
_TORCH_REINTERPRET = {"float8_e4m3fn": ("uint8", "fp8_e4m3"), "float8_e5m2": ("uint8", "fp8_e5m2"),
                      "uint32": ("int32", "uint32")}


def make_config(max_num_tokens: int, num_experts: int, experts_per_token: int, rank: int, world_size: int,
                dp_size: int, hidden_dim: int, hidden_dim_bytes: int, hidden_dim_scale_bytes: int,
                expert_padding: int = 1, layout: str = "batched", dispatch_cast: str = "none") -> "_C.Config":
    """A validated Config from pplx-style arguments; raises epcomm.Error(code='invalid_config')."""
    sizes = dict(max_num_tokens=max_num_tokens, num_experts=num_experts, experts_per_token=experts_per_token,
                 rank=rank, world_size=world_size, dp_size=dp_size, hidden_dim=hidden_dim,
                 hidden_dim_bytes=hidden_dim_bytes, hidden_dim_scale_bytes=hidden_dim_scale_bytes,
                 expert_padding=expert_padding)
    cfg = _C.Config()
    for name, value in sizes.items():  # the fields are unsigned 32-bit: say which one is wrong, not a binding error
        try:
            v = -1 if isinstance(value, bool) else operator.index(value)
        except TypeError:
            v = -1
        if not 0 <= v < 2 ** 32:
            raise error(f"{name} must be an integer in [0, 2^32), got {value!r}", "invalid_config")
        setattr(cfg, name, v)
    cfg.layout = _C.layout_from_name(layout) if isinstance(layout, str) else layout
    cfg.dispatch_cast = (_C.dispatch_cast_from_name(dispatch_cast) if isinstance(dispatch_cast, str)
                         else dispatch_cast)
    cfg.validate()
    return cfg


class Plan:
    """The planner's answer: `buffers` (list of epcomm._C.PlannedBuffer), `total_bytes`, and str() = the table."""

    def __init__(self, cfg: "_C.Config", backend: str):
        self.config = cfg
        self.backend = backend
        self.buffers: List["_C.PlannedBuffer"] = _C.plan_buffers(cfg, backend)
        self.table: str = _C.format_plan(cfg, backend, self.buffers)

    @property
    def total_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers)

    def __str__(self) -> str:
        return self.table

    def __repr__(self) -> str:
        return f"Plan({self.config!r}, backend={self.backend!r}, {len(self.buffers)} buffers)"


def plan(config: Union["_C.Config", str, None] = None, backend: str = "", **kwargs: Any) -> Plan:
    """Every buffer a configuration needs, before anything is allocated.

    ``plan(cfg, "nvlink")``, ``plan("decode", "nvlink", world_size=8)`` (a standard config by name, keyword
    arguments world_size / rank / dp_size), or ``plan(backend="host", max_num_tokens=..., ...)`` with the
    AllToAll constructor's config arguments. ``print(plan(...))`` prints the table.
    """
    if isinstance(config, str):
        cfg = _C.standard_config(config, kwargs.pop("world_size", 1), kwargs.pop("rank", 0), kwargs.pop("dp_size", 1))
        for key, value in kwargs.items():
            if key == "layout" and isinstance(value, str):
                value = _C.layout_from_name(value)
            elif key == "dispatch_cast" and isinstance(value, str):
                value = _C.dispatch_cast_from_name(value)
            setattr(cfg, key, value)
    elif config is None:
        kwargs.setdefault("rank", 0)
        kwargs.setdefault("dp_size", 1)
        cfg = make_config(**kwargs)
    else:
        cfg = config
    return Plan(cfg, backend)


_EXPORT = []  # the chosen torch -> capsule function, found on first use


def _torch_exporter() -> Any:
    """The raw DLPack export of torch: no stream handshake, no deprecation warning in the hot path."""
    if not _EXPORT:
        import torch

        fn = getattr(torch._C, "_to_dlpack", None)
        if fn is None:
            import torch.utils.dlpack

            fn = getattr(torch.utils.dlpack, "to_dlpack", None)
        if fn is None:  # only the protocol is left: stream=-1 asks for no synchronisation
            def fn(t: Any) -> Any:
                return t.__dlpack__(stream=-1) if t.is_cuda else t.__dlpack__()
        _EXPORT.append(fn)
    return _EXPORT[0]


def _to_dlpack(t: Any) -> Any:
    """A torch tensor as something the extension imports without torch's stream handshake.

    Tensor.__dlpack__() without a stream may make the default stream wait on the current one (an event per
    tensor), which breaks CUDA-graph capture; a raw capsule carries no synchronisation. fp8 (and uint32) travel as
    same-size integers with the dtype name attached (older DLPack exporters lack those codes)."""
    import torch

    if t.requires_grad:
        t = t.detach()
    export = _torch_exporter()
    alias = _TORCH_REINTERPRET.get(str(t.dtype).replace("torch.", ""))
    if alias is not None:
        return (export(t.view(getattr(torch, alias[0]))), alias[1])
    return export(t)


def _prepare(t: Any) -> Any:
    if t is None:
        return None
    if isinstance(t, TypedArray):
        inner = _prepare(t.array)
        return (inner[0] if isinstance(inner, tuple) else inner, t.dtype)
    if is_torch_tensor(t):
        return _to_dlpack(t)
    return t


def _resolve_group_name(name: Optional[str]) -> Any:
    """The torch.distributed ProcessGroup called `name` (None for "default" / None: make_bootstrap then takes the
    default group when torch.distributed is initialised, or runs a single rank)."""
    if name is None or name == "default":
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        raise invalid_argument(f"group_name={name!r} names a torch.distributed group, but torch is not installed")
    if not (dist.is_available() and dist.is_initialized()):
        raise invalid_argument(f"group_name={name!r}: torch.distributed is not initialised")
    resolve = getattr(dist.distributed_c10d, "_resolve_process_group", None)
    if resolve is None:
        resolve = getattr(getattr(__import__("torch")._C, "_distributed_c10d", None), "_resolve_process_group", None)
    try:
        if resolve is None:
            raise RuntimeError("this torch has no group registry (torch.distributed _resolve_process_group)")
        return resolve(name)
    except Exception as e:  # noqa: BLE001 (torch raises RuntimeError or KeyError depending on the version)
        raise invalid_argument(f"group_name={name!r} names no torch.distributed ProcessGroup: {e}") from None


def _current_stream(*tensors: Any) -> int:
    for t in tensors:
        if is_torch_tensor(t) and t.is_cuda:
            import torch

            return torch.cuda.current_stream(t.device).cuda_stream
    return 0


class AllToAll:
    """MoE expert-parallel dispatch and combine (pplx-kernels' AllToAll interface) on one of epcomm's backends.

    Collective construction: every rank of the group calls it with the same config. Experts are placed in
    contiguous blocks of ``L = num_experts // world_size`` per rank; a DP group is ``dp_size`` consecutive ranks
    holding identical tokens.

    Args:
        max_num_tokens: most tokens any rank passes to one dispatch (m <= max_num_tokens).
        num_experts: E, experts over all ranks. experts_per_token: K (router top-k).
        rank, world_size, dp_size: this rank, W, and D (ranks per DP group, W % D == 0).
        hidden_dim: H, elements per token of the combine (expert_y, out_tokens).
        hidden_dim_bytes: dispatch payload bytes per token (H for fp8, 2H for bf16), a multiple of 16.
        hidden_dim_scale_bytes: dispatch scale bytes per token (0 = no scales; fp32 scales, a multiple of 4).
        expert_padding: row alignment of each expert's segment (power of two).
        layout: "batched" ([L, max_num_tokens * W / D, ...], pplx-kernels) or "packed" ([sum of padded counts, ...]).
        dispatch_cast: "none", or "fp8_blocks" / "fp8_blocks_pow2": the dispatch casts each token itself (DeepEP's
            low-latency fp8 cast, inside the dispatch kernel on nvlink): dp_x is bf16 [m, hidden_dim], dp_x_scale
            None, and out_expert_x fp8 e4m3 with out_expert_x_scale fp32 [..., hidden_dim / 128], bit for bit
            what deep_ep.per_token_cast_to_fp8 then a dispatch of its output give ("_pow2": round_scale). Needs
            hidden_dim % 128 == 0, hidden_dim_bytes = hidden_dim, hidden_dim_scale_bytes = hidden_dim / 128 * 4.
            Backends: nvlink and host (dispatch_cast_backends()); the others raise code "unavailable" here.
        backend: "auto", "nvlink", "nvshmem", "proxy" or "host" (see built_backends()).
        group: a torch.distributed ProcessGroup to rendezvous through.
        bootstrap: "host:port", "env", an epcomm._C.Bootstrap, or an object with all_gather / barrier /
            broadcast (see epcomm.TorchGroupBootstrap). Default: group, then EPCOMM_BOOTSTRAP, then the default
            torch.distributed group.

    Calls are stream-ordered on the caller's current CUDA stream (torch) or on ``stream=`` (any other framework),
    never synchronise the host on GPU backends, and are captured by CUDA graphs. Traced by torch.compile (or given
    tensor subclasses) they run as the custom ops ``torch.ops.epcomm.dispatch`` (``dispatch_scaled``) /
    ``combine``, so torch.compile(fullgraph=True) keeps them in the graph; plain eager calls go straight to the
    library.
    """

    def __init__(self, max_num_tokens: int, num_experts: int, experts_per_token: int, rank: int, world_size: int,
                 dp_size: int, hidden_dim: int, hidden_dim_bytes: int, hidden_dim_scale_bytes: int,
                 expert_padding: int = 1, layout: str = "batched", backend: str = "auto", group: Any = None,
                 bootstrap: Any = None, dispatch_cast: str = "none"):
        self._impl = None
        self._handle = 0
        cfg = make_config(max_num_tokens, num_experts, experts_per_token, rank, world_size, dp_size, hidden_dim,
                          hidden_dim_bytes, hidden_dim_scale_bytes, expert_padding, layout, dispatch_cast)
        boot = make_bootstrap(bootstrap, group, rank, world_size)
        self._impl = _C.create_all_to_all(cfg, boot, backend)
        self._config = self._impl.config
        self.backend: str = self._impl.backend_name
        if cfg.dispatch_cast != _C.DispatchCast.none and self.backend not in _C.dispatch_cast_backends():
            # Every rank got the same backend: all of them refuse here, before any dispatch.
            self._impl.close()
            raise error(f"dispatch_cast={cfg.dispatch_cast.name!r} is not supported by the {self.backend} backend "
                        f"(supported: {', '.join(_C.dispatch_cast_backends())}); cast dp_x first (for example "
                        "epcomm.deep_ep.per_token_cast_to_fp8) and dispatch fp8 with dispatch_cast='none'",
                        "unavailable")
        # Where the tensors must live: host memory for the host backend, the current CUDA device otherwise.
        self.device: Optional[str] = "cpu" if self.backend == "host" else "cuda"
        torch = sys.modules.get("torch")
        if self.device == "cuda" and torch is not None and torch.cuda.is_available():
            self.device = f"cuda:{torch.cuda.current_device()}"
        self._handle = _torch_ops.register(self)

    @classmethod
    def intranode(cls, max_num_tokens: int, num_experts: int, experts_per_token: int, rank: int, world_size: int,
                  dp_size: int, hidden_dim: int, hidden_dim_bytes: int, hidden_dim_scale_bytes: int,
                  group_name: Optional[str] = "default", **kwargs: Any) -> "AllToAll":
        """pplx-kernels' intranode constructor: the same arguments, keyword or positional. `group_name` names the
        torch.distributed ProcessGroup the ranks meet through (``ProcessGroup.group_name``, as pplx-kernels
        resolves it; "default" or None: the default group when torch.distributed is initialised). ``group=`` /
        ``bootstrap=`` and the other keyword arguments of AllToAll take precedence; the backend is "auto"."""
        if "group" not in kwargs and "bootstrap" not in kwargs:
            kwargs["group"] = _resolve_group_name(group_name)
        return cls(max_num_tokens, num_experts, experts_per_token, rank, world_size, dp_size, hidden_dim,
                   hidden_dim_bytes, hidden_dim_scale_bytes, **kwargs)

    @classmethod
    def internode(cls, max_num_tokens: int, num_experts: int, experts_per_token: int, rank: int, world_size: int,
                  dp_size: int, hidden_dim: int, hidden_dim_bytes: int, hidden_dim_scale_bytes: int,
                  group_name: Optional[str] = "default", **kwargs: Any) -> "AllToAll":
        """pplx-kernels' internode constructor (see intranode): "auto" picks the backend that every rank can run,
        so the same call serves one node and several."""
        return cls.intranode(max_num_tokens, num_experts, experts_per_token, rank, world_size, dp_size, hidden_dim,
                             hidden_dim_bytes, hidden_dim_scale_bytes, group_name, **kwargs)

    # -- properties --------------------------------------------------------------------------------------------
    @property
    def config(self) -> "_C.Config":
        """The validated Config (rank-specific)."""
        return self._config

    @property
    def handle(self) -> int:
        """The integer that names this object in torch.ops.epcomm.dispatch / combine."""
        return self._handle

    @property
    def buffer_bytes(self) -> int:
        """Bytes of communication buffers the backend allocated."""
        return self._live().buffer_bytes

    # -- elastic ranks (docs/failures.md, "Elastic ranks") --------------------------------------------------------
    @property
    def active_ranks(self) -> List[int]:
        """The active-ranks mask: world_size entries, 1 = the rank takes part in rounds, 0 = masked. A masked rank
        is skipped in every send and wait; tokens routed to its experts are dropped (left out of combine, the other
        weights not renormalised) and counted in dropped_tokens. On the host backend with EPCOMM_ELASTIC=1 a peer
        that dies (or leaves) is masked once the others agree: the call that lost it raises, the next rounds run
        without it. Backends without elastic ranks raise code "unavailable"."""
        return list(self._live().active_ranks)

    def set_active_ranks(self, mask: Any) -> None:
        """Masks ranks on purpose: collective over the active ranks (the ones it masks too, which then leave: later
        calls on them raise), each passing the same mask (a sequence of world_size 0 / 1), between rounds. Blocks
        until the ranks that stay agree. A masked rank never becomes active again."""
        try:
            values = [operator.index(v) for v in mask]
        except TypeError:
            raise invalid_argument(f"set_active_ranks: mask must be a sequence of 0 / 1 integers, got {mask!r}") \
                from None
        self._live().set_active_ranks(values)

    @property
    def dropped_tokens(self) -> int:
        """(token, k) positions of this rank's combines left out because their expert's rank (or the token's
        sending rank) was masked, since creation."""
        return self._live().dropped_tokens

    def _live(self) -> "_C.AllToAll":
        if self._impl is None or self._impl.closed:
            raise invalid_argument("this AllToAll was destroyed")
        return self._impl

    # -- dispatch / combine ------------------------------------------------------------------------------------
    def dispatch(self, out_expert_num_tokens: Any, out_expert_x: Any, out_expert_x_scale: Any, dp_x: Any,
                 dp_x_scale: Any, indices: Any, bound_m: Any = None, do_send: bool = True, do_recv: bool = True,
                 stream: Optional[int] = None) -> None:
        """Sends each token of this rank's share (t % dp_size == rank % dp_size, t < bound_m) once to every distinct
        expert in indices[t] and receives this rank's experts' tokens.

        Shapes (L = E / W, R = max_num_tokens * W / D padded, P = packed rows, S = hidden_dim_scale_bytes / 4):
            out_expert_num_tokens: [L] int32, written: tokens received per local expert.
            out_expert_x: batched [L, R, hidden_dim_bytes / itemsize] or packed [P, ...], any dtype, written.
            out_expert_x_scale: [L, R, S] / [P, S] fp32, written; None when hidden_dim_scale_bytes == 0.
            dp_x: [m, hidden_dim_bytes / itemsize]; dp_x_scale: [m, S] fp32 or None.
            indices: [m, K] int32 / uint32 / int64; -1 = no expert.
            bound_m: optional 0-d / [1] int32 tensor with the token count (<= m) on the tensors' device.
        do_send / do_recv split the call into its non-blocking send half and its receive half. `stream`
        (cudaStream_t as int) is for non-torch callers; torch tensors use the current stream.
        """
        if (_torch_ops.HAVE_TORCH_OPS and stream is None and isinstance(out_expert_x, _torch.Tensor)
                and isinstance(out_expert_num_tokens, _torch.Tensor) and _torch_ops.needs_op(out_expert_x)):
            if out_expert_x_scale is None:
                if dp_x_scale is not None:  # an error (no scales configured): the eager path reports it
                    return self._dispatch_eager(out_expert_num_tokens, out_expert_x, None, dp_x, dp_x_scale, indices,
                                                bound_m, do_send, do_recv, stream)
                _torch_ops.DISPATCH(self._handle, out_expert_num_tokens, out_expert_x, dp_x, indices, bound_m,
                                    do_send, do_recv)
            else:
                _torch_ops.DISPATCH_SCALED(self._handle, out_expert_num_tokens, out_expert_x, out_expert_x_scale,
                                           dp_x, dp_x_scale, indices, bound_m, do_send, do_recv)
            return
        self._dispatch_eager(out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale, indices,
                             bound_m, do_send, do_recv, stream)

    def combine(self, out_tokens: Any, indices: Any, weights: Any, expert_y: Any, bound_m: Any = None,
                do_send: bool = True, do_recv: bool = True, accumulate: bool = False,
                stream: Optional[int] = None) -> None:
        """Returns the expert outputs to the ranks that own the tokens and forms
        ``out_tokens[t] (+)= sum_k weights[t, k] * expert_y[slot(t, k)]`` (fp32 accumulation, fixed order) for
        t < bound_m on every rank of the DP group. Must follow a dispatch with the same indices.

        Shapes: out_tokens [m, H] bf16 / fp16 / fp32 (written); indices [m, K]; weights [m, K] fp32;
        expert_y in out_expert_x's layout with H columns, bf16 / fp16 / fp32.
        """
        if (_torch_ops.HAVE_TORCH_OPS and stream is None and isinstance(out_tokens, _torch.Tensor)
                and _torch_ops.needs_op(out_tokens)):
            _torch_ops.COMBINE(self._handle, out_tokens, indices, weights, expert_y, bound_m, do_send, do_recv,
                               accumulate)
            return
        self._combine_eager(out_tokens, indices, weights, expert_y, bound_m, do_send, do_recv, accumulate, stream)

    def _dispatch_eager(self, out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale, indices,
                        bound_m, do_send, do_recv, stream) -> None:
        impl = self._live()
        if do_recv:
            check_writable("out_expert_num_tokens", out_expert_num_tokens)
            check_writable("out_expert_x", out_expert_x)
            check_writable("out_expert_x_scale", out_expert_x_scale)
        if stream is None:
            stream = _current_stream(dp_x, out_expert_x)
        try:
            impl.dispatch(_prepare(out_expert_num_tokens), _prepare(out_expert_x), _prepare(out_expert_x_scale),
                          _prepare(dp_x), _prepare(dp_x_scale), _prepare(indices), _prepare(bound_m), do_send,
                          do_recv, stream)
        except _C.Error as e:  # the C++ checks name the C++ fields: say the Python argument names
            raise python_names(e) from None

    def _combine_eager(self, out_tokens, indices, weights, expert_y, bound_m, do_send, do_recv, accumulate,
                       stream) -> None:
        impl = self._live()
        if do_recv:
            check_writable("out_tokens", out_tokens)
        if stream is None:
            stream = _current_stream(out_tokens, expert_y)
        try:
            impl.combine(_prepare(out_tokens), _prepare(indices), _prepare(weights), _prepare(expert_y),
                         _prepare(bound_m), do_send, do_recv, accumulate, stream)
        except _C.Error as e:
            raise python_names(e) from None

    def synchronize(self) -> None:
        """Waits for this object's outstanding work and raises any error a kernel or thread recorded."""
        self._live().synchronize()

    def destroy(self) -> None:
        """Frees the backend's buffers (pplx-kernels' name). Later calls raise. Idempotent."""
        if self._handle:
            _torch_ops.unregister(self._handle)
        if self._impl is not None:
            self._impl.close()

    close = destroy

    def __del__(self) -> None:
        try:
            if getattr(self, "_handle", 0):
                _torch_ops.unregister(self._handle)
        except Exception:  # interpreter shutdown
            pass

    def __enter__(self) -> "AllToAll":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "destroyed" if self._impl is None or self._impl.closed else self.backend
        return f"epcomm.AllToAll({state}, {self._config!r})"

    # -- allocation helpers ------------------------------------------------------------------------------------
    def _framework(self, dtype: Any, device: Any) -> str:
        torch = sys.modules.get("torch")
        if torch is not None:
            if isinstance(dtype, torch.dtype) or isinstance(device, torch.device):
                return "torch"
            if isinstance(device, str) and device.startswith("cuda"):
                return "torch"
            if device is None and self.device != "cpu":
                return "torch"
        if self.device != "cpu":
            raise invalid_argument(f"backend {self.backend} needs CUDA tensors: install torch or allocate them "
                                   "with your framework")
        return "numpy"

    def _alloc(self, shape: Tuple[int, ...], dtype: Any, default: str, device: Any, zero: bool = True,
               framework: Optional[str] = None) -> Any:
        framework = framework or self._framework(dtype, device)
        if framework == "torch":
            import torch

            if dtype is None or isinstance(dtype, str):
                name = dtype or default
                if name not in _TORCH_DTYPES:
                    raise invalid_argument(f"unknown dtype '{name}' ({', '.join(_TORCH_DTYPES)})")
                dtype = getattr(torch, _TORCH_DTYPES[name])
            dev = device if device is not None else (self.device if self.device != "cuda" else "cuda")
            # Zero bits through a same-size integer view: fill kernels do not exist for every dtype (fp8).
            item = torch.empty((), dtype=dtype).element_size()
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[item]
            return (torch.zeros if zero else torch.empty)(shape, dtype=bits, device=dev).view(dtype)
        import numpy as np

        if dtype is None or isinstance(dtype, str):
            name = dtype or default
            if name not in _NUMPY_STORAGE:
                raise invalid_argument(f"unknown dtype '{name}' ({', '.join(_NUMPY_STORAGE)})")
            storage, wrap = _NUMPY_STORAGE[name]
            arr = np.zeros(shape, dtype=storage)
            return TypedArray(arr, name) if wrap else arr
        return np.zeros(shape, dtype=dtype)

    def _expert_shape(self, cols: int) -> Tuple[int, ...]:
        c = self._config
        if c.layout == _C.Layout.batched:
            return (c.num_local_experts, c.batched_rows_per_expert, cols)
        return (c.packed_rows, cols)

    def _default_x_dtype(self) -> str:
        c = self._config
        per = c.hidden_dim_bytes // c.hidden_dim if c.hidden_dim_bytes % c.hidden_dim == 0 else 0
        return {1: "fp8_e4m3", 2: "bf16", 4: "fp32"}.get(per, "u8")

    def alloc_dispatch_outputs(self, dtype: Any = None, device: Any = None) -> Tuple[Any, Any, Any]:
        """Correctly shaped (out_expert_num_tokens, out_expert_x, out_expert_x_scale) for dispatch; the scale is
        None when hidden_dim_scale_bytes == 0. `dtype`: of out_expert_x (torch / numpy dtype or epcomm name;
        default from hidden_dim_bytes / hidden_dim). `device`: default the backend's (numpy arrays for host
        without torch tensors requested)."""
        c = self._config
        if dtype is None:
            dtype = self._default_x_dtype()
        # One framework for all three, chosen from what the caller asked for (a torch dtype on the host backend gives
        # torch CPU tensors for the counts and scales too: a numpy count array would send torch.compile off the ops).
        framework = self._framework(dtype, device)
        num = self._alloc((c.num_local_experts,), "int32", "int32", device, framework=framework)
        probe = self._alloc((1,), dtype, "u8", device, framework=framework)
        item = _itemsize_of(probe)
        if c.hidden_dim_bytes % item != 0:
            raise invalid_argument(f"dtype {dtype} does not divide hidden_dim_bytes = {c.hidden_dim_bytes}")
        x = self._alloc(self._expert_shape(c.hidden_dim_bytes // item), dtype, "u8", device, framework=framework)
        scale = None
        if c.hidden_dim_scale_bytes > 0:
            scale = self._alloc(self._expert_shape(c.hidden_dim_scale_bytes // 4), "fp32", "fp32", device,
                                framework=framework)
        return num, x, scale

    def alloc_expert_y(self, dtype: Any = "bf16", device: Any = None) -> Any:
        """An expert_y for combine: out_expert_x's layout with hidden_dim columns (default bf16)."""
        return self._alloc(self._expert_shape(self._config.hidden_dim), dtype, "bf16", device)

    def alloc_combine_output(self, num_tokens: Optional[int] = None, dtype: Any = "bf16", device: Any = None) -> Any:
        """out_tokens for combine: [num_tokens (default max_num_tokens), hidden_dim], default bf16."""
        m = self._config.max_num_tokens if num_tokens is None else num_tokens
        return self._alloc((m, self._config.hidden_dim), dtype, "bf16", device)


def _itemsize_of(t: Any) -> int:
    if isinstance(t, TypedArray):
        t = t.array
    if is_torch_tensor(t):
        return t.element_size()
    return t.dtype.itemsize
