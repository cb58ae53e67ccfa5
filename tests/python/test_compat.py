"""Drop-in compatibility with pplx-kernels and DeepEP (docs/compat.md), on the host backend with numpy arrays in
real processes (CI):

- pplx-kernels' calling patterns: its test's shapes (4 ranks, dp 2), keyword arguments, intranode / internode
  constructors with group_name, indices and bound_m as uint32, out_tokens with max_num_tokens rows (rows at and
  past bound_m untouched), every input dtype it tests;
- combine accuracy: fp16 and bf16 outputs against an fp64 reference are within one final rounding of an fp32 sum
  (and the same data summed with per-rank partials rounded to expert_y's dtype is not: the test tells them apart);
- a DeepEP-style decode step through epcomm.deep_ep.Buffer (dispatch with and without fp8, with and without the
  receive hook, a per-expert function, combine) against a CPU reference; with bf16 x the fp8 cast runs inside the
  dispatch (dispatch_cast), and its codes and scales are those of per_token_cast_to_fp8, bit for bit;
- AllToAll(dispatch_cast=...) against per_token_cast_to_fp8 followed by an fp8 dispatch, and what it refuses.

The torch variants (torch tensors, torch.compile around dispatch / combine, the torch group's name) are in
test_compat_torch.py.
"""

import pytest

np = pytest.importorskip("numpy", reason="numpy is not installed (pip install numpy)")
import epcomm  # noqa: E402

import _compat_worker  # noqa: E402
from conftest import free_port  # noqa: E402

pytestmark = pytest.mark.skipif("host" not in epcomm.built_backends(),
                                reason=f"the host backend is not in this build (built: {epcomm.built_backends()})")

# pplx-kernels' test: small_moe (E 8, K 3, H 512, T 10), 4 ranks, dp 2; in x each dtype it tests, out fp16 / bf16.
SMALL = dict(T=10, E=8, K=3, H=512)
PPLX_CASES = [
    dict(SMALL, x="bf16", out="bf16", internode=False),
    dict(SMALL, x="fp16", out="fp16", internode=True),
    dict(SMALL, x="fp8_e4m3", out="bf16", internode=False),
    dict(SMALL, x="fp8_e4m3", out="fp16", internode=True),
    dict(SMALL, x="bf16", out="fp16", internode=False, bound_short=1),
]


def _ids(cases):
    return ["{x}-{out}-{kind}{extra}".format(kind="internode" if c["internode"] else "intranode",
                                             extra="-bound_short" if c.get("bound_short") else "", **c)
            for c in cases]


@pytest.mark.parametrize("case", PPLX_CASES, ids=_ids(PPLX_CASES))
def test_pplx_calling_patterns(case, spawn, monkeypatch):
    monkeypatch.setenv("EPCOMM_FABRIC_PROVIDER", "tcp")  # inherited by the spawned ranks
    address = f"127.0.0.1:{free_port()}"
    out = spawn(_compat_worker.pplx_rank, 4, lambda r: (4, 2, address, case))
    assert sum(p["rows"] for _, _, p in out) > 0 and sum(p["tokens"] for _, _, p in out) > 0, out


@pytest.mark.parametrize("y_fmt, out_fmt", [("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "bf16"), ("bf16", "fp16")])
def test_combine_rounds_once(y_fmt, out_fmt, spawn, monkeypatch):
    monkeypatch.setenv("EPCOMM_FABRIC_PROVIDER", "tcp")
    address = f"127.0.0.1:{free_port()}"
    out = spawn(_compat_worker.accuracy_rank, 2, lambda r: (2, address, y_fmt, out_fmt))
    for _, rank, p in out:
        assert p["elements"] == 64 * 256
        assert p["worst"] <= 1.0, (rank, p)
        if y_fmt == out_fmt:  # narrow partials would round twice: the bound catches them
            assert p["narrow_worst"] > 1.0, (rank, p)


DEEPEP_CASES = [dict(fp8=True, hook=False, steps=2), dict(fp8=False, hook=True, steps=2),
                dict(fp8=True, hook=True, steps=1), dict(fp8=True, hook=False, steps=2, round_scale=True),
                dict(fp8=True, hook=True, steps=1, x="fp32")]


@pytest.mark.parametrize("case", DEEPEP_CASES, ids=["fp8", "bf16-hook", "fp8-hook", "fp8-round_scale", "fp8-fp32_x"])
@pytest.mark.parametrize("world", [2, 4])
def test_deepep_decode_step(case, world, spawn, monkeypatch):
    monkeypatch.setenv("EPCOMM_FABRIC_PROVIDER", "tcp")
    address = f"127.0.0.1:{free_port()}"
    out = spawn(_compat_worker.deepep_rank, world, lambda r: (world, address, case))
    assert sum(p["rows"] for _, _, p in out) > 0, out


CAST_CASES = [dict(cast="fp8_blocks", layout="batched"), dict(cast="fp8_blocks_pow2", layout="batched", split=True),
              dict(cast="fp8_blocks", layout="packed", padding=4, split=True)]


@pytest.mark.parametrize("case", CAST_CASES, ids=["fp8_blocks", "fp8_blocks_pow2-split", "packed-split"])
@pytest.mark.parametrize("world", [2, 3])
def test_dispatch_cast_is_the_separate_cast(case, world, spawn, monkeypatch):
    """AllToAll(dispatch_cast=...) on bf16 dp_x gives the bits of per_token_cast_to_fp8 followed by an fp8 dispatch."""
    monkeypatch.setenv("EPCOMM_FABRIC_PROVIDER", "tcp")
    address = f"127.0.0.1:{free_port()}"
    out = spawn(_compat_worker.cast_rank, world, lambda r: (world, address, case))
    assert sum(p["rows"] for _, _, p in out) > 0, out


def test_dispatch_cast_errors(monkeypatch):
    """What a dispatch that casts refuses, with the argument named; a backend whose dispatch does not cast refuses at
    construction, and DeepEP's Buffer then casts before the dispatch instead (same bits)."""
    import _numerics as nx
    from epcomm import _C, deep_ep, typed

    H = 256
    with pytest.raises(epcomm.Error, match="needs hiddenDim % 128 == 0") as info:
        epcomm.AllToAll(4, 4, 2, 0, 1, 1, 192, 192, 8, backend="host", dispatch_cast="fp8_blocks")
    assert info.value.code == "invalid_config"
    with pytest.raises(epcomm.Error, match="unknown dispatch_cast 'fp8'"):
        epcomm.AllToAll(4, 4, 2, 0, 1, 1, H, H, 8, backend="host", dispatch_cast="fp8")
    a2a = epcomm.AllToAll(4, 4, 2, 0, 1, 1, H, H, 8, backend="host", dispatch_cast="fp8_blocks")
    num, ex, ex_scale = a2a.alloc_dispatch_outputs()
    idx = np.zeros((2, 2), np.int32)
    x = typed(np.zeros((2, H), np.uint16), "bf16")
    with pytest.raises(epcomm.Error, match="dp_x must be bf16") as info:
        a2a.dispatch(num, ex, ex_scale, typed(np.zeros((2, H), np.uint8), "fp8_e4m3"), None, idx)
    assert info.value.code == "invalid_argument"
    with pytest.raises(epcomm.Error, match="dp_x_scale given"):
        a2a.dispatch(num, ex, ex_scale, x, np.ones((2, 2), np.float32), idx)
    a2a.dispatch(num, ex, ex_scale, x, None, idx)
    assert num.tolist() == [2, 0, 0, 0] and np.all(ex_scale[0, :2] == np.float32(1e-4) / np.float32(448))
    a2a.destroy()

    # A backend whose dispatch does not cast (as proxy and nvshmem): refused when created, naming it.
    monkeypatch.setattr(_C, "dispatch_cast_backends", lambda: ["nvlink"])
    with pytest.raises(epcomm.Error, match="not supported by the host backend") as info:
        epcomm.AllToAll(4, 4, 2, 0, 1, 1, H, H, 8, backend="host", dispatch_cast="fp8_blocks")
    assert info.value.code == "unavailable"
    buf = deep_ep.Buffer(None, low_latency_mode=True, backend="host", rank=0, world_size=1)
    rng = np.random.default_rng(3)
    xv = nx.to_format(rng.standard_normal((3, H)).astype(np.float32), "bf16")
    x_arg = typed(nx.encode(xv, "bf16"), "bf16")
    topk = np.array([[0, 1], [1, -1], [3, 2]], np.int64)
    (q, s), count, handle, _, _ = buf.low_latency_dispatch(x_arg, topk, 4, 4, use_fp8=True)
    assert handle.a2a.config.dispatch_cast.name == "none"  # cast before the dispatch
    monkeypatch.undo()
    buf2 = deep_ep.Buffer(None, low_latency_mode=True, backend="host", rank=0, world_size=1)
    (q2, s2), count2, handle2, _, _ = buf2.low_latency_dispatch(x_arg, topk, 4, 4, use_fp8=True)
    assert handle2.a2a.config.dispatch_cast.name == "fp8_blocks"  # cast inside the dispatch
    np.testing.assert_array_equal(count, count2)
    np.testing.assert_array_equal(q.array, q2.array)
    np.testing.assert_array_equal(s, s2)
    buf.destroy()
    buf2.destroy()


def test_fp8_cast_matches_the_definition():
    """The CPU cast (what the DeepEP front door uses for host arrays): codes and scales as defined, x within one
    e4m3 rounding of codes * scale, an all-zero block gets scale 1e-4 / 448, round_scale gives powers of two."""
    import _numerics as nx
    from epcomm import deep_ep, typed

    rng = np.random.default_rng(1)
    x = nx.to_format(rng.standard_normal((3, 256)).astype(np.float32) * 10, "bf16")
    x[1, 128:] = 0
    q, s = deep_ep.per_token_cast_to_fp8(typed(nx.encode(x, "bf16"), "bf16"))
    amax = np.maximum(np.abs(x).reshape(3, 2, 128).max(axis=2), np.float32(1e-4))
    np.testing.assert_array_equal(s, amax / np.float32(448))
    back = nx.decode(q.array, "fp8_e4m3") * np.repeat(s, 128, axis=1)
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0 ** -4 + np.repeat(s, 128, axis=1) * 2.0 ** -9)
    assert np.all(q.array[1, 128:] == 0)
    _, s2 = deep_ep.per_token_cast_to_fp8(typed(nx.encode(x, "bf16"), "bf16"), round_scale=True)
    assert np.all(np.log2(s2) == np.round(np.log2(s2))) and np.all(s2 >= s)
    with pytest.raises(epcomm.Error, match="not a multiple of the block size 128"):
        deep_ep.per_token_cast_to_fp8(np.zeros((2, 100), np.float32))


def test_deepep_unsupported_parts_say_so():
    from epcomm import deep_ep

    buf = deep_ep.Buffer(None, low_latency_mode=True, backend="host", rank=0, world_size=1)
    for call in (lambda: buf.dispatch(None), lambda: buf.get_dispatch_layout(None, 8),
                 lambda: buf.low_latency_dispatch(np.zeros((1, 128), np.float32), np.zeros((1, 1), np.int64), 4, 4,
                                                  use_ue8m0=True)):
        with pytest.raises(epcomm.Error, match="not supported") as info:
            call()
        assert info.value.code == "unavailable"
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) % 128 == 0
    buf.destroy()
