"""The report's figures from synthetic runs (no training): panels, groups, bars and lines per figure,
axis labels, tick labels that do not overlap (matplotlib's text bounding boxes), legends outside
the data, nothing outside the figure, heatmap totals equal to the measured bytes."""

import pytest

pytest.importorskip("matplotlib")

from megatron_mesh.tools import figures  # noqa: E402
from megatron_mesh.tools.report import RunResult  # noqa: E402

CP = 4
MODES = ["baseline", "ring", "mesh:auto", "mesh:2x2", "tasp", "a2a+mesh:2"]
MASKS = ["none", "docs", "docs-zigzag", "window"]
KIB = 1024


def _matrix(mode: str, mask: str) -> list[list[float]]:
    """Who sends to whom, shaped like each mode's traffic (values differ per mask and sender)."""
    scale = {"none": 1.0, "docs": 0.5, "docs-zigzag": 0.6, "window": 0.25}[mask]
    m = [[0.0] * CP for _ in range(CP)]
    for s in range(CP):
        if mode == "ring":
            peers = [(s + 1) % CP]
        elif mode.startswith("mesh"):  # 2x2 tile: the rank's row and column partners
            peers = [s ^ 1, s ^ 2]
        elif mode == "tasp":
            peers = [p for p in range(CP) if p != s]
        else:  # a2a+mesh:2: all-to-all partner and inner ring partner
            peers = [s ^ 1, (s + 2) % CP]
        for p in peers:
            m[s][p] = (96 + 8 * s) * KIB * scale
    return m


def _runs(masks=MASKS, modes=MODES) -> list[RunResult]:
    runs = []
    for k, mask in enumerate(masks):
        base = {1: 4.9 - k * 0.1, 2: 4.7 - k * 0.1, 3: 4.4 - k * 0.1}
        for j, mode in enumerate(modes):
            cp = 1 if mode == "baseline" else CP
            # ring equals the baseline to the bit (drawn at the floor), the others by rounding
            losses = dict(base) if mode in ("baseline", "ring") else {i: v + 10.0 ** -(5 + j) for i, v in base.items()}
            matrix = _matrix(mode, mask) if cp > 1 else []
            rank_bytes = [sum(row) for row in matrix]
            work = [1.0e6 * (1 + (0.3 * r if mask == "docs-zigzag" else 0)) for r in range(cp)] if cp > 1 else []
            runs.append(RunResult(mode, cp, mask=mask, tile="2x2" if mode.startswith("mesh") else "", losses=losses,
                                  times_ms={1: 900.0, 2: 300.0 + 10 * j, 3: 310.0 + 10 * j},
                                  bytes_per_step=max(rank_bytes) if rank_bytes else 0.0, peak_memory=(500 + j) * 2**20,
                                  memory_kind="max RSS", rank_bytes=rank_bytes, rank_work=work, bytes_matrix=matrix))
    return runs


def _overlap(a, b, tol=0.5) -> bool:
    return a.x0 + tol < b.x1 and b.x0 + tol < a.x1 and a.y0 + tol < b.y1 and b.y0 + tol < a.y1


def _inside(e, box, tol=3.0) -> bool:
    """Within the figure to a few pixels (constrained layout may leave an axes' tight box a pixel
    or two past the edge; savefig(bbox_inches="tight") pads the saved image around it anyway)."""
    return box.x0 - tol <= e.x0 and e.x1 <= box.x1 + tol and box.y0 - tol <= e.y0 and e.y1 <= box.y1 + tol


def _drawn_xticklabels(ax):
    """The x tick labels matplotlib draws: non-empty ones at ticks inside the view limits."""
    lo, hi = sorted(ax.get_xlim())
    return [t for loc, t in zip(ax.get_xticks(), ax.get_xticklabels())
            if lo - 1e-9 <= loc <= hi + 1e-9 and t.get_visible() and t.get_text()]


def _check_layout(fig):
    """Everything inside the figure (each axes with its labels and ticks, the legends, the title);
    each axes' x tick labels apart; legends off the data."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    parts = [ax.get_tightbbox(renderer) for ax in fig.axes if ax.get_visible()]
    parts += [legend.get_window_extent(renderer) for legend in fig.legends]
    parts += [t.get_window_extent(renderer) for t in fig.texts if t.get_text()]
    if fig._suptitle is not None:
        parts.append(fig._suptitle.get_window_extent(renderer))
    for e in parts:
        assert _inside(e, box), (e, box)
    for ax in fig.axes:
        labels = _drawn_xticklabels(ax)
        extents = [t.get_window_extent(renderer) for t in labels]
        for i in range(len(extents)):
            for j in range(i + 1, len(extents)):
                assert not _overlap(extents[i], extents[j]), (labels[i].get_text(), labels[j].get_text())
    data_axes = [ax for ax in fig.axes if ax.get_label() != "<colorbar>" and ax.axison]
    for legend in fig.legends:
        e = legend.get_window_extent(renderer)
        for ax in data_axes:
            assert not _overlap(e, ax.get_window_extent(renderer)), "legend on the data"


def _panels(fig):
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>" and ax.axison]


def test_loss_figure_panels_lines_and_log_deviation():
    runs = _runs()
    fig = figures.loss_fig(runs)
    axes = _panels(fig)
    assert len(axes) == 2 * len(MASKS)  # a loss panel and a deviation panel per mask
    tops, bottoms = axes[:len(MASKS)], axes[len(MASKS):]
    for mask, ax in zip(MASKS, tops):
        assert ax.get_title() == f"mask: {mask}" and len(ax.get_lines()) == len(MODES)
    assert tops[0].get_ylabel() == "lm loss"
    for ax in bottoms:
        assert ax.get_yscale() == "log" and ax.get_xlabel() == "iteration"
        assert len(ax.get_lines()) == len(MODES) - 1  # every mode but the baseline
    assert bottoms[0].get_ylabel() == "|loss - baseline loss|"
    ring = bottoms[0].get_lines()[0]  # equal to the baseline: drawn at the floor
    assert list(ring.get_ydata()) == [figures.DEVIATION_FLOOR] * 3
    mesh = bottoms[0].get_lines()[1]
    assert mesh.get_ydata()[0] == pytest.approx(1e-7, rel=1e-3)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == MODES and "drawn at 1e-12" in legend.get_title().get_text()
    _check_layout(fig)


@pytest.mark.parametrize("measure", ["bytes", "time", "memory"])
def test_measure_figures_group_the_modes_by_mask(measure):
    runs = _runs()
    fig = figures.measure_fig(runs, measure)
    (ax,) = _panels(fig)
    modes = MODES[1:] if measure == "bytes" else MODES  # CP 1 sends nothing: no bytes bar
    assert len(ax.patches) == len(modes) * len(MASKS)
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"mask: {m}" for m in MASKS]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == modes
    assert ax.get_ylabel()
    if measure == "bytes":  # a group's bars are the modes' bytes of that mask, in KiB: the busiest rank's
        assert "KiB" in ax.get_ylabel() and "by the busiest rank" in ax.get_ylabel()
        assert "per rank" not in ax.get_ylabel()
        heights = [p.get_height() for p in ax.patches]
        by = {(r.mode, r.mask): r.bytes_per_step / KIB for r in runs}
        expect = [by[mode, mask] for mode in modes for mask in MASKS]
        assert heights == pytest.approx(expect)
    if measure == "time":  # whiskers span the timed iterations (2 and 3; the first is the warm-up)
        spans = sorted(tuple(sorted(seg[:, 1])) for c in ax.collections for seg in c.get_segments())
        assert spans == sorted((300.0 + 10 * j, 310.0 + 10 * j) for j in range(len(MODES)) for _ in MASKS)
        assert "mean of iterations 2-3 (the first left out" in ax.get_title() and "noise" in ax.get_title()
    if measure == "memory":
        label = ax.get_ylabel().replace("\n", " ")
        assert "max RSS per process" in ax.get_title() and "the largest of the ranks" in label
    _check_layout(fig)
    for r in runs:  # a failed run has no bar; a mode with none left has no legend entry
        if r.mode == runs[2].mode:
            r.ok = False
    fig = figures.measure_fig(runs, measure)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [m for m in modes if m != runs[2].mode]
    assert len(_panels(fig)[0].patches) == (len(modes) - 1) * len(MASKS)
    with pytest.raises(ValueError, match="unknown measure 'speed'; allowed: bytes, time, memory"):
        figures.measure_fig(runs, "speed")


@pytest.mark.parametrize("times, says", [
    ({1: 900.0, 2: 300.0}, "time of iteration 2 (the first left out"),  # a 2-iteration job: one timed
    ({1: 900.0}, "time of iteration 1 (the only one"),
    ({5: 900.0, 6: 300.0, 7: 310.0, 8: 320.0}, "mean of iterations 6-8 (the first left out"),
])
def test_time_figure_names_the_iterations_it_times(times, says):
    """The time figure's title says which iterations its bars are (issue 48: a 2-iteration job said
    "mean of 1 iteration")."""
    runs = _runs(masks=["none"], modes=MODES[:2])
    for r in runs:
        r.times_ms = dict(times)
    title = _panels(figures.measure_fig(runs, "time"))[0].get_title()
    assert says in title and "mean of 1 " not in title, title


def test_ranks_figure_shows_every_rank_and_the_imbalance():
    runs = _runs()
    fig = figures.ranks_fig(runs)
    axes = _panels(fig)
    assert len(axes) == 2 * len(MASKS)  # work and bytes per mask
    cp_modes = MODES[1:]
    for ax in axes:
        assert len(ax.patches) == CP * len(cp_modes)
        assert [t.get_text() for t in ax.get_xticklabels()] == cp_modes and ax.get_ylabel()
    zigzag_work = axes[2 * MASKS.index("docs-zigzag")]
    ratios = [t.get_text() for t in zigzag_work.texts]
    assert ratios == ["max/mean\n1.31"] * len(cp_modes)  # work 1, 1.3, 1.6, 1.9 (x 1e6): 1.9 / 1.45
    assert "millions" in zigzag_work.get_ylabel()
    _check_layout(fig)


def test_heatmap_totals_equal_the_measured_bytes():
    runs = _runs()
    fig = figures.heatmap_fig(runs)
    axes = _panels(fig)
    cp_runs = [r for r in runs if r.cp > 1]
    assert len(axes) == len(cp_runs)  # one panel per mask and CP mode
    scale = 1 / KIB  # the largest cell of all is < 1 MiB: KiB, in every panel
    for ax, r in zip(axes, cp_runs):
        (image,) = ax.get_images()
        data = image.get_array()
        assert data.shape == (CP, CP)
        assert float(data.sum()) == pytest.approx(sum(r.rank_bytes) * scale)
        for s in range(CP):
            assert float(data[s].sum()) == pytest.approx(r.rank_bytes[s] * scale)
        assert ax.get_title() == f"{r.mode}: total {figures._cell_label(sum(r.rank_bytes) * scale)} KiB"
        last_row, first_col = r.mask == MASKS[-1], r.mode == MODES[1]  # axis labels at the grid's edges
        assert ax.get_xlabel() == ("receiver (CP rank)" if last_row else "")
        assert ax.get_ylabel() == (f"mask: {r.mask}\nsender (CP rank)" if first_col else "")
        # each nonzero cell annotated
        assert len(ax.texts) == sum(1 for row in r.bytes_matrix for v in row if v)
    ring = axes[0]
    assert [[bool(v) for v in row] for row in ring.get_images()[0].get_array()] == \
        [[(s + 1) % CP == p for p in range(CP)] for s in range(CP)]  # the ring's band
    _check_layout(fig)


def test_write_figures_writes_every_png(tmp_path):
    names = figures.write_figures(_runs(masks=["none"]), str(tmp_path))
    assert names == list(figures.FIGURES)
    for name in names:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a CP 1 run alone: no per-rank or bytes figures, the rest drawn
    assert figures.write_figures(_runs(masks=["none"], modes=["baseline"]), str(tmp_path / "b")) == \
        ["loss.png", "time.png", "memory.png"]


def test_heatmap_has_one_unit_and_one_colour_scale_for_every_panel():
    """Masks whose largest cells differ by more than a unit step (MiB and KiB) still share the
    unit (in every colour bar and title, the cells as plain numbers in it); the modes of a mask
    share its colour scale."""
    runs = _runs(masks=["none", "window"])
    for r in runs:  # "none" sends MiB per cell, "window" KiB
        if r.mask == "none":
            r.bytes_matrix = [[v * 16 for v in line] for line in r.bytes_matrix]
    fig = figures.heatmap_fig(runs)
    axes = _panels(fig)
    cp_runs = [r for r in runs if r.cp > 1]
    largest = max(v for r in cp_runs for line in r.bytes_matrix for v in line)
    assert 2**20 <= largest < 2**30
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert [bar.get_ylabel() for bar in bars] == ["MiB sent per step"] * 2  # one per mask
    assert "in MiB" in fig._suptitle.get_text()
    for ax, r in zip(axes, cp_runs):
        (image,) = ax.get_images()
        mine = max(v for q in cp_runs if q.mask == r.mask for line in q.bytes_matrix for v in line)
        assert image.get_clim() == pytest.approx((0, mine / 2**20))
        cells = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}
        for (i, j), text in cells.items():  # a number in MiB, no unit letter of its own
            assert float(text) == pytest.approx(r.bytes_matrix[i][j] / 2**20, rel=0.05), text
        assert ax.get_title().endswith(" MiB")
    assert figures._cell_label(2.25) == "2.25" and figures._cell_label(0.75) == "0.75"
    assert figures._cell_label(768) == "768" and figures._cell_label(0.09375) == "0.094"
    _check_layout(fig)
