"""The torch integration without a GPU: the scenarios of test_torch_nvlink.py (every dtype pair, dp groups, bound_m,
send/recv split with accumulate, the torch-group bootstrap, torch.compile(fullgraph=True) around a small MoE layer)
on the host backend with CPU tensors, 2 processes over libfabric tcp. The CUDA graph scenario needs a GPU.

Skips (with the reason) without torch or without the host backend in this build.
"""

import os

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
import epcomm  # noqa: E402

import _torch_worker  # noqa: E402
from conftest import free_port  # noqa: E402

pytestmark = pytest.mark.skipif("host" not in epcomm.built_backends(),
                                reason=f"the host backend is not in this build (built: {epcomm.built_backends()})")

WORLD = 2


@pytest.fixture(scope="module")
def scenario_results():
    os.environ.setdefault("EPCOMM_FABRIC_PROVIDER", "tcp")  # inherited by the spawned ranks
    return _torch_worker.run_pair("cpu", WORLD, free_port(), deadline_s=600)


@pytest.mark.parametrize("name", [s["name"] for s in _torch_worker.scenarios("cpu")])
def test_torch_host(name, scenario_results):
    _torch_worker.check_scenario(scenario_results, name, WORLD)


def test_eager_calls_bypass_the_custom_op():
    """A plain eager call goes straight to the library; traced calls and tensor subclasses take the custom op (what
    torch.compile needs; the compile scenario above proves the traced path stays in one graph)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from epcomm import _torch_ops

    x = torch.zeros(2)
    assert not _torch_ops.needs_op(x)
    with FakeTensorMode():
        assert _torch_ops.needs_op(torch.zeros(2))

    @torch.compile(fullgraph=True, backend="eager")
    def traced(t):
        return t + 1 if _torch_ops.needs_op(t) else t - 1

    assert torch.equal(traced(x), x + 1)
