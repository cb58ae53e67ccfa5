"""DeepEP's low-latency API over epcomm's backends: ``from epcomm import deep_ep`` then ``deep_ep.Buffer``.

Code written for DeepEP's low-latency mode (decode) runs with its import line changed::

    from epcomm.deep_ep import Buffer           # was: from deep_ep import Buffer
    buf = Buffer(group, num_nvl_bytes=0, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T, H, W, E),
                 low_latency_mode=True, num_qps_per_rank=E // W)
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)
    y = experts(recv_x, recv_count)             # [L, T * W, H] bf16
    combined_x, event, hook = buf.low_latency_combine(y, topk_idx, topk_weights, handle)

Each (T, H, E, top-k, payload, cast) shape gets two epcomm AllToAll objects (created collectively on the first
dispatch of that shape), used in turn like DeepEP's two low-latency buffers: two dispatches may be in flight (two
micro-batches) before their combines. Outputs are in DeepEP's layout and dtypes: ``recv_x`` is ``[L, T * W, H]`` (rows of each
local expert ordered by source rank, then token), with ``use_fp8`` an fp8 e4m3 tensor and ``[L, T * W, H / 128]``
fp32 scales whose last two dimensions are column-major. With ``use_fp8`` and bf16 ``x`` the fp8 cast runs inside the
dispatch (AllToAll's dispatch_cast) on the backends that can (nvlink: in the dispatch kernel; host); elsewhere it runs
before the dispatch (per_token_cast_to_fp8), with the same bits. What differs and what is not supported:
docs/compat.md.

Without torch (the host backend, CI) the same calls take numpy arrays: bf16 data as ``epcomm.typed(u16, "bf16")``
and the results come back the same way (fp8 as ``typed(u8, "fp8_e4m3")``).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from . import _C
from ._all_to_all import AllToAll, plan
from ._bootstrap import make_bootstrap
from ._tensors import TypedArray, error, invalid_argument, is_torch_tensor

__all__ = ["Buffer", "EventOverlap", "LowLatencyHandle", "per_token_cast_to_fp8"]

# DeepEP's fp8 block: one fp32 scale per 128 elements of a token.
FP8_BLOCK = 128


def _unsupported(what: str) -> "_C.Error":
    return error(f"{what} is not supported by epcomm's DeepEP front door (docs/compat.md, 'Not supported yet')",
                 "unavailable")


class EventOverlap:
    """DeepEP's event wrapper. epcomm runs every call on the caller's current stream, so the work is already ordered
    before anything that follows on that stream; ``current_stream_wait()`` makes the current stream wait for the
    recorded event (a no-op without CUDA). Also a context manager, as in DeepEP."""

    def __init__(self, event: Any = None, extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors  # kept alive until the event is consumed, as DeepEP does

    def current_stream_wait(self) -> None:
        if self.event is not None:
            import torch

            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.current_stream_wait()


class LowLatencyHandle(NamedTuple):
    """What low_latency_combine needs from its dispatch (DeepEP's handle; treat it as opaque)."""

    a2a: AllToAll
    num_tokens: int
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


def _torch() -> Any:
    return sys.modules.get("torch")


def _array_of(t: Any) -> Any:
    return t.array if isinstance(t, TypedArray) else t


def _dtype_name(t: Any) -> str:
    """epcomm dtype name of a torch tensor, numpy array or TypedArray."""
    if isinstance(t, TypedArray):
        return t.dtype
    if is_torch_tensor(t):
        return {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}.get(str(t.dtype),
                                                                                               str(t.dtype))
    return {"float16": "fp16", "float32": "fp32", "bfloat16": "bf16"}.get(t.dtype.name, t.dtype.name)


def _add_into(stats: Any, counts: Any) -> None:
    """stats += counts in place (torch or numpy); nothing when stats is None."""
    if stats is None:
        return
    if is_torch_tensor(stats):
        stats.add_(counts)
    else:
        import numpy as np

        np.add(stats, counts, out=stats)


def per_token_cast_to_fp8(x: Any, round_scale: bool = False) -> Tuple[Any, Any]:
    """DeepEP's cast before a low-latency dispatch: per token and block of 128 elements, amax = max(|x|, 1e-4),
    ``x_fp8 = fp8_e4m3(x * 448 / amax)`` and ``scale = amax / 448`` (``x ~ x_fp8 * scale``); with `round_scale`
    the scale is rounded up to a power of two. Returns ``(x_fp8 [m, H], scales [m, H / 128] fp32)``.

    torch tensors (any device) are cast with torch operations; numpy arrays (bf16 as ``typed(u16, "bf16")``) with the
    library's CPU cast (epcomm/reference.hpp, castFp8Blocks), which gives the same bits."""
    if is_torch_tensor(x):
        import torch

        m, h = x.shape
        if h % FP8_BLOCK != 0:
            raise invalid_argument(f"x has {h} columns, not a multiple of the block size {FP8_BLOCK}")
        xf = x.float().view(m, h // FP8_BLOCK, FP8_BLOCK)
        amax = xf.abs().amax(dim=2).clamp(min=1e-4)
        # Tensor over tensor, never a Python scalar: torch evaluates 448.0 / amax as reciprocal(amax) * 448 and, on
        # CUDA, amax / 448.0 as amax * (1 / 448), second roundings the library's cast (one division) does not make.
        c448 = torch.full_like(amax, 448.0)
        scale = amax / c448
        if round_scale:
            # 2^ceil(log2(scale)) from the bits (exact, as the library computes it): a power of two stays, any other
            # scale takes the next exponent. scale >= 1e-4 / 448 is a normal number; an infinite one stays.
            bits = scale.view(torch.int32)
            exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
            scale = torch.where(bits >> 23 == 255, scale, (exponent << 23).view(torch.float32))
            inv = (((254 - exponent).clamp(min=0)) << 23).view(torch.float32)  # 1 / scale, exact
            inv = torch.where(bits >> 23 == 255, torch.zeros_like(inv), inv)
        else:
            inv = c448 / amax
        q = xf * inv.unsqueeze(2)
        return q.to(torch.float8_e4m3fn).view(m, h), scale.contiguous()
    import numpy as np

    arr = _array_of(x)
    m, h = arr.shape
    out = np.zeros((m, h), np.uint8)
    scales = np.zeros((m, h // FP8_BLOCK if h % FP8_BLOCK == 0 else 1), np.float32)
    _C.cast_fp8_blocks(x if isinstance(x, TypedArray) else arr, TypedArray(out, "fp8_e4m3"), scales, FP8_BLOCK,
                       round_scale)
    return TypedArray(out, "fp8_e4m3"), scales


class Buffer:
    """DeepEP's ``deep_ep.Buffer``, low-latency mode, over an epcomm backend.

    Args (DeepEP's): group: a torch.distributed ProcessGroup (its rank and size are the EP rank and world).
        num_nvl_bytes, num_rdma_bytes, num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl,
        explicitly_destroy: accepted for compatibility; epcomm sizes its own buffers from the shapes of the first
        dispatch (``epcomm.plan`` shows them). low_latency_mode: DeepEP's normal mode is not supported, so the
        low-latency methods work either way and the normal-mode ones raise.
    epcomm's own (keyword only): backend ("auto", "nvlink", "host", ...), and for callers without torch.distributed
        rank, world_size and bootstrap (as for epcomm.AllToAll: "host:port", "env", an object with all_gather /
        barrier / broadcast).
    """

    num_sms: int = 20

    def __init__(self, group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, *, backend: str = "auto", rank: Optional[int] = None,
                 world_size: Optional[int] = None, bootstrap: Any = None) -> None:
        if group is not None:
            rank = group.rank() if rank is None else rank
            world_size = group.size() if world_size is None else world_size
        if rank is None or world_size is None:
            raise invalid_argument("Buffer needs a torch.distributed group, or rank= and world_size= with bootstrap=")
        self.group = group
        self.rank = int(rank)
        self.group_size = int(world_size)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.backend = backend
        self._bootstrap = make_bootstrap(bootstrap, group, self.rank, self.group_size)
        # (T, H, E, K, payload dtype, dispatch cast) -> [two AllToAll objects, index of the next one to dispatch on]
        self._objects: Dict[Tuple[Any, ...], List[Any]] = {}
        # Whether the backend casts to fp8 in its dispatch (None: not known before the first fp8 dispatch).
        self._fused_cast: Optional[bool] = None

    # -- DeepEP's static helpers ---------------------------------------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Accepted for compatibility (the SM count of DeepEP's normal-mode kernels); epcomm sizes its own grids."""
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current CUDA stream (an empty one without CUDA)."""
        torch = _torch()
        if torch is not None and torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record()
            return EventOverlap(event)
        return EventOverlap()

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of communication buffers epcomm's planner gives the first built backend for two objects of this
        shape (bf16 payload, top-k 8, as DeepEP sizes with bf16), rounded up to 128 bytes. Code that sizes
        ``num_rdma_bytes`` this way runs unchanged; the Buffer allocates what each shape needs itself."""
        backends = _C.built_backends()
        backend = backends[0] if backends else ""
        top_k = min(8, num_experts)
        p = plan(backend=backend, max_num_tokens=num_max_dispatch_tokens_per_rank, num_experts=num_experts,
                 experts_per_token=top_k, world_size=num_ranks, hidden_dim=hidden, hidden_dim_bytes=2 * hidden,
                 hidden_dim_scale_bytes=0)
        own = sum(b.bytes for b in p.buffers if b.owner != "outputs")
        return (2 * own + 127) // 128 * 128

    # -- low-latency mode ----------------------------------------------------------------------------------------
    def _object_for(self, key: Tuple[Any, ...], make: Callable[[], AllToAll]) -> AllToAll:
        entry = self._objects.get(key)
        if entry is None:  # collective: every rank dispatches the same shape at the same point
            entry = [make(), make(), 0]
            self._objects[key] = entry
        a2a = entry[entry[2]]
        entry[2] ^= 1
        return a2a

    def _alloc(self, like: Any, shape: Tuple[int, ...], dtype: str, zero: bool = False) -> Any:
        """A tensor of the framework and device of `like` (numpy: dtypes numpy lacks come as TypedArray)."""
        if is_torch_tensor(like):
            import torch

            tdtype = {"fp8_e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16,
                      "fp32": torch.float32, "int32": torch.int32}[dtype]
            return (torch.zeros if zero else torch.empty)(shape, dtype=tdtype, device=like.device)
        import numpy as np

        storage = {"fp8_e4m3": (np.uint8, True), "bf16": (np.uint16, True), "fp16": (np.float16, False),
                   "fp32": (np.float32, False), "int32": (np.int32, False)}[dtype]
        arr = np.zeros(shape, storage[0])
        return TypedArray(arr, dtype) if storage[1] else arr

    def low_latency_dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Any = None, dispatch_wait_recv_cost_stats: Any = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False
                             ) -> Tuple[Any, Any, LowLatencyHandle, EventOverlap, Optional[Callable[[], None]]]:
        """DeepEP's low_latency_dispatch. x: [m, H] bf16 (fp16 / fp32 also accepted), m <=
        num_max_dispatch_tokens_per_rank; topk_idx: [m, K] int64 (int32 / uint32 accepted), -1 = no expert.

        Returns (recv_x, recv_count, handle, event, hook): recv_x is ``(x_fp8 [L, T * W, H] fp8 e4m3, scales
        [L, T * W, H / 128] fp32, column-major in the last two dimensions)`` with use_fp8, else ``[L, T * W, H]`` in
        x's dtype; recv_count is ``[L]`` int32 (rows of each expert that hold tokens). With return_recv_hook the
        call only sends, and ``hook()`` receives (recv_x and recv_count are valid after it); otherwise hook is
        None. cumulative_local_expert_recv_stats ([L] int32), when given, gets recv_count added on receipt.

        use_fp8 with bf16 x: the dispatch itself casts (the fp8 codes and scales of per_token_cast_to_fp8, bit for
        bit; round_scale: power-of-two scales) on the backends whose dispatch casts (nvlink, host); on the others,
        and for fp16 / fp32 x, per_token_cast_to_fp8 runs before the dispatch."""
        if use_ue8m0:
            raise _unsupported("use_ue8m0 (scales packed as UE8M0)")
        xa = _array_of(x)
        if len(xa.shape) != 2:
            raise invalid_argument(f"x must have 2 dimensions [num_tokens, hidden], got shape {tuple(xa.shape)}")
        m, hidden = int(xa.shape[0]), int(xa.shape[1])
        idx_shape = tuple(_array_of(topk_idx).shape)
        if len(idx_shape) != 2:
            raise invalid_argument(f"topk_idx must have 2 dimensions [num_tokens, num_topk], got shape {idx_shape}")
        top_k = int(idx_shape[1])
        T, E, W = int(num_max_dispatch_tokens_per_rank), int(num_experts), self.group_size
        x_dtype = _dtype_name(x)
        cast = "none"
        if use_fp8:
            if hidden % FP8_BLOCK != 0:
                raise invalid_argument(f"use_fp8 needs hidden % {FP8_BLOCK} == 0, got hidden = {hidden}")
            payload_dtype, payload_bytes, scale_bytes = "fp8_e4m3", hidden, hidden // FP8_BLOCK * 4
            # bf16 x: the dispatch casts it itself (dispatch_cast, in the dispatch kernel on nvlink) where the
            # backend can; otherwise (other dtypes, backends without it) the cast runs first, here.
            if x_dtype == "bf16" and self._fused_cast is not False:
                cast = "fp8_blocks_pow2" if round_scale else "fp8_blocks"
        else:
            payload_dtype = x_dtype
            payload_bytes, scale_bytes = hidden * _C.dtype_size(x_dtype), 0

        def make(dispatch_cast: str) -> AllToAll:
            return AllToAll(T, E, top_k, self.rank, W, 1, hidden, payload_bytes, scale_bytes, backend=self.backend,
                            bootstrap=self._bootstrap, dispatch_cast=dispatch_cast)

        a2a = None
        if cast != "none":
            try:
                a2a = self._object_for((T, hidden, E, top_k, payload_dtype, cast), lambda: make(cast))
                self._fused_cast = True
            except _C.Error as e:
                # The backend does not cast in its dispatch (every rank learns it alike, at construction).
                if getattr(e, "code", "") != "unavailable" or self._fused_cast:
                    raise
                self._fused_cast = False
                cast = "none"
        if cast != "none":
            payload, scales = x, None
        else:
            payload, scales = per_token_cast_to_fp8(x, round_scale) if use_fp8 else (x, None)
            a2a = self._object_for((T, hidden, E, top_k, payload_dtype, "none"), lambda: make("none"))
        L, R = E // W, a2a.config.batched_rows_per_expert
        recv_x = self._alloc(x, (L, R, hidden), payload_dtype)
        recv_count = self._alloc(x, (L,), "int32", zero=True)
        recv_scales = None
        if use_fp8:
            # DeepEP's scales are column-major in their last two dimensions (TMA-friendly): a transposed view.
            cols = hidden // FP8_BLOCK
            base = self._alloc(x, (L, cols, R), "fp32")
            recv_scales = base.transpose(1, 2) if is_torch_tensor(base) else base.transpose(0, 2, 1)

        def receive() -> None:
            a2a.dispatch(recv_count, recv_x, recv_scales, payload, scales, topk_idx, None, do_send=False,
                         do_recv=True)
            _add_into(cumulative_local_expert_recv_stats, recv_count)

        if return_recv_hook:
            a2a.dispatch(recv_count, recv_x, recv_scales, payload, scales, topk_idx, None, do_send=True,
                         do_recv=False)
            hook: Optional[Callable[[], None]] = receive
        else:
            a2a.dispatch(recv_count, recv_x, recv_scales, payload, scales, topk_idx, None)
            _add_into(cumulative_local_expert_recv_stats, recv_count)
            hook = None
        handle = LowLatencyHandle(a2a, m, T, hidden, E)
        out_x = (recv_x, recv_scales) if use_fp8 else recv_x
        return out_x, recv_count, handle, self._event(async_finish, (x, topk_idx, recv_x, recv_count)), hook

    def low_latency_combine(self, x: Any, topk_idx: Any, topk_weights: Any, handle: LowLatencyHandle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Any = None,
                            combine_wait_recv_cost_stats: Any = None) -> Tuple[Any, EventOverlap, Any]:
        """DeepEP's low_latency_combine: ``combined_x[t] = sum_k topk_weights[t, k] * x[row of (t, k)]``, summed in
        fp32 and rounded once. x: [L, T * W, H] bf16 (fp16 / fp32 accepted), the experts' outputs in recv_x's rows;
        topk_idx / topk_weights ([m, K], fp32): the dispatch's. Returns (combined_x [m, H] in x's dtype, or `out`
        when given; event; hook, as in low_latency_dispatch)."""
        if use_logfmt:
            raise _unsupported("use_logfmt (LogFMT-compressed combine)")
        if zero_copy:
            raise _unsupported("zero_copy (get_next_low_latency_combine_buffer)")
        if not isinstance(handle, LowLatencyHandle):
            raise invalid_argument("handle must be the one low_latency_dispatch returned")
        a2a = handle.a2a
        if out is None:
            out = self._alloc(x, (handle.num_tokens, handle.hidden), _dtype_name(x))

        if return_recv_hook:
            a2a.combine(out, topk_idx, topk_weights, x, None, do_send=True, do_recv=False)

            def hook() -> None:
                a2a.combine(out, topk_idx, topk_weights, x, None, do_send=False, do_recv=True)
        else:
            a2a.combine(out, topk_idx, topk_weights, x, None)
            hook = None
        return out, self._event(async_finish, (x, topk_idx, topk_weights, out)), hook

    def _event(self, async_finish: bool, tensors: Tuple[Any, ...]) -> EventOverlap:
        if not async_finish:
            return EventOverlap()
        event = Buffer.capture()
        event.extra_tensors = tensors
        return event

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean: epcomm's buffers carry round counters, not zeroed flags."""

    def get_next_low_latency_combine_buffer(self, handle: Any) -> Any:
        raise _unsupported("get_next_low_latency_combine_buffer (zero-copy combine)")

    # -- DeepEP's normal (high-throughput) mode: not supported ---------------------------------------------------
    def get_dispatch_layout(self, *args: Any, **kwargs: Any) -> Any:
        raise _unsupported("DeepEP's normal mode (get_dispatch_layout)")

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        raise _unsupported("DeepEP's normal mode (dispatch); use low_latency_dispatch")

    def combine(self, *args: Any, **kwargs: Any) -> Any:
        raise _unsupported("DeepEP's normal mode (combine); use low_latency_combine")

    # -- lifetime -----------------------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Frees every object this Buffer created (collective on some backends). Idempotent."""
        for entry in self._objects.values():
            for a2a in entry[:2]:
                a2a.destroy()
        self._objects.clear()

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()
