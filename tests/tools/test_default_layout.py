"""The planner's rows of a derived CP layout (tools/default_layout.py): per mode the row of the layout
the kind picks for it, left out where that row is missing, and the fastest of every mode as the
fastest of those rows -- each mode may run on another layout (Mesh on its owners layout, ring on
the zigzag)."""

from __future__ import annotations

from megatron_mesh.plan.layouts import Sample
from megatron_mesh.tools.default_layout import derived_rows
from megatron_mesh.tools.mode_result import ModeResult
from megatron_mesh.tools.plan_cli import _advice
from megatron_mesh.tools.planner import AUTO


def _row(layout: str, mode: str, ms: float, tile=None, **extra) -> ModeResult:
    t = ms * 1e-3
    return ModeResult(mode, tile, 1000, 0.0, 0.0, 0.0, 1, 0, t, t / 2, t / 2, t / 4, layout=layout, extra=extra)


class _Kind:
    """A derived kind that picks per mode: ring on the zigzag, Mesh on its owners layout, TASP balanced."""

    name = "auto"
    derived_from = ("balanced", "zigzag", "owners")

    def pick(self, sample: Sample) -> str:
        return {"ring": "zigzag", "mesh": "owners", "tasp": "balanced"}[sample.mode]


def test_each_mode_takes_its_pick_and_the_fastest_is_theirs():
    rows = [_row("balanced", "ring", 5.0), _row("balanced", "mesh", 5.0), _row("balanced", "tasp", 6.0),
            _row("balanced", AUTO, 5.0, pick="ring"), _row("zigzag", "ring", 4.0), _row("zigzag", "mesh", 4.5),
            _row("zigzag", "tasp", 7.0), _row("owners", "mesh", 3.0)]
    got = derived_rows(_Kind(), rows, Sample((0, 8), 2))
    assert [(r.layout, r.mode, r.time_s * 1e3, r.extra["auto_pick"]) for r in got] == [
        ("auto", "ring", 4.0, "zigzag"), ("auto", "mesh", 3.0, "owners"), ("auto", "tasp", 6.0, "balanced"),
        ("auto", AUTO, 3.0, "owners")]  # the balanced layout's fastest (ring, 5 ms) is not the default's
    assert got[-1].extra["pick"] == "mesh"
    # Mesh's pick planned on no owners row (the builder refused the sample): its row left out
    got = derived_rows(_Kind(), rows[:-1], Sample((0, 8), 2))
    assert [(r.mode, r.time_s * 1e3) for r in got] == [("ring", 4.0), ("tasp", 6.0), (AUTO, 4.0)]


def test_the_advice_for_a_layout_that_refuses_samples_names_the_one_that_runs_it():
    """The planner's "in Megatron" line for the fastest row: on Mesh's owners layout, which stops a
    run at a sample it cannot lay out, the flags of the default layout whose row this sample is
    (``auto`` runs it there); without such a row, the owners flag with that warning; any other
    layout as it is."""
    owners, auto = _row("owners", "mesh-auto", 4.8, tile=(2, 4)), _row("auto", "mesh-auto", 4.8, tile=(2, 4))
    assert _advice(owners, [owners, auto], 8) == (
        "--cp-comm-type mesh --mesh-tile-shape 2x4 --cp-layout auto (it runs this sample on owners; --cp-layout "
        "owners stops at a sample it cannot lay out)")
    assert _advice(owners, [owners, _row("auto", "mesh-auto", 5.2, tile=(2, 4))], 8) == (
        "--cp-comm-type mesh --mesh-tile-shape 2x4 --cp-layout owners (stops at a sample it cannot lay out, naming it)")
    balanced = _row("balanced", "ring", 5.2)
    assert _advice(balanced, [balanced, _row("auto", "ring", 5.2)], 8) == "--cp-comm-type ring --cp-layout balanced"
