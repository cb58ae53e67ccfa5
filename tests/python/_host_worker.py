"""One rank of the multi-process host-backend tests (spawned; must stay importable without pytest).

Every process generates every rank's inputs from a seed, runs its own dispatch/combine on the host backend,
runs the C++ reference (epcomm._C.reference_dispatch / reference_combine) for all ranks, and compares its own
outputs with the reference's. DP groups hold identical tokens, as the contract requires.
"""

import traceback
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np


@dataclass
class Case:
    name: str
    world_size: int
    dp_size: int = 1
    num_experts: int = 8
    experts_per_token: int = 3
    hidden_dim: int = 64
    max_num_tokens: int = 12
    x_dtype: str = "bf16"  # bf16 | fp8_e4m3 | fp32
    with_scale: bool = False
    y_dtype: str = "bf16"
    out_dtype: str = "bf16"
    index_dtype: str = "int32"  # int32 | uint32 | int64
    layout: str = "batched"
    expert_padding: int = 1
    use_bound_m: bool = False
    split_send_recv: bool = False
    accumulate: bool = False
    masked_fraction: float = 0.15
    rounds: int = 2
    bootstrap: str = "tcp"  # tcp | callback | env
    empty_groups: List[int] = field(default_factory=list)  # DP groups with no tokens (m = 0) in every round
    seed: int = 1234
    tags: List[str] = field(default_factory=list)


_STORAGE = {"bf16": np.uint16, "fp16": np.float16, "fp32": np.float32, "fp8_e4m3": np.uint8}
_ITEM = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1}


def _wrap(arr: np.ndarray, dtype: str):
    import epcomm

    return epcomm.typed(arr, dtype) if dtype in ("bf16", "fp8_e4m3") else arr


def _to_f32(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def _random_values(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    vals = rng.standard_normal(shape).astype(np.float32)
    if dtype == "bf16":
        return (vals.view(np.uint32) >> 16).astype(np.uint16)
    if dtype == "fp8_e4m3":
        # Bit patterns of finite e4m3 values (0x7f / 0xff are NaN); dispatch moves bytes, never reads them.
        b = rng.integers(0, 0x7F, size=shape, dtype=np.uint8)
        return b | (rng.integers(0, 2, size=shape, dtype=np.uint8) << 7)
    return vals.astype(_STORAGE[dtype])


def _indices(rng: np.random.Generator, m: int, case: Case) -> np.ndarray:
    if m == 0:
        idx = np.zeros((0, case.experts_per_token), np.int64)
    else:
        idx = np.stack([rng.permutation(case.num_experts)[: case.experts_per_token] for _ in range(m)]).astype(np.int64)
    mask = rng.random(idx.shape) < case.masked_fraction
    idx[mask] = -1
    if case.index_dtype == "uint32":
        return idx.astype(np.int64).astype(np.uint32)  # -1 -> 0xFFFFFFFF
    return idx.astype(case.index_dtype)


class _Inputs:
    """One round's inputs for one DP group (identical on its D ranks)."""

    def __init__(self, case: Case, rnd: int, group: int):
        rng = np.random.default_rng([case.seed, rnd, group])
        self.m = 0 if group in case.empty_groups else case.max_num_tokens - (group + rnd) % 3
        # hidden_dim_bytes = hidden_dim * itemsize: the payload has hidden_dim elements of x_dtype.
        self.x = _random_values(rng, (self.m, case.hidden_dim), case.x_dtype)
        self.scale_cols = case.hidden_dim // 32 if case.with_scale else 0
        self.x_scale = rng.random((self.m, self.scale_cols), dtype=np.float32) if case.with_scale else None
        self.indices = _indices(rng, self.m, case)
        self.weights = rng.random((self.m, case.experts_per_token), dtype=np.float32)
        bound = max(0, self.m - (1 + (rnd + group) % 2)) if case.use_bound_m else self.m
        self.bound_m = np.array([bound], dtype=np.int32)
        self.out_init = _random_values(rng, (self.m, case.hidden_dim), case.out_dtype)
        if self.m == 0:
            # As frameworks may hand over a 0-row tensor: strides (0, 0).
            bare = lambda a: None if a is None else np.lib.stride_tricks.as_strided(a, a.shape, (0, 0))  # noqa: E731
            self.x, self.x_scale, self.indices = bare(self.x), bare(self.x_scale), bare(self.indices)
            self.weights, self.out_init = bare(self.weights), bare(self.out_init)


def hidden_dim_bytes(case: Case) -> int:
    return case.hidden_dim * _ITEM[case.x_dtype]


class _CallbackBootstrap:
    """A Python-level bootstrap (exercises epcomm's callback path) carried by a real TCP bootstrap."""

    def __init__(self, inner):
        self.inner = inner

    def all_gather(self, data: bytes) -> bytes:
        return self.inner.all_gather(data)

    def barrier(self) -> None:
        self.inner.barrier()

    def broadcast(self, data: bytes, root: int) -> bytes:
        return self.inner.broadcast(data, root)


def _valid_rows(cfg, counts: np.ndarray) -> List[np.ndarray]:
    """Row indices (into the flattened expert dimension) that hold received tokens, per local expert."""
    import epcomm

    rows = []
    offset = 0
    for e, n in enumerate(counts):
        if cfg.layout == epcomm.Layout.batched:
            base = e * cfg.batched_rows_per_expert
        else:
            base = offset
            pad = cfg.expert_padding
            offset += (int(n) + pad - 1) // pad * pad
        rows.append(np.arange(base, base + int(n)))
    return rows


def _flat(arr) -> np.ndarray:
    arr = arr.array if hasattr(arr, "array") else arr
    return arr.reshape(-1, arr.shape[-1])


def run_rank(rank: int, case: Case, address: str, results) -> None:
    import os

    # CI machines are small and shared: give the rendezvous and the waits room when 4 ranks start under load.
    # (Read by epcomm on first use, so it must be set before the first epcomm call in this process.)
    os.environ.setdefault("EPCOMM_TIMEOUT_MS", "60000")
    try:
        results.put(("ok", rank, _run(rank, case, address)))
    except BaseException:  # noqa: BLE001 -- report everything to the parent
        results.put(("error", rank, traceback.format_exc()))


def _run(rank: int, case: Case, address: str) -> Dict[str, int]:
    import epcomm
    from epcomm import _C

    W, D = case.world_size, case.dp_size
    bootstrap = address
    if case.bootstrap == "env":
        import os

        os.environ.update(EPCOMM_BOOTSTRAP=address, EPCOMM_RANK=str(rank), EPCOMM_WORLD_SIZE=str(W))
        bootstrap = "env"
    elif case.bootstrap == "callback":
        bootstrap = _CallbackBootstrap(_C.tcp_bootstrap(address, rank, W))
    a2a = epcomm.AllToAll(case.max_num_tokens, case.num_experts, case.experts_per_token, rank, W, D, case.hidden_dim,
                          hidden_dim_bytes(case), case.hidden_dim // 32 * 4 if case.with_scale else 0,
                          expert_padding=case.expert_padding, layout=case.layout, backend="host",
                          bootstrap=bootstrap)
    assert a2a.backend == "host", a2a.backend
    cfg = a2a.config
    ref_cfg = epcomm.make_config(case.max_num_tokens, case.num_experts, case.experts_per_token, 0, W, D,
                                 case.hidden_dim, hidden_dim_bytes(case), cfg.hidden_dim_scale_bytes,
                                 case.expert_padding, case.layout)
    checked = {"rows": 0, "tokens": 0}
    for rnd in range(case.rounds):
        groups = [_Inputs(case, rnd, g) for g in range(W // D)]
        mine = groups[rank // D]
        bound = mine.bound_m if case.use_bound_m else None

        # --- dispatch on the backend ---
        num, ex, exs = a2a.alloc_dispatch_outputs(case.x_dtype)
        args = (num, ex, exs, _wrap(mine.x, case.x_dtype), mine.x_scale, mine.indices, bound)
        if case.split_send_recv:
            a2a.dispatch(*args, do_send=True, do_recv=False)
            a2a.dispatch(*args, do_send=False, do_recv=True)
        else:
            a2a.dispatch(*args)

        # --- reference dispatch for every rank ---
        ref = []
        for r in range(W):
            g = groups[r // D]
            rnum, rex, rexs = a2a.alloc_dispatch_outputs(case.x_dtype)
            ref.append(dict(out_expert_num_tokens=rnum, out_expert_x=rex, out_expert_x_scale=rexs,
                            dp_x=_wrap(g.x, case.x_dtype), dp_x_scale=g.x_scale, indices=g.indices,
                            bound_m=g.bound_m if case.use_bound_m else None))
        _C.reference_dispatch(ref_cfg, ref)
        want = ref[rank]
        np.testing.assert_array_equal(num, want["out_expert_num_tokens"], err_msg=f"rank {rank} round {rnd}: counts")
        for e, rows in enumerate(_valid_rows(cfg, num)):
            np.testing.assert_array_equal(_flat(ex)[rows], _flat(want["out_expert_x"])[rows],
                                          err_msg=f"rank {rank} round {rnd}: out_expert_x of local expert {e}")
            if exs is not None:
                np.testing.assert_array_equal(_flat(exs)[rows], _flat(want["out_expert_x_scale"])[rows],
                                              err_msg=f"rank {rank} round {rnd}: out_expert_x_scale, expert {e}")
            checked["rows"] += len(rows)

        # --- combine: every rank's experts produce deterministic outputs ---
        ys = []
        for r in range(W):
            rng = np.random.default_rng([case.seed, rnd, 1000 + r])
            y = a2a.alloc_expert_y(case.y_dtype)
            arr = y.array if hasattr(y, "array") else y
            arr[...] = _random_values(rng, arr.shape, case.y_dtype)
            ys.append(y)
        out = _wrap(mine.out_init.copy(), case.out_dtype)
        cargs = (out, mine.indices, mine.weights, ys[rank], bound)
        if case.split_send_recv:
            a2a.combine(*cargs, do_send=True, do_recv=False, accumulate=case.accumulate)
            a2a.combine(*cargs, do_send=False, do_recv=True, accumulate=case.accumulate)
        else:
            a2a.combine(*cargs, accumulate=case.accumulate)
        refc = []
        for r in range(W):
            g = groups[r // D]
            refc.append(dict(out_tokens=_wrap(g.out_init.copy(), case.out_dtype), indices=g.indices,
                             weights=g.weights, expert_y=ys[r], bound_m=g.bound_m if case.use_bound_m else None,
                             accumulate=case.accumulate))
        _C.reference_combine(ref_cfg, refc)
        got = _to_f32(_flat(out), case.out_dtype)
        exp = _to_f32(_flat(refc[rank]["out_tokens"]), case.out_dtype)
        tol = 1e-5 if case.out_dtype == "fp32" else 2e-2
        np.testing.assert_allclose(got, exp, rtol=tol, atol=tol, err_msg=f"rank {rank} round {rnd}: out_tokens")
        b = int(mine.bound_m[0]) if case.use_bound_m else mine.m
        # Rows at or past bound_m are never written.
        np.testing.assert_array_equal(_flat(out)[b:], mine.out_init[b:], err_msg=f"rank {rank}: rows >= bound_m")
        checked["tokens"] += b
    a2a.synchronize()
    a2a.destroy()
    return checked
