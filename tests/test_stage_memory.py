"""Per-stage figures of ``model_parallel`` follow the schedule and the micro-batches, and count the outputs and loss.

The planner's numbers only (pure, or from a build on simulated devices); what they are against the allocator's peak
is measured by ``benchmarks/bench_stage_memory.py``, one configuration per fresh process.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import pytest  # noqa: E402
from conftest import logits_loss  # noqa: E402

from paraml import Parallel  # noqa: E402
from paraml.planning.partition import LayerCost, plan_balanced, plan_even, plan_explicit  # noqa: E402
from paraml.planning.schedules import Schedule  # noqa: E402

BATCH = 1024
WIDTH = 128


def gelu_mlp() -> keras.Model:
    """Activations dominate at BATCH rows: 8 x 128 x 1024 floats per layer against 128 x 128 weights."""
    layers = [keras.layers.Dense(WIDTH, activation="gelu", name=f"d{i}") for i in range(8)]
    return keras.Sequential([keras.Input((WIDTH,)), *layers, keras.layers.Dense(10, name="head")])


def planned(schedule: str, micro_batches: int = 8, **options: object) -> Parallel:
    par = Parallel(
        "model_parallel", devices=2, seed=0, schedule=schedule, micro_batches=micro_batches, batch_size=BATCH, **options
    )
    par.build(gelu_mlp, optimizer="adam", loss=logits_loss())
    return par


@pytest.fixture(scope="module")
def plans() -> dict[str, Parallel]:
    return {kind: planned(kind) for kind in ("gpipe", "1f1b")}


def test_one_f_one_b_largest_stage_is_at_most_0_9_of_gpipes(plans: dict[str, Parallel]) -> None:
    gpipe, one_f_one_b = (plans[k].plan.largest_stage_bytes for k in ("gpipe", "1f1b"))
    assert one_f_one_b <= 0.9 * gpipe, (one_f_one_b, gpipe)


def test_stages_hold_the_micro_batches_the_schedules_timeline_keeps(plans: dict[str, Parallel]) -> None:
    assert [s.in_flight for s in plans["gpipe"].plan.stages] == [8, 8]
    assert [s.in_flight for s in plans["1f1b"].plan.stages] == Schedule("1f1b", 2, 8).most_in_flight() == [2, 1]
    # Under GPipe a stage holds all 8 micro-batches of 128 rows: its activations are 8 times one micro-batch's.
    one = planned("gpipe", micro_batches=1)
    eight = plans["gpipe"]
    assert [s.layers for s in one.plan.stages] == [s.layers for s in eight.plan.stages]
    for whole, parts in zip(one.plan.stages, eight.plan.stages, strict=True):
        assert parts.activation_bytes % 8 == 0
        assert parts.activation_bytes == pytest.approx(whole.activation_bytes, rel=0.02)  # 8 x 128 rows ~ 1024 rows
        assert parts.state_bytes == whole.state_bytes


def test_gpipes_figures_are_labelled_upper_bounds(plans: dict[str, Parallel]) -> None:
    """GPipe's order is the executor's, which frees earlier micro-batches (bench_stage_memory: 0.3-0.6 of the
    figure), so its figures say they are bounds; 1F1B's order is fixed, so its figures do not."""
    assert "under gpipe the stages' figures are upper bounds" in plans["gpipe"].describe()
    assert "upper bound" not in plans["1f1b"].describe()


def test_the_last_stage_holds_the_outputs_and_the_loss(plans: dict[str, Parallel]) -> None:
    for par in plans.values():
        first, last = par.plan.stages
        assert first.output_bytes == 0
        # 128 rows x 10 logits float32, and the loss' buffer of their size, per micro-batch held there
        assert last.output_bytes == last.in_flight * 2 * (BATCH // 8) * 10 * 4
        assert last.peak_bytes == last.state_bytes + last.activation_bytes + last.output_bytes
    text = plans["1f1b"].describe()
    assert "micro-batches held" in text and "outputs + loss" in text
    assert "leave out the batch of 1024 rows" in text


def test_the_planner_balances_the_figures_it_reports(plans: dict[str, Parallel]) -> None:
    # Equal layers: under 1F1B the first stage holds 2 micro-batches, the last 1, so the planner gives it fewer.
    gpipe, one_f_one_b = ([len(s.layers) for s in plans[k].plan.stages] for k in ("gpipe", "1f1b"))
    assert one_f_one_b[0] < gpipe[0], (one_f_one_b, gpipe)
    first, last = plans["1f1b"].plan.stages
    assert abs(first.peak_bytes - last.peak_bytes) < 0.5 * max(first.peak_bytes, last.peak_bytes)


def _brute_force(costs: list[LayerCost], k: int, slots: int, in_flight: list[int], output: int) -> int:
    return min(
        plan_explicit(costs, list(cuts), k, slots, in_flight=in_flight, output_bytes=output).largest_stage_bytes
        for cuts in itertools.combinations(range(1, len(costs)), k - 1)
    )


@pytest.mark.parametrize(("k", "in_flight", "output"), [(2, [2, 1], 0), (3, [3, 2, 1], 50), (3, [8, 8, 8], 7)])
def test_balanced_is_optimal_for_the_schedules_figures(k: int, in_flight: list[int], output: int) -> None:
    costs = [LayerCost(f"l{i}", p, a) for i, (p, a) in enumerate([(3, 40), (1, 5), (9, 1), (2, 30), (4, 4), (1, 60)])]
    costs.append(LayerCost("r", 2, 8, recompute_bytes=100))
    plan = plan_balanced(costs, k, slots_per_param=2, in_flight=in_flight, output_bytes=output)
    assert plan.largest_stage_bytes == _brute_force(costs, k, 2, in_flight, output)
    for stage in plan.stages:  # what it balanced is what each stage reports
        members = [c for c in costs if c.name in stage.layers]
        held = in_flight[stage.index]
        expected = sum(c.param_bytes for c in members) * 4 + held * sum(c.activation_bytes for c in members)
        expected += max(c.recompute_bytes for c in members)  # one unit recomputed at a time: the largest, once
        expected += held * output if stage.index == k - 1 else 0
        assert stage.peak_bytes == expected


def test_one_f_one_b_gives_the_first_stage_fewer_units() -> None:
    costs = [LayerCost(f"l{i}", 0, 10) for i in range(9)]
    assert [len(s.layers) for s in plan_balanced(costs, 2).stages] == [4, 5]  # ties: the earliest cut
    assert [len(s.layers) for s in plan_balanced(costs, 2, in_flight=[2, 1]).stages] == [3, 6]
    assert [s.activation_bytes for s in plan_even(costs, 2, in_flight=[2, 1]).stages] == [100, 40]


def test_micro_batch_rows_and_held_counts() -> None:
    assert Schedule("gpipe", 2, 8).micro_batch_rows(1001) == 126  # the first 1001 % 8 micro-batches get one more
    assert Schedule("gpipe", 2, 8).held(3) == [3, 3]  # only 3 micro-batches are not empty
    assert Schedule("1f1b", 4, 8).held(64) == [4, 3, 2, 1]
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        Schedule("gpipe", 2, 8).held(0)


def test_bad_in_flight_is_refused_with_the_stage_count() -> None:
    costs = [LayerCost(f"l{i}", 1, 1) for i in range(3)]
    with pytest.raises(ValueError, match=r"in_flight must give one count of micro-batches per stage \(2 stages\)"):
        plan_balanced(costs, 2, in_flight=[1])
    with pytest.raises(ValueError, match=r"in_flight\[1\] must be an int >= 1, got 0"):
        plan_even(costs, 2, in_flight=[1, 0])
    with pytest.raises(ValueError, match="output_bytes must be an int >= 0"):
        plan_balanced(costs, 2, output_bytes=-1)


_MEASURE_ONE_F_ONE_B = """
import gc, json
from paraml import simulate_devices
simulate_devices(2)
import keras, numpy as np, tensorflow as tf
from paraml import Parallel
rows, micro_batches = 256, 16
def model_fn():
    dense = [keras.layers.Dense(512, activation="gelu") for _ in range(8)]
    return keras.Sequential([keras.Input((512,)), *dense, keras.layers.Dense(10)])
rng = np.random.default_rng(0)
x = rng.normal(size=(rows, 512)).astype("float32")
y = rng.integers(0, 10, rows)
par = Parallel("model_parallel", devices=2, seed=0, schedule="1f1b", micro_batches=micro_batches, batch_size=rows)
par.build(model_fn, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
par.fit(x, y, batch_size=rows, epochs=1, steps_per_epoch=1, verbose=0)
gc.collect()  # the first fit's copies of the data
tf.config.experimental.reset_memory_stats("CPU:0")
par.fit(x, y, batch_size=rows, epochs=1, steps_per_epoch=1, verbose=0)
peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
print(json.dumps({"peak": peak, "stages": sum(s.peak_bytes for s in par.plan.stages), "gradients": 8 * 512 * 513 * 4}))
"""


@pytest.mark.slow  # a fresh process: 32 s alone on 2 cores
def test_one_f_one_b_frees_each_micro_batchs_gradients_once_added() -> None:
    """An MLP whose weights (8 MB of gradients) outweigh its activations, in 16 micro-batches under 1F1B, measured
    in a fresh process: the allocator's peak of one step stays near the stages' figures (which count one copy of
    the gradients). Before the running sums drove the gates, Grappler made them one ``AddN`` of all 16 micro-batches'
    gradients, which held them all: 161 MB against figures of 35 MB (now 48 MB)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    command = [sys.executable, "-c", _MEASURE_ONE_F_ONE_B]
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    # the stages' figures hold one copy of the gradients; the step holds the running sum and the tape's gradient of
    # the surrogate term at its end (one more), and a few micro-batches' gradients while they are added
    assert measured["peak"] <= measured["stages"] + 4 * measured["gradients"], measured
