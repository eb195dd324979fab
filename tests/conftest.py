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
    if not config.getoption("--exhaustive"):  # opt-in sweeps: left out, not reported as skipped
        kept = [item for item in items if "exhaustive" not in item.keywords]
        config.hook.pytest_deselected(items=[item for item in items if "exhaustive" in item.keywords])
        items[:] = kept
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


def pytest_addoption(parser):
    parser.addoption("--exhaustive", action="store_true",
                     help="also run the tests marked 'exhaustive' (plan checks for every P up to 256, hours)")


@pytest.fixture(scope="session")
def dist_results():
    """One spawn of 8 gloo ranks for the masked, hybrid and hostile-API cases (tests/mask_cases.py):
    start-up, not compute, dominates small distributed tests on 2 cores."""
    from megatron_mesh.launch import spawn

    import mask_cases

    return spawn(mask_cases.all_cases, 8, timeout=600)


@pytest.fixture(scope="session")
def gloo(request):
    """{part: {CP size: [results of group rank 0, 1, ...]}} for every distributed part (cases.PARTS)
    that a collected test's module names in its GLOO_PARTS, all from ONE spawn of 8 gloo processes
    (cases.run_gloo): only the parts the selected tests need run."""
    import cases

    parts = {p for item in request.session.items if "gloo" in item.fixturenames
             for p in getattr(item.module, "GLOO_PARTS", ())}
    return cases.run_gloo(parts)
