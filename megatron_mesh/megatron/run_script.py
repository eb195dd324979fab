"""Run any Megatron training script -- e.g. Megatron-LM's own ``pretrain_gpt.py``, unmodified --
with the plugin's flags and checks, as one torchrun worker::

    torchrun --nproc-per-node 4 -m megatron_mesh.megatron.run_script pretrain_gpt.py <Megatron flags> \\
        --spec megatron_mesh.megatron.spec gpt_layer_spec --context-parallel-size 4 \\
        --cp-comm-type mesh --mesh-tile-shape 2x2

(``scripts/run_megatron_script.sh SCRIPT.py [CONFIG.yaml] [flags]`` builds that command.) Before the
script runs, exactly as ``python SCRIPT.py`` would run it (its directory first on ``sys.path``, so a
Megatron-LM checkout's ``megatron/`` is the one imported):

* the worker dies with its launcher (:func:`.bootstrap.die_with_parent`) and exits on Ctrl-C
  without a traceback (:func:`.bootstrap.quiet_interrupt`);
* :func:`.bootstrap.prepare_runtime`: the ``typing.override`` polyfill, the prebuilt dataset
  helpers and -- only without CUDA -- the CPU workarounds of :mod:`.cpu_compat`;
* :func:`.bootstrap.install_argument_hook`: Megatron's parser accepts the plugin's flags, and the
  plugin's checks run before Megatron's own validation (one error on rank 0, exit status 2);
* :func:`.batch_layout.install`: with ``--reset-attention-mask`` the script's
  ``get_batch_on_this_cp_rank`` takes each sample's documents from its position ids (or
  end-of-document tokens) and splits the batch by its CP layout (``--cp-layout``), so the plugin
  layers get the document boundaries instead of a dense [s, s] mask (GPUs too);
* :func:`.pipeline.install`: with documents at pipeline parallelism > 1 every stage -- the middle
  ones, whose ``get_batch`` returns nothing, too -- learns each micro-batch's documents.

Processes the script spawns (the checkpoint writer's ``multiprocessing`` manager re-imports the
script, without this module) get the same through ``_site/sitecustomize.py``, which this module
puts on ``PYTHONPATH`` for them.
"""

from __future__ import annotations

import os
import runpy
import sys

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
CHILD_ENV = "MEGATRON_MESH_BOOTSTRAP"  # tells _site/sitecustomize.py to prepare spawned children


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].endswith(".py"):
        raise SystemExit("usage: python -m megatron_mesh.megatron.run_script SCRIPT.py [flags]")
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_mesh: error: no such script: {argv[0]}")
    from . import bootstrap
    from .process import PROCESS

    bootstrap.quiet_interrupt()  # Ctrl-C (forwarded by torchrun): exit 130 without a traceback per rank
    bootstrap.pause_gc()  # while the script imports torch and Megatron (resumed when it parses its arguments)
    bootstrap.die_with_parent()
    # as `python SCRIPT.py`: the script's directory first (its sibling modules, a checkout's megatron/)
    sys.path[0] = os.path.dirname(script)
    os.environ[CHILD_ENV] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SITE_DIR, os.environ.get("PYTHONPATH")) if p)
    bootstrap.prepare_runtime()
    with bootstrap.entry_run():  # after torch's import: a node that stops stops the others, and back
        bootstrap.install_argument_hook()
        from . import batch_layout, pipeline

        batch_layout.install()  # before the script imports get_batch_on_this_cp_rank
        batch_layout.install_lookahead()
        pipeline.install()  # at PP > 1 every stage learns each micro-batch's documents
        PROCESS.batch_documents = True
        sys.argv = [script, *argv[1:]]
        runpy.run_path(script, run_name="__main__")
    bootstrap.freeze_gc()  # a quicker exit


if __name__ == "__main__":
    main()
