"""One rank of the elastic-ranks test (spawned; importable without pytest): rounds on the host backend with
EPCOMM_ELASTIC=1, checked against the C++ reference under the object's active-ranks mask; the victim rank kills
itself with SIGKILL before a round, and the survivors go on without it."""

import os
import traceback

W, E, K, T, H = 3, 6, 3, 8, 32
VICTIM = 2
ROUNDS_BEFORE, ROUNDS_AFTER = 3, 60


def _inputs(rnd: int):
    import numpy as np

    rng = np.random.default_rng([7, rnd])
    x = [rng.standard_normal((T, H)).astype(np.float32) for _ in range(W)]
    idx = []
    for _ in range(W):
        i = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
        i[rng.random(i.shape) < 0.2] = -1
        idx.append(i)
    w = [rng.random((T, K)).astype(np.float32) for _ in range(W)]
    return x, idx, w


def _round(a2a, ref_cfg, rank: int, rnd: int, mode: str) -> int:
    """One checked round; returns the positions dropped by the mask for this rank."""
    import numpy as np
    from epcomm import _C

    x, idx, w = _inputs(rnd)
    ys = []
    for r in range(W):
        y = a2a.alloc_expert_y("fp32")
        y[...] = np.random.default_rng([11, rnd, r]).standard_normal(y.shape).astype(np.float32)
        ys.append(y)
    num, ex, exs = a2a.alloc_dispatch_outputs("fp32")
    a2a.dispatch(num, ex, exs, x[rank], None, idx[rank])
    out = np.zeros((T, H), np.float32)
    a2a.combine(out, idx[rank], w[rank], ys[rank])
    mask = a2a.active_ranks
    # The reference under the mask the object reports after the round.
    ref = []
    for r in range(W):
        rnum, rex, rexs = a2a.alloc_dispatch_outputs("fp32")
        ref.append(dict(out_expert_num_tokens=rnum, out_expert_x=rex, out_expert_x_scale=rexs, dp_x=x[r],
                        dp_x_scale=None, indices=idx[r]))
    _C.reference_dispatch(ref_cfg, ref, mask)
    np.testing.assert_array_equal(num, ref[rank]["out_expert_num_tokens"], err_msg=f"round {rnd}: counts")
    for e in range(E // W):
        n = int(num[e])
        np.testing.assert_array_equal(ex[e, :n], ref[rank]["out_expert_x"][e, :n], err_msg=f"round {rnd}: rows")
    refc = [dict(out_tokens=np.zeros((T, H), np.float32), indices=idx[r], weights=w[r], expert_y=ys[r])
            for r in range(W)]
    _C.reference_combine(ref_cfg, refc, mask)
    np.testing.assert_array_equal(out, refc[rank]["out_tokens"], err_msg=f"round {rnd}: out_tokens")
    L = E // W
    return int(sum(1 for e in idx[rank].ravel() if e >= 0 and not mask[e // L]))


def run_rank(rank: int, address: str, mode: str, results) -> None:
    # Read by epcomm on first use: set before the first epcomm call in this process.
    os.environ.update(EPCOMM_ELASTIC="1", EPCOMM_TIMEOUT_MS="3000", EPCOMM_FABRIC_PROVIDER="tcp")
    try:
        results.put(("ok", rank, _run(rank, address, mode)))
    except BaseException:  # noqa: BLE001 -- report everything to the parent
        results.put(("error", rank, traceback.format_exc()))


def _run(rank: int, address: str, mode: str):
    import signal

    import epcomm

    a2a = epcomm.AllToAll(T, E, K, rank, W, 1, H, 4 * H, 0, backend="host", bootstrap=address)
    ref_cfg = epcomm.make_config(T, E, K, 0, W, 1, H, 4 * H, 0)
    assert a2a.active_ranks == [1] * W
    for rnd in range(ROUNDS_BEFORE):
        assert _round(a2a, ref_cfg, rank, rnd, mode) == 0
    rnd = ROUNDS_BEFORE
    lost = None
    if mode == "kill":
        if rank == VICTIM:
            # Leaves no time to say goodbye: the survivors find out from their waits.
            import time

            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            _round(a2a, ref_cfg, rank, rnd, mode)
        except epcomm.Error as e:
            lost = (e.code, str(e))
        assert lost is not None, "the round completed without the dead rank"
        assert lost[0] in ("timeout", "fabric", "peer_failure"), lost
        assert f"without rank {VICTIM}" in lost[1], lost
        rnd += 1
    else:
        # Every rank masks the victim on purpose, the victim included (it leaves).
        mask = [1] * W
        mask[VICTIM] = 0
        a2a.set_active_ranks(mask)
        if rank == VICTIM:
            x, idx, _ = _inputs(rnd)
            try:
                a2a.dispatch(*a2a.alloc_dispatch_outputs("fp32"), x[rank], None, idx[rank])
            except epcomm.Error as e:
                assert "left the object" in str(e), str(e)
                return {"dropped": 0, "rounds": 0}
            raise AssertionError("a dispatch on a rank that left went through")
    expected = [1] * W
    expected[VICTIM] = 0
    assert a2a.active_ranks == expected, a2a.active_ranks
    dropped = 0
    for i in range(ROUNDS_AFTER):
        dropped += _round(a2a, ref_cfg, rank, rnd + i, mode)
    assert a2a.dropped_tokens == dropped, (a2a.dropped_tokens, dropped)
    assert dropped > 0
    a2a.destroy()
    return {"dropped": dropped, "rounds": ROUNDS_AFTER}
