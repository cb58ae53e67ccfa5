"""Device tests: every GPU backend of the build from torch with 2 ranks (every dtype pair, DP groups, bound_m,
send/recv split, torch.compile(fullgraph=True) around a small MoE layer, CUDA-graph capture and replay): nvlink,
nvshmem, and proxy over libfabric's shm and tcp providers (EPCOMM_PROXY_LOCAL_SIZE=1: every peer over the fabric).

Rank r runs on GPU r % device_count: on a one-GPU machine both ranks share it (their contexts take turns on it,
correctness only), on two GPUs each has its own. The scenarios of each backend run once, in one pair of processes.

Skips (with the reason) without torch, without a CUDA GPU, or for a backend that is not in this build.
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
import epcomm  # noqa: E402

import _gpu_backends  # noqa: E402
import _torch_worker  # noqa: E402
from conftest import free_port  # noqa: E402

pytestmark = pytest.mark.gpu

WORLD = 2


@pytest.fixture(scope="module", params=_gpu_backends.IDS)
def scenario_results(request):
    """Runs every scenario once on the backend of the parameter; maps name -> list of per-rank (status, stats)."""
    why = _gpu_backends.skip_reason(torch, epcomm, request.param)
    if why:
        pytest.skip(why)
    return _torch_worker.run_pair("cuda", WORLD, free_port(), deadline_s=400,
                                  backend=_gpu_backends.backend(request.param),
                                  env=_gpu_backends.environment(request.param))


@pytest.mark.parametrize("name", [s["name"] for s in _torch_worker.scenarios("cuda")])
def test_torch_gpu(name, scenario_results):
    _torch_worker.check_scenario(scenario_results, name, WORLD)
