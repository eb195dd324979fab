"""Start-up of processes spawned by a Megatron script that runs under
``megatron_mesh.megatron.run_script`` (which puts this directory on ``PYTHONPATH`` and sets
``MEGATRON_MESH_BOOTSTRAP=1``; nothing happens without it).

``multiprocessing``'s spawn start method -- used by Megatron's torch_dist checkpoint writer for its
result queue's manager -- starts a fresh interpreter that re-imports the main script (as
``__mp_main__``) without the wrapper, so this makes it importable (the ``typing.override``
polyfill) and, once ``multiprocessing`` has imported it (and with it ``megatron``, from the same
place as the parent), applies the same CPU workarounds as the parent. This directory holds this
file only, and any other ``sitecustomize`` on the path still runs.
"""

import os
import sys


def _chain_other_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    saved, module = sys.path[:], sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        import importlib

        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        if module is not None:
            sys.modules["sitecustomize"] = module


def _bootstrap() -> None:
    if not hasattr(__import__("typing"), "override"):
        import typing

        import typing_extensions

        typing.override = typing_extensions.override
    import multiprocessing.spawn as spawn

    prepare = spawn.prepare

    def prepare_then_patch(data):
        prepare(data)  # sys.path as the parent's, then the parent's main script re-imported
        import torch

        if not torch.cuda.is_available():
            from megatron_mesh.megatron import bootstrap

            bootstrap.prepare_runtime()

    spawn.prepare = prepare_then_patch


_chain_other_sitecustomize()
if os.environ.get("MEGATRON_MESH_BOOTSTRAP") == "1":
    _bootstrap()
