"""One rank of the torch tests (spawned). Runs every scenario in one process pair and reports per scenario.

Each rank generates every rank's inputs on the CPU from a seed, runs its own dispatch/combine with torch tensors and
compares with the C++ reference (epcomm._C.reference_*) run on CPU copies. DEVICE = "cuda": a GPU backend (nvlink,
nvshmem or proxy) on CUDA tensors, rank r on device r % device_count (test_torch_gpu.py: ranks share the GPU of a
one-GPU machine); "cpu": the host backend on CPU tensors (test_torch_host.py: the same scenarios but the CUDA graph
one, so the torch integration is exercised without a GPU).
"""

import os
import traceback
from typing import Any, Dict, List, Optional

SCENARIOS: List[Dict[str, Any]] = [
    # Every dispatch dtype with several combine (expert_y, out_tokens) dtype pairs.
    dict(name="bf16", x="bf16", pairs=[("bf16", "bf16"), ("fp16", "fp32"), ("fp32", "bf16")]),
    dict(name="fp8_scale", x="fp8_e4m3", scale=True, pairs=[("bf16", "bf16"), ("fp32", "fp16"), ("fp16", "bf16")]),
    dict(name="fp16_torch_group_bootstrap", x="fp16", torch_bootstrap=True,
         pairs=[("fp16", "fp16"), ("bf16", "fp32")]),
    dict(name="fp32_int64", x="fp32", index="int64", pairs=[("fp32", "fp32")]),
    dict(name="dp2_bf16", x="bf16", dp=2, pairs=[("bf16", "bf16")]),
    dict(name="packed_pad_fp8", x="fp8_e4m3", scale=True, layout="packed", padding=16, pairs=[("bf16", "bf16")]),
    dict(name="bound_m", x="bf16", bound=True, pairs=[("bf16", "bf16"), ("bf16", "fp32")]),
    dict(name="split_send_recv_accumulate", x="bf16", split=True, accumulate=True, pairs=[("bf16", "fp32")]),
    dict(name="compile_fullgraph", kind="compile"),
    dict(name="cuda_graph", kind="graph"),
]

E, K, H, T = 16, 4, 256, 32
DEVICE = "cuda"  # set by run()
BACKEND = "nvlink"  # set by run()


def _device(torch, rank):
    # The device the library picks for this rank (EPCOMM_LOCAL_RANK unset): rank % device_count.
    return torch.device("cuda", rank % torch.cuda.device_count()) if DEVICE == "cuda" else torch.device("cpu")


def _sync(torch):
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _dtype(torch, name):
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn,
            "int32": torch.int32, "int64": torch.int64}[name]


def _item(name: str) -> int:
    return {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1}[name]


class Inputs:
    """One round's CPU inputs of one DP group."""

    def __init__(self, torch, sc, rnd: int, group: int):
        g = torch.Generator().manual_seed(1000 * rnd + group + 7)
        self.m = T - (group + rnd) % 3
        x = torch.randn(self.m, H, generator=g)
        self.x = x.to(_dtype(torch, sc.get("x", "bf16")))
        self.scale = torch.rand(self.m, H // 128, generator=g) if sc.get("scale") else None
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(self.m)])
        idx[torch.rand(idx.shape, generator=g) < 0.1] = -1
        self.indices = idx.to(_dtype(torch, sc.get("index", "int32")))
        self.weights = torch.rand(self.m, K, generator=g)
        self.bound = self.m - 1 - (rnd + group) % 3 if sc.get("bound") else self.m
        self.out_init = torch.randn(self.m, H, generator=g)


def _reference(epcomm, cfg, W, D, groups, sc, ex_dtype, ys, out_dtype, accumulate):
    """Reference dispatch + combine for every rank on CPU; returns per-rank dicts."""
    from epcomm._all_to_all import _prepare

    import torch

    disp, comb = [], []
    for r in range(W):
        gi = groups[r // D]
        num = torch.zeros(cfg.num_local_experts, dtype=torch.int32)
        shape = ((cfg.num_local_experts, cfg.batched_rows_per_expert) if cfg.layout == epcomm.Layout.batched
                 else (cfg.packed_rows,))
        ex = torch.zeros(*shape, H * ex_dtype.itemsize, dtype=torch.uint8).view(ex_dtype)  # no fp8 fill needed
        exs = torch.zeros(*shape, H // 128) if gi.scale is not None else None
        bm = torch.tensor([gi.bound], dtype=torch.int32) if sc.get("bound") else None
        disp.append(dict(out_expert_num_tokens=num, out_expert_x=ex, out_expert_x_scale=exs, dp_x=gi.x,
                         dp_x_scale=gi.scale, indices=gi.indices, bound_m=bm))
    epcomm._C.reference_dispatch(cfg, [{k: _prepare(v) for k, v in d.items()} for d in disp])
    if ys is not None:
        for r in range(W):
            gi = groups[r // D]
            out = gi.out_init.to(out_dtype).clone()
            bm = disp[r]["bound_m"]
            comb.append(dict(out_tokens=out, indices=gi.indices, weights=gi.weights, expert_y=ys[r], bound_m=bm))
        epcomm._C.reference_combine(
            cfg, [dict({k: _prepare(v) for k, v in c.items()}, accumulate=accumulate) for c in comb])
    return disp, comb


def _valid_rows(epcomm, cfg, counts) -> List[range]:
    rows, offset = [], 0
    for e, n in enumerate(counts):
        n = int(n)
        if cfg.layout == epcomm.Layout.batched:
            rows.append(range(e * cfg.batched_rows_per_expert, e * cfg.batched_rows_per_expert + n))
        else:
            rows.append(range(offset, offset + n))
            offset += (n + cfg.expert_padding - 1) // cfg.expert_padding * cfg.expert_padding
    return rows


def _flat(t):
    return t.reshape(-1, t.shape[-1])


def _check_dispatch(epcomm, cfg, num, ex, exs, want, label):
    import torch

    num = num.cpu()
    assert torch.equal(num, want["out_expert_num_tokens"]), f"{label}: counts {num} != {want['out_expert_num_tokens']}"
    got_x = _flat(ex.cpu()).view(torch.uint8)
    want_x = _flat(want["out_expert_x"]).view(torch.uint8)
    for e, rows in enumerate(_valid_rows(epcomm, cfg, num)):
        idx = torch.tensor(list(rows), dtype=torch.long)
        assert torch.equal(got_x[idx], want_x[idx]), f"{label}: out_expert_x of local expert {e} differs"
        if exs is not None:
            assert torch.equal(_flat(exs.cpu())[idx], _flat(want["out_expert_x_scale"])[idx]), f"{label}: scales"
    return sum(len(r) for r in _valid_rows(epcomm, cfg, num))


def _check_combine(out, want, init, bound, label, y_dtype):
    import torch

    out = out.cpu().float()
    # The reference sums in fp32 and rounds once. A backend may round earlier, within the contract: nvlink sends each
    # expert rank's fp32 partial sum in expert_y's dtype (docs/nvlink.md), so fp32 outputs from bf16/fp16 expert
    # outputs carry that dtype's rounding; only fp32 in and out is held to fp32 precision.
    tol = 1e-5 if want.dtype == torch.float32 and y_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:bound], want[:bound].float(), rtol=tol, atol=tol, msg=lambda m: f"{label}: {m}")
    assert torch.equal(out[bound:], init[bound:].float()), f"{label}: rows >= bound_m were written"


def _make(epcomm, torch, rank, W, sc, group):
    x = sc.get("x", "bf16")
    return epcomm.AllToAll(T, E, K, rank, W, sc.get("dp", 1), H, H * _item(x), H // 128 * 4 if sc.get("scale") else 0,
                           expert_padding=sc.get("padding", 1), layout=sc.get("layout", "batched"),
                           backend=BACKEND,
                           group=None if sc.get("torch_bootstrap") else group,
                           bootstrap=epcomm.TorchGroupBootstrap(group) if sc.get("torch_bootstrap") else None)


def _run_plain(epcomm, torch, rank, W, sc, group) -> Dict[str, int]:
    a2a = _make(epcomm, torch, rank, W, sc, group)
    D = sc.get("dp", 1)
    ref_cfg = epcomm.make_config(T, E, K, 0, W, D, H, a2a.config.hidden_dim_bytes, a2a.config.hidden_dim_scale_bytes,
                                 a2a.config.expert_padding, sc.get("layout", "batched"))
    stats = {"rows": 0, "combines": 0}
    dev = _device(torch, rank)
    for rnd, (y_name, out_name) in enumerate(sc["pairs"]):
        groups = [Inputs(torch, sc, rnd, g) for g in range(W // D)]
        mine = groups[rank // D]
        x_dtype = _dtype(torch, sc.get("x", "bf16"))
        num, ex, exs = a2a.alloc_dispatch_outputs(x_dtype)
        bound_m = torch.tensor([mine.bound], dtype=torch.int32, device=dev) if sc.get("bound") else None
        args = (num, ex, exs, mine.x.to(dev), mine.scale.to(dev) if mine.scale is not None else None,
                mine.indices.to(dev), bound_m)
        if sc.get("split"):
            a2a.dispatch(*args, do_send=True, do_recv=False)
            a2a.dispatch(*args, do_send=False, do_recv=True)
        else:
            a2a.dispatch(*args)
        # Every rank's expert outputs, generated identically everywhere.
        ys = []
        for r in range(W):
            gy = torch.Generator().manual_seed(99 + 10 * rnd + r)
            shape = tuple(ex.shape[:-1]) + (H,)
            ys.append(torch.randn(*shape, generator=gy).to(_dtype(torch, y_name)))
        out_dtype = _dtype(torch, out_name)
        disp, comb = _reference(epcomm, ref_cfg, W, D, groups, sc, x_dtype, ys, out_dtype, sc.get("accumulate", False))
        _sync(torch)
        label = f"{sc['name']} round {rnd} rank {rank}"
        stats["rows"] += _check_dispatch(epcomm, a2a.config, num, ex, exs, disp[rank], label)
        out = mine.out_init.to(out_dtype).to(dev)
        cargs = (out, mine.indices.to(dev), mine.weights.to(dev), ys[rank].to(dev), bound_m)
        acc = sc.get("accumulate", False)
        if sc.get("split"):
            a2a.combine(*cargs, do_send=True, do_recv=False, accumulate=acc)
            a2a.combine(*cargs, do_send=False, do_recv=True, accumulate=acc)
        else:
            a2a.combine(*cargs, accumulate=acc)
        _sync(torch)
        _check_combine(out, comb[rank]["out_tokens"], mine.out_init.to(out_dtype), mine.bound, label,
                       ys[rank].dtype)
        stats["combines"] += 1
    a2a.destroy()
    return stats


def _moe_layer(torch, a2a, w):
    """A small MoE layer: dispatch, one matmul per local expert, combine."""

    def forward(x, indices, weights, bound_m, num, ex, out):
        a2a.dispatch(num, ex, None, x, None, indices, bound_m)
        y = torch.bmm(ex, w)
        a2a.combine(out, indices, weights, y, bound_m)
        return out

    return forward


def _run_compile(epcomm, torch, rank, W, sc, group) -> Dict[str, int]:
    sc = dict(sc, x="bf16")
    a2a = _make(epcomm, torch, rank, W, sc, group)
    dev = _device(torch, rank)
    L = a2a.config.num_local_experts
    w = (torch.randn(L, H, H, generator=torch.Generator().manual_seed(5 + rank)) / H ** 0.5).bfloat16().to(dev)
    layer = _moe_layer(torch, a2a, w)
    compiled = torch.compile(layer, fullgraph=True)
    for rnd in range(3):
        gi = Inputs(torch, dict(x="bf16", bound=True), rnd, 0 if rank == 0 else 1)
        args = [gi.x.to(dev), gi.indices.to(dev), gi.weights.to(dev),
                torch.tensor([gi.bound], dtype=torch.int32, device=dev)]
        outs = []
        for fn in (layer, compiled):
            num, ex, _ = a2a.alloc_dispatch_outputs(torch.bfloat16)
            out = torch.zeros(gi.m, H, dtype=torch.bfloat16, device=dev)
            fn(*args, num, ex, out)
            outs.append(out)
        _sync(torch)
        torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"compiled vs eager, round {rnd}: {m}")
        assert outs[0][: gi.bound].abs().sum() > 0, "eager output is all zeros"
    # fullgraph=True raises on any graph break, so reaching here means dispatch/combine stayed in the graph.
    a2a.destroy()
    return {"rounds": 3}


def _run_graph(epcomm, torch, rank, W, sc, group) -> Dict[str, int]:
    sc = dict(sc, x="bf16", bound=True)
    a2a = _make(epcomm, torch, rank, W, sc, group)
    dev = _device(torch, rank)
    ref_cfg = epcomm.make_config(T, E, K, 0, W, 1, H, 2 * H, 0)
    # Static buffers: the graph reads and writes these; replays change their contents, never their addresses.
    x = torch.zeros(T, H, dtype=torch.bfloat16, device=dev)
    indices = torch.full((T, K), -1, dtype=torch.int32, device=dev)
    weights = torch.zeros(T, K, device=dev)
    bound_m = torch.tensor([T], dtype=torch.int32, device=dev)
    num, ex, _ = a2a.alloc_dispatch_outputs(torch.bfloat16)
    y = torch.zeros(*ex.shape[:-1], H, dtype=torch.bfloat16, device=dev)
    out = torch.zeros(T, H, dtype=torch.bfloat16, device=dev)

    def step():
        a2a.dispatch(num, ex, None, x, None, indices, bound_m)
        torch.mul(ex, 2.0, out=y)
        a2a.combine(out, indices, weights, y, bound_m)

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        step()  # warm-up outside capture (allocations, lazy init)
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for rnd in range(4):
        groups = [Inputs(torch, dict(x="bf16", bound=True), rnd, g) for g in range(W)]
        mine = groups[rank]
        x.zero_()
        indices.fill_(-1)
        weights.zero_()
        x[: mine.m].copy_(mine.x)
        indices[: mine.m].copy_(mine.indices)
        weights[: mine.m].copy_(mine.weights)
        bound_m.fill_(mine.bound)
        out.zero_()
        graph.replay()
        _sync(torch)
        # Reference with the static shapes the graph saw: m = T rows, masked past m, bound_m as replayed.
        for g in groups:
            g.x = torch.cat([g.x, torch.zeros(T - g.m, H, dtype=torch.bfloat16)])
            g.indices = torch.cat([g.indices, torch.full((T - g.m, K), -1, dtype=torch.int32)])
            g.weights = torch.cat([g.weights, torch.zeros(T - g.m, K)])
            g.out_init = torch.zeros(T, H)
            g.m = T
        disp, _ = _reference(epcomm, ref_cfg, W, 1, groups, dict(bound=True), torch.bfloat16, None, None, False)
        label = f"cuda graph replay {rnd} rank {rank}"
        _check_dispatch(epcomm, a2a.config, num, ex, None, disp[rank], label)
        ys = [(_flat(d["out_expert_x"].float() * 2).bfloat16()).reshape(d["out_expert_x"].shape) for d in disp]
        _, comb = _reference(epcomm, ref_cfg, W, 1, groups, dict(bound=True), torch.bfloat16, ys, torch.bfloat16,
                             False)
        _check_combine(out, comb[rank]["out_tokens"], torch.zeros(T, H), mine.bound, label, torch.bfloat16)
    a2a.destroy()
    return {"replays": 4}


def _progress_log(rank: int, label: str, dump_after_s: float):
    """Progress lines on stderr (pytest shows them for a failed test) and, when TORCH_WORKER_LOG_DIR is set, in a file
    there; a rank still running after `dump_after_s` dumps every thread's Python stack to the same places
    (faulthandler)."""
    import faulthandler
    import sys
    import time

    start = time.monotonic()
    sinks = [sys.stderr]
    log_dir = os.environ.get("TORCH_WORKER_LOG_DIR")
    if log_dir:
        sinks.append(open(os.path.join(log_dir, f"torch_worker_{label}_rank{rank}.log"), "w", buffering=1))
    faulthandler.enable(file=sys.stderr)  # a crash (SIGSEGV, SIGABRT) prints the Python stack before the process dies
    faulthandler.dump_traceback_later(dump_after_s, repeat=False, file=sinks[-1])

    def log(msg: str) -> None:
        for f in sinks:
            print(f"[torch worker {label} rank {rank} +{time.monotonic() - start:.1f}s] {msg}", file=f, flush=True)

    return log


def scenarios(device: str) -> List[Dict[str, Any]]:
    """The scenarios that apply to `device` ("cuda" or "cpu": no CUDA graphs on the CPU)."""
    return [sc for sc in SCENARIOS if device == "cuda" or sc.get("kind") != "graph"]


def run(rank: int, world_size: int, port: int, names: Optional[List[str]], results, device: str = "cuda",
        backend: Optional[str] = None, env: Optional[Dict[str, str]] = None, dump_after_s: float = 90) -> None:
    """Runs the scenarios of `device` (all when names is None) on `backend` (default: nvlink on "cuda", host on
    "cpu") with `env` set before epcomm loads; puts (name, rank, 'ok'|traceback, stats) per scenario."""
    global DEVICE, BACKEND
    DEVICE = device
    BACKEND = backend or ("nvlink" if device == "cuda" else "host")
    os.environ.update(env or {})
    provider = (env or {}).get("EPCOMM_FABRIC_PROVIDER")
    log = _progress_log(rank, f"{BACKEND}-{provider}" if provider else BACKEND, dump_after_s)
    try:
        log("importing torch and epcomm")
        import torch
        import torch.distributed as dist

        import epcomm

        if DEVICE == "cuda":
            torch.cuda.set_device(_device(torch, rank))
        log("init_process_group(gloo)")
        import datetime

        # Bounded collectives: a rank that failed a scenario must not leave the other waiting for 30 minutes (but
        # ranks taking turns on one GPU, each compiling its own graphs, may reach a barrier minutes apart).
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=180))
        group = dist.group.WORLD
        log(f"process group ready; backend {BACKEND}" + (f" on {_device(torch, rank)}" if DEVICE == "cuda" else ""))
    except BaseException:  # noqa: BLE001
        results.put(("<setup>", rank, traceback.format_exc(), {}))
        return
    for sc in scenarios(DEVICE):
        if names is not None and sc["name"] not in names:
            continue
        kind = sc.get("kind", "plain")
        fn = {"plain": _run_plain, "compile": _run_compile, "graph": _run_graph}[kind]
        log(f"scenario {sc['name']}")
        try:
            stats = fn(epcomm, torch, rank, world_size, sc, group)
            results.put((sc["name"], rank, "ok", stats))
        except BaseException:  # noqa: BLE001
            results.put((sc["name"], rank, traceback.format_exc(), {}))
        log(f"scenario {sc['name']} done")
        dist.barrier()
    dist.destroy_process_group()
    results.close()
    results.join_thread()
    os._exit(0)  # skip interpreter teardown of CUDA/NCCL state in the child


def run_pair(device: str, world: int, port: int, deadline_s: float = 300, backend: Optional[str] = None,
             env: Optional[Dict[str, str]] = None) -> Dict[str, list]:
    """Runs every scenario of `device` once in `world` spawned processes on `backend` with `env` (see run()); maps
    name -> [(rank, status, stats)]. A rank that dies (crash, abort) ends the wait at once with its exit code under
    the name "<setup>"."""
    import multiprocessing as mp
    import queue
    import time

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    dump_after_s = max(90.0, deadline_s - 30)  # the stacks of a hung rank, before the deadline gives up on it
    procs = [ctx.Process(target=run, args=(r, world, port, None, results, device, backend, env, dump_after_s),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    count = len(scenarios(device))
    out: Dict[str, list] = {}
    deadline = time.monotonic() + deadline_s  # all scenarios together; a hung rank fails the ones it did not report
    for _ in range(count * world):
        got = None
        while got is None and time.monotonic() < deadline:
            try:
                got = results.get(timeout=2)
            except queue.Empty:
                reported = [sum(1 for v in out.values() for rank, _, _ in v if rank == r) for r in range(world)]
                dead = [f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(procs)
                        if not p.is_alive() and reported[r] < count]
                if dead:
                    out.setdefault("<setup>", []).append((-1, "; ".join(dead) + " before reporting every scenario "
                                                          f"(reported so far: {sorted(out)})", {}))
                    break
        if got is None:
            break
        name, rank, status, stats = got
        out.setdefault(name, []).append((rank, status, stats))
        if name == "<setup>":
            break
    import _mp_util

    _mp_util.reap(procs, 30)
    return out


def check_scenario(results: Dict[str, list], name: str, world: int) -> None:
    """Fails (pytest) unless every rank reported scenario `name` as ok."""
    import pytest

    if "<setup>" in results:
        pytest.fail("worker setup failed:\n" + "\n".join(s for _, s, _ in results["<setup>"]))
    got = results.get(name)
    assert got is not None and len(got) == world, f"scenario {name}: results {got} (a rank hung or died)"
    errors = [f"rank {rank}:\n{status}" for rank, status, _ in got if status != "ok"]
    assert not errors, "\n".join(errors)
