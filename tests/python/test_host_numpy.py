"""End to end on the host backend with numpy arrays, in 2 and 4 real processes, against the C++ reference."""

import pytest

np = pytest.importorskip("numpy", reason="numpy is not installed (pip install numpy)")
import epcomm  # noqa: E402

import _host_worker  # noqa: E402
from _host_worker import Case  # noqa: E402
from conftest import free_port  # noqa: E402

pytestmark = pytest.mark.skipif("host" not in epcomm.built_backends(),
                                reason=f"the host backend is not in this build (built: {epcomm.built_backends()})")

CASES = [
    Case("w2_bf16_batched", world_size=2),
    Case("w2_fp8_scale_packed_int64_bound_acc", world_size=2, x_dtype="fp8_e4m3", with_scale=True, layout="packed",
         expert_padding=4, index_dtype="int64", use_bound_m=True, accumulate=True, out_dtype="fp32"),
    Case("w2_fp32_fp16_split_uint32", world_size=2, x_dtype="fp32", y_dtype="fp16", out_dtype="fp16",
         index_dtype="uint32", split_send_recv=True),
    Case("w2_callback_bootstrap", world_size=2, bootstrap="callback", rounds=1),
    Case("w2_env_bootstrap", world_size=2, bootstrap="env", rounds=1, layout="packed"),
    Case("w4_dp2_bf16_bound_split", world_size=4, dp_size=2, num_experts=16, use_bound_m=True, split_send_recv=True),
    Case("w4_packed_fp8_scale", world_size=4, num_experts=16, experts_per_token=4, x_dtype="fp8_e4m3",
         with_scale=True, layout="packed", expert_padding=8, y_dtype="fp32", out_dtype="bf16"),
    Case("w4_dp4_int64", world_size=4, dp_size=4, num_experts=8, index_dtype="int64", masked_fraction=0.3),
    # A rank with no tokens this step (data-parallel attention) takes its part in the round.
    Case("w2_empty_rank", world_size=2, empty_groups=[1], rounds=3),
    Case("w4_dp2_empty_group_split_bound", world_size=4, dp_size=2, num_experts=16, empty_groups=[0],
         use_bound_m=True, split_send_recv=True, x_dtype="fp8_e4m3", with_scale=True, layout="packed",
         expert_padding=4),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_host_matches_reference(case, spawn):
    address = f"127.0.0.1:{free_port()}"
    out = spawn(_host_worker.run_rank, case.world_size, lambda r: (case, address))
    rows = sum(payload["rows"] for _, _, payload in out)
    tokens = sum(payload["tokens"] for _, _, payload in out)
    assert rows > 0 and tokens > 0, f"nothing was compared: {out}"


def test_docs_numpy_example():
    """The numpy example of docs/python.md, verbatim."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "python.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    example = next(b for b in blocks if "import numpy" in b)
    exec(compile(example, "docs/python.md", "exec"), {"__name__": "__example__"})


def test_calls_out_of_order_are_refused(monkeypatch):
    """Dispatch and combine alternate: a call out of order is an error naming the call and the object's state, and
    the object stays usable (one process, W = 1)."""
    monkeypatch.setenv("EPCOMM_FABRIC_PROVIDER", "tcp")
    T, E, K, H = 4, 4, 2, 16
    x = np.ones((T, H), np.float32)
    idx = np.array([[0, 1], [1, 2], [2, 3], [3, 0]], np.int32)
    w = np.full((T, K), 0.5, np.float32)
    with epcomm.AllToAll(T, E, K, 0, 1, 1, H, H * 4, 0, backend="host",
                         bootstrap=f"127.0.0.1:{free_port()}") as a2a:
        num, ex, _ = a2a.alloc_dispatch_outputs("fp32")
        out = a2a.alloc_combine_output(T, "fp32")
        with pytest.raises(epcomm.Error, match="combine send while the object is 'idle'"):
            a2a.combine(out, idx, w, ex)
        with pytest.raises(epcomm.Error, match="dispatch receive while the object is 'idle'"):
            a2a.dispatch(num, ex, None, x, None, idx, do_send=False)
        a2a.dispatch(num, ex, None, x, None, idx)
        a2a.combine(out, idx, w, (ex * 2).astype(np.float32))
        with pytest.raises(epcomm.Error, match="combine send while the object is 'idle'"):
            a2a.combine(out, idx, w, ex)
        np.testing.assert_allclose(out, 2 * x)
