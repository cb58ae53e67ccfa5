"""The README's PyTorch example on 2 GPUs (nvlink; it runs NCCL, one GPU per rank), and the torch custom ops'
schemas. The scenarios of every GPU backend, on one GPU or two, are in test_torch_gpu.py.

Skips (with the reason) without torch, and the example with fewer than 2 GPUs or without the nvlink backend.
"""

import multiprocessing as mp
import pathlib
import re

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
import epcomm  # noqa: E402

import _mp_util  # noqa: E402
from conftest import free_port  # noqa: E402

WORLD = 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
@pytest.mark.skipif("nvlink" not in epcomm.built_backends(),
                    reason=f"the nvlink backend is not in this build (built: {epcomm.built_backends()})")
def test_torch_docs_example():
    """The PyTorch example of the README (docs/python.md carries the same one), verbatim, on 2 GPUs."""
    root = pathlib.Path(__file__).resolve().parents[2]

    def torch_example(path):
        text = (root / path).read_text()
        return next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "import torch" in b)

    example = torch_example("README.md")
    assert torch_example("docs/python.md") == example, "README.md and docs/python.md show different examples"
    assert len(example.strip().splitlines()) <= 15
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_mp_util.run_example, args=(r, WORLD, example, env, results), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    out = _mp_util.gather(procs, results, 120)
    errors = [f"rank {rank}:\n{payload}" for status, rank, payload in out if status != "ok"]
    assert not errors, "\n".join(errors)


def test_torch_custom_ops_registered():
    """The ops exist with mutable outputs declared in their schema (what torch.compile relies on)."""
    assert epcomm.HAVE_TORCH_OPS
    schema = str(torch.ops.epcomm.dispatch.default._schema)
    assert "Tensor(a1!) out_expert_num_tokens" in schema and "Tensor(a2!) out_expert_x" in schema, schema
    scaled = str(torch.ops.epcomm.dispatch_scaled.default._schema)
    assert "Tensor(a3!) out_expert_x_scale" in scaled, scaled
    assert "Tensor(a1!) out_tokens" in str(torch.ops.epcomm.combine.default._schema)
