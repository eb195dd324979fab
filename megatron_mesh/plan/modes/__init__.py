"""CP modes in one registry (see :mod:`.base`): ring and Mesh (:mod:`.mesh`), TASP (:mod:`.tasp`)
and their Ulysses hybrids (:mod:`.hybrid`). A new mode is one file here -- its options, resolve,
dense plan, assignment under a mask, rings, candidates, description -- and one :func:`register`
call; the API, the Megatron flags and checks, the planner and the reports read it from
:data:`MODES`."""

from .base import (HYBRID_PREFIX, MODES, Mode, OptionSpec, Placement, get_mode, option_specs, parse_mode_spec,
                   register, resolve, setting, topology_for)
from .hybrid import HybridMode, register_hybrid
from .mesh import MeshMode, MeshOptions, RingMode, RingOptions
from .tasp import TRANSPORTS, TaspMode, TaspOptions
from . import base as _base

__all__ = ["Mode", "Placement", "MODES", "register", "get_mode", "resolve", "parse_mode_spec", "setting", "option_specs", "OptionSpec",
           "HYBRID_PREFIX", "TRANSPORTS", "topology_for", "MeshMode", "RingMode", "TaspMode", "HybridMode",
           "MeshOptions", "RingOptions", "TaspOptions", "DEFAULT_MODE", "REFERENCE_MODE"]

for _mode in (RingMode(), MeshMode(), TaspMode()):
    register(_mode)
for _inner in ("mesh", "tasp", "ring"):
    register_hybrid(MODES[_inner])
_base._ON_REGISTER.append(register_hybrid)  # a mode registered from now on gets its hybrid too

# the mode the others are compared against (bytes and speed "vs ring"), and the one a single-rank
# group runs (every mode is the same one block there)
REFERENCE_MODE = DEFAULT_MODE = "ring"
