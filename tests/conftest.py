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
    _check_process_modules(items)


# The test modules that start several processes at a time: the shared spawns' readers (the 8-rank
# gloo spawn, the 4-rank Megatron spawn), the Megatron training runs, the scripts' jobs. Under
# pytest-xdist one worker runs them one after the other (:func:`pytest_xdist_make_scheduler`);
# collection fails naming a module that should be here and is not (:func:`_check_process_modules`).
PROCESS_MODULES = (
    "tests/megatron/test_megatron_masks.py", "tests/megatron/test_megatron_mla.py",
    "tests/megatron/test_megatron_model.py", "tests/megatron/test_megatron_pretrain.py",
    "tests/megatron/test_megatron_pretrain_masks.py", "tests/megatron/test_megatron_pretrain_models.py",
    "tests/megatron/test_megatron_pretrain_pipeline.py", "tests/megatron/test_megatron_sinks.py",
    "tests/runtime/test_api_distributed.py", "tests/runtime/test_masked_attention.py",
    "tests/runtime/test_mesh_attention.py", "tests/runtime/test_plan_bytes_vs_measured.py",
    "tests/runtime/test_sinks.py", "tests/runtime/test_tasp_attention.py",
    "tests/tools/test_main_job.py", "tests/tools/test_scripts.py",
)
SHARED_SPAWNS = ("gloo", "dist_results", "megatron_models")


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


def _check_process_modules(items) -> None:
    missing = sorted({_module(i.nodeid) for i in items
                      if ("slow" in i.keywords or any(f in i.fixturenames for f in SHARED_SPAWNS))}
                     - set(PROCESS_MODULES))
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: add {', '.join(missing)} to PROCESS_MODULES (its tests read a "
                                "shared spawn or are marked slow: under pytest-xdist they must run on the worker "
                                "that runs the other multi-process tests)")


PROCESS_WORKER = "gw0"  # the pytest-xdist worker that runs PROCESS_MODULES


def pytest_configure(config):
    # the other workers run at a lower priority: they take the cores the multi-process tests leave
    # idle (start-up, waits) instead of slowing them down (tests/README.md, "Two workers")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None and worker != PROCESS_WORKER:
        os.nice(10)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist (``scripts/test.sh`` runs ``-n 2``): each worker takes whole scopes -- a
    module (its module-scoped fixtures, a Megatron module's training runs, run once) -- and
    :data:`PROCESS_WORKER` first takes one scope of every module in :data:`PROCESS_MODULES`, which
    it runs one after the other (they keep both cores busy, and the shared spawns start once),
    while the other worker runs the single-process tests beside them at a lower priority
    (:func:`pytest_configure`). Two multi-process tests at once would put 8-12 processes on the
    2 cores (tests/README.md)."""
    from xdist.scheduler import LoadScopeScheduling

    class ProcessesInARow(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            return "processes" if module in PROCESS_MODULES else module

        def _assign_work_unit(self, node) -> None:
            queue = self.workqueue
            if node.gateway.id == PROCESS_WORKER and "processes" in queue:
                queue.move_to_end("processes", last=False)
            elif next(iter(queue)) == "processes" and len(queue) > 1:
                queue.move_to_end("processes", last=True)
            super()._assign_work_unit(node)

    return ProcessesInARow(config, log)


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
