"""The plugin's Megatron settings, as one schema: every command-line flag with its type, choices,
default, help and the layer modes it applies to -- generated from the mode registry (each mode
option that names a Megatron flag, see :func:`megatron_mesh.plan.setting`) plus the plugin's
general flags below. The argparse flags (:func:`.args.add_args`), the config fields
(:class:`MeshTransformerConfig`), the settings a layer reads (:func:`plugin_settings`) and the
applicability checks (:mod:`.checks`) are all made from :func:`flags` -- nothing restates them.

Example: MeshMode's option ``tile = setting("auto", flag="--mesh-tile-shape", help=...)`` gives
the flag ``--mesh-tile-shape`` (default None = not given), the config field ``mesh_tile_shape``, and
the rule that it applies to layers running ``mesh`` or ``a2a+mesh``; ``plugin_settings(config)
.options("a2a+mesh")`` returns ``{"tile": ..., "contiguous": ..., ...}`` for the hybrid's inner Mesh.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron.core.transformer.transformer_config import TransformerConfig

from ..kernels import KERNEL_BACKENDS
from ..plan.modes import MODES, get_mode, option_specs
from . import plugin_modes

__all__ = ["Flag", "flags", "flag_dest", "PluginSettings", "plugin_settings", "MeshTransformerConfig", "layer_modes",
           "plugin_modes_of", "ALL_PLUGIN_MODES", "NODE_AWARE", "CP_LAYOUTS",
           "BATCH_DOCUMENTS", "cp_layout"]

# --cp-layout's values, the default first (why: docs/megatron.md, "Packed documents: the CP layout");
# "auto": per sample the balanced layout unless the zigzag is priced faster for the layers' mode
# (plan/choice.py); "balanced-hide": the balanced layout whose Ulysses groups run some inside
# documents first and last (balanced_layout(hide=True), where the planner finds it pays)
CP_LAYOUTS = ("auto", "balanced", "zigzag", "balanced-hide")
# config.cp_documents values whose documents come from each sample of the batch (end-of-document
# tokens, position-id resets) and so get a CP layout per sample; "thd" is a layout of its own
BATCH_DOCUMENTS = ("eod", "positions")
# applies_to markers of the general flags (resolved against the registry when asked)
ALL_PLUGIN_MODES = "every plugin mode"
NODE_AWARE = "every plugin mode that uses the node layout"


@dataclass(frozen=True)
class Flag:
    """One plugin flag. ``default`` is the setting's value when the flag is left out (argparse's
    default is None: "not given", so a flag given where nothing uses it is an error);
    ``applies_to``: the layer modes it applies to at CP > 1 (None: always applies);
    ``option``: the mode option it sets (None: a general setting)."""

    name: str
    default: Any
    help: str
    choices: tuple | None = None
    type: Any = str
    store_true: bool = False
    applies_to: tuple[str, ...] | str | None = None
    option: str | None = None

    @property
    def dest(self) -> str:
        return flag_dest(self.name)

    def modes(self) -> tuple[str, ...] | None:
        """The layer modes this flag applies to, read from the registry now."""
        if self.applies_to == ALL_PLUGIN_MODES:
            return plugin_modes()
        if self.applies_to == NODE_AWARE:
            return tuple(m for m in MODES if get_mode(m).uses_nodes)
        return self.applies_to


def flag_dest(flag: str) -> str:
    """argparse's attribute name of a flag (``--mesh-tile-shape`` -> ``mesh_tile_shape``)."""
    return flag.lstrip("-").replace("-", "_")


GENERAL = (
    Flag("--tasp-gpus-per-node", None, type=int, applies_to=NODE_AWARE,
         help="GPUs per node: TASP's node-aware rings, the node layout the 'auto' choices are simulated on, the "
              "Ulysses groups (default: torchrun's LOCAL_WORLD_SIZE)"),
    Flag("--cp-kernel-backend", "auto", choices=KERNEL_BACKENDS, applies_to=ALL_PLUGIN_MODES,
         help="block attention kernel of the plugin modes"),
    Flag("--log-cp-attention-bytes", False, store_true=True, applies_to=ALL_PLUGIN_MODES,
         help="log the plugin's attention bytes per iteration (min and max over ranks) at every --log-interval, and "
              "write them to TensorBoard when a writer is set up"),
    Flag("--cp-metrics-dir", None,
         help="write per-rank JSON lines (rank<R>.jsonl) to this directory: the mode and tile of every layer, then "
              "loss, time, attention bytes and peak memory per iteration"),
    Flag("--cp-layout", CP_LAYOUTS[0], choices=CP_LAYOUTS,
         help="which CP rank holds which tokens of a sample of packed documents (--reset-attention-mask; megatron_mesh's "
              "entry script, or any script through scripts/run_megatron_script.sh) at CP > 1: 'auto' -- per sample "
              "the balanced layout, unless Megatron's zigzag is priced faster for the layers' mode (the plain modes "
              "across nodes, mostly; megatron_mesh/plan/choice.py) -- 'balanced' -- each "
              "sample's own work-balanced, document-aware layout (short documents whole on one rank, long ones in "
              "zigzag portions over a few ranks; needs --calculate-per-token-loss, as auto does) -- 'balanced-hide', "
              "the same whose "
              "Ulysses groups (a2a+*) run some documents first and last to hide the all-to-all (megatron-mesh-plan "
              "--layout all says when it pays) -- or 'zigzag', Megatron's global zigzag"),
    Flag("--no-cp-layout-lookahead", False, store_true=True,
         help="--cp-layout balanced or auto: work out each micro-batch's layouts and this rank's plans of them on "
              "the step's critical path, instead of on a background thread while the step before trains (the default)"),
    Flag("--cp-thd-packing", False, store_true=True,
         help="megatron_mesh's entry script: pack each sample's end-of-document-delimited documents into Transformer "
              "Engine's THD layout (packed_seq_params, qkv_format thd), every document padded to a multiple of "
              "--cp-thd-pad-multiple; needs --micro-batch-size 1"),
    Flag("--cp-thd-pad-multiple", None, type=int,
         help="padding multiple of --cp-thd-packing (a multiple of 2 x CP size; default 2 x CP size)"),
)


def flags() -> tuple[Flag, ...]:
    """Every plugin flag: the general ones, then one per mode option that names a flag (a flag
    several modes share -- a hybrid and its inner mode -- applies to all of them). Read from the
    registry at call time, so a mode registered later brings its flags."""
    by_name: dict[str, Flag] = {}
    for mode in MODES.values():
        for spec in option_specs(mode.Options):
            if spec.flag is None:
                continue
            known = by_name.get(spec.flag)
            if known is not None:
                by_name[spec.flag] = dataclasses.replace(known, applies_to=known.applies_to + (mode.name,))
                continue
            kind = type(spec.default) if spec.default is not None and spec.parse is None else str
            by_name[spec.flag] = Flag(spec.flag, spec.default, spec.help, spec.choices, kind,
                                      applies_to=(mode.name,), option=spec.name)
    return GENERAL + tuple(by_name.values())


@dataclass(frozen=True)
class PluginSettings:
    """The plugin settings a config carries: every flag's value (its default when not given)."""

    values: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, **given) -> "PluginSettings":
        """Settings from keyword values by flag dest (e.g. ``mesh_tile_shape="2x2"``); the rest default."""
        unknown = sorted(set(given) - {f.dest for f in flags()})
        if unknown:
            raise ValueError(f"unknown plugin settings {unknown}; known: {', '.join(f.dest for f in flags())}")
        return cls(tuple((f.dest, given[f.dest] if given.get(f.dest) is not None else f.default) for f in flags()))

    def __getitem__(self, dest: str) -> Any:
        for k, v in self.values:
            if k == dest:
                return v
        raise KeyError(f"no plugin setting {dest!r}")

    @property
    def kernel(self) -> str:
        return self["cp_kernel_backend"]

    @property
    def gpus_per_node(self) -> Optional[int]:
        """GPUs per node: ``--tasp-gpus-per-node``, else torchrun's LOCAL_WORLD_SIZE, else None (one node)."""
        given = self["tasp_gpus_per_node"]
        if given is not None:
            return given
        local = os.environ.get("LOCAL_WORLD_SIZE")
        return int(local) if local else None

    def options(self, mode: str) -> dict:
        """The options of ``mode`` its flags set (every option with a flag; the others keep the
        mode's defaults)."""
        out = {}
        for spec in option_specs(get_mode(mode).Options):
            if spec.flag is not None:
                value = self[flag_dest(spec.flag)]
                out[spec.name] = spec.parse(value) if spec.parse is not None and isinstance(value, str) else value
        return out


def plugin_settings(config) -> PluginSettings:
    """The plugin settings carried by ``config`` (a MeshTransformerConfig, or any config
    :func:`.args.apply_args` put them on; defaults for what it lacks or leaves None)."""
    return PluginSettings.of(**{f.dest: getattr(config, f.dest, None) for f in flags()})


def _config_fields() -> list:
    out = [(f.dest, Optional[Any], field(default=None, metadata={"help": f.help})) for f in flags()]
    out.append(("cp_seq_length", Optional[int],
                field(default=None, metadata={"help": "global sequence length (from --seq-length), for the time "
                                                      "model behind the 'auto' choices"})))
    out.append(("cp_documents", Optional[str],
                field(default=None, metadata={"help": "where the layers' document boundaries come from: 'eod' "
                                                      "(end-of-document tokens, --reset-attention-mask), 'positions' "
                                                      "(position-id resets, --reset-position-ids too, through "
                                                      "run_megatron_script.sh), 'thd' (packed sequences) or None "
                                                      "(whole sequences)"})))
    return out


MeshTransformerConfig = dataclasses.make_dataclass(
    "MeshTransformerConfig", _config_fields(), bases=(TransformerConfig,),
    namespace={"__doc__": "TransformerConfig plus the plugin's settings: one field per plugin flag (None: not "
                          "given), the global sequence length and where documents come from.",
               "__module__": __name__})


# -- the layers' modes -------------------------------------------------------------------------------------
def layer_modes(cp_comm_type) -> list:
    """cp_comm_type as a list (a single mode -> one entry); None -> []."""
    if cp_comm_type is None:
        return []
    return [cp_comm_type] if isinstance(cp_comm_type, str) else list(cp_comm_type)


def plugin_modes_of(modes) -> set:
    """The plugin's modes among ``modes``."""
    return {m for m in modes if m in plugin_modes()}


def cp_layout(config) -> str:
    """``--cp-layout`` of ``config`` (Megatron's parsed arguments or a transformer config carrying
    the plugin settings); its default when not given."""
    return getattr(config, "cp_layout", None) or CP_LAYOUTS[0]
