"""``paraml.bench.trace``: one traced training step of real strategies on logical CPUs, device by device."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from paraml import Parallel
from paraml.bench.trace import TIMELINE_WIDTH, StepTrace, merge_intervals, trace_step, trace_steps
from paraml.devices import canonical_device

WIDTH = 64
MATMULS = ("MatMul", "_MklMatMul", "_MklNativeFusedMatMul", "_FusedMatMul")


def mlp() -> keras.Model:
    layers = [keras.layers.Dense(WIDTH, activation="relu", name=f"unit{i}") for i in range(4)]
    return keras.Sequential([keras.Input((WIDTH,)), *layers])


def batch(rows: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, WIDTH)).astype("float32"), rng.normal(size=(rows, WIDTH)).astype("float32")


def pipeline(schedule: str) -> Parallel:
    par = Parallel("model_parallel", devices=2, micro_batches=2, schedule=schedule, partition="even")
    par.build(mlp, optimizer="sgd", loss="mse")
    return par


def unit_matmuls(trace: StepTrace, unit: str, backward: bool) -> set[str]:
    """The devices on which the matmuls of ``unit``'s forward (or backward) passes ran."""
    return {
        op.device
        for op in trace.ops
        if op.op in MATMULS and f"/{unit}" in op.name and ("_grad/" in op.name) == backward
    }


@pytest.fixture(scope="module")
def one_f_one_b() -> tuple[Parallel, list[StepTrace]]:
    par = pipeline("1f1b")
    return par, trace_steps(par, *batch(), steps=2)


def test_each_stage_runs_its_units_forward_and_backward_on_its_device(one_f_one_b):
    par, traces = one_f_one_b
    assert len(traces) == 2
    for trace in traces:
        assert trace.devices == par.devices  # the Parallel's own device names, in its order
        assert {op.device for op in trace.ops} == set(par.devices)
        for stage, device in zip(par.plan.stages, par.devices):
            for unit in stage.layers:
                assert unit_matmuls(trace, unit, backward=False) == {device}, unit
                assert unit_matmuls(trace, unit, backward=True) == {device}, unit


def test_busy_intervals_lie_in_the_span_and_idle_fractions_are_fractions(one_f_one_b):
    _, traces = one_f_one_b
    for trace in traces:
        assert trace.span > 0 and min(op.start for op in trace.ops) == 0.0
        assert max(op.end for op in trace.ops) == pytest.approx(trace.span)
        for device in trace.devices:
            busy = trace.busy(device)
            assert busy and all(0 <= start <= end <= trace.span + 1e-12 for start, end in busy)
            assert all(a[1] < b[0] for a, b in zip(busy, busy[1:]))  # sorted and merged: gaps between them
            assert 0.0 <= trace.idle_fraction(device) < 1.0
        assert list(trace.idle_fractions()) == list(trace.devices)


def test_the_printed_timeline_has_one_row_per_device(one_f_one_b):
    _, traces = one_f_one_b
    trace = traces[0]
    lines = str(trace).splitlines()
    assert len(lines) == 1 + len(trace.devices) and "ms from the first op's start" in lines[0]
    for device, line in zip(trace.devices, lines[1:]):
        row = line.split()[1]
        assert line.startswith(device) and len(row) == TIMELINE_WIDTH and set(row) <= {"#", "."}
        assert line.endswith(f"idle {trace.idle_fraction(device):.3f}")
        assert "#" in row  # each stage ran something


def test_an_unknown_device_is_named_with_the_valid_ones(one_f_one_b):
    _, traces = one_f_one_b
    with pytest.raises(ValueError, match=r"device '/device:GPU:7' is not one of .*/device:CPU:0, /device:CPU:1"):
        traces[0].idle_fraction("/device:GPU:7")


def test_a_later_call_on_the_same_parallel_reuses_the_record(one_f_one_b):
    par, _ = one_f_one_b
    trace = trace_step(par, *batch(), warmup=1)
    assert {op.device for op in trace.ops} == set(par.devices)


def test_on_single_only_its_device_is_busy():
    par = Parallel("single")
    par.build(mlp, optimizer="sgd", loss="mse")
    trace = trace_step(par, *batch())
    assert trace.devices == par.devices and len(trace.devices) == 1
    assert trace.ops and {op.device for op in trace.ops} == set(par.devices)
    assert len(str(trace).splitlines()) == 2


def test_a_parallel_that_trained_untraced_is_refused():
    par = Parallel("single")
    par.build(mlp, optimizer="sgd", loss="mse")
    par.fit(*batch(), batch_size=32, verbose=0)
    with pytest.raises(ValueError, match="had trained before; build a new Parallel"):
        trace_step(par, *batch())


def test_counts_are_checked_before_training():
    par = Parallel("single")
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        trace_steps(par, *batch(), steps=0)
    with pytest.raises(ValueError, match="warmup must be an int >= 1, got 0"):
        trace_step(par, *batch(), warmup=0)


def test_merge_intervals():
    assert merge_intervals([]) == []
    assert merge_intervals([(2.0, 3.0), (0.0, 1.0), (0.5, 1.5), (1.5, 2.0)]) == [(0.0, 3.0)]
    assert merge_intervals([(0.0, 1.0), (2.0, 2.5)]) == [(0.0, 1.0), (2.0, 2.5)]


def test_gpipe_runs_each_stages_backward_pass_on_its_device():
    par = pipeline("gpipe")
    trace = trace_step(par, *batch())
    last_stage, device = par.plan.stages[-1], par.devices[-1]
    for unit in last_stage.layers:
        assert unit_matmuls(trace, unit, backward=False) == {device}, unit
        assert unit_matmuls(trace, unit, backward=True) == {device}, unit


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_each_stages_optimizer_update_runs_on_its_device(optimizer):
    """The update's arithmetic runs where the variable and its slots live. Before, a pipeline's one-device strategy
    ran Adam's update of stage 1's weights on stage 0's device and sent the results back."""
    par = Parallel("model_parallel", devices=2, micro_batches=2, schedule="1f1b", partition="even")
    par.build(mlp, optimizer=optimizer, loss="mse")
    trace = trace_step(par, *batch())
    prefix = par.model.optimizer.name + "/"
    arithmetic = {"Mul", "Sub", "Sqrt", "RealDiv", "AddV2", "Square"}
    update_ops = [op for op in trace.ops if op.name.startswith(prefix) and op.op in arithmetic]
    assert update_ops
    counts = {device: sum(op.device == device for op in update_ops) for device in par.devices}
    placed = [canonical_device(v.value.device) for v in par.model.trainable_variables]
    held = {device: placed.count(canonical_device(device)) for device in par.devices}
    assert all(held.values())
    # the same ops per variable on every stage: the counts follow where the variables live
    per_variable = {counts[device] / held[device] for device in par.devices}
    assert len(per_variable) == 1 and per_variable.pop() > 0, (counts, held)


def test_shard_parameters_reads_each_units_weights_one_unit_ahead():
    """ZeRO-3 on 2 replicas: each owner sends a unit's weights to the other replica in the units' order, one unit
    ahead of the computation. Without the wait (zero.ReadAhead) every owner sent all its weights in the step's first
    0.2 ms, in no order."""
    par = Parallel("mirrored", devices=2, seed=0, shard_parameters=True)

    def six_units() -> keras.Model:
        layers = [keras.layers.Dense(WIDTH, activation="relu", name=f"unit{i}") for i in range(6)]
        return keras.Sequential([keras.Input((WIDTH,)), *layers])

    par.build(six_units, optimizer="sgd", loss="mse")
    trace = trace_step(par, *batch())
    first_sent = {}
    for op in sorted(trace.ops, key=lambda op: op.start):
        for i in range(6):
            if op.op == "_Send" and f"/unit{i}_" in op.name:
                first_sent.setdefault(i, op.start)
    assert sorted(first_sent) == list(range(6)), first_sent  # each unit's weights reach the replica that lacks them
    times = [first_sent[i] for i in range(6)]
    # One unit ahead: a unit's weights go out after the unit two before it has had its own (neighbours, of two
    # owners on two devices, may swap by a fraction of a millisecond on a loaded machine).
    assert all(a <= b for a, b in zip(times, times[2:])), times
