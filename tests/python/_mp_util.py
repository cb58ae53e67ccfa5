"""Process helpers of the Python tests (no numpy, no torch: importable everywhere, also in spawned children)."""

import traceback
from typing import Dict, List, Optional


def run_example(rank: int, world_size: int, code: str, env: Dict[str, str], results) -> None:
    """Runs a documentation example with torch.distributed environment variables set."""
    import faulthandler
    import os
    import sys

    faulthandler.dump_traceback_later(60, repeat=False, file=sys.stderr)  # a hang shows where it is
    try:
        os.environ.update(env)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
        exec(compile(code, "docs/python.md", "exec"), {"__name__": "__example__"})
        results.put(("ok", rank, {}))
    except BaseException:  # noqa: BLE001
        results.put(("error", rank, traceback.format_exc()))


def gather(procs, results, timeout_s: float) -> List[Optional[tuple]]:
    """Collects one result per process (or a timeout note) and reaps the processes."""
    import queue
    import time

    out = []
    deadline = time.monotonic() + timeout_s
    for _ in procs:
        try:
            out.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
        except queue.Empty:
            out.append(("error", -1, f"no result within {timeout_s} s (a rank hung or crashed)"))
    reap(procs, 10)
    return out


def reap(procs, grace_s: float) -> None:
    """Joins every process, killing the ones still running after `grace_s` seconds."""
    for p in procs:
        p.join(timeout=grace_s)
        if p.is_alive():
            p.kill()
            p.join()
