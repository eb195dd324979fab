"""CP layouts users choose by name, in one registry (see :mod:`.base`): Megatron's zigzag
(:mod:`.zigzag`), Transformer Engine's THD (:mod:`.thd`), the balanced layout (:mod:`.balanced`,
:mod:`.balanced_hide`), Mesh's own (:mod:`.owners`) and Megatron's default ``auto`` (:mod:`.auto`). A new layout is one file
here -- its name and help, how it is built for a sample, its Megatron flag and what it asks of the
consumers -- and one :func:`register` call; Megatron's ``--cp-layout``, its checks and per-sample
decision, and the planner's ``--layout`` rows read it from :data:`LAYOUTS`."""

from .auto import AutoKind
from .balanced import BalancedKind
from .balanced_hide import BalancedHideKind
from .owners import OwnersKind
from .base import (DEFAULT_LAYOUT, LAYOUTS, REFERENCE_LAYOUT, LayoutKind, Sample, SampleLayoutError, cp_layout_names,
                   get_layout_kind, layout_names, register)
from .thd import ThdKind, thd_layout
from .zigzag import ZigzagKind

__all__ = ["LayoutKind", "Sample", "SampleLayoutError", "LAYOUTS", "register", "get_layout_kind", "layout_names", "cp_layout_names",
           "DEFAULT_LAYOUT", "REFERENCE_LAYOUT", "thd_layout", "ZigzagKind", "ThdKind", "BalancedKind",
           "BalancedHideKind", "OwnersKind", "AutoKind"]

# the planner's rows in this order
for _kind in (ZigzagKind(), ThdKind(), BalancedKind(), BalancedHideKind(), OwnersKind(), AutoKind()):
    register(_kind)
