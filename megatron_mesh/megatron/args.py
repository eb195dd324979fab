"""The plugin's command-line flags in Megatron's parser, and the typed settings they put on the
model config -- both generated from the settings schema (:mod:`.settings`).

Flags are added through Megatron's ``extra_args_provider`` hook (:func:`add_args`) and checked at
start-up by :func:`.checks.validate_args`. Whatever the entry script, the spec functions put the
settings of Megatron's parsed arguments -- one frozen :class:`~.settings.PluginSettings` with the
real sequence length and where documents come from -- on the transformer config
(:func:`apply_args`: ``config.cp_settings``), which the layers read with
:func:`.settings.plugin_settings`.

A plugin flag left out is ``None`` on the arguments (so a flag given but unable to apply -- a Mesh
flag without a Mesh layer -- is an error) and its default on the settings.

Example (CP 4, 4 layers: Mesh tile 2x2 for the first two, TASP for the last two)::

    --context-parallel-size 4 --cp-comm-type mesh mesh tasp tasp --mesh-tile-shape 2x2
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import TransformerConfig

from .errors import fail
from .settings import PluginSettings, flags

__all__ = ["add_args", "apply_args", "parse_flags", "MeshTransformerConfig"]


@dataclass
class MeshTransformerConfig(TransformerConfig):
    """TransformerConfig plus the plugin's settings (:class:`~.settings.PluginSettings`, None: the
    defaults), e.g. ``MeshTransformerConfig(..., cp_settings=PluginSettings.of(mesh_tile_shape="2x2"))``."""

    cp_settings: Optional[PluginSettings] = None


def add_args(parser):
    """``extra_args_provider`` for ``megatron.training.arguments.parse_and_validate_args``: one
    flag per entry of :func:`.settings.flags`, default None ("not given"): the settings supply
    the real defaults, and the checks reject a flag given for a mode no layer runs."""
    # A bad flag (the plugin's or Megatron's) is one line per node and status 2 on every rank,
    # as the plugin's own checks are, instead of argparse's usage (~380 lines) from every rank.
    parser.error = _one_line_error
    g = parser.add_argument_group("megatron_mesh", "context-parallel attention modes of the plugin "
                                  "(--cp-comm-type MODE, one value or one per layer)")
    for f in flags():
        # argparse reads help as a %-format (e.g. "ties within 1 %" in --mesh-tile-shape's): a
        # literal % is written %%
        if f.store_true:
            g.add_argument(f.name, action="store_true", help=f.help.replace("%", "%%"))
            continue
        default = f" (default {f.default})" if f.default is not None else ""
        g.add_argument(f.name, default=None, type=f.type, choices=f.choices,
                       help=(f.help + default).replace("%", "%%"))
    return parser


def _one_line_error(message: str):
    if message.endswith("expected one argument"):
        # argparse takes a value that starts with '-' (--window-size -1,0) for another flag
        message += " (a value starting with '-' is written --flag=VALUE, e.g. --window-size=-1,0)"
    fail(f"{message} (the flags: --help)")


def parse_flags(argv) -> argparse.Namespace:
    """``argv`` parsed by Megatron's argument parser with the plugin's flags -- the parser a run
    starts with -- and nothing else (no validation, no process state): an unknown flag or a value
    the parser refuses is the run's own one line and status 2, without training.
    ``python -m megatron_mesh.megatron.args FLAGS...`` runs it (scripts/compare_cp_modes.py, on
    the flags after its ``--``, before its first run)."""
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)  # as Megatron's
    return add_args(add_megatron_arguments(parser)).parse_args(list(argv))


def apply_args(args, config, *, entry_packs_documents: bool = False, batch_documents: bool = False) -> None:
    """Put the plugin settings of Megatron's parsed ``args`` (defaults for flags it lacks, the
    global sequence length, where documents come from) on ``config`` as ``config.cp_settings`` --
    a plain TransformerConfig too: what any entry script builds with
    ``core_transformer_config_from_args(args)``. ``entry_packs_documents``: whether the entry
    script hands the layers document boundaries (megatron_mesh's own); ``batch_documents``:
    whether :mod:`.batch_layout` takes them from its batches (``run_script``)."""
    config.cp_settings = PluginSettings.from_args(args, entry_packs_documents=entry_packs_documents,
                                                  batch_documents=batch_documents)


if __name__ == "__main__":
    import gc

    from . import ensure_typing_override

    gc.disable()  # a process that only parses: the collector's passes over Megatron's import are waste
    ensure_typing_override()
    parse_flags(sys.argv[1:])
