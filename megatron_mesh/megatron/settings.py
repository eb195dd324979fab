"""The plugin's Megatron settings: one schema, and one typed object read where the settings are used.

The schema (:func:`flags`) is every command-line flag with its type, choices, default, help and
the layer modes it applies to -- generated from the mode registry (each mode option that names a
Megatron flag, see :func:`megatron_mesh.plan.setting`), the layout registry (``--cp-layout``'s
values, :mod:`megatron_mesh.plan.layouts`) and the plugin's general flags below. The argparse
flags (:func:`.args.add_args`), the typed settings object (:class:`PluginSettings`) and the
applicability checks (:mod:`.checks`) are made from it -- nothing restates them.

:class:`PluginSettings` is frozen and typed (one attribute per flag: ``cp_layout: str``,
``cp_thd_packing: bool``, ``tasp_gpus_per_node: int | None`` ...; a mode or layout registered
later brings its own), made once from Megatron's parsed arguments (:meth:`PluginSettings.from_args`,
the one reader of the plugin's flags) and carried on the transformer config (``cp_settings``);
the layers, the checks and the batch split read its attributes. With it the problem of the run
(:func:`problem_of`: heads, shape, Ulysses degree, window, documents), from
:class:`megatron_mesh.plan.megatron_problem.MegatronProblem`.

Example: MeshMode's option ``tile = setting("auto", flag="--mesh-tile-shape", help=...)`` gives
the flag ``--mesh-tile-shape`` (left out: None on the arguments), the attribute
``settings.mesh_tile_shape`` ("auto" when left out), and the rule that it applies to layers
running ``mesh`` or ``a2a+mesh``; ``settings.options("a2a+mesh")`` returns ``{"tile": ...,
"contiguous": ..., ...}`` for the hybrid's inner Mesh.

Importing this module imports neither Megatron nor torch (the comparison job maps its mode specs
to flags here, :func:`mode_flags`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
import typing
from typing import Any, Optional

from ..plan.layouts import DEFAULT_LAYOUT, LAYOUTS, LayoutKind, cp_layout_names, get_layout_kind
from ..plan.megatron_problem import BATCH_DOCUMENTS, CHUNK_FLAG, MegatronProblem, documents_of
from ..plan.modes import MODES, get_mode, option_specs
from . import plugin_modes

__all__ = ["Flag", "flags", "flag_dest", "PluginSettings", "plugin_settings", "problem_of", "layer_modes",
           "plugin_modes_of", "mode_flags", "ALL_PLUGIN_MODES", "NODE_AWARE", "BATCH_DOCUMENTS", "NODES_FLAG",
           "HIERARCHY_FLAG"]

# applies_to markers of the general flags (resolved against the registry when asked)
ALL_PLUGIN_MODES = "every plugin mode"
NODE_AWARE = "every plugin mode that uses the node layout"
# where a placement's CP ranks per node and a hybrid's all-to-all degree come from in Megatron
NODES_FLAG = "--tasp-gpus-per-node"
HIERARCHY_FLAG = "--hierarchical-context-parallel-sizes"  # Megatron's own: U M


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

    @property
    def value_type(self) -> Any:
        """The type of the setting's attribute on :class:`PluginSettings`."""
        if self.store_true:
            return bool
        return self.type if self.default is not None else Optional[self.type]

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


def _layout_help() -> str:
    kinds = [LAYOUTS[name] for name in cp_layout_names()]
    return ("which CP rank holds which tokens of a sample of packed documents (--reset-attention-mask; megatron_mesh's "
            "entry script, or any script through scripts/run_megatron_script.sh) at CP > 1: " +
            "; ".join(f"'{k.name}' -- {k.help}" for k in kinds) + ". Every layout but Megatron's own zigzag needs "
            "--calculate-per-token-loss (the ranks hold different documents)")


def _general() -> tuple[Flag, ...]:
    """The plugin's general flags (read now: --cp-layout's values from the layout registry)."""
    from ..kernels import KERNEL_BACKENDS  # torch: only where flags are made, not where this module is imported

    return (
        Flag(NODES_FLAG, None, type=int, applies_to=NODE_AWARE,
             help="GPUs per node: TASP's node-aware rings, the node layout the 'auto' choices are simulated on, the "
                  "Ulysses groups (default: torchrun's LOCAL_WORLD_SIZE)"),
        Flag("--cp-kernel-backend", "auto", choices=KERNEL_BACKENDS, applies_to=ALL_PLUGIN_MODES,
             help="block attention kernel of the plugin modes"),
        Flag("--log-cp-attention-bytes", False, store_true=True, applies_to=ALL_PLUGIN_MODES,
             help="log the plugin's attention bytes per iteration (min and max over ranks) at every --log-interval, "
                  "and write them to TensorBoard when a writer is set up"),
        Flag("--cp-metrics-dir", None,
             help="write per-rank JSON lines (rank<R>.jsonl) to this directory: the mode and tile of every layer, "
                  "then loss, time, attention bytes and peak memory per iteration"),
        Flag("--cp-layout", DEFAULT_LAYOUT, choices=cp_layout_names(), help=_layout_help()),
        Flag(CHUNK_FLAG, None, type=int, applies_to=ALL_PLUGIN_MODES,
             help="Llama 4's chunked local attention: causal attention inside chunks of this many tokens (counted from "
                  "each document's start) on every layer but those --no-rope-freq marks as NoPE layers, which attend "
                  "globally (Llama 4 interleaves them: --no-rope-freq 4); the plugin's layers apply it, at CP 1 too "
                  "(Megatron's own attention has no chunked attention)"),
        Flag("--no-cp-layout-lookahead", False, store_true=True,
             help="a --cp-layout other than zigzag: work out each micro-batch's layouts and this rank's plans of them "
                  "on the step's critical path, instead of on a background thread while the step before trains (the "
                  "default)"),
        Flag("--cp-thd-packing", False, store_true=True,
             help="megatron_mesh's entry script: pack each sample's end-of-document-delimited documents into "
                  "Transformer Engine's THD layout (packed_seq_params, qkv_format thd), every document padded to a "
                  "multiple of --cp-thd-pad-multiple; needs --micro-batch-size 1"),
        Flag("--cp-thd-pad-multiple", None, type=int,
             help="padding multiple of --cp-thd-packing (a multiple of 2 x CP size; default 2 x CP size, so runs at "
                  "other CP sizes pad, and train on, other sequences: give one multiple of 2 x the largest CP size "
                  "to compare CP sizes)"),
    )


def flags() -> tuple[Flag, ...]:
    """Every plugin flag: the general ones, then one per mode option that names a flag (a flag
    several modes share -- a hybrid and its inner mode -- applies to all of them). Read from the
    registries at call time, so a mode or layout registered later brings its flag or value."""
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
    return _general() + tuple(by_name.values())


# -- the typed settings -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PluginSettings:
    """The plugin's settings, typed (see the module docstring): one attribute per flag, named by
    its dest (its default when the flag is left out), which flags were ``given``, and what the
    plugin reads of Megatron's arguments beside them: the global sequence length and where the
    documents come from. The attributes of the flags are a subclass's, made from :func:`flags`
    (:meth:`of`); every value is checked when the object is made (ValueError naming the flag)."""

    given: frozenset = frozenset()
    seq_length: Optional[int] = None
    documents: Optional[str] = None
    _schema: typing.ClassVar[tuple] = ()  # the flags whose attributes the made type has

    @classmethod
    def of(cls, **values) -> "PluginSettings":
        """Settings from keyword values by flag dest (e.g. ``mesh_tile_shape="2x2"``), ``given``,
        ``seq_length`` and ``documents``; a flag left out or None takes its default."""
        known = {f.dest: f for f in flags()}
        unknown = sorted(set(values) - set(known) - {f.name for f in dataclasses.fields(PluginSettings)})
        if unknown:
            raise ValueError(f"unknown plugin settings {unknown}; known: {', '.join(known)}")
        values = {k: v for k, v in values.items() if v is not None or k not in known}
        return _settings_type(tuple(known.values()))(**values)

    @classmethod
    def from_args(cls, args, *, entry_packs_documents: bool = False, batch_documents: bool = False
                  ) -> "PluginSettings":
        """The settings of Megatron's parsed ``args`` (or any object with the flags' dests: a
        flag it lacks, or holds None or False for, is left out). ``entry_packs_documents``: the
        entry script hands the layers document boundaries (megatron_mesh's own);
        ``batch_documents``: the batch split of Megatron-LM's scripts takes them from the batches."""
        values = {f.dest: getattr(args, f.dest, None) for f in flags()}
        given = frozenset(dest for dest, v in values.items() if v is not None and v is not False)
        thd = bool(values.get("cp_thd_packing"))
        return cls.of(**values, given=given, seq_length=getattr(args, "seq_length", None),
                      documents=documents_of(args, thd_packing=thd, entry_packs_documents=entry_packs_documents,
                                             batch_documents=batch_documents))

    def __post_init__(self) -> None:
        for f in self._schema:
            value = getattr(self, f.dest)
            if f.store_true:
                if not isinstance(value, bool):
                    raise ValueError(f"{f.name} is on or off (True or False), got {value!r}")
            elif f.choices is not None and value not in f.choices:
                raise ValueError(f"{f.name} {value!r}: allowed {', '.join(map(str, f.choices))}")
            elif f.type is int and value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                                          or value < 1):
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")

    def __reduce__(self):  # the type is made at run time: rebuild it by value (copy, pickle)
        return _rebuild, ({f.name: getattr(self, f.name) for f in dataclasses.fields(self)},)

    def shown(self, f: Flag) -> str:
        """The flag as given, e.g. ``--mesh-tile-shape 2x2`` (a switch: its name)."""
        value = getattr(self, f.dest)
        return f.name if value is True else f"{f.name} {value}"

    @property
    def kernel(self) -> str:
        return self.cp_kernel_backend

    @property
    def layout(self) -> LayoutKind:
        """The kind of ``--cp-layout`` (:mod:`megatron_mesh.plan.layouts`)."""
        return get_layout_kind(self.cp_layout)

    @property
    def gpus_per_node(self) -> Optional[int]:
        """GPUs per node: ``--tasp-gpus-per-node``, else torchrun's LOCAL_WORLD_SIZE, else None (one node)."""
        given = self.tasp_gpus_per_node
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
                value = getattr(self, flag_dest(spec.flag))
                out[spec.name] = spec.parse(value) if spec.parse is not None and isinstance(value, str) else value
        return out


@functools.lru_cache(maxsize=None)
def _settings_type(schema: tuple[Flag, ...]) -> type:
    """The frozen dataclass with one typed attribute per flag of ``schema`` (one per registry state)."""
    fields = [(f.dest, f.value_type, dataclasses.field(default=f.default, metadata={"flag": f.name, "help": f.help}))
              for f in schema]
    return dataclasses.make_dataclass("PluginSettings", fields, bases=(PluginSettings,), frozen=True,
                                      namespace={"__module__": __name__, "__doc__": PluginSettings.__doc__,
                                                 "_schema": schema})


def _rebuild(values: dict) -> PluginSettings:
    return PluginSettings.of(**values)


def plugin_settings(config) -> PluginSettings:
    """The plugin settings of ``config``: the object it carries (``cp_settings``, put there by
    :func:`.args.apply_args`), else -- Megatron's parsed arguments, a config built without it --
    made from the flags' dests it holds (defaults for what it lacks)."""
    carried = getattr(config, "cp_settings", None)
    return carried if carried is not None else PluginSettings.from_args(config)


def problem_of(config, settings: PluginSettings | None = None) -> MegatronProblem:
    """The run's attention problem (:class:`~megatron_mesh.plan.megatron_problem.MegatronProblem`)
    of Megatron's arguments or a transformer config, with the sequence length and documents its
    ``settings`` carry (default: :func:`plugin_settings` of it)."""
    settings = plugin_settings(config) if settings is None else settings
    return MegatronProblem.from_namespace(config, seq_len=settings.seq_length, documents=settings.documents,
                                          chunk_size=settings.attention_chunk_size)


# -- the layers' modes -------------------------------------------------------------------------------------
def layer_modes(cp_comm_type) -> list:
    """cp_comm_type as a list (a single mode -> one entry); None -> []."""
    if cp_comm_type is None:
        return []
    return [cp_comm_type] if isinstance(cp_comm_type, str) else list(cp_comm_type)


def plugin_modes_of(modes) -> set:
    """The plugin's modes among ``modes``."""
    return {m for m in modes if m in plugin_modes()}


def mode_flags(mode: str, settings: dict, cp: int) -> list[str]:
    """The Megatron flags that run ``mode`` at CP size ``cp`` with ``settings`` (its options and
    shorthand settings by name, as :func:`megatron_mesh.plan.modes.parse_mode_spec` gives them):
    each option's own flag, the CP ranks per node as --tasp-gpus-per-node, a hybrid's all-to-all
    degree U as --hierarchical-context-parallel-sizes U CP/U. ValueError naming a setting no
    Megatron flag sets (never dropped)."""
    flag_of = {s.name: s.flag for s in option_specs(get_mode(mode).Options)}
    out: list[str] = []
    for name, value in settings.items():
        if name == "ranks_per_node":
            out += [NODES_FLAG, str(value)]
        elif name == "ulysses_size":
            if not isinstance(value, int) or isinstance(value, bool) or value < 2 or cp % value:
                raise ValueError(f"the all-to-all degree {value} must be an integer >= 2 dividing the CP size {cp}")
            out += [HIERARCHY_FLAG, str(value), str(cp // value)]
        elif flag_of.get(name):
            out += [flag_of[name], str(value)]
        else:
            raise ValueError(f"CP mode {mode!r}: its setting {name} has no Megatron flag (its flags: "
                             f"{', '.join(f for f in flag_of.values() if f) or 'none'})")
    return out

