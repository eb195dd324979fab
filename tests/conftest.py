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


@pytest.fixture(scope="session")
def dist_results(gloo):
    """Per rank, the results of mask_cases.all_cases (masked, hybrid and hostile-API cases): the
    last part of the one shared spawn of 8 gloo ranks (see ``gloo``)."""
    return gloo["mask_cases"]


@pytest.fixture(scope="session")
def gloo(request):
    """Everything distributed the selected tests need, from ONE spawn of 8 gloo processes
    (cases.run_gloo): process start-up, not compute, dominates small distributed tests on 2 cores.
    {part: {CP size: [results of group rank 0, 1, ...]}} for the parts (cases.PARTS) that a
    selected test's module names in its GLOO_PARTS, and "mask_cases" (per rank) when a selected
    test uses ``dist_results``; parts no selected test needs do not run."""
    import cases

    parts = set()
    for item in request.session.items:
        if "gloo" in item.fixturenames:
            parts.update(getattr(item.module, "GLOO_PARTS", ()))
        if "dist_results" in item.fixturenames:
            parts.add("mask_cases")
    return cases.run_gloo(parts)


@pytest.fixture(scope="session")
def megatron_models(request):
    """{case function: per-rank records} from ONE spawn of 4 gloo processes running the
    megatron_cases functions that the selected tests' modules name in their MEGATRON_CASES
    ({function name: its layouts}): each process imports Megatron, which costs more than the
    cases themselves on 2 cores."""
    import megatron_cases

    from megatron_mesh.comm.spawn import spawn

    cases: dict = {}
    for item in request.session.items:
        if "megatron_models" in item.fixturenames:
            cases.update(getattr(item.module, "MEGATRON_CASES", {}))
    per_rank = spawn(megatron_cases.run_cases, 4, cases, timeout=800)
    return {name: [records[name] for records in per_rank] for name in cases}


# -- Megatron's argument parser with the plugin's flags (test_megatron_args*.py) --------------------------
@pytest.fixture(scope="module")
def megatron_args():
    """parse(argv) -> Megatron's argparse Namespace with the plugin's flags (no Megatron validation)."""
    from megatron_mesh.megatron import ensure_typing_override

    ensure_typing_override()
    from megatron.training import arguments

    from megatron_mesh.megatron.args import add_args

    def parse(argv):
        saved = sys.argv
        sys.argv = ["pretrain_gpt", "--num-layers", "2", *argv]
        try:
            return arguments.parse_args(add_args)
        finally:
            sys.argv = saved
    return parse


@pytest.fixture()
def our_entry():
    """Keyword arguments of the checks (and apply_args) as megatron_mesh's entry script calls them: it
    hands the layers document boundaries."""
    return {"entry_packs_documents": True}


# -- documents for the pretrain() tests (test_megatron_pretrain_masks.py, _sinks.py) -------------------------
@pytest.fixture(scope="session")
def doc_data(tmp_path_factory):
    """Prefix of the documents dataset scripts/make_doc_dataset.py writes (its defaults: the same
    documents every time), made once per session for the pretrain() tests that train on documents."""
    import subprocess

    from helpers import ROOT

    prefix = str(tmp_path_factory.mktemp("docs") / "tiny_docs")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_doc_dataset.py"), prefix], check=True,
                   capture_output=True, timeout=120)
    return prefix
