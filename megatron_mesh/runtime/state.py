"""What the runtime keeps of a process between attention calls, in one object: :data:`RUNTIME`.

Four memories, three of them a small class here with the call sites that read it:

* :class:`GroupChecks` -- the plan agreement check's memory of each process group
  (:mod:`.agreement`: the device of its check's tensor, whether its ranks agreed to run without it,
  the CPU group it runs on instead of an NCCL group);
* :class:`LayoutCalls` -- the prebuild memory: the recent attention calls on a layout with
  documents of its own, which :func:`~megatron_mesh.runtime.api.prebuild` plans again for the next
  samples' layouts (:mod:`.api`);
* :class:`Arenas` -- each rank's arena (:class:`Scratch`), kept from call to call so a step
  allocates nothing there (:mod:`.buffers`);
* ``values`` -- the document boundaries read on the host, per tensor and version
  (:func:`~.inputs.host_values`: once per step, not once per layer).

The functions and classes that use them take the one they need (``checks=``, ``calls=``,
``arenas=``; None: the process's, read from :data:`RUNTIME` at call time), so a test passes its
own instead of patching these.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from ..plan.arena import ScratchLayout
from ..plan.maskkinds import MaskKind
from ..plan.modes import Placement
from ..plan.shape import AttentionShape

__all__ = ["GroupChecks", "LayoutCalls", "Scratch", "Arenas", "RuntimeState", "RUNTIME"]


class GroupChecks:
    """What the check remembers of each process group (weakly: a destroyed group goes): the
    device of its check's tensor, chosen from the group alone, whether its ranks agreed to run
    without the check (``MEGATRON_MESH_PLAN_AGREEMENT=0`` on all), and the CPU group with the same
    ranks its check runs on instead, where one was given (:meth:`use_cpu_group`)."""

    def __init__(self):
        self._devices: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._agreed_off: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._cpu: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def device(self, group) -> torch.device:
        """CUDA for an NCCL group, else the CPU -- so every rank picks the same, whatever its inputs."""
        device = self._devices.get(group)
        if device is None:
            nccl = dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
            self._devices[group] = device
        return device

    def use_cpu_group(self, group, cpu_group) -> None:
        """Check the calls on ``group`` over ``cpu_group`` (gloo, the same ranks in the same order):
        the check's all-reduce then runs between the hosts, and the host, which must read its
        result, need not wait for the GPU's queued work -- on an NCCL group it would, once per call,
        losing the lead the host gains while the GPU runs the layer's other work. ValueError for a
        group that is not gloo or holds other ranks."""
        self.check_cpu_group(group, cpu_group)
        self._cpu[group] = cpu_group

    @staticmethod
    def check_cpu_group(group, cpu_group) -> None:
        """ValueError where ``cpu_group`` cannot check the calls on ``group`` (:meth:`use_cpu_group`)."""
        backend = dist.get_backend(cpu_group)
        if backend != "gloo":
            raise ValueError(f"the plan check's CPU group must be a gloo group, got a {backend} group")
        ranks, cpu_ranks = dist.get_process_group_ranks(group), dist.get_process_group_ranks(cpu_group)
        if list(ranks) != list(cpu_ranks):
            raise ValueError(f"the plan check's CPU group must hold the ranks of its group in the same order, "
                             f"{list(ranks)}; got {list(cpu_ranks)}")

    def forget_cpu_group(self, group) -> None:
        self._cpu.pop(group, None)

    def check_group(self, group):
        """The group a call on ``group`` is checked over: its CPU group where one was given, else itself."""
        return self._cpu.get(group, group)

    def agreed_off(self, group) -> bool:
        return group in self._agreed_off

    def agree(self, group, on: bool) -> None:
        """The group's ranks agreed to run with the check ``on`` (True) or without it."""
        if on:
            self._agreed_off.pop(group, None)
        else:
            self._agreed_off[group] = True


class LayoutCalls:
    """The prebuild memory: the attention calls recently made on a layout with documents of its
    own (the balanced layout of a packed sample), as the (placement, shape, mask, rank) that
    :func:`~megatron_mesh.runtime.api.prebuild` plans again for the next samples' layouts (the
    mask without its documents: the next layout brings its own). Newest last, at most
    :attr:`KEPT` (a few per model: one per distinct attention setting, not per layer); the step
    adds while the lookahead thread reads, so under a lock."""

    KEPT = 16

    def __init__(self):
        self._calls: "OrderedDict[tuple, None]" = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, placement: Placement, shape: AttentionShape, mask: MaskKind, rank: int) -> None:
        key = (placement, shape, mask, rank)
        with self._lock:
            self._calls[key] = None
            self._calls.move_to_end(key)
            while len(self._calls) > self.KEPT:
                self._calls.popitem(last=False)

    def recent(self) -> list[tuple]:
        with self._lock:
            return list(self._calls)


class Scratch:
    """One rank's arena on one device, kept from call to call: grown (made anew) when a plan
    needs more, with the views of each layout's buffers made once."""

    def __init__(self):
        self.arena: Tensor | None = None
        self.views: "weakref.WeakKeyDictionary[ScratchLayout, dict]" = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()

    def bind(self, layout: ScratchLayout, device: torch.device, dtypes: tuple, size: int) -> dict:
        """The views cache of ``layout`` with ``dtypes`` (input, accumulator) over an arena of at
        least ``size`` bytes on ``device`` (the plan's larger direction's: the other direction then
        finds it large enough, and the views made stay valid)."""
        with self.lock:
            if self.arena is None or self.arena.numel() < size or self.arena.device != device:
                self.arena = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
                self.views = weakref.WeakKeyDictionary()
            per_layout = self.views.setdefault(layout, {})
            return per_layout.setdefault(dtypes, {})


class Arenas:
    """A process's arenas: one :class:`Scratch` per device, rank and group (in-process virtual ranks:
    one each), for both directions -- a rank runs one direction at a time, its ops in stream order, so
    the backward takes over the forward's bytes (and the next layer's forward the backward's).
    Per group (``members``, :attr:`~megatron_mesh.comm.base.Communicator.members`): two CP groups
    run from two threads at once, this process rank 0 of both, shared one arena and got wrong
    results without a word (stop 79); a group's own calls cannot overlap (its transfers are
    ordered), so every layer over one group still shares one."""

    def __init__(self):
        self.by: dict[tuple, Scratch] = {}
        self.lock = threading.Lock()

    def get(self, device: torch.device, rank: int, members: object = None) -> Scratch:
        key = (str(device), rank, members)
        with self.lock:
            got = self.by.get(key)
            if got is None:
                got = self.by[key] = Scratch()
            return got


@dataclass
class RuntimeState:
    """One process's runtime memories (see the module docstring); each field is what the
    functions taking it use when given None."""

    checks: GroupChecks = field(default_factory=GroupChecks)  # the plan check's memory per process group
    calls: LayoutCalls = field(default_factory=LayoutCalls)  # the prebuild memory
    arenas: Arenas = field(default_factory=Arenas)  # each rank's buffers, kept from call to call
    # tensor -> (its version, its values) of the document boundaries read on the host (weakly: a
    # freed tensor goes; :func:`~.inputs.host_values`)
    values: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)


RUNTIME = RuntimeState()  # the process's
