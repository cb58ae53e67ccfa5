"""Drop-in compatibility with pplx-kernels and DeepEP (docs/compat.md), on the host backend with numpy arrays in
real processes (CI):

- pplx-kernels' calling patterns: its test's shapes (4 ranks, dp 2), keyword arguments, intranode / internode
  constructors with group_name, indices and bound_m as uint32, out_tokens with max_num_tokens rows (rows at and
  past bound_m untouched), every input dtype it tests;
- combine accuracy: fp16 and bf16 outputs against an fp64 reference are within one final rounding of an fp32 sum
  (and the same data summed with per-rank partials rounded to expert_y's dtype is not: the test tells them apart);
- a DeepEP-style decode step through epcomm.deep_ep.Buffer (dispatch with and without fp8, with and without the
  receive hook, a per-expert function, combine) against a CPU reference.

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
                dict(fp8=True, hook=True, steps=1)]


@pytest.mark.parametrize("case", DEEPEP_CASES, ids=["fp8", "bf16-hook", "fp8-hook"])
@pytest.mark.parametrize("world", [2, 4])
def test_deepep_decode_step(case, world, spawn, monkeypatch):
    monkeypatch.setenv("EPCOMM_FABRIC_PROVIDER", "tcp")
    address = f"127.0.0.1:{free_port()}"
    out = spawn(_compat_worker.deepep_rank, world, lambda r: (world, address, case))
    assert sum(p["rows"] for _, _, p in out) > 0, out


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
