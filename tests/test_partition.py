"""Tests for paraml.planning.partition (pure Python, no TensorFlow)."""

from __future__ import annotations

import itertools
import random
import sys

import pytest

from paraml.planning.partition import (
    PARTITION_CHOICES,
    LayerCost,
    PartitionPlan,
    Stage,
    layer_cost,
    make_plan,
    plan_balanced,
    plan_even,
    plan_explicit,
)


def _costs(*pairs: tuple[int, int]) -> list[LayerCost]:
    return [LayerCost(f"l{i}", p, a) for i, (p, a) in enumerate(pairs)]


def _uniform(n: int, param_bytes: int = 10, activation_bytes: int = 1) -> list[LayerCost]:
    return [LayerCost(f"l{i}", param_bytes, activation_bytes) for i in range(n)]


def _brute_force(costs: list[LayerCost], k: int, slots: int) -> tuple[int, tuple[int, ...]]:
    """Optimal largest-stage cost and the lexicographically smallest optimal cut tuple."""
    weights = [layer_cost(c, slots) for c in costs]
    n = len(weights)
    best: tuple[int, tuple[int, ...]] | None = None
    for cuts in itertools.combinations(range(1, n), k - 1):  # lexicographic order
        bounds = (0, *cuts, n)
        largest = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
        if best is None or largest < best[0]:
            best = (largest, cuts)
    assert best is not None
    return best


def _layers(plan: PartitionPlan) -> list[tuple[str, ...]]:
    return [s.layers for s in plan.stages]


# ------------------------------------------------------------------ data classes


def test_layer_cost_formula() -> None:
    c = LayerCost("d", 100, 7)
    assert layer_cost(c, 0) == 207
    assert layer_cost(c, 1) == 307
    assert layer_cost(c, 2) == 407


def test_layer_cost_rejects_negative_bytes() -> None:
    with pytest.raises(ValueError, match="LayerCost 'd': param_bytes must be an int >= 0, got -1"):
        LayerCost("d", -1, 0)
    with pytest.raises(ValueError, match="LayerCost 'd': activation_bytes must be an int >= 0, got -5"):
        LayerCost("d", 0, -5)
    with pytest.raises(ValueError, match="param_bytes must be an int >= 0, got True"):
        LayerCost("d", True, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="activation_bytes must be an int >= 0, got 1.5"):
        LayerCost("d", 0, 1.5)  # type: ignore[arg-type]


def test_stage_and_plan_properties() -> None:
    costs = _costs((10, 1), (20, 2), (30, 3))
    plan = plan_explicit(costs, [1], 2, slots_per_param=2)
    first, second = plan.stages
    assert first == Stage(0, ("l0",), 10, 40, 1)
    assert second == Stage(1, ("l1", "l2"), 50, 200, 5)
    assert second.peak_bytes == 205
    assert plan.largest_stage_bytes == 205
    assert plan.num_stages == 2
    assert plan.boundaries == (0, 1)
    assert [plan.stage_of(n) for n in ("l0", "l1", "l2")] == [0, 1, 1]
    assert plan.as_rows() == [
        {"stage": 0, "layers": ["l0"], "param_bytes": 10, "peak_bytes": 41},
        {"stage": 1, "layers": ["l1", "l2"], "param_bytes": 50, "peak_bytes": 205},
    ]


def test_stage_of_unknown_layer() -> None:
    plan = plan_even(_uniform(3), 1)
    with pytest.raises(ValueError, match="'nope' is not in this plan.*'l0'"):
        plan.stage_of("nope")


def test_plan_is_frozen() -> None:
    plan = plan_even(_uniform(2), 2)
    with pytest.raises(AttributeError):
        plan.stages = ()  # type: ignore[misc]


# ---------------------------------------------------------------------- balanced


def test_balanced_matches_brute_force_on_random_models() -> None:
    rng = random.Random(1234)
    checked = 0
    for _ in range(400):
        n = rng.randint(2, 8)
        k = rng.randint(1, min(4, n))
        slots = rng.choice([0, 1, 2])
        costs = [
            LayerCost(f"l{i}", rng.choice([0, rng.randint(0, 50), rng.randint(0, 2000)]), rng.randint(0, 500))
            for i in range(n)
        ]
        plan = plan_balanced(costs, k, slots)
        optimum, earliest_cuts = _brute_force(costs, k, slots)
        stage_costs = [sum(layer_cost(c, slots) for c in costs if c.name in s.layers) for s in plan.stages]
        assert max(stage_costs) == optimum
        assert plan.largest_stage_bytes == optimum  # layer_cost sums equal stage peaks
        assert plan.num_stages == k
        assert all(s.layers for s in plan.stages)
        assert [n for s in plan.stages for n in s.layers] == [c.name for c in costs]
        assert plan.boundaries[1:] == earliest_cuts  # deterministic tie-break
        checked += 1
    assert checked == 400


def test_balanced_with_ties_prefers_earliest_cut() -> None:
    plan = plan_balanced(_uniform(4), 3)
    assert _layers(plan) == [("l0",), ("l1",), ("l2", "l3")]
    assert plan_balanced(_uniform(4), 3) == plan  # deterministic


def test_balanced_isolates_one_large_layer() -> None:
    costs = [LayerCost(f"small{i}", 10, 1) for i in range(10)]
    costs.insert(5, LayerCost("huge", 10_000, 1))
    plan = plan_balanced(costs, 3, slots_per_param=2)
    huge_stage = plan.stages[plan.stage_of("huge")]
    assert huge_stage.layers == ("huge",)
    assert plan.largest_stage_bytes == 10_000 * 4 + 1
    # The small layers are split around it, and the even split is much worse.
    assert plan.stage_of("small0") == 0 and plan.stage_of("small9") == 2
    assert plan_even(costs, 3, slots_per_param=2).largest_stage_bytes > plan.largest_stage_bytes


def test_balanced_large_model_is_exact_and_fast_enough() -> None:
    rng = random.Random(7)
    costs = [LayerCost(f"l{i}", rng.randint(0, 10**9), rng.randint(0, 10**8)) for i in range(2000)]
    plan = plan_balanced(costs, 8, slots_per_param=2)
    assert plan.num_stages == 8
    weights = [layer_cost(c, 2) for c in costs]
    # Optimality certificate: with bound = optimum - 1, the greedy needs more than 8 stages.
    bound = plan.largest_stage_bytes - 1
    count, run = 1, 0
    for w in weights:
        if w > bound:
            count = sys.maxsize
            break
        if run + w > bound:
            count, run = count + 1, w
        else:
            run += w
    assert count > 8


def test_balanced_single_stage_and_one_layer_per_stage() -> None:
    costs = _uniform(5)
    assert _layers(plan_balanced(costs, 1)) == [tuple(c.name for c in costs)]
    assert _layers(plan_balanced(costs, 5)) == [(c.name,) for c in costs]


def test_balanced_zero_cost_layers() -> None:
    costs = _costs((0, 0), (0, 0), (0, 0))
    plan = plan_balanced(costs, 2)
    assert _layers(plan) == [("l0",), ("l1", "l2")]
    assert plan.largest_stage_bytes == 0


# -------------------------------------------------------------------------- even


@pytest.mark.parametrize(
    ("n", "k", "sizes"),
    [(7, 3, [3, 2, 2]), (6, 3, [2, 2, 2]), (5, 1, [5]), (4, 4, [1, 1, 1, 1]), (10, 4, [3, 3, 2, 2])],
)
def test_even_shapes(n: int, k: int, sizes: list[int]) -> None:
    plan = plan_even(_uniform(n), k)
    assert [len(s.layers) for s in plan.stages] == sizes
    assert [name for s in plan.stages for name in s.layers] == [f"l{i}" for i in range(n)]


# ---------------------------------------------------------------------- explicit


def test_explicit_groups() -> None:
    costs = _uniform(5)
    plan = plan_explicit(costs, [["l0", "l1"], ["l2"], ["l3", "l4"]], 3)
    assert _layers(plan) == [("l0", "l1"), ("l2",), ("l3", "l4")]
    tuples = plan_explicit(costs, (("l0", "l1"), ("l2",), ("l3", "l4")), 3)
    assert tuples == plan


def test_explicit_cut_indices() -> None:
    costs = _uniform(5)
    assert _layers(plan_explicit(costs, [2, 3], 3)) == [("l0", "l1"), ("l2",), ("l3", "l4")]
    assert _layers(plan_explicit(costs, [], 1)) == [tuple(f"l{i}" for i in range(5))]


def test_make_plan_dispatch() -> None:
    costs = _costs((1, 0), (1, 0), (100, 0))
    assert make_plan(costs, "balanced", 2) == plan_balanced(costs, 2)
    assert make_plan(costs, "even", 2) == plan_even(costs, 2)
    assert make_plan(costs, [["l0"], ["l1", "l2"]], 2) == plan_explicit(costs, [1], 2)
    assert make_plan(costs, [2], 2) == plan_explicit(costs, [["l0", "l1"], ["l2"]], 2)
    assert PARTITION_CHOICES == ("balanced", "even")


# ------------------------------------------------------------------------ errors


def test_error_unknown_partition_string() -> None:
    with pytest.raises(ValueError, match="unknown partition 'greedy'.*'balanced', 'even'"):
        make_plan(_uniform(3), "greedy", 2)


def test_error_partition_of_wrong_type() -> None:
    with pytest.raises(ValueError, match="partition must be one of"):
        make_plan(_uniform(3), 3, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("planner", [plan_balanced, plan_even])
def test_error_num_stages_below_one(planner) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="num_stages must be an int >= 1, got 0"):
        planner(_uniform(3), 0)
    with pytest.raises(ValueError, match="num_stages must be an int >= 1, got True"):
        planner(_uniform(3), True)
    with pytest.raises(ValueError, match="num_stages must be an int >= 1, got 2.0"):
        planner(_uniform(3), 2.0)


@pytest.mark.parametrize("planner", [plan_balanced, plan_even])
def test_error_more_stages_than_layers(planner) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=r"cannot split 3 layers into 4 stages.*\(4\).*\(3\)"):
        planner(_uniform(3), 4)


def test_error_more_stages_than_layers_explicit() -> None:
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        plan_explicit(_uniform(2), [["l0"], ["l1"], []], 3)


def test_error_empty_model_and_duplicate_names() -> None:
    with pytest.raises(ValueError, match="the list of layer costs is empty"):
        plan_balanced([], 1)
    with pytest.raises(ValueError, match="'x' appears twice"):
        plan_balanced([LayerCost("x", 1, 1), LayerCost("x", 1, 1)], 1)


def test_error_bad_slots_per_param() -> None:
    with pytest.raises(ValueError, match="slots_per_param must be an int >= 0, got -1"):
        plan_balanced(_uniform(2), 1, slots_per_param=-1)


def test_error_unknown_layer_in_group() -> None:
    with pytest.raises(ValueError, match="'dense_9', which the model does not have.*'l0', 'l1'"):
        plan_explicit(_uniform(3), [["l0"], ["l1", "dense_9"]], 2)


def test_error_unknown_layer_lists_only_a_few_names() -> None:
    with pytest.raises(ValueError, match=r"'l7', \.\.\. \(20 layers in total\)"):
        plan_explicit(_uniform(20), [["zzz"], ["l1"]], 2)


def test_error_layer_left_out() -> None:
    with pytest.raises(ValueError, match="layer 'l2' is not in any group"):
        plan_explicit(_uniform(4), [["l0", "l1"], ["l3"]], 2)


def test_error_layer_named_twice() -> None:
    with pytest.raises(ValueError, match="layer 'l1' is named twice"):
        plan_explicit(_uniform(3), [["l0", "l1"], ["l1", "l2"]], 2)


def test_error_layers_out_of_order() -> None:
    with pytest.raises(ValueError, match="layer 'l2' is out of order.*model order.*should be 'l1'"):
        plan_explicit(_uniform(3), [["l0", "l2"], ["l1"]], 2)
    with pytest.raises(ValueError, match="layer 'l2' is out of order"):
        plan_explicit(_uniform(3), [["l2"], ["l0", "l1"]], 2)


def test_error_empty_group() -> None:
    with pytest.raises(ValueError, match="layer group 1 is empty"):
        plan_explicit(_uniform(3), [["l0", "l1", "l2"], []], 2)


def test_error_wrong_number_of_groups() -> None:
    with pytest.raises(ValueError, match="got 3 layer groups for num_stages=2"):
        plan_explicit(_uniform(3), [["l0"], ["l1"], ["l2"]], 2)


@pytest.mark.parametrize(
    ("cuts", "message"),
    [
        ([0, 2], "cut index 0 is out of range"),
        ([2, 5], "cut index 5 is out of range"),
        ([3, 2], "cut index 2 is not greater than the previous one"),
        ([2, 2], "cut index 2 is not greater than the previous one"),
        ([2], "got 1 cut indices"),
        ([0, 1, 2, 5], "drop the leading 0 and trailing 5"),
    ],
)
def test_error_bad_cut_indices(cuts: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_explicit(_uniform(5), cuts, 3)


def test_error_mixed_or_malformed_spec() -> None:
    with pytest.raises(ValueError, match="list of lists of layer names"):
        plan_explicit(_uniform(3), [1, ["l1", "l2"]], 2)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="list of lists of layer names"):
        plan_explicit(_uniform(3), ["l0", "l1"], 2)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="list of lists of layer names"):
        plan_explicit(_uniform(3), [True], 2)  # type: ignore[list-item]


# ---------------------------------------------------------------------- describe


def test_describe_lists_devices_and_layers() -> None:
    costs = [
        LayerCost(name, 1024 * (i + 1), 64) for i, name in enumerate(["embed", "block_0", "block_1", "block_2", "head"])
    ]
    plan = plan_explicit(costs, [["embed", "block_0"], ["block_1"], ["block_2", "head"]], 3)
    devices = ["/job:localhost/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
    text = plan.describe(devices)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["stage", "device", "layers"]
    for device in devices:
        assert device in text
    for name in ("embed..block_0 (2)", "block_1 (1)", "block_2..head (2)"):
        assert name in text
    assert "3.00 KiB" in text  # parameters of stage 0
    assert text.endswith("largest stage: 18.12 KiB")  # (4+5) KiB * 2 + 128 B
    # Fixed-width columns: every row's device and layers start under the header's.
    cells = ("embed..block_0 (2)", "block_1 (1)", "block_2..head (2)")
    for line, device, cell in zip(lines[2:5], devices, cells, strict=True):
        assert line.index(device) == lines[0].index("device")
        assert line.index(cell) == lines[0].index("layers")


def test_describe_without_devices_and_bad_device_count() -> None:
    plan = plan_even(_uniform(2), 2)
    assert "l0 (1)" in plan.describe()
    with pytest.raises(ValueError, match="got 1 devices for 2 stages"):
        plan.describe(["/CPU:0"])


def test_partition_module_does_not_import_tensorflow() -> None:
    """partition.py (and memory.py, which it imports) must not import TF or Keras.

    The modules are loaded into a stand-in package so that whatever
    paraml/__init__.py imports does not matter.
    """
    import subprocess
    from pathlib import Path

    import paraml.planning.partition

    package_dir = str(Path(paraml.planning.partition.__file__).parents[1])
    code = (
        "import importlib, sys, types\n"
        "pkg = types.ModuleType('paraml_probe')\n"
        f"pkg.__path__ = [{package_dir!r}]\n"
        "sys.modules['paraml_probe'] = pkg\n"
        "importlib.import_module('paraml_probe.planning.partition')\n"
        "bad = sorted(m for m in ('tensorflow', 'keras', 'numpy') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
