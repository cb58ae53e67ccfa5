"""Elastic ranks through the Python API on the host backend (docs/failures.md, "Elastic ranks"): a rank killed with
SIGKILL is masked once the survivors agree, and they go on without it; ranks masked on purpose with
set_active_ranks; every completed round against the C++ reference under the mask."""

import pytest

np = pytest.importorskip("numpy", reason="numpy is not installed (pip install numpy)")
import epcomm  # noqa: E402

import _elastic_worker  # noqa: E402
from conftest import free_port  # noqa: E402

pytestmark = pytest.mark.skipif("host" not in epcomm.built_backends(),
                                reason=f"the host backend is not in this build (built: {epcomm.built_backends()})")


def _spawn_allowing_victim(target, n, args_fn, victim, timeout_s=180.0):
    """Like the spawn fixture, but the victim rank may die without a result."""
    import multiprocessing as mp

    import _mp_util

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args_fn(r), results), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    out = _mp_util.gather(procs[:victim] + procs[victim + 1:], results, timeout_s)
    _mp_util.reap(procs, 10)
    errors = [f"rank {rank}:\n{payload}" for status, rank, payload in out if status != "ok"]
    assert not errors, "\n".join(errors)
    assert procs[victim].exitcode == -9, f"the victim ended with {procs[victim].exitcode}"
    return out


def test_survivors_go_on_without_a_killed_rank():
    address = f"127.0.0.1:{free_port()}"
    out = _spawn_allowing_victim(_elastic_worker.run_rank, _elastic_worker.W, lambda r: (address, "kill"),
                                 _elastic_worker.VICTIM)
    assert sorted(rank for _, rank, _ in out) == [0, 1]
    assert all(payload["dropped"] > 0 for _, _, payload in out), out


def test_set_active_ranks_masks_a_rank_on_purpose(spawn):
    address = f"127.0.0.1:{free_port()}"
    out = spawn(_elastic_worker.run_rank, _elastic_worker.W, lambda r: (address, "set"))
    assert sum(payload["rounds"] for _, _, payload in out) == 2 * _elastic_worker.ROUNDS_AFTER


def test_bad_masks_are_refused():
    a2a = epcomm.AllToAll(8, 4, 2, 0, 1, 1, 32, 64, 0, backend="host", bootstrap=epcomm._C.self_bootstrap())
    assert a2a.active_ranks == [1]
    assert a2a.dropped_tokens == 0
    for mask, message in (([1, 1], "2 entries for 1 ranks"), ([2], "entry 0 is 2"), ([0], "no rank active"),
                          ("x", "sequence of 0 / 1 integers")):
        with pytest.raises(epcomm.Error, match=message) as info:
            a2a.set_active_ranks(mask)
        assert info.value.code == "invalid_argument"
    a2a.set_active_ranks([1])
    assert a2a.active_ranks == [1]
    a2a.destroy()
