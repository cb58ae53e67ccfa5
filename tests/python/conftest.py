"""Shared fixtures of the Python tests. The package must be installed (`pip install .`); numpy is optional."""

import multiprocessing as mp
import socket

import pytest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def spawn():
    """spawn(target, n, args_fn, timeout) -> list of (status, rank, payload): runs target(rank, *args_fn(rank),
    results) in n spawned processes and fails the test on any error or hang."""
    import _mp_util

    def run(target, n, args_fn, timeout_s=180.0):
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=target, args=(r, *args_fn(r), results), daemon=True) for r in range(n)]
        for p in procs:
            p.start()
        out = _mp_util.gather(procs, results, timeout_s)
        errors = [f"rank {rank}:\n{payload}" for status, rank, payload in out if status != "ok"]
        assert not errors, "\n".join(errors)
        return out

    return run
