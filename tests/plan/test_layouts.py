"""The CP layout registry (megatron_mesh/plan/layouts/): every kind users choose by name, what each
builds for a sample, and the proof that a new layout is one file: registering one (a toy that
gives rank r the r-th contiguous S/P tokens) makes it a --cp-layout value that the start-up
checks accept, the per-sample decision of Megatron's batch split and a planner --layout row --
with no other file touched; and that nobody else compares layout names or probes a layout's
capabilities."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from helpers import package_comparisons, package_nodes, str_literals
from megatron_mesh.plan import AttentionShape, Mask, Topology, resolve, validate_plan
from megatron_mesh.plan.balance import balanced_layout
from megatron_mesh.plan.layout import Layout, ZigzagLayout, layout_from_text, match_text, register_layout
from megatron_mesh.plan.layouts import (DEFAULT_LAYOUT, LAYOUTS, LayoutKind, Sample, cp_layout_names, get_layout_kind,
                                        layout_names, register, thd_layout)

CU = (0, 3, 19, 24, 32)


def test_registry_holds_every_layout_and_what_runs_it():
    assert layout_names() == ("zigzag", "thd", "balanced", "balanced-hide", "owners", "auto")
    assert cp_layout_names() == ("auto", "zigzag", "balanced", "balanced-hide", "owners") and DEFAULT_LAYOUT == "auto"
    assert [LAYOUTS[n].flag for n in layout_names()] == ["--cp-layout zigzag", "--cp-thd-packing",
                                                         "--cp-layout balanced", "--cp-layout balanced-hide",
                                                         "--cp-layout owners", "--cp-layout auto"]
    with pytest.raises(ValueError, match="unknown CP layout 'ragged'; allowed: zigzag, thd, balanced"):
        get_layout_kind("ragged")


def test_each_kind_builds_the_layout_of_a_sample():
    shape = AttentionShape(seq_local=8, heads=2, kv_heads=2, head_dim=4)
    sample = Sample(CU, 4, shape=shape)
    assert get_layout_kind("zigzag").build(sample) is None  # Megatron's own split: the documents go with the mask
    assert get_layout_kind("thd").build(sample) == thd_layout(CU, 4)
    assert get_layout_kind("balanced").build(sample) == balanced_layout(CU, 4)
    hybrid = Sample(CU, 4, group=2, shape=shape)
    assert get_layout_kind("balanced-hide").build(hybrid) == balanced_layout(CU, 4, group=2, hide=True)
    assert get_layout_kind("balanced-hide").build(sample) == balanced_layout(CU, 4)  # no group to hide in
    # nodes first only where a node holds whole Ulysses groups
    assert get_layout_kind("balanced").build(Sample(CU, 4, group=2, ranks_per_node=2)) == \
        balanced_layout(CU, 4, group=2, ranks_per_node=2)
    assert get_layout_kind("balanced").build(Sample(CU, 8, group=4, ranks_per_node=2)) == balanced_layout(CU, 8, group=4)
    auto = get_layout_kind("auto")  # 32 tokens: a launch-bound step keeps the zigzag; a window keeps balance
    assert auto.pick(sample) == "zigzag" and auto.build(sample) is None
    windowed = Sample(CU, 4, window=(3, 0), shape=shape)
    assert auto.pick(windowed) == "balanced" and auto.build(windowed) == balanced_layout(CU, 4, window=(3, 0))


def test_layouts_declare_their_capabilities_with_defaults():
    zigzag = ZigzagLayout(4, 32)
    assert (zigzag.group, zigzag.owners, zigzag.owner(2, 1)) == (1, (), 2)
    with pytest.raises(ValueError, match="ZigzagLayout holds no Ulysses group in all-to-all set order"):
        zigzag.set_tokens(0)
    balanced = balanced_layout(CU, 4, group=2)
    assert balanced.group == 2 and len(balanced.set_tokens(0)) == 4


# -- a new layout is one file ------------------------------------------------------------------------------
@register_layout("contig")
@dataclass(frozen=True)
class ContigLayout(Layout):
    """Rank r holds tokens [r S/P, (r + 1) S/P): no balance at all, the simplest layout there is."""

    world_size: int
    seq_len: int

    @property
    def seq_local(self) -> int:
        return self.seq_len // self.world_size

    def runs(self, chunk: int, span: int = 1):
        n = self.seq_local * span
        return ((0, chunk * n, n),)

    def documents(self):
        return None  # positions only: the documents come with the mask

    def text(self) -> str:
        return f"contig {self.seq_len} tokens over {self.world_size} ranks"

    @classmethod
    def parse(cls, rest: str) -> "ContigLayout":
        tokens, ranks = match_text(r"^(\d+) tokens over (\d+) ranks$", rest, "contig 32 tokens over 4 ranks").groups()
        return cls(int(ranks), int(tokens))


class ContigKind(LayoutKind):
    name = "contig"
    help = "rank r holds the r-th contiguous S/P tokens"

    def build(self, sample: Sample) -> ContigLayout:
        return ContigLayout(sample.world_size, sample.cu_seqlens[-1])


@pytest.fixture()
def contig():
    register(ContigKind())
    yield
    LAYOUTS.pop("contig", None)


def test_a_new_layout_is_one_file_and_one_registration(contig, megatron_args):
    """Registered, the layout is: a --cp-layout value (argparse's and the start-up check's), the
    per-sample decision of Megatron's batch split, a planner --layout row with its Megatron flag,
    and every mode's plan on it validates -- with no other file touched."""
    from megatron_mesh.megatron import batch_layout
    from megatron_mesh.megatron.checks import validate_args
    from megatron_mesh.megatron.settings import PluginSettings, flags
    from megatron_mesh.tools import plan_args, plan_cli
    from megatron_mesh.tools.layout_rows import layout_rows

    assert "contig" in next(f for f in flags() if f.name == "--cp-layout").choices
    args = megatron_args(["--spec", "megatron_mesh.megatron.spec", "gpt_layer_spec", "--transformer-impl", "local",
                          "--attention-dropout", "0", "--context-parallel-size", "4", "--seq-length", "32",
                          "--cp-comm-type", "ring", "--reset-attention-mask", "--calculate-per-token-loss",
                          "--cp-layout", "contig"])
    assert validate_args(args, have_te=False, entry_packs_documents=True) == []
    assert PluginSettings.from_args(args).layout.name == "contig"
    # the per-sample decision: Megatron's batch split and the layers take it
    layout = batch_layout.sample_layout(CU, args)
    assert layout == ContigLayout(4, 32) and layout_from_text(layout.text()) == layout
    split = batch_layout.BatchLayout.of([CU], args, 2)
    assert split.balanced and split.index.tolist() == [list(range(16, 24))]
    # every mode's plan on it, the documents from the mask
    shape = AttentionShape(seq_local=8, heads=4, kv_heads=2, head_dim=4)
    mask = Mask.from_cu_seqlens(CU, 32, True)
    for mode, settings in (("ring", {}), ("mesh", {"tile": (2, 2)}), ("tasp", {}), ("a2a+ring", {"ulysses_size": 2})):
        validate_plan(resolve(mode, 4, shape, **settings).build(shape, mask, layout))
    # the planner's rows, named by the CLI, with the flag that runs them in Megatron
    rows, skipped = layout_rows(4, shape, Topology(nodes=1, gpus_per_node=4), CU, modes=("ring", "tasp"),
                                layouts=("contig",))
    assert [(r.layout, r.mode) for r in rows] == [("contig", "ring"), ("contig", "tasp")] and not skipped
    assert plan_cli.megatron_flags(rows[0], 4) == "--cp-comm-type ring --cp-layout contig"
    assert "contig" in next(a for a in plan_args.parser()._actions if a.dest == "layout").choices
    assert plan_cli.main(["--cp", "4", "--heads", "4", "--kv-heads", "2", "--head-dim", "4", "--seq-len", "32",
                          "--docs", "fixed:5", "--layout", "contig", "--modes", "ring"]) == 0


# -- nobody else knows a layout by name ---------------------------------------------------------------------
# words of other vocabularies too: the auto tile, backward chunks and kernel; Transformer Engine's
# qkv_format "thd" and the documents of --cp-thd-packing. Compared with these, a layout is meant
# where an operand is one ("cp_layout", "r.layout", "layouts").
SHARED_WORDS = {"auto", "thd"}


def test_no_layout_name_is_compared_outside_the_registry():
    """No ``== "zigzag"`` / ``in ("balanced", ...)`` ladders outside a layout kind's own file
    (megatron_mesh/plan/layouts/): Megatron's flags, checks and per-sample decision and the
    planner read the registry (issue 49: 24 such comparisons by this rule, in 7 files)."""
    names = set(LAYOUTS)
    found = []
    for where, node, operands in package_comparisons("plan/layouts"):
        hits = {x for o in operands for x in str_literals(o)} & names
        about_layouts = "layout" in " ".join(ast.unparse(o) for o in operands).lower()
        if hits - SHARED_WORDS or hits and about_layouts:
            found.append(f"{where} {ast.unparse(node)}")
    assert not found, "layout names compared outside the registry:\n" + "\n".join(found)


def test_no_layout_capability_is_probed():
    """A layout's capabilities (owners, group, set_tokens, ...) are declared members of the Layout
    protocol with defaults: no ``getattr(layout, ...)`` / ``hasattr(layout, ...)`` (issue 49: 4
    probes in plan/hybrid.py, plan/modes/base.py, plan/modes/mesh.py)."""
    members = {n for n in dir(Layout) if not n.startswith("__")} | set(Layout.__annotations__)
    assert {"owners", "owner", "group", "set_tokens", "runs", "documents"} <= members
    found = [f"{where} {ast.unparse(node)}" for where, node in package_nodes()
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
             and len(node.args) >= 2 and str_literals(node.args[1]) and str_literals(node.args[1])[0] in members]
    assert not found, "layout capabilities probed:\n" + "\n".join(found)


def test_megatron_runs_what_the_planner_plans():
    """The per-sample decision in Megatron is the kind's, for the layers' mode and shape: under
    --cp-layout auto a sample the zigzag is priced faster for keeps it (None: Megatron's split)."""
    pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")
    from megatron_mesh.megatron import batch_layout

    config = SimpleNamespace(context_parallel_size=4, cp_layout="balanced", cp_comm_type="a2a+ring", num_layers=2,
                             num_attention_heads=4, window_size=None, hierarchical_context_parallel_sizes=[2, 2])
    assert batch_layout.sample_layout(CU, config) == balanced_layout(CU, 4, group=2)
    config.cp_layout = "auto"
    assert batch_layout.sample_layout(CU, config) is None  # as AutoKind.pick: 32 tokens keep the zigzag
