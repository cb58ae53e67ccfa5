"""pplx-kernels' and DeepEP's calling patterns with torch tensors (docs/compat.md): pplx-kernels' own test calls
(keyword arguments, group_name of a torch.distributed group, uint32 indices and bound_m, out_tokens with
max_num_tokens rows, torch.compile around dispatch and combine) and a DeepEP decode step through
epcomm.deep_ep.Buffer. On the host backend with CPU tensors (2 processes), and on the GPU backends with CUDA
tensors (2 processes sharing the GPUs there are).

Skips without torch, and the GPU half without a GPU or a GPU backend in this build.
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
import epcomm  # noqa: E402

import _compat_torch_worker  # noqa: E402
from conftest import free_port  # noqa: E402

WORLD = 2
NAMES = [s["name"] for s in _compat_torch_worker.SCENARIOS]


def _run(device):
    import multiprocessing as mp
    import queue
    import time

    import _mp_util

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_compat_torch_worker.run, args=(r, WORLD, port, device, results), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + 900
    for _ in range(len(NAMES) * WORLD):
        try:
            name, rank, status, stats = results.get(timeout=max(1.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        out.setdefault(name, []).append((rank, status, stats))
        if name == "<setup>":
            break
    _mp_util.reap(procs, 30)
    return out


def _check(results, name):
    if "<setup>" in results:
        pytest.fail("worker setup failed:\n" + "\n".join(s for _, s, _ in results["<setup>"]))
    got = results.get(name)
    assert got is not None and len(got) == WORLD, f"{name}: {got} (a rank hung or died)"
    errors = [f"rank {rank}:\n{status}" for rank, status, _ in got if status != "ok"]
    assert not errors, "\n".join(errors)
    assert sum(stats["rows"] for _, _, stats in got) > 0


@pytest.fixture(scope="module")
def host_results():
    if "host" not in epcomm.built_backends():
        pytest.skip(f"the host backend is not in this build (built: {epcomm.built_backends()})")
    return _run("cpu")


@pytest.fixture(scope="module")
def gpu_results():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if not set(epcomm.built_backends()) & {"nvlink", "nvshmem", "proxy"}:
        pytest.skip(f"no GPU backend in this build (built: {epcomm.built_backends()})")
    return _run("cuda")


@pytest.mark.parametrize("name", NAMES)
def test_compat_torch_host(name, host_results):
    _check(host_results, name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_compat_torch_gpu(name, gpu_results):
    _check(gpu_results, name)
