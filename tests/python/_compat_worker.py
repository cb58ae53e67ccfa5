"""Rank bodies of test_compat.py, run in spawned processes on the host backend with numpy arrays: pplx-kernels'
calling patterns, the combine's rounding against fp64, and a DeepEP-style decode step. Each returns a small dict of
what it compared (so the test can assert that something was)."""

import traceback

import numpy as np

import _numerics as nx

NAN_BF16 = 0x7FC0


def _run(body, rank, args, results):
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(150, repeat=False, file=sys.stderr)  # a hang shows where it is
    try:
        results.put(("ok", rank, body(rank, *args)))
    except BaseException:  # noqa: BLE001
        results.put(("error", rank, traceback.format_exc()))


# ---- pplx-kernels' calling patterns -------------------------------------------------------------------------------

def pplx_rank(rank, world, dp, address, case, results):
    _run(_pplx_body, rank, (world, dp, address, case), results)


def _pplx_data(case, world, dp):
    """Every DP group's tokens, as pplx-kernels' test makes them: m_g in [1, T], K distinct experts per token,
    positive weights. The same on every rank (one seed)."""
    rng = np.random.default_rng(123)
    T, E, K, H = case["T"], case["E"], case["K"], case["H"]
    groups = []
    for _ in range(world // dp):
        m = int(rng.integers(1, T + 1))
        idx = np.stack([rng.permutation(E)[:K] for _ in range(m)]).astype(np.uint32)
        w = rng.random((m, K)).astype(np.float32)
        if case["x"] == "fp8_e4m3":
            bits = rng.integers(0, 256, (m, H)).astype(np.uint8)
            bits[(bits & 0x7F) == 0x7F] = 0x38  # no NaN codes: 1.0 instead
            scale = rng.random((m, H // 128)).astype(np.float32) + 0.5
            groups.append(dict(m=m, idx=idx, w=w, x=bits, scale=scale, value=nx.fp8_value(bits)))
        else:
            value = nx.to_format(rng.standard_normal((m, H)).astype(np.float32), case["x"])
            groups.append(dict(m=m, idx=idx, w=w, x=nx.encode(value, case["x"]), scale=None, value=value))
    return groups


def _pplx_body(rank, world, dp, address, case):
    import epcomm

    T, E, K, H = case["T"], case["E"], case["K"], case["H"]
    in_fmt, out_fmt = case["x"], case["out"]
    fp8 = in_fmt == "fp8_e4m3"
    item = 1 if fp8 else 2
    groups = _pplx_data(case, world, dp)
    mine = groups[rank // dp]
    m = mine["m"]
    bound = m - case.get("bound_short", 0)
    ctor = epcomm.AllToAll.internode if case["internode"] else epcomm.AllToAll.intranode
    # pplx-kernels' keyword arguments, the group named as pplx-kernels names it ("default": no torch group here,
    # so the bootstrap comes from bootstrap=).
    ata = ctor(max_num_tokens=T, num_experts=E, experts_per_token=K, rank=rank, world_size=world, dp_size=dp,
               hidden_dim=H, hidden_dim_bytes=H * item, hidden_dim_scale_bytes=(H // 128 * 4 if fp8 else 0),
               group_name="default", backend="host", bootstrap=address)
    L, num_dp = E // world, world // dp
    expert_num_tokens = np.zeros(L, np.int32)
    expert_x = np.zeros((L, T * num_dp, H), np.uint8 if fp8 else (np.uint16 if in_fmt == "bf16" else np.float16))
    expert_x_arg = epcomm.typed(expert_x, in_fmt) if in_fmt in ("bf16", "fp8_e4m3") else expert_x
    expert_x_scale = np.zeros((L, T * num_dp, H // 128), np.float32) if fp8 else None
    dp_x = epcomm.typed(mine["x"], in_fmt) if in_fmt in ("bf16", "fp8_e4m3") else mine["x"]
    bound_m = np.array([bound], np.uint32)  # pplx-kernels passes a [1] uint32 tensor
    ata.dispatch(out_expert_num_tokens=expert_num_tokens, out_expert_x=expert_x_arg,
                 out_expert_x_scale=expert_x_scale, dp_x=dp_x, dp_x_scale=mine["scale"], indices=mine["idx"],
                 bound_m=bound_m)

    # What each local expert must have received, in (sending rank, token) order (token t of DP group g is sent by
    # rank g * dp + t % dp): pplx-kernels' check, which compares sets, made exact.
    rows = 0
    for le in range(L):
        e = rank * L + le
        want = sorted(((g, t) for g, grp in enumerate(groups) for t in range(grp["m"] - case.get("bound_short", 0))
                       if e in grp["idx"][t].tolist()), key=lambda gt: (gt[0] * dp + gt[1] % dp, gt[1]))
        assert int(expert_num_tokens[le]) == len(want), (le, int(expert_num_tokens[le]), len(want))
        for i, (g, t) in enumerate(want):
            np.testing.assert_array_equal(expert_x[le, i], groups[g]["x"][t])
            if fp8:
                np.testing.assert_array_equal(expert_x_scale[le, i], groups[g]["scale"][t])
            rows += 1

    # The experts: y = x.to(out_dtype) * 1.5, as pplx-kernels' test (scales ignored).
    received = nx.decode(expert_x, in_fmt).astype(np.float32)
    y_value = nx.to_format(nx.to_format(received, out_fmt) * np.float32(1.5), out_fmt)
    expert_y = nx.encode(y_value, out_fmt)
    expert_y_arg = epcomm.typed(expert_y, out_fmt) if out_fmt == "bf16" else expert_y
    # out_tokens with max_num_tokens rows, NaN-filled; indices with m rows: rows >= bound_m stay NaN.
    y = np.full((T, H), NAN_BF16, np.uint16) if out_fmt == "bf16" else np.full((T, H), np.nan, np.float16)
    y_arg = epcomm.typed(y, "bf16") if out_fmt == "bf16" else y
    ata.combine(out_tokens=y_arg, indices=mine["idx"], weights=mine["w"], expert_y=expert_y_arg, bound_m=bound_m)
    ata.destroy()

    got = nx.decode(y, out_fmt)
    assert np.isnan(got[bound:]).all(), "combine wrote rows at or past bound_m"
    tok_y = nx.to_format(nx.to_format(mine["value"][:bound], out_fmt) * np.float32(1.5), out_fmt).astype(np.float64)
    w64 = mine["w"][:bound].astype(np.float64)
    ref = w64.sum(axis=1, keepdims=True) * tok_y  # every expert returns the same row: sum_k w_k * y
    abs_terms = np.abs(w64).sum(axis=1, keepdims=True) * np.abs(tok_y)
    err = np.abs(got[:bound] - ref)
    bound_err = nx.one_rounding_bound(ref, abs_terms, K, out_fmt)
    assert (err <= bound_err).all(), f"max error {err.max()} beyond one rounding ({bound_err[err > bound_err][:4]})"
    return dict(rows=rows, tokens=bound)


# ---- combine accuracy: one rounding of an fp32 sum ------------------------------------------------------------------

def accuracy_rank(rank, world, address, y_fmt, out_fmt, results):
    _run(_accuracy_body, rank, (world, address, y_fmt, out_fmt), results)


def _accuracy_body(rank, world, address, y_fmt, out_fmt):
    import epcomm

    T, E, K, H = 64, 16, 8, 256
    L = E // world
    rng = np.random.default_rng(99)
    idx = [np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32) for _ in range(world)]
    w = [rng.random((T, K)).astype(np.float32) for _ in range(world)]
    # Expert outputs of every (source rank, token, expert): wide magnitudes, in y's format.
    mag = np.exp2(rng.integers(-4, 5, (world, T, E, 1))).astype(np.float32)
    Y = nx.to_format(rng.standard_normal((world, T, E, H)).astype(np.float32) * mag, y_fmt)

    # Dispatch carries each token's (source rank, token) so that every expert row knows whose it is.
    x = np.zeros((T, 4), np.float32)
    x[:, 0], x[:, 1] = rank, np.arange(T)
    a2a = epcomm.AllToAll(T, E, K, rank, world, 1, H, 16, 0, backend="host", bootstrap=address)
    num = np.zeros(L, np.int32)
    ex = np.zeros((L, T * world, 4), np.float32)
    a2a.dispatch(num, ex, None, x, None, idx[rank])
    y = np.zeros((L, T * world, H), np.float32)
    for le in range(L):
        for i in range(int(num[le])):
            src, t = int(ex[le, i, 0]), int(ex[le, i, 1])
            y[le, i] = Y[src, t, rank * L + le]
    y_arg = epcomm.typed(nx.encode(y, "bf16"), "bf16") if y_fmt == "bf16" else nx.encode(y, y_fmt)
    out = np.zeros((T, H), np.uint16 if out_fmt == "bf16" else np.float16)
    a2a.combine(epcomm.typed(out, "bf16") if out_fmt == "bf16" else out, idx[rank], w[rank], y_arg)
    a2a.destroy()

    got = nx.decode(out, out_fmt)
    terms = w[rank].astype(np.float64)[:, :, None] * Y[rank, np.arange(T)[:, None], idx[rank]].astype(np.float64)
    ref = terms.sum(axis=1)
    err = np.abs(got - ref)
    limit = nx.one_rounding_bound(ref, np.abs(terms).sum(axis=1), K, out_fmt)
    worst = float((err / limit).max())
    assert worst <= 1.0, f"error up to {worst:.3f} x the bound of one final rounding"

    # The same sum with each expert rank's partial rounded to y's format first (what a combine that sends narrow
    # partials computes): this test tells the two apart.
    owner = idx[rank] // L
    partials = [nx.to_format(np.where((owner == r)[:, :, None], terms, 0).sum(axis=1).astype(np.float32), y_fmt)
                for r in range(world)]
    narrow = nx.to_format(sum(p.astype(np.float32) for p in partials), out_fmt).astype(np.float64)
    narrow_worst = float((np.abs(narrow - ref) / limit).max())
    return dict(elements=int(got.size), worst=worst, narrow_worst=narrow_worst)


# ---- DeepEP-style decode step ----------------------------------------------------------------------------------------

def deepep_rank(rank, world, address, case, results):
    _run(_deepep_body, rank, (world, address, case), results)


def _deepep_body(rank, world, address, case):
    from epcomm import deep_ep, typed

    T, E, K, H = 16, 8, 4, 256
    L = E // world
    round_scale = case.get("round_scale", False)
    x_fmt = case.get("x", "bf16")  # fp32 x: the cast runs before the dispatch (the dispatch casts bf16 only)
    rng = np.random.default_rng(5)
    ms = [int(rng.integers(1, T + 1)) for _ in range(world)]
    # Blocks of different magnitudes, one all zero (the 1e-4 amax floor): the scales differ block to block.
    xs = [nx.to_format(rng.standard_normal((m, H)).astype(np.float32)
                       * np.repeat(np.exp2(rng.integers(-12, 12, (m, H // 128))), 128, axis=1).astype(np.float32),
                       "bf16") for m in ms]
    for x_r in xs:
        x_r[0, :128] = 0
    idx = [np.stack([rng.permutation(E)[:K] for _ in range(m)]).astype(np.int64) for m in ms]
    for i in idx:
        i[0, -1] = -1  # a masked slot
    ws = [rng.random((m, K)).astype(np.float32) for m in ms]
    m = ms[rank]

    buf = deep_ep.Buffer(None, num_nvl_bytes=0,
                         num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E),
                         low_latency_mode=True, num_qps_per_rank=L, backend="host", rank=rank, world_size=world,
                         bootstrap=address)
    stats = np.zeros(L, np.int32)
    x_arg = typed(nx.encode(xs[rank], "bf16"), "bf16") if x_fmt == "bf16" else xs[rank].astype(np.float32)

    def separate_cast(rows):  # the cast a dispatch of fp8 expects: per_token_cast_to_fp8 of the bf16 values
        return deep_ep.per_token_cast_to_fp8(typed(nx.encode(rows, "bf16"), "bf16"), round_scale=round_scale)

    checked = 0
    for step in range(case["steps"]):
        recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
            x_arg, idx[rank], T, E, cumulative_local_expert_recv_stats=stats, use_fp8=case["fp8"],
            round_scale=round_scale, async_finish=False, return_recv_hook=case["hook"])
        assert (hook is not None) == case["hook"]
        # bf16 x with fp8: the host backend's dispatch casts (dispatch_cast); otherwise nothing is cast in it.
        want_cast = ("fp8_blocks_pow2" if round_scale else "fp8_blocks") if case["fp8"] and x_fmt == "bf16" else "none"
        assert handle.a2a.config.dispatch_cast.name == want_cast, handle.a2a.config
        if hook is not None:
            hook()
        event.current_stream_wait()
        # DeepEP's layout: [L, T * W, H] (+ [L, T * W, H / 128] scales, column-major in the last two dimensions).
        if case["fp8"]:
            q, scales = recv_x
            assert q.dtype == "fp8_e4m3" and q.array.shape == (L, T * world, H)
            assert scales.shape == (L, T * world, H // 128) and scales.strides[1] == 4
            received = nx.decode(q.array, "fp8_e4m3") * np.repeat(scales, 128, axis=2)
        else:
            assert recv_x.dtype == "bf16" and recv_x.array.shape == (L, T * world, H)
            received = nx.decode(recv_x.array, "bf16")
        assert recv_count.shape == (L,) and recv_count.dtype == np.int32

        # The rows each local expert must hold, in (source rank, token) order, and their values.
        y = np.zeros((L, T * world, H), np.float32)
        for le in range(L):
            e = rank * L + le
            want = [(s, t) for s in range(world) for t in range(ms[s]) if e in idx[s][t].tolist()]
            assert int(recv_count[le]) == len(want)
            for i, (s, t) in enumerate(want):
                src = xs[s][t].astype(np.float64)
                if case["fp8"]:
                    q_src, s_src = separate_cast(xs[s][t:t + 1])
                    np.testing.assert_array_equal(q.array[le, i], q_src.array[0])
                    np.testing.assert_array_equal(scales[le, i], s_src[0])
                    # fp8 with per-128 scales: within one e4m3 rounding of the source (2^-4 relative; 2^-10 of
                    # the block's scale for the subnormals).
                    tol = np.abs(src) * 2.0 ** -4 + np.repeat(scales[le, i], 128) * 2.0 ** -9
                    assert np.all(np.abs(received[le, i] - src) <= tol)
                else:
                    np.testing.assert_array_equal(received[le, i], src)
                checked += 1
            # The per-expert function: expert e scales its tokens by (e + 1).
            y[le, :len(want)] = received[le, :len(want)] * (e + 1)
        y_bits = nx.encode(nx.to_format(y, "bf16"), "bf16")
        combined_x, event, hook = buf.low_latency_combine(typed(y_bits, "bf16"), idx[rank], ws[rank], handle,
                                                         return_recv_hook=case["hook"])
        if hook is not None:
            hook()
        got = nx.decode(combined_x.array, "bf16")
        assert got.shape == (m, H)

        # CPU reference in fp64 from the same expert rows (what each expert returned for this rank's tokens).
        ref = np.zeros((m, H))
        abs_terms = np.zeros((m, H))
        yv = nx.decode(y_bits, "bf16")
        for t in range(m):
            for k in range(K):
                e = int(idx[rank][t, k])
                if e < 0:
                    continue
                owner_rows = [(s, tt) for s in range(world) for tt in range(ms[s]) if e in idx[s][tt].tolist()]
                row = owner_rows.index((rank, t))
                # This rank's token t row on expert e: recomputed from the source, as the owner did.
                src = xs[rank][t].astype(np.float64)
                if case["fp8"]:
                    qq, ss = separate_cast(xs[rank][t:t + 1])
                    src = nx.decode(qq.array[0], "fp8_e4m3") * np.repeat(ss[0], 128)
                val = nx.to_format((src * (e + 1)).astype(np.float32), "bf16").astype(np.float64)
                if e // L == rank:
                    np.testing.assert_array_equal(val, yv[e % L, row])
                ref[t] += ws[rank][t, k] * val
                abs_terms[t] += abs(ws[rank][t, k]) * np.abs(val)
        err = np.abs(got - ref)
        limit = nx.one_rounding_bound(ref, abs_terms, K, "bf16")
        assert (err <= limit).all(), f"step {step}: combine error up to {(err / limit).max():.3f} x one rounding"
    assert stats.tolist() == [case["steps"] * int(c) for c in recv_count.tolist()]
    buf.destroy()
    return dict(rows=checked, tokens=m * case["steps"])


# ---- AllToAll(dispatch_cast=...): the fp8 cast inside the dispatch -----------------------------------------------------

def cast_rank(rank, world, address, case, results):
    _run(_cast_body, rank, (world, address, case), results)


def _cast_body(rank, world, address, case):
    """One object that casts (dispatch_cast) and one that dispatches what per_token_cast_to_fp8 made: their outputs
    must be the same bits, in whole calls or split ones, batched or packed."""
    import epcomm
    from epcomm import deep_ep, typed

    T, E, K, H = 12, 4 * world, 3, 384
    cast = case["cast"]
    rng = np.random.default_rng(31)
    ms = [int(rng.integers(0, T + 1)) for _ in range(world)]
    m = ms[rank]
    x = nx.to_format(rng.standard_normal((T, H)).astype(np.float32)
                     * np.repeat(np.exp2(rng.integers(-20, 20, (T, H // 128))), 128, axis=1).astype(np.float32),
                     "bf16")[:m]
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)[:m]
    kw = dict(backend="host", bootstrap=address, layout=case["layout"], expert_padding=case.get("padding", 1))
    fused = epcomm.AllToAll(T, E, K, rank, world, 1, H, H, H // 128 * 4, dispatch_cast=cast, **kw)
    plain = epcomm.AllToAll(T, E, K, rank, world, 1, H, H, H // 128 * 4, **kw)
    assert fused.config.dispatch_cast.name == cast and plain.config.dispatch_cast.name == "none"
    x_bf16 = typed(nx.encode(x, "bf16"), "bf16")
    q, s = deep_ep.per_token_cast_to_fp8(x_bf16, round_scale=cast == "fp8_blocks_pow2")
    outs = []
    for a2a, dp_x, dp_x_scale in ((fused, x_bf16, None), (plain, q, s)):
        num, ex, ex_scale = a2a.alloc_dispatch_outputs()
        assert ex.dtype == "fp8_e4m3" and ex_scale.dtype == np.float32
        if case.get("split"):
            a2a.dispatch(num, ex, ex_scale, dp_x, dp_x_scale, idx, do_recv=False)
            a2a.dispatch(num, ex, ex_scale, dp_x, dp_x_scale, idx, do_send=False)
        else:
            a2a.dispatch(num, ex, ex_scale, dp_x, dp_x_scale, idx)
        outs.append((num.copy(), ex.array.copy(), ex_scale.copy()))
    for got, want in zip(outs[0], outs[1]):
        np.testing.assert_array_equal(got, want)
    fused.destroy()
    plain.destroy()
    return dict(rows=int(outs[0][0].sum()))
