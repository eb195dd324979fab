"""The plugin's lines in Megatron's log, in one process: the per-stage summary, the compute /
communication timers (a layer's forward and backward, its transfers pausing the compute timer),
bytes per iteration in the log and TensorBoard, and the metrics JSON lines."""

import json
import logging
import types

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

import torch  # noqa: E402

from megatron_mesh.comm.base import DONE, Communicator, record_bytes  # noqa: E402
from megatron_mesh.megatron import telemetry  # noqa: E402
from megatron_mesh.megatron.metrics import MetricsWriter  # noqa: E402
from megatron_mesh.megatron.process import ProcessState  # noqa: E402

pytestmark = pytest.mark.megatron


def test_summary_names_runs_of_layers():
    layers = [(1, ("mesh (CP 4, tile 2x2)", {}, True)), (2, ("mesh (CP 4, tile 2x2)", {}, True)),
              (3, ("tasp (CP 4)", {}, True)), (5, ("tasp (CP 4)", {}, True))]
    assert telemetry.layer_runs(layers) == ["layers 1-2: mesh (CP 4, tile 2x2)", "layer 3: tasp (CP 4)",
                                            "layer 5: tasp (CP 4)"]


def test_summary_is_logged_once_at_the_first_forward(caplog):
    tel = telemetry.Telemetry()
    tel.summary.register_layer(1, "ring (CP 2, zigzag ring, kernel auto)", {"mode": "ring"}, logs=True)
    tel.summary.register_layer(2, "ring (CP 2, zigzag ring, kernel auto)", {"mode": "ring"}, logs=True)
    with caplog.at_level(logging.INFO, logger=telemetry.__name__):
        tel.on_forward()
        tel.on_forward()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["megatron_mesh: layers 1-2: ring (CP 2, zigzag ring, kernel auto)"]  # no parallel state here


class _Timers:
    """Megatron's Timers as the plugin uses them: timers(name, log_level=...).start()/stop()."""

    def __init__(self):
        self.events = []

    def __call__(self, name, log_level=None):
        assert log_level == telemetry.TIMER_LOG_LEVEL
        return types.SimpleNamespace(start=lambda: self.events.append(f"{name} start"),
                                     stop=lambda: self.events.append(f"{name} stop"))


class _Comm(Communicator):
    rank, world_size = 0, 2

    def _start(self, sends, recvs):
        return DONE


def test_transfers_pause_the_compute_timer_forward_and_backward():
    timers = _Timers()
    timing = telemetry.Timing(on=True, timers=lambda: timers)
    comm = timing.communicator(_Comm())
    assert isinstance(comm, telemetry.TimedCommunicator)
    q = torch.randn(4, requires_grad=True)
    (qm,), mark_output = timing.mark_backward((q,))
    with timing.compute_phase():  # a layer's forward: compute, one round (start + wait), compute
        comm.start([(1, torch.zeros(2))], []).wait()
        out = mark_output(qm * 2)
    C, M = telemetry.TIMER_COMPUTE, telemetry.TIMER_COMM
    assert timers.events == [f"{C} start", f"{C} stop", f"{M} start", f"{M} stop", f"{C} start",
                             f"{C} stop", f"{M} start", f"{M} stop", f"{C} start", f"{C} stop"]
    timers.events.clear()
    out.sum().backward()  # the output's mark starts the compute timer, the inputs' mark stops it
    assert timers.events == [f"{C} start", f"{C} stop"] and torch.equal(q.grad, torch.full((4,), 2.0))


def test_timers_off_changes_nothing():
    timing = telemetry.Telemetry(types.SimpleNamespace(timing_log_level=1)).timing  # below the plugin timers' level
    comm = _Comm()
    assert timing.communicator(comm) is comm
    q = torch.randn(3, requires_grad=True)
    (qm,), mark_output = timing.mark_backward((q,))
    assert qm is q and mark_output(q) is q


def test_iteration_records_and_bytes_in_the_log_and_tensorboard(tmp_path, caplog):
    scalars = []
    writer = types.SimpleNamespace(add_scalar=lambda name, value, it: scalars.append((name, value, it)))
    tel = telemetry.Telemetry(types.SimpleNamespace(log_interval=2, log_cp_attention_bytes=True),
                              MetricsWriter(str(tmp_path), 0, 1), writer=lambda: writer, process=ProcessState())
    tel.records.step_ms = 12.5
    with caplog.at_level(logging.INFO, logger=telemetry.__name__):
        for it, (sent, loss) in enumerate([(1000, 4.5), (3000, 4.25)], start=1):
            record_bytes(sent, 2 * sent)
            tel.after_iteration({"lm loss": torch.tensor(loss)}, it, is_first=False)
    run, *recs = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert run == {"kind": "run"}  # a run opens its records (a directory used again holds several)
    assert [(r["iteration"], r["losses"], r["bytes_sent"], r["bytes_received"], r["time_ms"]) for r in recs] == \
        [(1, {"lm loss": 4.5}, 1000, 2000, 12.5), (2, {"lm loss": 4.25}, 3000, 6000, 12.5)]
    # logged at iteration 2 (--log-interval 2): the mean over the two iterations, min = max on one rank
    assert [r.getMessage() for r in caplog.records] == [
        "cp attention bytes per iteration (min, max) across ranks: sent (1.95 KiB, 1.95 KiB) | "
        "received (3.91 KiB, 3.91 KiB)"]
    assert scalars == [("cp-attention-bytes-sent", 2000.0, 2), ("cp-attention-bytes-received", 4000.0, 2)]


class _Comm4(Communicator):
    rank, world_size = 1, 4

    def _start(self, sends, recvs):
        return DONE


def test_iteration_records_bytes_per_peer_and_attention_work(tmp_path):
    """Each iteration record splits bytes_sent by receiver (CP group ranks; they sum to bytes_sent)
    and carries the forward attention work of the plans the layers ran: summed over a CP group's
    ranks it is every causal (query, key) pair x heads x samples, for a plain and a head-sliced plan;
    and the bytes its plans send (the backward's only for a call whose backward runs)."""
    from megatron_mesh.plan import AttentionShape, Mask, plan_bytes, resolve

    tel = telemetry.Telemetry(types.SimpleNamespace(log_interval=100), MetricsWriter(str(tmp_path), 1, 2),
                              process=ProcessState())
    records = tel.records
    records.step_ms = 1.0
    comm = _Comm4()
    f32 = torch.float32
    comm.start([(0, torch.zeros(10, dtype=f32)), (2, torch.zeros(3, dtype=f32)), (0, torch.zeros(1, dtype=f32))],
               [(3, torch.zeros(4, dtype=f32))])
    comm.start([(3, torch.zeros(5, dtype=torch.float64))], [])
    S, heads, kv_heads, batch = 32, 4, 2, 2
    shape = AttentionShape(seq_local=S // 4, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=8, itemsize=4)
    causal_scores = S * (S + 1) // 2 * heads * batch
    for mode, settings in (("ring", {}), ("a2a+mesh", {"ulysses_size": 2})):
        plan = resolve(mode, 4, shape, **settings).build(shape, Mask(causal=True))
        works = []
        for rank in range(4):
            before = records.work
            for _ in range(2):  # a second call of the same plan (next micro-batch) adds the same work again
                records.on_attention(plan, rank, shape, backward=True)
            works.append((records.work - before) // 2)
        assert sum(works) == causal_scores, (mode, works)
    records.planned_sent = 0
    planned = plan_bytes(plan, shape)[1]
    records.on_attention(plan, 1, shape, backward=False)  # this process is CP rank 1; a recompute forward
    records.on_attention(plan, 1, shape, backward=True)  # ... then the forward whose backward runs
    tel.after_iteration({"lm loss": torch.tensor(4.0)}, 1, is_first=False)
    tel.after_iteration({"lm loss": torch.tensor(3.9)}, 2, is_first=False)
    _, first, second = [json.loads(line) for line in (tmp_path / "rank1.jsonl").read_text().splitlines()]
    assert first["bytes_sent_to"] == {"0": 44, "2": 12, "3": 40} and first["bytes_sent"] == 96 == 4 * 11 + 12 + 40
    assert first["cp_rank"] == 1 and first["attention_work"] == 4 * causal_scores + 2 * works[1]
    assert first["planned_bytes_sent"] == 2 * planned.forward_sent + planned.backward_sent > 0
    assert (second["bytes_sent"], second["bytes_sent_to"], second["attention_work"]) == (0, {}, 0)
    assert second["planned_bytes_sent"] == 0


def test_the_layouts_samples_ran_on_in_the_log_and_the_records(tmp_path, caplog):
    """Under --cp-layout auto, at each --log-interval, which layouts this rank's samples ran on since
    the last log (the batch split counts them in the process state); every iteration's record holds
    its own; under a layout of one kind, and at CP 1 (no layout to pick), the records only."""
    for layout, cp, logged in (("auto", 4, True), ("balanced", 4, False), ("auto", 1, False)):
        process = ProcessState()
        out = tmp_path / f"{layout}{cp}"
        tel = telemetry.Telemetry(types.SimpleNamespace(log_interval=2, cp_layout=layout, context_parallel_size=cp),
                                  MetricsWriter(str(out), 0, 1), process=process)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=telemetry.__name__):
            for it, kinds in enumerate(({"balanced": 1, "owners": 1}, {"zigzag": 2}, {}, {"owners": 1}), 1):
                process.layout_kinds.update(kinds)
                tel.after_iteration({"lm loss": torch.tensor(4.0)}, it, is_first=False)
        assert not process.layout_kinds  # taken
        records = [json.loads(line) for line in (out / "rank0.jsonl").read_text().splitlines()][1:]
        assert [r["layouts"] for r in records] == [{"balanced": 1, "owners": 1}, {"zigzag": 2}, {}, {"owners": 1}]
        lines = [r.getMessage() for r in caplog.records]
        want = ["megatron_mesh: --cp-layout auto ran this rank's 4 samples since the last log on: zigzag 2, balanced 1, "
                "owners 1", "megatron_mesh: --cp-layout auto ran this rank's 1 samples since the last log on: owners 1"]
        assert lines == (want if logged else []), lines


def test_comm_counter_counts_bytes_per_peer():
    from megatron_mesh.comm.base import comm_counter

    with comm_counter() as c:
        _Comm4().start([(0, torch.zeros(2)), (3, torch.zeros(6)), (0, torch.zeros(1))], [])
    assert c.sent_to == {0: 12, 3: 24} and c.bytes_sent == 36 and c.messages_sent == 3
    with pytest.raises(ValueError, match=r"bytes per peer \{0: 5\} sum to 5, not to the 6 bytes sent"):
        record_bytes(6, 0, 1, {0: 5})


def test_a_plan_placed_otherwise_than_the_summary_is_logged_once(caplog):
    """mesh:auto picks its tile for dense attention (the summary line); under documents the
    mask-aware plan takes another tile map, or the query owner: one line says so per placement."""
    from megatron_mesh.plan import AttentionShape, Mask, MaskAwareFacts, resolve

    summary = telemetry.LayerSummary()
    shape = AttentionShape(seq_local=1024, batch=1, heads=4, kv_heads=4, head_dim=8, itemsize=4)
    placement = resolve("mesh", 8, shape, tile="auto")
    assert placement.tile == (2, 4)
    documents = Mask.from_cu_seqlens([0, 3000, 4000, 4100, 8192], 8192, True, None)
    plan = placement.build(shape, documents, None)
    assert (plan.facts.tile, plan.facts.assignment) == ((4, 2), "tile")
    dense = placement.build(shape, None, None)
    desc = placement.describe()[:-1] + ", kernel auto)"
    for n in (1, 2):
        summary.register_layer(n, desc, {"mode": "mesh"}, logs=True)
    summary.register_layer(3, "tasp (CP 8, kernel auto)", {"mode": "tasp"}, logs=True)
    with caplog.at_level(logging.INFO, logger=telemetry.__name__):
        summary.on_plan(1, placement.tile, dense)  # as summarised: nothing
        for _ in range(3):  # every batch, two layers: said once
            summary.on_plan(1, placement.tile, plan)
            summary.on_plan(2, placement.tile, plan)
        summary.on_plan(3, None, plan)  # no tile summarised: nothing to correct
        owner = types.SimpleNamespace(facts=MaskAwareFacts("shift", "query owner", (2, 4), "q"))
        summary.on_plan(2, placement.tile, owner)
        ring = types.SimpleNamespace(facts=MaskAwareFacts("shift", "query owner", (1, 8), "q"))
        summary.on_plan(1, (1, 8), ring)  # a ring tile
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"megatron_mesh: layers with {desc}: under this batch's mask the plan runs tile 4x2 (of the tile "
                     "maps and the query owner, the fewest bytes on the busiest rank under this mask)",
                     f"megatron_mesh: layers with {desc}: under this batch's mask the plan runs every block at its "
                     "query chunk's owner (query owner: under this mask no tile map moves fewer bytes on the busiest "
                     "rank)"]
    summary = telemetry.LayerSummary()
    summary.register_layer(4, desc, {"mode": "mesh"}, logs=False)  # a rank that does not speak for its stage
    with caplog.at_level(logging.INFO, logger=telemetry.__name__):
        caplog.clear()
        summary.on_plan(4, placement.tile, plan)
    assert caplog.records == []


def test_install_gives_every_spec_call_of_a_run_the_same_telemetry(monkeypatch, tmp_path):
    """The spec functions call install once per model chunk: Megatron's wrapped training_log
    holds the run's telemetry, so they all get it; new arguments (another run in the process) get
    a new one, writing to the metrics file already open."""
    from megatron_mesh.megatron import ensure_typing_override

    ensure_typing_override()
    from megatron.training import training

    monkeypatch.setattr(training, "training_log", training.training_log)  # Megatron's, as it was, after the test
    monkeypatch.setattr(training, "train_step", training.train_step)
    args = types.SimpleNamespace(log_interval=1, cp_metrics_dir=str(tmp_path))
    first = telemetry.install(args)
    assert telemetry.install(args) is first and training.training_log.megatron_mesh_telemetry is first
    again = telemetry.install(types.SimpleNamespace(log_interval=1, cp_metrics_dir=str(tmp_path)))
    assert again is not first and again.records.metrics is first.records.metrics
    assert training.training_log.megatron_mesh_telemetry is again
    assert telemetry.install(types.SimpleNamespace(log_interval=1)).records.metrics is None  # no --cp-metrics-dir
