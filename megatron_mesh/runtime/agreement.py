"""Plan agreement: on every attention call, the ranks of the CP group check that they run the same call.

Why: the executor trusts that every rank of the group walks the same plan -- the same rounds,
transfers and shapes. Ranks that disagree hang (a transfer one side never posts), abort inside the
transport (gloo's C++ size check), or, worst, return a wrong result without an error (two plans
whose transfers have the same shapes; a different softmax scale). With packed documents every
batch brings a new plan, so a single data-loader bug is enough -- and a rank that reuses a cached
plan must be checked as much as one that built a new one, so nothing here is cached per rank.

How: each rank digests what must agree (:class:`Call`) into a 63-bit integer ``d``. One
all-reduce MAX of the int64 pair ``[d, -d]`` gives every rank the largest digest of the group and
minus the smallest: ``max == min`` (the same on every rank) means all agree, and the call runs.
Only when they differ do the ranks gather their descriptions (``all_gather_object``) to name the
difference, and every rank raises :class:`PlanMismatchError` with the same message -- before any
transfer is posted, so none hangs and none returns.

Worked example (4 ranks; rank 0 passes ``softmax_scale=0.5``, the others the default 1/sqrt(32)):
d0 != d1 = d2 = d3, so max != min on every rank, the descriptions are gathered and every rank
raises::

    PlanMismatchError: the ranks of this CP group disagree on the attention plan (...):
    softmax_scale: rank 0: 0.5, ranks 1-3: 0.17677669529663687

What a call's digest covers: the mode and every placement setting (tile, schedule, backward
chunks and keep limit, rank order, ranks per node, transport, all-to-all degree, the inner placement), the mask
(causal, window, documents), the layout (zigzag, or THD's padded sequences), the local shape
(s_local, batch, heads, kv heads, head dim, value head dim), the attention sinks' kind (none,
fixed or learnable: not their values, which would cost a host read per call), the dtype, the
softmax scale, the kernel, whether a backward follows (grad mode on and an input requiring grad:
a rank under ``torch.no_grad()`` would leave the others waiting in theirs), the check's own
switch (below), the plan itself (a digest of its structure, computed once per plan object), and
the code that built it (:func:`plan_code`: the plugin's version, a digest of the plan layer's
source files and the plan builders' tunables). The plan digest names the plan, not each rank's op list (a
rank builds only its own); ranks running the same code on the same inputs build matching op
lists, so the code is what closes that gap: two nodes with different plugin versions, or a
patched builder, raise here instead of hanging in a transfer one side never posts.

Cost: one 16-byte all-reduce per call, on the group backend's device (CPU for gloo; for NCCL a
CUDA tensor whose result the host reads: one stream synchronisation per call, which drains the
GPU's queue and with it the lead the host gained while the GPU ran the layer's other work). So an
NCCL group is checked over a gloo group of the same ranks where one is given
(:meth:`GroupChecks.use_cpu_group`; the Megatron adapter makes one per CP group): the hosts agree
among themselves, and the GPU's queue is left alone. Measured on CPU with
``scripts/bench_agreement.py`` (docs/performance.md). Communicators without a ``process_group``
(in-process test transports) and single-rank groups are not checked.

The switch, ``MEGATRON_MESH_PLAN_AGREEMENT``: ``1`` (the default) checks every call; ``0`` turns
the check off once the ranks agree to that. A rank with it off cannot skip the collective on its
own: the ranks with it on would wait for it in their all-reduce. So a rank with the check off
still takes part in the check of a group's first call (and of the first call after it was on
again), its digest covering the switch; where every rank has it off they agree and no collective
runs on that group any more; where some have it on, every rank raises PlanMismatchError naming the
switch. (A rank that turns the check back on later, alone, after its group agreed to run without
it is not seen: nothing runs to see it.) A value other than 0 or 1 raises ValueError on its rank,
after joining the check described by that error, as a bad input does.

A rank whose own input checks fail still joins the check, describing itself by its error
(:func:`joined_on_error`), before raising that error: the other ranks raise PlanMismatchError
naming it instead of waiting for that rank in their first transfer. The process settings of the
runtime (the mask piece, ``MEGATRON_MESH_MASK_PIECE``) are read there too.
"""

from __future__ import annotations

import functools
import hashlib
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from .. import __version__
from .. import plan as plan_package
from ..plan.ir import Plan
from ..plan.tunables import TUNABLES
from .state import RUNTIME, GroupChecks

__all__ = ["PlanMismatchError", "Call", "GroupChecks", "check", "check_plans_over", "joined_on_error", "enabled",
           "plan_digest", "plan_code", "mismatch_message", "differences", "ENV", "SWITCH"]

ENV = "MEGATRON_MESH_PLAN_AGREEMENT"
SWITCH = f"plan check ({ENV})"  # the switch's field in a call's description


class PlanMismatchError(RuntimeError):
    """The ranks of one CP group called attention with different plans, settings or inputs
    (they would hang or return a wrong result)."""


def enabled() -> bool:
    """Whether calls are checked (``MEGATRON_MESH_PLAN_AGREEMENT``: 1, the default, or 0)."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 1 (check every attention call, the default) or 0 (no check), got {value!r}")
    return value == "1"


def plan_digest(plan: Plan) -> str:
    """A digest of the plan's structure (mode, sizes, tile, schedule, mask, layout, rings,
    options), once per plan object (kept with the plan): every batch with documents brings a new
    plan, but a plan reused by several calls (or layers) is digested once."""
    def digest() -> str:
        text = f"{plan.header()}|{plan.mask.text()}|{plan.layout.text()}|{plan.rings}"
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    return plan.memo(("agreement digest",), digest)


@functools.cache
def _source_digest() -> str:
    """The plan layer's source files, hashed once per process."""
    root = Path(plan_package.__file__).parent
    h = hashlib.blake2b(digest_size=6)
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def plan_code() -> str:
    """The code that builds the plans: the plugin's version, a digest of the plan layer's source
    files (read once) and the builders' tunables the runtime builds with (:data:`TUNABLES`, as a
    whole: every field). Two ranks with different values would build op lists that do not match."""
    return f"{__version__} {_source_digest()} {TUNABLES!r}"


def _kernel_text(kernel) -> str:
    """The kernel's identity: its class and the op it was asked for (``name`` changes as it runs)."""
    op = "auto" if getattr(kernel, "auto", False) else getattr(kernel, "op", None)
    return type(kernel).__name__ + (f" {op}" if op else "")


@dataclass(frozen=True)
class Call:
    """What every rank of the group must agree on for one attention call (see the module docstring).

    ``placement`` is None for an explicit plan (:func:`megatron_mesh.runtime.api.plan_attention`)."""

    plan: Plan
    placement: object
    q_shape: tuple
    kv_shape: tuple
    dtype: torch.dtype
    scale: float
    kernel: object
    backward: bool  # one will follow: grad mode on and an input requiring grad
    v_head_dim: int | None = None  # None: k's head dim
    sink: str = "none"  # the softmax offset's kind (runtime.sinks.sink_kind): none, fixed or learnable

    def digest(self, checked: bool = True) -> int:
        """63 bits (so that the negated digest is an int64 too); ``checked``: the switch's value."""
        key = (plan_digest(self.plan), repr(self.placement), self.q_shape, self.kv_shape, str(self.dtype),
               repr(float(self.scale)), _kernel_text(self.kernel), self.backward, checked, plan_code(),
               self._v_head_dim, self.sink)
        return _digest(repr(key))

    @property
    def _v_head_dim(self) -> int:
        return self.kv_shape[-1] if self.v_head_dim is None else self.v_head_dim

    def describe(self, checked: bool = True) -> dict:
        """Field -> value, for naming what differs (built only when the ranks disagree)."""
        plan, p = self.plan, self.placement
        if p is not None:
            mode = p.describe()
        else:
            mode = f"{plan.mode} plan" + (f" tile {plan.facts.tile[0]}x{plan.facts.tile[1]}" if plan.facts.tile else "")
        mask = plan.mask
        layout = plan.layout
        return {
            "input": "valid",
            "mode": mode,
            "settings": repr(p) if p is not None else "explicit plan",
            "mask": mask.head_text(),
            "documents": tuple(f"{a}:{b}" for a, b in mask.documents) if mask.documents is not None else "none",
            "local shape [s_local, batch, heads, head_dim]": f"q {list(self.q_shape)}, k/v {list(self.kv_shape)}"
            + (f", v head dim {self._v_head_dim}" if self._v_head_dim != self.kv_shape[-1] else ""),
            "layout": layout.text(),
            "dtype": str(self.dtype).replace("torch.", ""),
            "softmax_scale": repr(float(self.scale)),
            "kernel": _kernel_text(self.kernel),
            "softmax offset (sinks)": self.sink,
            "backward": "yes" if self.backward else "no (grad mode off, or no input requires grad)",
            SWITCH: "1 (every call)" if checked else "0 (off)",
            "plan": f"{plan.mode} over {plan.world_size} ranks x {plan.seq_local} tokens, digest {plan_digest(plan)}",
            "plan code (version, source digest, tunables)": plan_code(),
        }


# -- the collective (its memory of each group: state.GroupChecks) -----------------------------------------
def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _group(comm, checks: GroupChecks):
    """The group the check of ``comm``'s calls runs on -- its live process group (a wrapper such as
    Megatron's timed communicator forwards the attribute), or the CPU group given for it
    (:meth:`GroupChecks.use_cpu_group`) --, or None where the check does not apply."""
    if comm.world_size == 1:
        return None
    group = getattr(comm, "process_group", None)
    return None if group is None else checks.check_group(group)


def _agree(group, world_size: int, digest: int, describe, checks: GroupChecks) -> None:
    t = torch.tensor([digest, -digest], dtype=torch.int64, device=checks.device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    top, neg_bottom = t.tolist()
    if top == -neg_bottom:  # the same on every rank: they all return, or all gather below
        return
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, describe(), group=group)
    raise PlanMismatchError(mismatch_message(gathered))


def _join_failed(group, world_size: int, error: Exception, checks: GroupChecks) -> None:
    """Take part in the group's check described by this rank's ``error`` (the others raise
    PlanMismatchError naming it); the caller raises the error itself."""
    what = f"raised {type(error).__name__}: {error}"
    try:
        _agree(group, world_size, _digest(what), lambda: {"input": what}, checks)
    except PlanMismatchError:
        pass  # this rank's own error says more; the others raise theirs


def _skips(group, checks: GroupChecks) -> bool:
    """Whether this rank runs no collective on ``group`` now: its check is off and the group's
    ranks agreed to that (a bad switch still joins)."""
    try:
        return not enabled() and checks.agreed_off(group)
    except ValueError:
        return False


TWIN_WAIT_S = 120.0  # how long check_plans_over waits for every rank of the group to give it


def check_plans_over(group, cpu_group, checks: GroupChecks | None = None, wait_s: float = TWIN_WAIT_S) -> None:
    """Check the calls on ``group`` (an NCCL CP group) over ``cpu_group``, a gloo group of the same
    ranks in the same order, so that the check does not synchronise the host with the GPU once per
    call (the module docstring). Collective: every rank of the group must give it -- a rank that did
    not would check its calls on ``group`` while the others check on ``cpu_group``, and both would
    wait for ever --, so it waits up to ``wait_s`` seconds for them (``monitored_barrier`` on
    ``cpu_group``) and raises RuntimeError naming the ranks that did not come. ``checks`` as for
    :func:`check`. Example::

        cp = dist.new_group(ranks)                        # NCCL
        megatron_mesh.check_plans_over(cp, dist.new_group(ranks, backend="gloo"))
    """
    from datetime import timedelta

    checks = RUNTIME.checks if checks is None else checks
    checks.check_cpu_group(group, cpu_group)  # a wrong group is refused here, before any wait
    try:
        dist.monitored_barrier(group=cpu_group, timeout=timedelta(seconds=wait_s), wait_all_ranks=True)
    except RuntimeError as e:
        raise RuntimeError(f"check_plans_over: not every rank of the group gave it within {wait_s:g} s -- call it on "
                           f"every rank of the group, with the same groups ({str(e).splitlines()[0]})") from None
    checks.use_cpu_group(group, cpu_group)


def check(comm, call: Call, checks: GroupChecks | None = None) -> None:
    """Raise :class:`PlanMismatchError` on every rank of ``comm``'s group unless all ranks make
    the same ``call`` (one small all-reduce; see the module docstring, also for the switch).
    ``checks``: what the check remembers per group (None: the process's, ``RUNTIME.checks``)."""
    checks = RUNTIME.checks if checks is None else checks
    group = _group(comm, checks)
    if group is None:
        return
    try:
        on = enabled()
    except ValueError as e:  # read where this rank still joins the check: the others name its error
        _join_failed(group, comm.world_size, e, checks)
        raise
    if not on and checks.agreed_off(group):
        return
    _agree(group, comm.world_size, call.digest(on), lambda: call.describe(on), checks)
    checks.agree(group, on)


@contextmanager
def joined_on_error(comm, checks: GroupChecks | None = None) -> Iterator[None]:
    """Run the block; if it raises on this rank, join the group's check first, described by the
    error (so the ranks that did not fail raise PlanMismatchError naming it instead of hanging),
    then re-raise it here. ``checks`` as for :func:`check`."""
    checks = RUNTIME.checks if checks is None else checks
    try:
        yield
    except Exception as e:
        group = _group(comm, checks)
        if group is not None and not _skips(group, checks):
            _join_failed(group, comm.world_size, e, checks)
        raise


# -- naming the difference ----------------------------------------------------------------------------------
def _ranks(ranks: list[int]) -> str:
    """'rank 3', 'ranks 1-3', 'ranks 0, 2-3'."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _items(value, first: int, keep: int = 3) -> str:
    """A list field (documents) as its count and the items around the first difference ``first``."""
    if len(value) <= 2 * keep + 1:
        shown = " ".join(value)
    else:
        lo = max(0, min(first - keep, len(value) - 2 * keep - 1))
        hi = lo + 2 * keep + 1
        shown = ("... " if lo else "") + f"(#{lo}) " + " ".join(value[lo:hi]) + (" ..." if hi < len(value) else "")
    return f"{len(value)} [{shown}]"


def _first_difference(values: list) -> int:
    seqs = [v for v in values if isinstance(v, tuple)]
    n = min(len(s) for s in seqs)
    return next((i for i in range(n) if len({s[i] for s in seqs}) > 1), n)


LONG_TEXT = 300  # characters: a layout's text longer than this is named by where it differs
_TEXT_FIELDS = ("layout",)  # fields holding a layout's text (Layout.text())


def _text_parts(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """A layout's text as (name, items): each plain word as itself, each KEY=VALUE as its
    comma-separated items, one list per ';'-separated group (a balanced layout's runs: one
    group per rank), e.g. 'balanced P=2 U=1 cu=0,5,8 runs=0+2,6+2;2+4' -> ('balanced', ()),
    ('P', ('2',)), ('U', ('1',)), ('cu', ('0', '5', '8')), ('runs of rank 0', ('0+2', '6+2')),
    ('runs of rank 1', ('2+4',))."""
    parts: list[tuple[str, tuple[str, ...]]] = []
    for word in text.split(" "):
        key, eq, value = word.partition("=")
        groups = value.split(";") if eq else []
        parts += [(key if len(groups) == 1 else f"{key} of rank {g}", tuple(group.split(",")))
                  for g, group in enumerate(groups)] or [(word, ())]
    return parts


def _long_texts(values: list[str]) -> dict[str, str]:
    """Each of the different layout texts ``values`` (some over :data:`LONG_TEXT` characters) as
    its head -- the words before its first list -- its length and the part where the values first
    differ, with the items around the first different one, e.g. ``balanced P=8 U=1 (1729
    characters), runs of rank 3: 17 [... (#2) 20+2 22+1 29+3 ...]``."""
    heads = {v: _head(v) for v in values}
    parsed = {v: _text_parts(v) for v in values}
    lists = list(parsed.values())
    n = min(len(p) for p in lists)
    at = next((i for i in range(n) if len({p[i] for p in lists}) > 1), n)
    out = {}
    for v, parts in parsed.items():
        detail = ""
        if len(set(heads.values())) == 1 and at < len(parts):  # the heads say nothing: the part that differs
            name, items = parts[at]
            same = [p[at][1] for p in lists if at < len(p) and p[at][0] == name]
            detail = f", {name}" + (f": {_items(items, _first_difference(same))}" if items else "")
        out[v] = f"{heads[v]} ({len(v)} characters){detail}"
    return out


def _head(text: str) -> str:
    """The words of a layout's text before its first list ('balanced P=8 U=1')."""
    cut = min((i for i in (text.find(","), text.find(";")) if i >= 0), default=len(text))
    return text[:text.rfind(" ", 0, cut)] if " " in text[:cut] else text[:cut]


def differences(descriptions: list[dict], skip=()) -> list[str]:
    """Every field (but ``skip``) on which the ranks' descriptions differ, each as its values and
    the ranks holding them (a list of ranks' descriptions, rank order), e.g.
    ``softmax_scale: rank 0: 0.5, ranks 1-3: 0.1767...``.

    >>> differences([{"dtype": "bfloat16"}, {"dtype": "float32"}, {"dtype": "float32"}])
    ['dtype: rank 0: bfloat16, ranks 1-2: float32']
    """
    fields = [f for f in descriptions[0] if all(f in d for d in descriptions)]
    parts = []
    for f in fields:
        values = [d[f] for d in descriptions]
        if f in skip or len(set(values)) == 1:
            continue
        holders: dict = {}
        for r, v in enumerate(values):
            holders.setdefault(v, []).append(r)
        if any(isinstance(v, tuple) for v in values):
            first = _first_difference(values)
            shown = {v: _items(v, first) if isinstance(v, tuple) else v for v in holders}
        elif f in _TEXT_FIELDS and any(len(v) > LONG_TEXT for v in holders):
            shown = _long_texts(list(holders))
        else:
            shown = {v: v for v in holders}
        parts.append(f"{f}: " + ", ".join(f"{_ranks(rs)}: {shown[v]}" for v, rs in holders.items()))
    return parts


def mismatch_message(descriptions: list[dict]) -> str:
    """Every field on which the ranks' descriptions differ (:func:`differences`), after what the
    plan check asks of the ranks.

    >>> mismatch_message([{"dtype": "bfloat16"}, {"dtype": "float32"}, {"dtype": "float32"}]).endswith(
    ...     "dtype: rank 0: bfloat16, ranks 1-2: float32")
    True
    """
    differ = {f for f in descriptions[0] if all(f in d for d in descriptions) and len({d[f] for d in descriptions}) > 1}
    # derived fields add nothing once what they derive from differs: the settings' repr after the
    # modes' descriptions, the plan's digest after anything else
    skip = set()
    if {"mode", "settings"} <= differ:
        skip.add("settings")
    if "plan" in differ and len(differ) > 1:
        skip.add("plan")
    return ("the ranks of this CP group disagree on the attention plan (each must pass the same mode, settings, "
            "mask, layout, dtype, local shape, softmax scale and kernel, in the same grad mode and with the same "
            f"{ENV}; running it would hang or return a wrong result): " + "; ".join(differences(descriptions, skip)))
