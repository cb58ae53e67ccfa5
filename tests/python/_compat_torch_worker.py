"""Rank body of test_compat_torch.py: pplx-kernels' and DeepEP's calling patterns with torch tensors, on the host
backend with CPU tensors (no GPU) or on a GPU backend with CUDA tensors, rank r on GPU r % device_count (ranks share
the GPU of a one-GPU machine). One process group (gloo) per run; every scenario reports (name, rank, 'ok' |
traceback, stats)."""

import traceback


def _pplx_scenario(torch, epcomm, dist, rank, world, device, backend, internode, use_compile, out_dtype):
    """pplx-kernels' test, its calls verbatim: keyword arguments, the group named by group_name, uint32 indices and
    bound_m, out_tokens of max_num_tokens NaN rows, torch.compile around dispatch and combine when asked."""
    T, E, K, H, dp = 10, 8, 3, 512, 1
    gen = torch.Generator().manual_seed(123)
    ms = [int(torch.randint(1, T + 1, (1,), generator=gen)) for _ in range(world)]
    idx_all = [torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(m)]) for m in ms]
    w_all = [torch.rand(m, K, generator=gen) for m in ms]
    x_all = [torch.randn(m, H, generator=gen).to(torch.bfloat16) for m in ms]
    group = dist.new_group(list(range(world)), backend="gloo")
    ctor = epcomm.AllToAll.internode if internode else epcomm.AllToAll.intranode
    ata = ctor(max_num_tokens=T, num_experts=E, experts_per_token=K, rank=rank, world_size=world, dp_size=dp,
               hidden_dim=H, hidden_dim_bytes=H * 2, hidden_dim_scale_bytes=0, group_name=group.group_name,
               backend=backend)
    m = ms[rank]
    L = E // world
    expert_num_tokens = torch.empty(L, dtype=torch.int32, device=device)
    expert_x = torch.empty((L, T * world // dp, H), dtype=torch.bfloat16, device=device)
    bound_m = torch.tensor([m], dtype=torch.uint32, device=device)
    indices = idx_all[rank].to(device).to(torch.uint32)
    dispatch = torch.compile(ata.dispatch) if use_compile else ata.dispatch
    dispatch(out_expert_num_tokens=expert_num_tokens, out_expert_x=expert_x, out_expert_x_scale=None,
             dp_x=x_all[rank].to(device), dp_x_scale=None, indices=indices, bound_m=bound_m)
    if device != "cpu":
        torch.cuda.synchronize()
    rows = 0
    for le in range(L):
        e = rank * L + le
        want = [(s, t) for s in range(world) for t in range(ms[s]) if e in idx_all[s][t].tolist()]
        assert int(expert_num_tokens[le]) == len(want)
        for i, (s, t) in enumerate(want):
            assert torch.equal(expert_x[le, i].cpu(), x_all[s][t])
            rows += 1
    expert_y = expert_x.to(out_dtype) * 1.5
    y = torch.full((T, H), torch.nan, dtype=out_dtype, device=device)
    combine = torch.compile(ata.combine) if use_compile else ata.combine
    combine(out_tokens=y, indices=indices, weights=w_all[rank].to(device), expert_y=expert_y, bound_m=bound_m)
    if device != "cpu":
        torch.cuda.synchronize()
    ata.destroy()
    y = y.cpu()
    assert torch.isnan(y[m:].float()).all(), "rows at and past bound_m were written"
    tok = (x_all[rank].to(out_dtype) * 1.5).double()
    ref = w_all[rank].double().sum(dim=1, keepdim=True) * tok
    # One rounding of an fp32 sum: half an ulp of the output, plus the fp32 accumulation.
    eps = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[out_dtype]
    acc = (2 * K + 1) * 2.0 ** -24 * w_all[rank].double().abs().sum(dim=1, keepdim=True) * tok.abs()
    limit = (ref.abs() + acc) * eps + acc + 2.0 ** -24
    err = (y[:m].double() - ref).abs()
    assert bool((err <= limit).all()), f"max error {float(err.max())} beyond one rounding"
    return {"rows": rows, "tokens": m}


def _deepep_scenario(torch, epcomm, dist, rank, world, device, backend, use_fp8, hook, round_scale=False):
    """A DeepEP decode step with torch tensors: dispatch (fp8 or bf16), experts scale by (e + 1), combine. With fp8 the
    received codes and scales are those of per_token_cast_to_fp8 on the sender's device, bit for bit, whether the
    dispatch cast them (dispatch_cast: host, nvlink) or the cast ran before it."""
    from epcomm import _C, deep_ep

    T, E, K, H = 16, 8, 4, 256
    L = E // world
    gen = torch.Generator().manual_seed(11)
    ms = [int(torch.randint(1, T + 1, (1,), generator=gen)) for _ in range(world)]
    x_all = [(torch.randn(m, H, generator=gen) * 4).to(torch.bfloat16) for m in ms]
    idx_all = [torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(m)]).long() for m in ms]
    w_all = [torch.rand(m, K, generator=gen) for m in ms]
    group = dist.new_group(list(range(world)), backend="gloo")
    buf = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E),
                         low_latency_mode=True, num_qps_per_rank=L, backend=backend)
    x, idx, w = x_all[rank].to(device), idx_all[rank].to(device), w_all[rank].to(device)
    recv_x, recv_count, handle, event, recv_hook = buf.low_latency_dispatch(x, idx, T, E, use_fp8=use_fp8,
                                                                            round_scale=round_scale,
                                                                            return_recv_hook=hook)
    fused = handle.a2a.backend in _C.dispatch_cast_backends()
    want_cast = ("fp8_blocks_pow2" if round_scale else "fp8_blocks") if use_fp8 and fused else "none"
    assert handle.a2a.config.dispatch_cast.name == want_cast, (handle.a2a.backend, handle.a2a.config)
    if recv_hook is not None:
        recv_hook()
    event.current_stream_wait()
    if use_fp8:
        q, scales = recv_x
        assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (L, T * world, H)
        assert tuple(scales.shape) == (L, T * world, H // 128) and scales.stride(1) == 1  # column-major
        deq = q.float() * scales.repeat_interleave(128, dim=2)
    else:
        assert recv_x.dtype == torch.bfloat16 and tuple(recv_x.shape) == (L, T * world, H)
        deq = recv_x.float()
    assert recv_count.dtype == torch.int32 and tuple(recv_count.shape) == (L,)
    y = torch.zeros(L, T * world, H, dtype=torch.bfloat16, device=device)
    rows = 0
    for le in range(L):
        e = rank * L + le
        n = int(recv_count[le])
        want = [(s, t) for s in range(world) for t in range(ms[s]) if e in idx_all[s][t].tolist()]
        assert n == len(want)
        for i, (s, t) in enumerate(want):
            src = x_all[s][t].float()
            got = deq[le, i].cpu()
            if use_fp8:
                # The separate cast of the same token on the same kind of device: the same bits.
                q_src, s_src = deep_ep.per_token_cast_to_fp8(x_all[s][t:t + 1].to(device), round_scale=round_scale)
                assert torch.equal(q[le, i].view(torch.uint8).cpu(), q_src[0].view(torch.uint8).cpu()), (le, i)
                assert torch.equal(scales[le, i].cpu(), s_src[0].cpu()), (le, i)
                assert bool(((got - src).abs() <= src.abs() * 2.0 ** -4 + 1e-3).all())
            else:
                assert torch.equal(got, src)
            rows += 1
        y[le, :n] = (deq[le, :n] * (e + 1)).to(torch.bfloat16)
    combined, event, combine_hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook)
    if combine_hook is not None:
        combine_hook()
    # Reference: each (t, k) row as its owner computed it, summed in fp64.
    m = ms[rank]
    ref = torch.zeros(m, H, dtype=torch.float64)
    for t in range(m):
        xt = x_all[rank][t:t + 1]
        if use_fp8:
            qq, ss = deep_ep.per_token_cast_to_fp8(xt.to(device), round_scale=round_scale)
            xt_deq = qq.float().cpu() * ss.cpu().repeat_interleave(128, dim=1)
        else:
            xt_deq = xt.float()
        for k in range(K):
            e = int(idx_all[rank][t, k])
            ref[t] += float(w_all[rank][t, k]) * (xt_deq[0] * (e + 1)).to(torch.bfloat16).double()
    err = (combined.cpu().double() - ref).abs()
    assert bool((err <= ref.abs() * 2.0 ** -8 + 1e-4).all()), f"combine error {float(err.max())}"
    if use_fp8:
        # torch's cast (used for torch tensors, on this device) and the library's CPU cast (used for numpy) give the
        # same bits.
        import numpy as np

        q_t, s_t = deep_ep.per_token_cast_to_fp8(x_all[rank].to(device), round_scale=round_scale)
        q_n, s_n = deep_ep.per_token_cast_to_fp8(epcomm.typed(x_all[rank].view(torch.int16).numpy().view(np.uint16),
                                                              "bf16"), round_scale=round_scale)
        assert np.array_equal(q_t.view(torch.uint8).cpu().numpy(), q_n.array)
        assert np.array_equal(s_t.cpu().numpy(), s_n)
    buf.destroy()
    return {"rows": rows, "tokens": m}


SCENARIOS = [
    dict(name="pplx_intranode_bf16", fn="pplx", internode=False, use_compile=False, out="bfloat16"),
    dict(name="pplx_internode_fp16", fn="pplx", internode=True, use_compile=False, out="float16"),
    dict(name="pplx_compile_bf16", fn="pplx", internode=False, use_compile=True, out="bfloat16"),
    dict(name="deepep_fp8", fn="deepep", use_fp8=True, hook=False),
    dict(name="deepep_bf16_hook", fn="deepep", use_fp8=False, hook=True),
    dict(name="deepep_fp8_round_scale_hook", fn="deepep", use_fp8=True, hook=True, round_scale=True),
]


def run(rank, world, port, device, results, backend=None, env=None, dump_after_s=400):
    """One rank: every scenario on `backend` (default "host" for device "cpu", "auto" for "cuda"), with `env` set
    before epcomm loads."""
    import datetime
    import faulthandler
    import os
    import sys

    faulthandler.dump_traceback_later(dump_after_s, repeat=False, file=sys.stderr)
    try:
        os.environ.setdefault("EPCOMM_FABRIC_PROVIDER", "tcp")
        os.environ.update(env or {})
        import torch
        import torch.distributed as dist

        import epcomm

        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = f"cuda:{torch.cuda.current_device()}"
        backend = backend or ("host" if device == "cpu" else "auto")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
    except BaseException:  # noqa: BLE001
        results.put(("<setup>", rank, traceback.format_exc(), {}))
        return
    for sc in SCENARIOS:
        try:
            if sc["fn"] == "pplx":
                stats = _pplx_scenario(torch, epcomm, dist, rank, world, device, backend, sc["internode"],
                                       sc["use_compile"], getattr(torch, sc["out"]))
            else:
                stats = _deepep_scenario(torch, epcomm, dist, rank, world, device, backend, sc["use_fp8"],
                                         sc["hook"], sc.get("round_scale", False))
            results.put((sc["name"], rank, "ok", stats))
        except BaseException:  # noqa: BLE001
            results.put((sc["name"], rank, traceback.format_exc(), {}))
    dist.destroy_process_group()
    results.close()
    results.join_thread()
    os._exit(0)  # skip interpreter teardown of the CUDA state (an NVSHMEM runtime lives until the process ends)
