"""pplx-kernels' and DeepEP's calling patterns with torch tensors (docs/compat.md): pplx-kernels' own test calls
(keyword arguments, group_name of a torch.distributed group, uint32 indices and bound_m, out_tokens with
max_num_tokens rows, torch.compile around dispatch and combine) and a DeepEP decode step through
epcomm.deep_ep.Buffer. On the host backend with CPU tensors (2 processes), and on each GPU backend of the build with
CUDA tensors (nvlink, nvshmem, proxy over shm and over tcp; 2 processes, rank r on GPU r % device_count: both share
the GPU of a one-GPU machine).

Skips without torch, and the GPU half without a GPU or for a backend that is not in this build.
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
import epcomm  # noqa: E402

import _compat_torch_worker  # noqa: E402
import _gpu_backends  # noqa: E402
from conftest import free_port  # noqa: E402

WORLD = 2
NAMES = [s["name"] for s in _compat_torch_worker.SCENARIOS]


def _run(device, deadline_s, backend=None, env=None):
    """Every scenario in WORLD spawned ranks; maps name -> [(rank, status, stats)]. A rank that dies before it
    reported every scenario ends the wait at once, under the name "<setup>"."""
    import multiprocessing as mp
    import queue
    import time

    import _mp_util

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    dump_after_s = max(60.0, deadline_s - 30)  # the stacks of a hung rank, before the deadline gives up on it
    procs = [ctx.Process(target=_compat_torch_worker.run,
                         args=(r, WORLD, port, device, results, backend, env, dump_after_s), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    out = {}
    reported = [0] * WORLD
    deadline = time.monotonic() + deadline_s
    while sum(reported) < len(NAMES) * WORLD and time.monotonic() < deadline and "<setup>" not in out:
        try:
            name, rank, status, stats = results.get(timeout=2)
        except queue.Empty:
            dead = [f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(procs)
                    if not p.is_alive() and reported[r] < len(NAMES)]
            if dead:
                out["<setup>"] = [(-1, "; ".join(dead) + f" before reporting every scenario (reported: {sorted(out)})",
                                   {})]
            continue
        out.setdefault(name, []).append((rank, status, stats))
        if 0 <= rank < WORLD:
            reported[rank] += 1
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
    return _run("cpu", 900)


@pytest.fixture(scope="module", params=_gpu_backends.IDS)
def gpu_results(request):
    why = _gpu_backends.skip_reason(torch, epcomm, request.param)
    if why:
        pytest.skip(why)
    return _run("cuda", 400, _gpu_backends.backend(request.param), _gpu_backends.environment(request.param))


@pytest.mark.parametrize("name", NAMES)
def test_compat_torch_host(name, host_results):
    _check(host_results, name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_compat_torch_gpu(name, gpu_results):
    _check(gpu_results, name)
