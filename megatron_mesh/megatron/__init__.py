"""Megatron-Core integration: the only part of megatron_mesh that imports Megatron.

* :mod:`.core_attention` -- the core-attention module (``cp_comm_type`` mesh / tasp / ring, or
  Transformer Engine's modes handed over to ``TEDotProductAttention``; Megatron's own at CP 1);
* :mod:`.spec` -- layer specs for ``--spec megatron_mesh.megatron.spec gpt_layer_spec`` and GPTModel;
  in any Megatron training script they also configure the plugin from Megatron's parsed arguments;
* :mod:`.args` -- the plugin's CLI flags, their start-up checks, and the config that carries them;
* :mod:`.groups` -- Mesh Q/KV ring and TASP node process groups built from Megatron's CP groups;
* :mod:`.telemetry` / :mod:`.metrics` -- summary line, timers and bytes in Megatron's log; JSON lines;
* :mod:`.pretrain_gpt` -- the plugin's pretraining entry script (``megatron.training.pretrain``);
* :mod:`.batch_layout` -- the CP layout of packed documents (``--cp-layout auto|balanced|zigzag``): the
  per-sample decision, the batch split, RoPE at the layout's positions, Megatron-LM's scripts;
* :mod:`.run_script` -- runs any Megatron script (Megatron-LM's ``pretrain_gpt.py``) with the plugin;
* :mod:`.bootstrap` -- process start-up shared by the two;
* :mod:`.cpu_compat` -- workarounds for running Megatron on a CPU (loaded by CPU runs only).

``scripts/pretrain_gpt.sh CONFIG.yaml`` and ``scripts/run_megatron_script.sh SCRIPT.py`` start them
under torchrun (``python -m megatron_mesh.megatron.launch``); see docs/megatron.md.

Importing this package does not import Megatron.
"""

from __future__ import annotations

import typing

from ..plan.modes import MODES

__all__ = ["plugin_modes", "TE_MODES", "cp_modes", "ensure_typing_override"]

# cp_comm_type values handed over to Transformer Engine
TE_MODES = ("p2p", "a2a", "all_gather", "a2a+p2p")


def plugin_modes() -> tuple[str, ...]:
    """cp_comm_type values run by this plugin: its mode registry, read at call time (ring, mesh,
    tasp, the Ulysses hybrids, and any mode registered since)."""
    return tuple(MODES)


def cp_modes() -> tuple[str, ...]:
    return plugin_modes() + TE_MODES


def ensure_typing_override() -> None:
    """megatron.training (0.19) does ``from typing import override``, new in Python 3.12; the
    wheel itself runs on 3.11, so give 3.11 the typing_extensions version before importing it."""
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
