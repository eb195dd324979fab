import os
import sys

import pytest

# spawned ranks import the case functions from this directory by module name
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for marker, option in (("exhaustive", "--exhaustive"), ("megatron_matrix", "--megatron-matrix")):
        if not config.getoption(option):  # opt-in sweeps: left out, not reported as skipped
            kept = [item for item in items if marker not in item.keywords]
            config.hook.pytest_deselected(items=[item for item in items if marker in item.keywords])
            items[:] = kept
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


def pytest_addoption(parser):
    parser.addoption("--exhaustive", action="store_true",
                     help="also run the tests marked 'exhaustive' (plan checks for every P up to 256, hours)")
    parser.addoption("--megatron-matrix", action="store_true",
                     help="also run the tests marked 'megatron_matrix' (every plugin mode x bf16 / fp16 / distributed "
                          "optimizer / recompute / sequence parallelism through both entry scripts, ~15 min)")
