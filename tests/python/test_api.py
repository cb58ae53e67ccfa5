"""The package's surface without a backend: configs, planner, errors, DLPack conversion (through the C++
reference, single rank) and the argument checks (the C++ ones, named as the Python arguments)."""

import pytest

np = pytest.importorskip("numpy", reason="numpy is not installed (pip install numpy)")
import epcomm  # noqa: E402
from epcomm import _C  # noqa: E402

needs_host = pytest.mark.skipif("host" not in epcomm.built_backends(),
                                reason=f"the host backend is not in this build (built: {epcomm.built_backends()})")


def small_config(**overrides):
    args = dict(max_num_tokens=8, num_experts=4, experts_per_token=2, rank=0, world_size=1, dp_size=1, hidden_dim=8,
                hidden_dim_bytes=32, hidden_dim_scale_bytes=0)
    args.update(overrides)
    return epcomm.make_config(**args)


def test_version_and_backends():
    assert epcomm.__version__.count(".") == 2
    assert set(epcomm.built_backends()) <= {"nvlink", "nvshmem", "proxy", "host"}


def test_config_fields_roundtrip():
    cfg = small_config(expert_padding=4, layout="packed", hidden_dim_scale_bytes=8)
    assert (cfg.max_num_tokens, cfg.num_experts, cfg.experts_per_token, cfg.hidden_dim, cfg.hidden_dim_bytes,
            cfg.hidden_dim_scale_bytes, cfg.expert_padding) == (8, 4, 2, 8, 32, 8, 4)
    assert cfg.layout == epcomm.Layout.packed
    assert cfg.num_local_experts == 4 and cfg.num_dp_groups == 1
    assert cfg.packed_rows == 8 * 2 + 4 * 3
    assert "E=4" in repr(cfg)


def test_invalid_config_raises_epcomm_error():
    with pytest.raises(epcomm.Error) as info:
        small_config(num_experts=6, world_size=4)
    assert info.value.code == "invalid_config"
    assert "numExperts 6 is not a multiple of worldSize 4" in str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert info.value.file.endswith(".cc") and info.value.line > 0


@pytest.mark.parametrize("field, value", [("max_num_tokens", -1), ("hidden_dim", 64.5), ("experts_per_token", True),
                                          ("num_experts", 2 ** 32), ("rank", "0")])
def test_config_fields_must_be_unsigned_ints(field, value):
    with pytest.raises(epcomm.Error, match=f"{field} must be an integer in \\[0, 2\\^32\\), got") as info:
        small_config(**{field: value})
    assert info.value.code == "invalid_config"


def test_config_accepts_numpy_integers():
    assert small_config(max_num_tokens=np.int64(8)).max_num_tokens == 8


def test_unknown_layout_and_standard_config():
    with pytest.raises(epcomm.Error, match="unknown layout 'diagonal'"):
        small_config(layout="diagonal")
    assert epcomm.standard_config_names() == ["decode", "prefill", "small", "qwen3"]
    dec = epcomm.standard_config("decode", 8)
    assert (dec.num_experts, dec.experts_per_token, dec.hidden_dim, dec.hidden_dim_scale_bytes) == (256, 8, 7168, 224)
    with pytest.raises(epcomm.Error) as info:
        epcomm.standard_config("huge", 8)
    assert info.value.code == "invalid_argument"


def test_plan_table():
    p = epcomm.plan("decode", "", world_size=8)
    names = [b.name for b in p.buffers]
    assert names[:2] == ["outExpertNumTokens", "outExpertX"]
    assert p.total_bytes == sum(b.bytes for b in p.buffers)
    out_x = p.buffers[1]
    assert out_x.bytes == 32 * 128 * 8 * 7168  # L * R * hidden_dim_bytes
    assert "outExpertX" in str(p)
    p2 = epcomm.plan(backend="host", max_num_tokens=8, num_experts=4, experts_per_token=2, world_size=1,
                     hidden_dim=8, hidden_dim_bytes=32, hidden_dim_scale_bytes=0)
    assert p2.buffers[0].bytes == 4 * 4
    with pytest.raises(epcomm.Error, match="unknown backend"):
        epcomm.plan("decode", "carrier-pigeon", world_size=8)


def test_plan_proxy_without_a_gpu():
    # The proxy backend's planner is arithmetic: every build has it, with or without a GPU or the backend itself.
    p = epcomm.plan("decode", "proxy", world_size=8)
    own = [b for b in p.buffers if b.owner == "proxy"]
    assert own and sum(b.bytes for b in own) > 0
    assert any("registered" in b.memory for b in own)


def test_env_vars_listed():
    names = [n for n, _, _ in epcomm.env_vars()]
    assert "EPCOMM_TIMEOUT_MS" in names and "EPCOMM_BOOTSTRAP" in names


# ---- DLPack conversion, through the C++ reference (one rank: no backend needed) ----

def _reference_round(cfg, x, indices, weights, y_dtype="fp32"):
    num = np.zeros(cfg.num_local_experts, np.int32)
    ex = np.zeros((cfg.num_local_experts, cfg.batched_rows_per_expert, cfg.hidden_dim_bytes // 4), np.float32)
    _C.reference_dispatch(cfg, [dict(out_expert_num_tokens=num, out_expert_x=ex, out_expert_x_scale=None, dp_x=x,
                                     dp_x_scale=None, indices=indices, bound_m=None)])
    out = np.zeros((x.shape[0], cfg.hidden_dim), np.float32)
    _C.reference_combine(cfg, [dict(out_tokens=out, indices=indices, weights=weights, expert_y=ex, bound_m=None)])
    return num, ex, out


def test_reference_through_dlpack_numpy():
    cfg = small_config()
    x = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)
    idx = np.array([[0, 1], [1, 2], [2, 3], [3, -1]], np.int32)
    w = np.full((4, 2), 0.5, np.float32)
    num, ex, out = _reference_round(cfg, x, idx, w)
    assert num.tolist() == [1, 2, 2, 2]
    np.testing.assert_array_equal(ex[1, :2], x[[0, 1]])  # expert 1: token 0 then token 1
    np.testing.assert_allclose(out[:3], x[:3])
    np.testing.assert_allclose(out[3], 0.5 * x[3])


def test_strided_inputs_match_contiguous():
    cfg = small_config()
    rng = np.random.default_rng(0)
    big = rng.standard_normal((8, 16)).astype(np.float32)
    x_strided = big[::2, :8]  # row stride 32 elements (128 bytes): allowed
    idx_t = np.array([[0, 2, 1, 3], [1, 3, 2, 0]], np.int64)
    idx_strided = idx_t.T  # [4, 2] with strides (1, 4): any strides allowed
    w = rng.random((4, 2), dtype=np.float32)
    a = _reference_round(cfg, np.ascontiguousarray(x_strided), np.ascontiguousarray(idx_strided), w)
    b = _reference_round(cfg, x_strided, idx_strided, w)
    for got, want in zip(b, a):
        np.testing.assert_array_equal(got, want)


def test_bf16_typed_arrays_in_reference_combine():
    cfg = small_config(hidden_dim_bytes=16)  # bf16 payload, H = 8
    x = (np.ones((2, 8), np.float32).view(np.uint32) >> 16).astype(np.uint16)  # bf16 1.0
    idx = np.array([[0, 1], [2, -1]], np.int32)
    num = np.zeros(4, np.int32)
    ex = np.zeros((4, cfg.batched_rows_per_expert, 8), np.uint16)
    _C.reference_dispatch(cfg, [dict(out_expert_num_tokens=num, out_expert_x=epcomm.typed(ex, "bf16"),
                                     dp_x=epcomm.typed(x, "bf16"), indices=idx)])
    out = np.zeros((2, 8), np.uint16)
    w = np.array([[0.25, 0.5], [2.0, 9.0]], np.float32)
    _C.reference_combine(cfg, [dict(out_tokens=epcomm.typed(out, "bf16"), indices=idx, weights=w,
                                    expert_y=epcomm.typed(ex, "bf16"))])
    as_f32 = (out.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(as_f32[0], 0.75)
    np.testing.assert_array_equal(as_f32[1], 2.0)


def test_conversion_errors_name_the_argument():
    cfg = small_config()
    x = np.zeros((2, 8), np.float32)
    idx = np.zeros((2, 2), np.int32)
    num = np.zeros(4, np.int32)
    ex = np.zeros((4, 8, 8), np.float32)
    base = dict(out_expert_num_tokens=num, out_expert_x=ex, dp_x=x, indices=idx)
    with pytest.raises(epcomm.Error, match="out_expert_x .*not a writable array") as info:
        ro = ex.copy()
        ro.flags.writeable = False
        _C.reference_dispatch(cfg, [dict(base, out_expert_x=ro)])
    assert info.value.code == "invalid_argument"
    with pytest.raises(epcomm.Error, match="dp_x \\(list\\) is not an array"):
        _C.reference_dispatch(cfg, [dict(base, dp_x=[[0.0] * 8] * 2)])
    with pytest.raises(epcomm.Error, match="dp_x: cannot reinterpret 4-byte elements as bf16"):
        _C.reference_dispatch(cfg, [dict(base, dp_x=epcomm.typed(x, "bf16"))])
    with pytest.raises(epcomm.Error, match="dp_x has an unsupported DLPack dtype"):
        _C.reference_dispatch(cfg, [dict(base, dp_x=np.zeros((2, 16), np.int16))])
    with pytest.raises(epcomm.Error, match="bound_m must be an int32"):
        _C.reference_dispatch(cfg, [dict(base, bound_m=np.array([1], np.int64))])
    with pytest.raises(epcomm.Error, match="one dict per rank"):
        _C.reference_dispatch(cfg, [base, base])


# ---- argument checks: the C++ checks (src/core/validate.cc), reached through the package, in Python names ----

def _read_only(a):
    a.flags.writeable = False
    return a


def _dispatch_args(cfg, m=4, **over):
    scale_cols = cfg.hidden_dim_scale_bytes // 4
    args = dict(
        out_expert_num_tokens=np.zeros(cfg.num_local_experts, np.int32),
        out_expert_x=np.zeros((cfg.num_local_experts, cfg.batched_rows_per_expert, cfg.hidden_dim_bytes // 4),
                              np.float32),
        out_expert_x_scale=(np.zeros((cfg.num_local_experts, cfg.batched_rows_per_expert, scale_cols), np.float32)
                            if scale_cols else None),
        dp_x=np.zeros((m, cfg.hidden_dim_bytes // 4), np.float32),
        dp_x_scale=np.zeros((m, scale_cols), np.float32) if scale_cols else None,
        indices=np.zeros((m, cfg.experts_per_token), np.int32),
        bound_m=None, do_send=True, do_recv=True)
    args.update(over)
    return args


def _host_a2a(scale_bytes=0):
    return epcomm.AllToAll(8, 4, 2, 0, 1, 1, 8, 32, scale_bytes, backend="host")


def _expect_error(call, message, where="validate.cc"):
    with pytest.raises(epcomm.Error, match=message) as info:
        call()
    assert info.value.code == "invalid_argument"
    if where:
        assert where in info.value.file, f"raised by {info.value.file}, not by {where}"


@needs_host
@pytest.mark.parametrize("override, message, where", [
    (dict(dp_x=np.zeros((4, 9), np.float32)), "dp_x rows are 36 bytes", "validate.cc"),
    (dict(dp_x=np.zeros((9, 8), np.float32), indices=np.zeros((9, 2), np.int32)),
     "dp_x has 9 tokens, more than max_num_tokens = 8", "validate.cc"),
    (dict(dp_x=np.zeros((4, 16), np.float32)[:, ::2]), "dp_x must be contiguous in its last dimension", "validate.cc"),
    (dict(indices=np.zeros((4, 2), np.float32)), "indices must be int32, uint32 or int64", "validate.cc"),
    (dict(indices=np.zeros((3, 2), np.int32)), "indices dimension 0 must be 4", "validate.cc"),
    (dict(out_expert_num_tokens=np.zeros(4, np.int64)), "out_expert_num_tokens must be int32", "validate.cc"),
    (dict(out_expert_num_tokens=np.zeros(3, np.int32)), "out_expert_num_tokens dimension 0 must be 4",
     "validate.cc"),
    (dict(out_expert_x=np.zeros((4, 7, 8), np.float32)), "out_expert_x dimension 1 must be 8", "validate.cc"),
    (dict(out_expert_x=None), "out_expert_x is required", "tensor_convert.cc"),
    (dict(out_expert_x=_read_only(np.zeros((4, 8, 8), np.float32))), "out_expert_x .*not a writable array",
     "tensor_convert.cc"),
    (dict(dp_x_scale=np.zeros((4, 1), np.float32)), "dp_x_scale given but hidden_dim_scale_bytes = 0",
     "validate.cc"),
    (dict(bound_m=np.array([1, 2], np.int32)), "bound_m must hold exactly one element", "tensor_convert.cc"),
    (dict(bound_m=np.array(1, np.int64)), "bound_m must be an int32", "tensor_convert.cc"),
    (dict(do_send=False, do_recv=False), "do_send = do_recv = false", "validate.cc"),
])
def test_dispatch_argument_errors(override, message, where):
    with _host_a2a() as a2a:
        args = _dispatch_args(a2a.config, **override)
        _expect_error(lambda: a2a.dispatch(**args), message, where)
        a2a.dispatch(**_dispatch_args(a2a.config))  # nothing was launched: the object is still usable


@needs_host
def test_dispatch_scale_errors():
    with _host_a2a(scale_bytes=8) as a2a:
        cfg = a2a.config
        _expect_error(lambda: a2a.dispatch(**_dispatch_args(cfg, dp_x_scale=None)),
                      "dp_x_scale is required: hidden_dim_scale_bytes = 8")
        _expect_error(lambda: a2a.dispatch(**_dispatch_args(cfg, dp_x_scale=np.zeros((4, 2), np.float16))),
                      "dp_x_scale must have a 4-byte dtype")
        a2a.dispatch(**_dispatch_args(cfg))


@needs_host
@pytest.mark.parametrize("override, message, where", [
    (dict(out_tokens=np.zeros((4, 8), np.int32)), "out_tokens must be bf16, fp16 or fp32", "validate.cc"),
    (dict(out_tokens=np.zeros((4, 12), np.float32)), "out_tokens dimension 1 must be 8", "validate.cc"),
    (dict(out_tokens=np.zeros((3, 8), np.float32)),
     "indices has 4 tokens but out_tokens only 3 rows", "validate.cc"),
    (dict(out_tokens=_read_only(np.zeros((4, 8), np.float32))), "out_tokens .*not a writable array",
     "tensor_convert.cc"),
    (dict(weights=np.zeros((4, 2), np.float16)), "weights must be fp32", "validate.cc"),
    (dict(weights=np.zeros((4, 3), np.float32)), "weights dimension 1 must be 2", "validate.cc"),
    (dict(expert_y=np.zeros((4, 8, 8), np.int64)), "expert_y must be bf16, fp16 or fp32", "validate.cc"),
    (dict(expert_y=np.zeros((4, 8), np.float32)), "expert_y must have 3 dimensions", "validate.cc"),
])
def test_combine_argument_errors(override, message, where):
    with _host_a2a() as a2a:
        a2a.dispatch(**_dispatch_args(a2a.config))
        args = dict(out_tokens=np.zeros((4, 8), np.float32), indices=np.zeros((4, 2), np.int32),
                    weights=np.zeros((4, 2), np.float32), expert_y=np.zeros((4, 8, 8), np.float32))
        bad = dict(args, **override)
        _expect_error(lambda: a2a.combine(**bad), message, where)
        a2a.combine(**args)  # the bad call launched nothing: the round completes


def test_python_names_keep_code_and_site():
    err = _C.Error("epcomm invalid_argument at validate.cc:12: outExpertX dimension 1 must be 8, xScale given")
    err.code, err.message, err.file, err.line = (
        "invalid_argument", "outExpertX dimension 1 must be 8, xScale given", "validate.cc", 12)
    from epcomm._tensors import python_names

    out = python_names(err)
    assert out.message == "out_expert_x dimension 1 must be 8, dp_x_scale given"
    assert str(out).endswith(out.message) and "validate.cc:12" in str(out)
    assert (out.code, out.file, out.line) == ("invalid_argument", "validate.cc", 12)


@needs_host
def test_typed_bf16_dispatch_round():
    with epcomm.AllToAll(8, 4, 2, 0, 1, 1, 8, 16, 0, backend="host") as a2a:
        num, ex, _ = a2a.alloc_dispatch_outputs("bf16")
        x = epcomm.typed(np.arange(32, dtype=np.uint16).reshape(4, 8), "bf16")
        a2a.dispatch(num, ex, None, x, None, np.array([[0, 1], [1, 2], [2, 3], [3, 0]], np.int32))
        assert num.tolist() == [2, 2, 2, 2]
        np.testing.assert_array_equal(ex.array[0, :2], x.array[[0, 3]])


# ---- bootstraps and the factory ----

def test_bootstrap_argument_errors():
    with pytest.raises(epcomm.Error, match="neither 'env' nor 'host:port'"):
        epcomm.make_bootstrap("nowhere", None, 0, 2)
    with pytest.raises(epcomm.Error, match="has no method 'all_gather'"):
        epcomm.make_bootstrap(object(), None, 0, 2)


def test_self_bootstrap_collectives():
    b = _C.self_bootstrap()
    assert (b.rank, b.world_size) == (0, 1)
    assert b.all_gather(b"abc") == b"abc"
    assert b.broadcast(b"xyz", 0) == b"xyz"
    b.barrier()


def test_callback_bootstrap_errors_become_epcomm_errors():
    class Broken:
        def all_gather(self, data):
            return b"short"

        def barrier(self):
            raise ValueError("no barrier today")

        def broadcast(self, data, root):
            return 42

    b = _C.callback_bootstrap(Broken(), 0, 1)
    with pytest.raises(epcomm.Error, match="all_gather returned 5 bytes, expected 8") as info:
        b.all_gather(b"12345678")
    assert info.value.code == "bootstrap"
    with pytest.raises(epcomm.Error, match="no barrier today"):
        b.barrier()
    with pytest.raises(epcomm.Error, match="must return bytes"):
        b.broadcast(b"x", 0)


def test_backend_not_built_is_reported():
    missing = [b for b in ("nvshmem", "proxy", "nvlink", "host") if b not in epcomm.built_backends()]
    if not missing:
        pytest.skip("every backend is built")
    with pytest.raises(epcomm.Error) as info:
        epcomm.AllToAll(8, 4, 2, 0, 1, 1, 8, 32, 0, backend=missing[0])
    assert info.value.code == "not_built"
    assert missing[0] in str(info.value)


def test_unknown_backend():
    with pytest.raises(epcomm.Error, match="unknown backend 'warp-drive'"):
        epcomm.AllToAll(8, 4, 2, 0, 1, 1, 8, 32, 0, backend="warp-drive")


@needs_host
def test_host_single_rank_checks_before_launch_and_stays_usable():
    with epcomm.AllToAll(8, 4, 2, 0, 1, 1, 8, 32, 0, backend="host") as a2a:
        assert a2a.backend == "host" and a2a.device == "cpu"
        num, ex, scale = a2a.alloc_dispatch_outputs(np.float32)
        assert scale is None and ex.shape == (4, 8, 8)
        x = np.ones((4, 8), np.float32)
        idx = np.array([[0, 1], [1, 2], [2, 3], [3, 0]], np.int32)
        with pytest.raises(epcomm.Error, match="dp_x rows are 28 bytes"):
            a2a.dispatch(num, ex, None, x[:, :7], None, idx)
        # The low-level binding reaches the C++ checks directly: same contract, C++ message.
        with pytest.raises(epcomm.Error, match="x rows are 28 bytes") as info:
            a2a._impl.dispatch(num, ex, None, np.ascontiguousarray(x[:, :7]), None, idx)
        assert "validate.cc" in info.value.file
        a2a.dispatch(num, ex, None, x, None, idx)
        assert num.tolist() == [2, 2, 2, 2]
        out = a2a.alloc_combine_output(4, np.float32)
        a2a.combine(out, idx, np.full((4, 2), 0.5, np.float32), ex)
        np.testing.assert_allclose(out, x)
    with pytest.raises(epcomm.Error, match="destroyed"):
        a2a.dispatch(num, ex, None, x, None, idx)
