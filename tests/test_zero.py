"""``Parallel("mirrored", shard_optimizer=True)``: each variable's optimizer slots on one device, the same training."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from paraml import Parallel  # noqa: E402
from paraml.memory import variable_bytes_by_device  # noqa: E402
from paraml.planning.footprint import owners  # noqa: E402


def tagger() -> keras.Model:
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(40, 16)(tokens)  # a sparse gradient
    h = keras.layers.GlobalAveragePooling1D()(h)
    h = keras.layers.Dense(64, activation="relu")(h)
    h = keras.layers.Dense(32, activation="relu")(h)
    return keras.Model(tokens, keras.layers.Dense(3)(h))


def data():
    rng = np.random.default_rng(0)
    return rng.integers(0, 40, (100, 6)).astype("int32"), rng.integers(0, 3, 100)  # a last batch of 4


def train(devices, shard, optimizer, epochs=3, **fit):
    par = Parallel("mirrored", devices=devices, seed=2, shard_optimizer=shard)
    par.build(tagger, optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data()
    history = par.fit(x, y, batch_size=32, epochs=epochs, verbose=0, **fit)
    return par, history


@pytest.mark.parametrize(
    "devices, optimizer, epochs",
    [
        (2, "adam", 3),
        (4, "adam", 3),
        (2, keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.05), 2),
        (2, keras.optimizers.SGD(learning_rate=0.05, momentum=0.9, nesterov=True), 2),
        (2, keras.optimizers.Adam(use_ema=True), 1),
    ],
    ids=["adam-2", "adam-4", "adamw-2", "sgd-momentum-2", "adam-ema-2"],
)
@pytest.mark.slow
def test_sharded_training_equals_mirrored(devices, optimizer, epochs):
    (plain, plain_history), (sharded, sharded_history) = (train(devices, s, optimizer, epochs) for s in (False, True))
    np.testing.assert_allclose(sharded_history.history["loss"], plain_history.history["loss"], rtol=1e-5)
    for got, want in zip(sharded.model.get_weights(), plain.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(sharded.model.optimizer.variables, plain.model.optimizer.variables, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6, err_msg=got.path)  # slots too
    slots = [v for v in sharded.model.optimizer.variables if len(v.shape) > 0 and "average" not in v.path]
    assert all(not hasattr(v.value, "values") for v in slots)  # one copy each, not mirrored (EMA's averages are)

    by_device = sharded.memory_by_device()
    full = plain.memory_by_device()
    assert len(by_device) == devices
    params = {b["parameters"] for b in by_device.values()}
    assert params == {b["parameters"] for b in full.values()}  # parameters stay replicated
    # replicated on every device: the step count, the learning rate, EMA's averages
    replicated = [v for v in plain.model.optimizer.variables if len(v.shape) == 0 or "average" in v.path]
    scalars = next(iter(variable_bytes_by_device(replicated).values()))
    one_copy = next(iter(full.values()))["optimizer"]
    shards = [b["optimizer"] - scalars for b in by_device.values()]
    assert sum(shards) == one_copy - scalars  # the shards add up to one full copy
    per_variable = len(slots) // len(sharded.model.trainable_weights)  # Adam's 2 slots (+1 average with use_ema)
    largest = max(int(np.prod(w.shape)) * 4 * per_variable for w in sharded.model.trainable_weights)
    assert max(shards) <= (one_copy - scalars) / devices + largest


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_anywhere_and_any_checkpoint_resumes_sharded(tmp_path):
    x, y = data()
    straight, _ = train(2, True, "adam", epochs=4)
    first, _ = train(2, True, "adam", epochs=2)
    first.save(tmp_path / "sharded")
    single = Parallel("single", seed=2)
    single.build(tagger, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    single.restore(tmp_path / "sharded")  # Adam's state comes back too, from the owners' slots
    single.fit(x, y, batch_size=32, epochs=4, initial_epoch=2, verbose=0)
    for got, want in zip(single.model.get_weights(), straight.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    single.save(tmp_path / "single")
    again = Parallel("mirrored", devices=2, seed=2, shard_optimizer=True)
    again.build(tagger, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    again.restore(tmp_path / "single")
    np.testing.assert_allclose(again.predict(x), single.predict(x), rtol=1e-6, atol=1e-6)
    assert int(again.model.optimizer.iterations.numpy()) == int(single.model.optimizer.iterations.numpy())


def test_owners_balance_bytes_and_bad_input_is_refused():
    assert owners([400, 100, 300, 200], 2) == [0, 0, 1, 1]
    assert owners([10], 4) == [0]
    with pytest.raises(ValueError, match="shard_optimizer must be True or False, got 'yes'"):
        Parallel("mirrored", devices=2, shard_optimizer="yes")
    for strategy in ("single", "central_storage", "model_parallel"):
        with pytest.raises(
            ValueError, match=r"unknown option 'shard_optimizer' .*only 'mirrored' and 'multi_worker' shard"
        ):
            Parallel(strategy, shard_optimizer=True)


@pytest.mark.parametrize("option", ["shard_optimizer", "shard_parameters"])
@pytest.mark.slow
def test_a_loss_scale_optimizer_around_a_sharded_one_trains_alike(option):
    def make():
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(3)])

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 3, 64)
    weights = {}
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        for shard in (False, True):
            par = Parallel("mirrored", devices=2, seed=1, **{option: shard})
            par.build(make, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            assert isinstance(par.model.optimizer, keras.optimizers.LossScaleOptimizer)
            par.fit(x, y, batch_size=32, epochs=2, verbose=0)
            weights[shard] = par.model.get_weights()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    for got, want in zip(weights[True], weights[False]):
        np.testing.assert_allclose(np.asarray(got, "float32"), np.asarray(want, "float32"), rtol=1e-5, atol=1e-6)
