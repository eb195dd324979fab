"""megatron_mesh.tools.predict: the planner's prediction for a Megatron config on GPUs (the
report's section for configs/llama3_8b_128k_cp16.yaml) and the measured-vs-planned bytes of the
CPU run, on synthetic runs (pure Python, no training: seconds)."""

from __future__ import annotations

import os
from dataclasses import replace
import re
import struct

import pytest

from megatron_mesh.plan import AttentionShape, Mask, Topology, plan_bytes, resolve
from megatron_mesh.tools import predict
from megatron_mesh.tools.planner import allowed_pairs, compute_floor
from megatron_mesh.tools.report import RunResult


def _rows(section: str) -> dict[str, list[list[str]]]:
    """The section's table rows by mode (a mode may have several: one per all-to-all degree)."""
    out: dict[str, list[list[str]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and not line.startswith("| mode") and not line.startswith("| run"):
            out.setdefault(cells[0], []).append(cells)
    return out


def test_the_llama3_config_reads_as_its_attention_per_rank():
    p = predict.read_config(predict.DEFAULT_CONFIG)
    assert (p.layers, p.heads, p.kv_heads, p.head_dim, p.seq_len, p.cp, p.tp, p.dtype) == \
        (32, 32, 8, 128, 131072, 16, 2, "bf16")
    assert p.shape == AttentionShape(seq_local=8192, batch=1, heads=16, kv_heads=4, head_dim=128, itemsize=2)
    topo = predict.machine(p)  # TP 2 inside nodes of 8 GPUs: 4 CP ranks per node, CP 16 over 4 nodes
    assert (topo.gpus_per_node, topo.nodes_used(16)) == (4, 4)


def test_the_prediction_has_a_row_per_mode_names_autos_pick_and_the_floor():
    section = predict.prediction_section(predict.DEFAULT_CONFIG)
    rows = _rows(section)
    expected = {m + (" (formula)" if m in ("ulysses", "usp") else "") for m in predict.PREDICT_MODES}
    assert set(rows) == expected, rows.keys()
    assert len(rows["a2a+tasp"]) >= 2  # every all-to-all degree that fits the heads and the node
    p = predict.read_config(predict.DEFAULT_CONFIG)
    topo = predict.machine(p)
    planned, _, floor = predict.predict(p, topo)
    assert floor == pytest.approx(compute_floor(allowed_pairs([0, p.seq_len]), 16, p.shape, topo))
    assert f"Compute floor: **{floor * 1e3:.2f} ms**" in section
    auto = next(r for r in planned if r.mode == "auto")
    best = min((r for r in planned if r.mode not in ("auto", "ulysses", "usp")), key=lambda r: r.time_s)
    assert auto.time_s == pytest.approx(best.time_s, rel=0.05)  # auto: the fastest plan (within the tolerance)
    assert f"`auto` picks **{auto.detail.split(':')[0]}**" in section
    for r in planned:  # every row: the planner's bytes and time, work balance for the plans
        cells = next(c for c in rows[r.mode + (" (formula)" if r.by_formula else "")]
                     if c[1] == (str(r.ulysses) if r.ulysses > 1 else "-"))
        assert cells[5] == f"{r.time_s * 1e3:.2f}" and cells[7] == f"{r.time_s / floor:.2f}", (r.mode, cells)
        assert (cells[8] == "-") == r.by_formula, cells
    # the assumptions are printed
    for text in ("8 GPUs per node", "TP 2 inside a node", "450 GB/s", "50 GB/s", "400 TFLOP/s", "spans 4 node(s)"):
        assert text in section, text


def test_bad_configs_raise_errors_naming_them(tmp_path):
    with pytest.raises(ValueError, match=r"config 'no/such.yaml': no such file"):
        predict.read_config("no/such.yaml")
    cfg = tmp_path / "partial.yaml"
    cfg.write_text("MODEL_ARGS:\n  --num-layers: 2\n  --num-attention-heads: 4\n  --context-parallel-size: 4\n")
    with pytest.raises(ValueError, match=r"partial.yaml'.*lacks --seq-length, --hidden-size \(or --kv-channels\)"):
        predict.read_config(str(cfg))
    cfg.write_text("MODEL_ARGS:\n  --num-layers: 2\n  --num-attention-heads: 4\n  --hidden-size: 64\n"
                   "  --seq-length: 100\n  --context-parallel-size: 4\n")
    with pytest.raises(ValueError, match=r"--seq-length 100 must be divisible by 2 x CP = 8"):
        predict.read_config(str(cfg))
    with pytest.raises(ValueError, match=r"context-parallel size 1: the CP modes need"):
        predict.read_config("configs/gpt_tiny_cpu.yaml")
    with pytest.raises(ValueError, match=r"partial.yaml'.*without --data-path"):
        cfg.write_text("MODEL_ARGS:\n  --num-layers: 2\n  --num-attention-heads: 4\n  --hidden-size: 64\n"
                       "  --seq-length: 64\n  --reset-attention-mask: true\n")
        predict.read_config(str(cfg), cp=4)


def test_documents_come_from_the_datas_index(tmp_path):
    """--reset-attention-mask: the first sample's documents, read from PREFIX.idx (Megatron's
    format) without Megatron; the prediction then plans the balanced layout and its work."""
    lengths = [10, 30, 4, 40, 50]
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(lengths), len(lengths) + 1)
    (tmp_path / "d.idx").write_bytes(header + struct.pack(f"<{len(lengths)}i", *lengths))
    cfg = tmp_path / "docs.yaml"
    cfg.write_text("MODEL_ARGS:\n  --num-layers: 2\n  --num-attention-heads: 4\n  --group-query-attention: true\n"
                   "  --num-query-groups: 2\n  --hidden-size: 64\n  --seq-length: 64\n  --context-parallel-size: 4\n"
                   f"  --reset-attention-mask: true\n  --data-path: {tmp_path / 'd'}\n")
    p = predict.read_config(str(cfg))
    assert p.documents == (0, 10, 40, 44, 64) and (p.kv_heads, p.head_dim) == (2, 16)
    section = predict.prediction_section(str(cfg))
    assert "4 documents of mean 16 tokens" in section
    assert all(c[8] != "-" for m, cells in _rows(section).items() for c in cells), section
    (tmp_path / "d.idx").write_bytes(b"garbage" * 10)
    with pytest.raises(ValueError, match="not a Megatron indexed dataset index"):
        predict.read_config(str(cfg))


def test_measured_vs_planned_puts_the_planners_bytes_next_to_the_measured(tmp_path):
    """Synthetic runs of configs/gpt_tiny_cpu.yaml at CP 4: the planned bytes per step are the
    busiest rank's plan bytes (as tests/tools/test_main_job.py matches them) x layers x micro-batches."""
    problem = predict.read_config("configs/gpt_tiny_cpu.yaml", cp=4)
    shape = AttentionShape(seq_local=16, batch=1, heads=4, kv_heads=2, head_dim=16, itemsize=4)
    assert problem.shape == shape and (problem.layers, problem.micro_batches) == (2, 2)

    def busiest(mode, mask=Mask(causal=True), **settings):
        plan = resolve(mode, 4, shape, **settings).build(shape, mask)
        return 2 * 2 * max(b.sent for b in plan_bytes(plan, shape))

    hybrid, ring, window = (busiest("a2a+mesh", ulysses_size=2, tile=(2, 1)), busiest("ring"),
                            busiest("mesh", Mask(True, (2, 0)), tile=(2, 2)))
    runs = [RunResult("baseline", 1, bytes_per_step=0.0), RunResult("ring", 4, bytes_per_step=ring),
            RunResult("a2a+mesh:2", 4, tile="2x1", bytes_per_step=hybrid / 2),
            RunResult("mesh:2x2", 4, "window", tile="2x2", bytes_per_step=window),
            RunResult("tasp", 4, "docs", bytes_per_step=1000.0),
            RunResult("ring", 4, "docs", bytes_per_step=1000.0, planned_bytes_per_step=800.0),  # recorded by the run
            RunResult("mesh:auto", 4, tile="1x4", bytes_per_step=ring),  # the ring tile: ring's bytes
            RunResult("mesh:2x2", 4, tile="1x4, 2x2", bytes_per_step=5.0),  # layers of different tiles
            RunResult("ring", 4, "docs-zigzag", ok=False)]
    section = predict.measured_vs_planned_section(runs, problem, window=2, doc_mean=16, draws=2)
    rows = _rows(section)
    assert set(rows) == {"ring", "a2a+mesh:2", "mesh:2x2 [window]", "tasp [docs]", "ring [docs]", "mesh:auto",
                         "mesh:2x2"}, rows
    assert rows["ring"][0][3] == rows["mesh:2x2 [window]"][0][3] == rows["mesh:auto"][0][3] == "1.000", rows
    assert rows["a2a+mesh:2"][0][3] == "0.500"  # its tile 2x1, not 1x2 (which moves fewer bytes)
    assert "mean of 2 document draws" in rows["tasp [docs]"][0][4] and float(rows["tasp [docs]"][0][3]) > 0
    assert rows["ring [docs]"][0][3] == "1.250" and "each batch's own documents" in rows["ring [docs]"][0][4]
    assert rows["mesh:2x2"][0][1] == "-" and "no single Mesh tile reported (1x4, 2x2)" in rows["mesh:2x2"][0][4]
    with pytest.raises(ValueError, match=r"planning the window runs needs the window's width"):
        predict.measured_vs_planned_section(runs, problem, window=None, doc_mean=16)
    assert Topology.for_cp(4, 4).nodes_used(4) == 1  # the CPU run's machine: one node


def _config(tmp_path, **flags) -> str:
    """A small config (4 heads of dim 16, 64 tokens at CP 4) with ``flags`` (--window-size as
    window_size) added to its MODEL_ARGS."""
    args = {"--num-layers": 2, "--num-attention-heads": 4, "--hidden-size": 64, "--seq-length": 64,
            "--context-parallel-size": 4, **{f"--{k.replace('_', '-')}": v for k, v in flags.items()}}
    cfg = tmp_path / "c.yaml"
    cfg.write_text("MODEL_ARGS:\n" + "".join(f"  {k}: {v}\n" for k, v in args.items()))
    return str(cfg)


def test_a_variable_set_nowhere_names_its_config(tmp_path):
    """The job reads three configs for its predictions: an unset ${VAR} says which one (the
    launcher's command names its config too: tests/megatron/test_megatron_entry.py)."""
    path = _config(tmp_path, seq_length="${MEGATRON_MESH_TEST_UNSET}")
    with pytest.raises(ValueError) as e:
        predict.read_config(path)
    assert str(e.value) == (f"config '{path}': --seq-length: ${{MEGATRON_MESH_TEST_UNSET}} is not set (export it or add "
                            "it to ENV_VARS)"), str(e.value)


@pytest.mark.parametrize("window, error", [
    ("-5,0", "--window-size -5,0: LEFT -5 is not allowed; each side is a number of tokens >= 0, or -1 (unlimited)"),
    ("16,4", "--window-size 16,4: the plugin's causal layers attend no later key, so the right side must be 0 (or -1, "
             "unlimited)"),
    ("16,-2", "--window-size 16,-2: RIGHT -2 is not allowed"),
    ("5,0,0", "--window-size 5,0,0: give two values LEFT,RIGHT"),
    ("a,0", "--window-size 'a,0' must be LEFT,RIGHT (integers)"),
])
def test_a_window_the_training_refuses_is_refused_by_the_prediction(tmp_path, window, error):
    """The prediction runs the training start-up's check of --window-size (one function, in plan/):
    -5,0 was predicted as 'window None tokens' and 16,4 as a causal 16-token window."""
    from megatron_mesh.plan.window import megatron_window

    with pytest.raises(ValueError, match="config '.*c.yaml': " + re.escape(error)):
        predict.read_config(_config(tmp_path, window_size=f'"{window}"'))
    if window != "a,0":  # what the start-up check of a training run says about the same window
        with pytest.raises(ValueError, match=re.escape(error)):
            megatron_window(tuple(int(x) for x in window.split(",")), causal=True)


@pytest.mark.parametrize("window, planned, text", [
    ("16,0", (16, 0), "causal, window 16 tokens"), ("(16,0)", (16, 0), "causal, window 16 tokens"),
    ("16,-1", (16, 0), "causal, window 16 tokens"), ("-1,0", None, "causal,"), ("-1,-1", None, "causal,"),
])
def test_the_prediction_reads_a_window_as_megatron_does(tmp_path, window, planned, text):
    p = predict.read_config(_config(tmp_path, window_size=f'"{window}"'))
    assert p.layer_windows == (planned, planned) and f"{p.dtype}, {text}" in p.describe() + ",", p.describe()


def _busiest(shape, mode, mask, layout=None, **settings) -> int:
    """The busiest rank's bytes of one layer's plan (forward + backward) at CP 4."""
    return max(b.sent for b in plan_bytes(resolve(mode, 4, shape, **settings).build(shape, mask, layout), shape))


def test_the_planned_bytes_price_each_layer_with_its_own_mask(tmp_path):
    """Layers alternating a 3-token window with full attention (--window-size 3,0
    --window-attn-skip-freq 2, 4 layers, as gpt-oss) at CP 4: a run's planned bytes are two window
    layers' plans plus two full layers' -- before, every layer was planned as full attention (ring:
    measured / planned 0.54); the 'window' run keeps the alternation with its own width."""
    path = _config(tmp_path, num_layers=4, window_size='"3,0"', window_attn_skip_freq=2)
    shape = AttentionShape(seq_local=16, batch=1, heads=4, kv_heads=4, head_dim=16, itemsize=4)
    full, window3, window5 = (_busiest(shape, "ring", m) for m in (Mask(True), Mask(True, (3, 0)), Mask(True, (5, 0))))
    assert window3 < window5 < full
    mesh = _busiest(shape, "mesh", Mask(True), tile=(2, 2)) + _busiest(shape, "mesh", Mask(True, (5, 0)), tile=(2, 2))
    runs = [RunResult("ring", 4, bytes_per_step=2 * (window3 + full)),
            RunResult("mesh:2x2", 4, "window", tile="2x2", bytes_per_step=2 * mesh)]
    problem = predict.read_config(path)
    rows = _rows(predict.measured_vs_planned_section(runs, problem, window=5))
    assert rows["ring"][0][3] == rows["mesh:2x2 [window]"][0][3] == "1.000", rows
    assert problem.layer_windows == ((3, 0), None, (3, 0), None) and problem.shape == shape
    assert "2 of 4 layers window 3 tokens, 2 of 4 layers full" in problem.describe()
    with pytest.raises(ValueError, match=re.escape("must be an integer N or a list pattern of 0/1 per layer")):
        predict.read_config(_config(tmp_path, window_size='"3,0"', window_attn_skip_freq='"[1]*x"'))
    with pytest.raises(ValueError, match=re.escape("--window-attn-skip-freq [1, 0, 1]: the list needs one entry per "
                                                   "layer (2 layers, --num-layers), got 3")):
        predict.read_config(_config(tmp_path, window_size='"3,0"', window_attn_skip_freq='"[1,0,1]"'))


def test_the_planned_bytes_price_llama4s_chunked_layers_with_their_chunks(tmp_path, monkeypatch):
    """Llama 4's layers (--attention-chunk-size 6 --no-rope-freq 4, 4 layers) at CP 4: a run's
    planned bytes are three chunked layers' plans plus one full layer's -- on one sequence, and
    on documents on one balanced layout of the layers' summed work (as the runtime builds it,
    megatron/layout_decision.layer_masks), each layer's plan with the chunks inside the
    documents."""
    from megatron_mesh import masks
    from megatron_mesh.plan.balance import balanced_layout
    from megatron_mesh.plan.maskkinds import MaskStack

    path = _config(tmp_path, num_layers=4, attention_chunk_size=6, no_rope_freq=4)
    shape = AttentionShape(seq_local=16, batch=1, heads=4, kv_heads=4, head_dim=16, itemsize=4)
    problem = predict.read_config(path)
    assert problem.layer_masks == (masks.chunked(6),) * 3 + (predict.FULL,)
    assert "3 of 4 layers chunks of 6 tokens, 1 of 4 layers full" in problem.describe()
    chunked, full = (_busiest(shape, "tasp", m.normalized(64)) for m in (masks.chunked(6), Mask(True)))
    assert chunked < full
    cu = [0, 10, 30, 64]
    stack = MaskStack.of([masks.chunked(6)] * 3 + [Mask(True)])
    lay = balanced_layout(cu, 4, group=1, mask=stack)
    on_docs = 3 * _busiest(shape, "tasp", masks.chunked(6), lay) + _busiest(shape, "tasp", Mask(True), lay)
    monkeypatch.setattr(predict, "document_bounds", lambda spec, seq_len, seed: list(cu))
    runs = [RunResult("tasp", 4, bytes_per_step=3 * chunked + full),
            RunResult("tasp", 4, "docs", bytes_per_step=on_docs)]
    rows = _rows(predict.measured_vs_planned_section(runs, problem, doc_mean=16, draws=1))
    assert rows["tasp"][0][3] == rows["tasp [docs]"][0][3] == "1.000", rows
    with pytest.raises(ValueError, match=re.escape("--attention-chunk-size 6 with --window-size 3,0: layer 1 would "
                                                   "have both")):
        predict.read_config(_config(tmp_path, num_layers=4, attention_chunk_size=6, no_rope_freq=4,
                                    window_size='"3,0"'))
    with pytest.raises(ValueError, match=re.escape("--attention-chunk-size x must be an integer >= 1")):
        predict.read_config(_config(tmp_path, attention_chunk_size="x"))


def test_the_planned_bytes_of_mla_move_values_of_their_own_dim(tmp_path, monkeypatch):
    """configs/deepseek_tiny_cpu.yaml at CP 4 (MLA: query/key dim 16 + 8, value dim 12; its own EOD
    documents): the plan's V, output and their gradients are 12 wide -- a run whose metrics lack
    the plans is estimated on the config's first sample, with those dims."""
    lengths = (8, 6, 14, 8, 4, 10, 30)  # an index as scripts/make_doc_dataset.py writes: its lengths are all read
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(lengths), len(lengths) + 1)
    (tmp_path / "d.idx").write_bytes(header + struct.pack(f"<{len(lengths)}i", *lengths))
    monkeypatch.setenv("DOC_DATA", str(tmp_path / "d"))
    problem = predict.read_config("configs/deepseek_tiny_cpu.yaml", cp=4)
    assert problem.documents == (0, 8, 14, 28, 36, 40, 50, 64)
    shape = problem.shape
    assert (shape.head_dim, shape.v_head_dim, shape.heads, shape.kv_heads) == (24, 12, 4, 4)
    assert "4 query / 4 KV heads, head dim 24 (values 12);" in problem.describe()
    square = AttentionShape(seq_local=16, batch=1, heads=4, kv_heads=4, head_dim=24, itemsize=4)
    mask = Mask.from_cu_seqlens(list(problem.documents), 64, True)
    assert _busiest(shape, "ring", mask) < _busiest(square, "ring", mask)
    runs = [RunResult("ring", 4, "docs-zigzag", bytes_per_step=1000.0, planned_bytes_per_step=1000.0),
            RunResult("ring", 4, bytes_per_step=4 * 2 * _busiest(shape, "ring", Mask(True), layout(problem)))]
    rows = _rows(predict.measured_vs_planned_section(runs, problem, doc_mean=16))
    docs = rows["ring [docs-zigzag]"][0]
    assert docs[3] == "1.000" and "each batch's own documents" in docs[4], docs
    assert rows["ring"][0][3] == "1.000" and rows["ring"][0][4] == "estimate: the first sample of the config's data"


def layout(problem):
    from megatron_mesh.plan.balance import balanced_layout

    return balanced_layout(list(problem.documents), 4, group=1)


def test_the_gpu_configs_of_gpt_oss_20b_and_deepseek_v3(tmp_path):
    """The main job's GPU predictions (its default --predict): gpt-oss-20b's 12 window layers (127
    tokens back + the query: its 128-token window) and 12 full layers priced each, with the stack's
    total under auto's per-layer pick; DeepSeek-V3's MLA heads (192 query/key, 128 value)."""
    oss, ds = (predict.read_config(p) for p in predict.DEFAULT_CONFIGS[1:3])
    assert oss.layer_kinds == [(Mask(True, (127, 0)), 12), (predict.FULL, 12)]
    assert oss.layer_windows[:3] == ((127, 0), None, (127, 0))
    assert oss.shape == AttentionShape(seq_local=8192, batch=1, heads=32, kv_heads=4, head_dim=64, itemsize=2)
    assert ds.layer_kinds == [(predict.FULL, 61)]
    assert ds.shape == AttentionShape(seq_local=8192, batch=1, heads=64, kv_heads=64, head_dim=192, itemsize=2,
                                      v_head_dim=128)
    section = predict.prediction_section(predict.DEFAULT_CONFIGS[1])
    window, full = section.split("### The 12 layers with a 127-token window")[1].split("### The 12 layers with full")
    topo = predict.machine(oss)
    stack = 0.0
    for kind, part in ((Mask(True, (127, 0)), window), (predict.FULL, full)):
        rows, _, floor = predict.predict(oss, topo, kind=kind)
        auto = next(r for r in rows if r.mode == "auto")
        assert f"Compute floor: **{floor * 1e3:.2f} ms**" in part and f"{auto.time_s * 1e3:.2f} ms per layer" in part
        stack += 12 * auto.time_s
    assert f"The stack: **{stack * 1e3:.2f} ms** of attention per micro-batch" in full
    with pytest.raises(ValueError, match="its layers run different masks"):
        predict.predict(oss, topo)
    deepseek = predict.prediction_section(predict.DEFAULT_CONFIGS[2])
    assert "## Prediction for deepseek_v3_128k_cp16.yaml" in deepseek and "head dim 192 (values 128)" in deepseek
    assert "`auto` picks **" in deepseek and "###" not in deepseek


def test_llama4s_chunked_layers_are_priced_with_their_chunks():
    """configs/llama4_scout_128k_cp16.yaml: Llama 4's 36 chunked layers (chunks of 8192 tokens, the
    plugin's --attention-chunk-size) and 12 global NoPE layers (--no-rope-freq 4) priced each with
    its own mask: the chunked layers' floor is the chunks' pairs, and every row of them equals the
    planner's for that mask (evaluate with masks.chunked); the global layers' rows are the causal
    ones."""
    from megatron_mesh import masks

    path = os.path.join(predict.ROOT, "configs", "llama4_scout_128k_cp16.yaml")
    assert path in predict.DEFAULT_CONFIGS  # the main job's report predicts it by default
    scout = predict.read_config(path)
    assert scout.layer_kinds == [(masks.chunked(8192), 36), (predict.FULL, 12)]
    assert [m == predict.FULL for m in scout.layer_masks[:8]] == [False, False, False, True] * 2
    assert "36 of 48 layers chunks of 8192 tokens, 12 of 48 layers full" in scout.describe()
    section = predict.prediction_section(path)
    chunked, full = section.split("### The 36 layers with chunks of 8192 tokens")[1].split("### The 12 layers with full")
    topo = predict.machine(scout)
    rows, _, floor = predict.predict(scout, topo, kind=masks.chunked(8192))
    assert floor == compute_floor(allowed_pairs([0, 131072], mask=masks.chunked(8192)), 16, scout.shape, topo)
    assert floor < compute_floor(allowed_pairs([0, 131072]), 16, scout.shape, topo) / 10  # 16 chunks: 1/16 the pairs
    assert f"Compute floor: **{floor * 1e3:.2f} ms**" in chunked
    want, _ = predict.evaluate(16, scout.shape, topo, modes=predict.PREDICT_MODES,
                               mask=masks.chunked(8192).normalized(131072), work=True)
    assert [(r.mode, r.ulysses, r.bytes_per_rank, r.time_s) for r in rows] == \
        [(r.mode, r.ulysses, r.bytes_per_rank, r.time_s) for r in want]
    for r in rows:
        assert f"| {r.time_s * 1e3:.2f} |" in chunked, r
    assert "`auto`'s pick on each kind of layer: ring on the 36 layers with chunks of 8192 tokens, a2a+tasp " \
           "(all-to-all 4) on the 12 layers with full attention; run it with a `--cp-comm-type` listing each layer's " \
           "pick, in layer order and `--hierarchical-context-parallel-sizes 4 4`" in full, full
    longer = predict.Problem("long chunks", replace(scout.run, chunk_size=200000))  # chunks as long as the sequence
    assert longer.layer_kinds == [(predict.FULL, 48)]  # causal: one kind of layer, priced once


@pytest.mark.parametrize("flags, error", [
    (dict(num_attention_heads=6, hidden_size=96, group_query_attention="true", num_query_groups=4),
     "--num-query-groups 4 must divide --num-attention-heads 6"),
    (dict(num_attention_heads=32, hidden_size=1024, group_query_attention="true", num_query_groups=64),
     "--num-query-groups 64 must divide --num-attention-heads 32"),
    (dict(num_attention_heads=8, hidden_size=256, group_query_attention="true", num_query_groups=4,
          tensor_model_parallel_size=8), None),  # 4 groups for TP 8: each replicated on 2 TP ranks
    (dict(num_attention_heads=24, hidden_size=768, group_query_attention="true", num_query_groups=6,
          tensor_model_parallel_size=4),
     "--num-query-groups 6 must be a multiple or a divisor of --tensor-model-parallel-size 4"),
])
def test_heads_that_cannot_be_split_are_refused_when_the_config_is_read(tmp_path, flags, error):
    """Read before any run of the main job (they failed in the prediction, after every run had trained)."""
    path = _config(tmp_path, **flags)
    if error is None:
        p = predict.read_config(path)
        assert (p.shape.heads, p.shape.kv_heads) == (1, 1)
        return
    with pytest.raises(ValueError, match="config '.*c.yaml': " + re.escape(error)):
        predict.read_config(path)


def test_an_index_announcing_more_sequences_than_it_holds_is_refused_in_one_line(tmp_path):
    """2^40 announced sequences: a MemoryError before; one ValueError naming the file now. Only the
    lengths of the first sample are read."""
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 2 ** 40, 2 ** 40 + 1)
    (tmp_path / "d.idx").write_bytes(header + struct.pack("<3i", 10, 30, 24))
    cfg = _config(tmp_path, reset_attention_mask="true", data_path=str(tmp_path / "d"))
    with pytest.raises(ValueError, match=r"d.idx: announces 1099511627776 sequences, but holds the lengths of 3 "
                                         r"\(4 bytes each\): truncated, or not an index"):
        predict.read_config(cfg)
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 3, 4)
    (tmp_path / "d.idx").write_bytes(header + struct.pack("<3i", 10, 30, 24))
    assert predict.read_config(cfg).documents == (0, 10, 40, 64)
