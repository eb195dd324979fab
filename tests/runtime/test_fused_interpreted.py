"""The fused merge's Triton kernel (``megatron_mesh/runtime/fused.py``: what every merge of the
executor runs on a GPU) on this CPU, through Triton's interpreter (``TRITON_INTERPRET=1``, set
before Triton is imported: a process of its own), against :func:`~megatron_mesh.runtime.merge.merge_partial_`'s
torch ops -- the CUDA tier's comparison (``tests/runtime/test_graphs.py``), run on every CI run."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

ROOT = pathlib.Path(__file__).resolve().parents[2]

CODE = textwrap.dedent("""
    import torch
    from megatron_mesh.runtime import fused
    from megatron_mesh.runtime.merge import merge_partial_

    got = fused._kernel()
    assert got is not None and type(got[1]).__name__ == "InterpretedFunction", got
    close = dict(rtol=1e-6, atol=1e-6)
    g = torch.Generator().manual_seed(0)
    for d, dtype in ((32, torch.bfloat16), (24, torch.float16), (64, torch.float32)):  # 24: a padded BLOCK
        out = torch.randn(48, 2, 3, d, generator=g).permute(1, 2, 0, 3)  # token-major storage, [B, H, T, D]
        lse = torch.randn(2, 3, 48, generator=g)
        lse[0, 0, :4], out[0, 0, :4] = float("-inf"), 0  # rows no key has reached
        blk_out = torch.randn(2, 3, 48, d, generator=g).to(dtype)
        blk_lse = torch.randn(2, 3, 48, generator=g)
        blk_lse[0, 0, 0] = float("-inf")  # ... nor does the block's
        blk_lse[1, 2, 5:9] = float("-inf")  # rows the block does not reach
        a, b = (out.clone(), lse.clone()), (out.clone(), lse.clone())
        merge_partial_(*a, blk_out, blk_lse)
        fused._launch(got, *b, blk_out, blk_lse)
        torch.testing.assert_close(b[0], a[0], **close)
        torch.testing.assert_close(b[1], a[1], **close)
        assert b[1][0, 0, 0] == float("-inf") and (b[0][0, 0, 0] == 0).all(), "an unreached row stays 0, -inf"
        assert torch.equal(b[0][0, 0, 1:4], blk_out[0, 0, 1:4].float()), "a row reached first becomes the block's"
        assert torch.equal(b[0][1, 2, 5:9], out[1, 2, 5:9]) and torch.equal(b[1][1, 2, 5:9], lse[1, 2, 5:9])
        again = (out.clone(), lse.clone())
        fused._launch(got, *again, blk_out, blk_lse)
        assert torch.equal(again[0], b[0]) and torch.equal(again[1], b[1]), "deterministic"
        # rows [10, 30) of the accumulator, as the executor merges a call's rows (views, any strides)
        c, e, f, h = out.clone(), lse.clone(), out.clone(), lse.clone()
        fused._launch(got, c[:, :, 10:30], e[:, :, 10:30], blk_out[:, :, 5:25], blk_lse[:, :, 5:25])
        merge_partial_(f[:, :, 10:30], h[:, :, 10:30], blk_out[:, :, 5:25], blk_lse[:, :, 5:25])
        torch.testing.assert_close(c, f, **close)
        torch.testing.assert_close(e, h, **close)
        assert torch.equal(c[:, :, :10], out[:, :, :10]) and torch.equal(c[:, :, 30:], out[:, :, 30:])
    print("ok")
""")


def test_the_triton_merge_matches_the_torch_ops_under_triton_s_interpreter():
    """The kernel against the torch ops on token-major fp32 accumulators and bf16 / fp16 / fp32
    block results (a head dim of 24: the block padded to 32, masked): within fp32 rounding, and
    exact where the merge is -- an unreached row stays (0, -inf), a row reached first becomes the
    block's, rows the block does not reach keep theirs; deterministic; on rows [10, 30) of an
    accumulator, the others untouched."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-4000:]
