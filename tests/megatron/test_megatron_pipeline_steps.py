"""Which micro-batch's documents a pipeline stage's forward and backward steps run with
(megatron_mesh/megatron/pipeline.py), one process, Megatron's step functions stood in for.

Megatron's schedules name the micro-batch of a forward step (``current_microbatch``) and hand
its backward step the output that forward step returned; a virtual pipeline or 1F1B runs them in
an order of their own, and a recomputed layer runs its forward again inside the backward step.
The training runs (test_megatron_pretrain_pipeline.py: a virtual pipeline with full and selective
recompute at PP 2, recompute at PP 3) check the losses; here, that each step sees its own
micro-batch's boundaries in any order, and that a step the bookkeeping cannot place stops.
"""

import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

from megatron_mesh.megatron.pipeline import _backward_step, _forward_step, _Step  # noqa: E402
from megatron_mesh.megatron.process import ProcessState  # noqa: E402
from megatron_mesh.plan.megatron_problem import THD_DOCUMENTS  # noqa: E402

EOD = 9


def _step(process: ProcessState, n: int = 3) -> _Step:
    """A step of ``n`` micro-batches of one 8-token sample each: micro-batch i ends a document after
    token i (THD documents: boundaries only, no layout, no process group)."""
    tokens = torch.zeros(n, 1, 8, dtype=torch.int64)
    for i in range(n):
        tokens[i, 0, i] = EOD
    settings = types.SimpleNamespace(documents=THD_DOCUMENTS)
    step = _Step(tokens, None, settings, EOD, process)
    process.pipeline_step = step
    return step


def _rows(i: int) -> tuple:
    return ((0, i + 1, 8),)


def test_each_step_runs_with_its_micro_batch_s_documents_in_any_order():
    process = ProcessState()
    _step(process)
    seen = []

    def forward(*a, current_microbatch=None, **kw):
        seen.append(("forward", current_microbatch, process.pipeline_rows))
        return [object()], 1  # a fresh output, as Megatron's forward_step returns [output_tensor]

    def backward(input_tensor, output_tensor, output_tensor_grad, config):
        seen.append(("backward", output_tensor, process.pipeline_rows))
        return None

    # a virtual pipeline's order on one stage: forward steps of both chunks, then backward steps
    # in an order of the schedule's own, each with the output its forward step returned
    outs = {}
    for chunk, mb in ((0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (1, 2)):
        out, _ = _forward_step(forward, process, "func", current_microbatch=mb, vp_stage=chunk)
        outs[chunk, mb] = out
    for chunk, mb in ((1, 0), (1, 1), (0, 0), (1, 2), (0, 1), (0, 2)):
        _backward_step(backward, process, None, outs[chunk, mb], None, None)
    forwards = [s for s in seen if s[0] == "forward"]
    assert [(mb, rows) for _, mb, rows in forwards] == [(mb, _rows(mb)) for mb in (0, 1, 0, 2, 1, 2)]
    backwards = [s for s in seen if s[0] == "backward"]
    assert [rows for _, _, rows in backwards] == [_rows(mb) for mb in (0, 1, 0, 2, 1, 2)]
    assert process.pipeline_step.outputs == {}  # every output's micro-batch was used once


def test_a_step_it_cannot_place_stops_naming_why():
    process = ProcessState()
    _step(process, n=2)

    def forward(*a, **kw):
        return [object()], 1

    with pytest.raises(RuntimeError, match="without naming its micro-batch"):
        _forward_step(forward, process, "func")
    with pytest.raises(RuntimeError, match="ran micro-batch 2 of a step of 2"):
        _forward_step(forward, process, "func", current_microbatch=2)
    out, _ = _forward_step(forward, process, "func", current_microbatch=1)
    _backward_step(lambda *a: None, process, None, out, None, None)
    # a second backward step of the same output, or of one no forward step returned
    for stranger in (out, [object()]):
        with pytest.raises(RuntimeError, match="an output no forward step of this step returned"):
            _backward_step(lambda *a: None, process, None, stranger, None, None)
    with pytest.raises(RuntimeError, match="an output no forward step of this step returned"):  # none given
        _backward_step(lambda *a, **kw: None, process, None, output_tensor_grad=None)


def test_outside_a_shared_step_the_steps_are_megatron_s_own():
    process = ProcessState()  # no step shares documents (PP 1, or no documents)
    assert _forward_step(lambda *a, **kw: ("out", 1), process, "func") == ("out", 1)
    assert _backward_step(lambda *a, **kw: "grad", process, None, "out", None, None) == "grad"
    assert process.pipeline_rows is None
