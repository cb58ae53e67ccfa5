"""JAX arrays through DLPack on the host backend (one process): dispatch and combine take JAX inputs (x, indices,
weights, expert_y) and give the same bytes as with numpy inputs. Outputs stay numpy: JAX arrays are immutable, so
the written arguments must come from a framework whose buffers may be written (numpy, torch, CuPy).

Skips without JAX (CI installs numpy only; `pip install "jax[cpu]"` to run it) or without the host backend.
"""

import numpy as np
import pytest

jnp = pytest.importorskip("jax.numpy", reason="jax is not installed (pip install 'jax[cpu]')")
import epcomm  # noqa: E402

from conftest import free_port  # noqa: E402

pytestmark = pytest.mark.skipif("host" not in epcomm.built_backends(),
                                reason=f"the host backend is not in this build (built: {epcomm.built_backends()})")


def test_jax_inputs_match_numpy_inputs(monkeypatch):
    monkeypatch.setenv("EPCOMM_FABRIC_PROVIDER", "tcp")
    T, E, K, H = 12, 4, 2, 64
    rng = np.random.default_rng(7)
    x = rng.standard_normal((T, H)).astype(np.float32)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    idx[3, 1] = -1  # one masked entry
    w = rng.random((T, K)).astype(np.float32)
    with epcomm.AllToAll(T, E, K, 0, 1, 1, H, H * 4, 0, backend="host",
                         bootstrap=f"127.0.0.1:{free_port()}") as a2a:
        results = []
        for make in (np.asarray, jnp.asarray):
            num, ex, _ = a2a.alloc_dispatch_outputs("fp32")
            a2a.dispatch(num, ex, None, make(x), None, make(idx))
            y = (ex * 2).astype(np.float32)
            out = a2a.alloc_combine_output(T, "fp32")
            a2a.combine(out, make(idx), make(w), make(y))
            results.append((num.copy(), ex.copy(), out.copy()))
    (num_np, ex_np, out_np), (num_jx, ex_jx, out_jx) = results
    assert num_np.sum() == T * K - 1
    np.testing.assert_array_equal(num_jx, num_np)
    np.testing.assert_array_equal(ex_jx, ex_np)
    np.testing.assert_array_equal(out_jx, out_np)
    # Every token's experts doubled it: out = 2 x * (sum of its unmasked weights).
    valid = np.where(idx >= 0, w, 0).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(out_np, 2 * x * valid, rtol=1e-5, atol=1e-5)


def test_jax_outputs_are_refused():
    """A JAX array as a written argument is an error naming it (writing through its DLPack export would change an
    immutable array); nothing is launched."""
    T, E, K, H = 4, 4, 2, 64
    num = np.zeros(E, np.int32)
    ex = np.zeros((E, T, H), np.float32)
    x = np.zeros((T, H), np.float32)
    idx = np.zeros((T, K), np.int32)
    with epcomm.AllToAll(T, E, K, 0, 1, 1, H, H * 4, 0, backend="host") as a2a:
        with pytest.raises(epcomm.Error, match="out_expert_x is written by this call but it is a JAX array"):
            a2a.dispatch(num, jnp.asarray(ex), None, x, None, idx)
        a2a.dispatch(num, ex, None, x, None, idx)
        with pytest.raises(epcomm.Error, match="out_tokens is written by this call but it is a JAX array"):
            a2a.combine(jnp.zeros((T, H), jnp.float32), idx, np.zeros((T, K), np.float32), ex)
