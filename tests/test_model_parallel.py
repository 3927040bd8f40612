"""model_parallel on simulated devices: parity with single, real placement, balanced stages, clear errors."""

import itertools

import keras
import numpy as np
import pytest
from conftest import logits_loss

from paraml import Parallel
from paraml.memory import layer_costs
from paraml.partition import layer_cost


def sequential():
    layers = [keras.layers.Dense(16, activation="relu", name=f"d{i}") for i in range(4)]
    return keras.Sequential([keras.Input((8,)), *layers, keras.layers.Dense(3, name="out")])


def with_skip():
    """A functional model whose skip connection crosses the stage boundary (d1 on stage 0 feeds add on stage 1)."""
    inputs = keras.Input((8,))
    h1 = keras.layers.Dense(16, activation="relu", name="d1")(inputs)
    h2 = keras.layers.Dense(16, activation="relu", name="d2")(h1)
    h3 = keras.layers.Dense(16, name="d3")(h2)
    added = keras.layers.Add(name="add")([h1, h3])
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(added))


def build(strategy, model_fn, devices=None, optimizer=None, **options):
    par = Parallel(strategy, devices=devices, seed=0, **options)
    par.build(model_fn, optimizer=optimizer or keras.optimizers.SGD(0.1), loss=logits_loss(), metrics=["accuracy"])
    return par


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1001, 8)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")


@pytest.mark.parametrize("model_fn", [sequential, with_skip], ids=["sequential", "skip"])
@pytest.mark.parametrize("micro_batches", [1, 4, 3])
def test_parity_with_single(data, model_fn, micro_batches):
    x, y = data
    reference = build("single", model_fn)
    initial = reference.model.get_weights()
    reference.fit(x, y, batch_size=64, epochs=3, verbose=0)
    par = build("model_parallel", model_fn, devices=2, micro_batches=micro_batches)
    par.model.set_weights(initial)
    par.fit(x, y, batch_size=64, epochs=3, verbose=0)
    for got, want in zip(par.model.get_weights(), reference.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert par.evaluate(x, y, batch_size=64)["loss"] == pytest.approx(reference.evaluate(x, y, batch_size=64)["loss"])
    np.testing.assert_allclose(par.predict(x), reference.predict(x), rtol=1e-4, atol=1e-6)


def test_same_seed_same_initial_weights_as_single():
    single = build("single", with_skip)
    staged = build("model_parallel", with_skip, devices=2)
    for a, b in zip(single.model.get_weights(), staged.model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_every_variable_of_stage_k_lives_on_device_k():
    par = build("model_parallel", sequential, devices=["CPU:1", "CPU:3"], optimizer="adam")
    stage_of = {name: s.index for s in par.plan.stages for name in s.layers}
    assert len(par.plan.stages) == 2
    for layer in par.model.layers:
        device = par.devices[stage_of[layer.name]]
        for v in layer.weights:
            assert v.value.device.endswith(device), (v.path, v.value.device, device)
    # Adam's slots follow their variables
    on = {v.path.split("/")[-1]: v.value.device for v in par.model.optimizer.variables if len(v.shape) > 0}
    assert on and all(d.endswith(("CPU:1", "CPU:3")) for d in on.values())
    per_device = {d: sum(v.value.device.endswith(d) for v in par.model.optimizer.variables) for d in par.devices}
    assert all(count > 0 for count in per_device.values())


def big_among_small():
    layers = [keras.layers.Dense(8, name=f"s{i}") for i in range(3)]
    layers += [keras.layers.Dense(256, name="big"), keras.layers.Dense(8, name="after")]
    layers += [keras.layers.Dense(8, name=f"t{i}") for i in range(3)]
    return keras.Sequential([keras.Input((8,)), *layers])


@pytest.mark.parametrize("stages", [2, 3])
def test_balanced_is_no_worse_than_the_best_contiguous_split(stages):
    par = build("model_parallel", big_among_small, devices=stages, optimizer="adam")
    costs = [layer_cost(c, 2) for c in layer_costs(big_among_small(), batch_size=32)]
    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
        for cuts in itertools.combinations(range(1, len(costs)), stages - 1)
    )
    assert par.plan.largest_stage_bytes <= best
    assert any(stage.layers == ("big",) or "big" in stage.layers for stage in par.plan.stages)


def test_explicit_partitions_and_describe():
    par = build("model_parallel", sequential, devices=2, partition=[["d0"], ["d1", "d2", "d3", "out"]])
    assert [s.layers for s in par.plan.stages] == [("d0",), ("d1", "d2", "d3", "out")]
    even = build("model_parallel", sequential, devices=2, partition="even")
    assert [len(s.layers) for s in even.plan.stages] == [3, 2]
    bounds = build("model_parallel", sequential, devices=2, partition=[2])
    assert bounds.plan.stages[1].layers[0] == "d2"
    text = par.describe()
    assert "/device:CPU:0" in text and "/device:CPU:1" in text and "d0" in text and "micro_batches=1" in text


@pytest.mark.parametrize(
    "partition, message",
    [
        ([["d0", "nope"], ["d1", "d2", "d3", "out"]], "nope"),
        ([["d0"], ["d1", "d2", "d3"]], "out"),
        ([["d0", "d1"], ["d1", "d2", "d3", "out"]], "d1"),
        ([["d1", "d0"], ["d2", "d3", "out"]], "order"),
        ("greedy", "greedy"),
    ],
    ids=["unknown-layer", "left-out", "twice", "out-of-order", "unknown-name"],
)
def test_bad_partitions_name_the_problem(partition, message):
    par = Parallel("model_parallel", devices=2, partition=partition)
    with pytest.raises(ValueError, match=message):
        par.build(sequential, optimizer="sgd", loss=logits_loss())


def test_more_stages_than_layers():
    par = Parallel("model_parallel", devices=4)
    with pytest.raises(ValueError, match=r"4 stages.*2 layers|2 layers.*4 stages"):
        par.build(
            lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(2)]), loss="mse"
        )


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_micro_batches(bad):
    with pytest.raises(ValueError, match=f"micro_batches must be an int >= 1, got {bad!r}"):
        Parallel("model_parallel", devices=2, micro_batches=bad)


def test_shared_layers_are_refused_with_advice():
    def shared():
        inputs = keras.Input((4,))
        dense = keras.layers.Dense(4, name="shared")
        return keras.Model(inputs, dense(dense(inputs)))

    with pytest.raises(ValueError, match="'shared' has no single input"):
        Parallel("model_parallel", devices=2).build(shared, loss="mse")


def test_reported_loss_with_regularization_matches_single_under_micro_batches(data):
    x, y = data

    def regularized():
        dense = [keras.layers.Dense(8, kernel_regularizer=keras.regularizers.L2(0.01), name=f"r{i}") for i in range(2)]
        return keras.Sequential([keras.Input((8,)), *dense, keras.layers.Dense(3, name="out")])

    reference = build("single", regularized)
    staged = build("model_parallel", regularized, devices=2, micro_batches=4)
    staged.model.set_weights(reference.model.get_weights())
    want = reference.fit(x, y, batch_size=64, epochs=2, verbose=0).history["loss"]
    got = staged.fit(x, y, batch_size=64, epochs=2, verbose=0).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-4)
    for a, b in zip(staged.model.get_weights(), reference.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_layers_with_several_tensor_arguments_are_refused_with_advice():
    def attention():
        inputs = keras.Input((4, 8))
        attended = keras.layers.MultiHeadAttention(2, 4, name="mha")(inputs, inputs)
        return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(attended)))

    with pytest.raises(ValueError, match="'mha'.*several tensor arguments.*custom layer"):
        Parallel("model_parallel", devices=2).build(attention, loss="mse")
