"""Fine-tuning as Keras' guide "Transfer learning & fine-tuning" does it: train a head on a frozen base, set
``base.trainable = True``, compile again with a lower learning rate, fit again; under every layout.

Keras 3 runs an unfrozen BatchNormalization in training mode although the guide calls the base with
``training=False`` (the outer ``fit``'s ``training=True`` wins, keras-team/keras#20285). So where the base's batch
statistics are kept frozen the two phases equal plain Keras on every layout; where they train (a keras.applications
base unfrozen whole), the data-parallel layouts equal Keras under ``MirroredStrategy`` (per-replica statistics).
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from paraml import Parallel, estimate_memory
from paraml.memory import variable_bytes_by_device

HEAD_RATE, TUNE_RATE = 1e-2, 1e-3

#: The layouts the guide's two phases run under: (strategy, devices, options).
LAYOUTS = {
    "single": ("single", 1, {}),
    "mirrored": ("mirrored", 2, {}),
    "central_storage": ("central_storage", 2, {}),
    "gpipe": ("model_parallel", 2, {"micro_batches": 2}),
    "1f1b": ("model_parallel", 2, {"micro_batches": 2, "schedule": "1f1b"}),
    "tensor_parallel": ("model_parallel", 2, {"tensor_parallel": 2}),
    "shard_optimizer": ("mirrored", 2, {"shard_optimizer": True}),
    "shard_parameters": ("mirrored", 2, {"shard_parameters": True}),
}


def dense_base_model() -> keras.Model:
    """The guide's shape: a frozen base (Dense, BatchNormalization, Dense) called with training=False, a new head."""
    base = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(name="base_bn"),
            keras.layers.Dense(16, activation="relu"),
        ],
        name="base",
    )
    base.trainable = False
    inputs = keras.Input((8,))
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(base(inputs, training=False)))


def mobilenet_model() -> keras.Model:
    base = keras.applications.MobileNet(
        weights=None, alpha=0.25, input_shape=(32, 32, 3), include_top=False, pooling="avg"
    )
    base.trainable = False
    inputs = keras.Input((32, 32, 3))
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(base(inputs, training=False)))


def dense_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")


def image_data():
    rng = np.random.default_rng(3)
    return rng.normal(size=(16, 32, 32, 3)).astype("float32"), rng.integers(0, 3, 16).astype("int32")


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def unfreeze(model: keras.Model, keep_statistics: bool) -> None:
    """The guide's ``base.trainable = True``; ``keep_statistics``: its BatchNormalization stays frozen (inference
    mode), what the guide means by ``training=False`` (keras-team/keras#20285)."""
    base = model.layers[1]  # the guide's functional model: its input, the base, the head
    base.trainable = True
    if keep_statistics:
        base.get_layer("base_bn").trainable = False


def keras_two_phases(model_fn, data, keep_statistics, strategy=None, batch_size=32):
    """Plain Keras ``fit`` (under ``strategy``, else on one device), from the weights ``model_fn`` gives at seed 0."""
    x, y = data
    scope = strategy.scope if strategy is not None else tf.init_scope
    keras.utils.set_random_seed(0)
    with scope():
        model = model_fn()
        model.compile(optimizer=keras.optimizers.Adam(HEAD_RATE), loss=loss())
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    unfreeze(model, keep_statistics)
    with scope():
        model.compile(optimizer=keras.optimizers.Adam(TUNE_RATE), loss=loss())
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return model


def paraml_two_phases(layout, model_fn, data, keep_statistics, through_model=True, batch_size=32):
    """The same two phases under paraml; the second compile through ``par.model.compile`` or ``par.compile``."""
    strategy, devices, options = LAYOUTS[layout] if isinstance(layout, str) else layout
    x, y = data
    par = Parallel(strategy, devices=devices, seed=0, **options)
    par.build(model_fn, optimizer=keras.optimizers.Adam(HEAD_RATE), loss=loss())
    par.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    base = par.model.layers[1]
    frozen = {w.path: w.numpy().copy() for w in base.weights}
    head_optimizer = par.model.optimizer
    unfreeze(par.model, keep_statistics)
    compile_again = par.model.compile if through_model else par.compile
    compile_again(optimizer=keras.optimizers.Adam(TUNE_RATE), loss=loss())
    assert par.model.optimizer is not head_optimizer
    par.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    moved = [w.path for w in base.trainable_weights if not np.allclose(w.numpy(), frozen[w.path])]
    assert moved, "the unfrozen base did not train"
    return par


def assert_same_weights(got: keras.Model, want: keras.Model) -> None:
    for a, b in zip(got.weights, want.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=a.path)


@pytest.fixture(scope="module")
def keras_dense():
    return keras_two_phases(dense_base_model, dense_data(), keep_statistics=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_guides_two_phases_equal_keras_under_every_layout(layout, keras_dense):
    through_model = list(LAYOUTS).index(layout) % 2 == 0  # par.model.compile on half of them, par.compile on half
    par = paraml_two_phases(layout, dense_base_model, dense_data(), keep_statistics=True, through_model=through_model)
    assert_same_weights(par.model, keras_dense)
    # the plan's optimizer follows the new trainable set: slots for the base's kernels and biases too
    slotted = {v.path for v in par.model.optimizer.variables}
    assert len(par.trained_variables) > 2 and len(slotted) > 2 * 2 + 2


@pytest.mark.slow
def test_a_keras_application_fine_tuned_equals_keras_with_its_batch_statistics_training():
    """MobileNet (weights=None) unfrozen whole: its BatchNormalization trains in the second phase (Keras 3), so the
    data-parallel layouts (here ZeRO-1 on mirrored) equal Keras under MirroredStrategy(2): the per-replica statistics
    are what this test is for (the layouts against one-device Keras are the dense base's test above)."""
    data = image_data()
    mirrored = keras_two_phases(
        mobilenet_model, data, False, tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), batch_size=8
    )
    par = paraml_two_phases("shard_optimizer", mobilenet_model, data, keep_statistics=False, batch_size=8)
    assert_same_weights(par.model, mirrored)


def test_under_zero_1_each_device_holds_half_of_the_new_optimizer_state():
    par = paraml_two_phases("shard_optimizer", dense_base_model, dense_data(), keep_statistics=True)
    by_device = par.memory_by_device()
    scalars = next(
        iter(variable_bytes_by_device([v for v in par.model.optimizer.variables if len(v.shape) == 0]).values())
    )
    shards = [b["optimizer"] - scalars for b in by_device.values()]
    trained = par.model.trainable_weights
    assert sum(shards) == 2 * sum(int(np.prod(w.shape)) * 4 for w in trained)  # Adam's two slots, once in all
    largest = max(int(np.prod(w.shape)) * 4 * 2 for w in trained)
    assert len(shards) == 2 and max(shards) <= sum(shards) / 2 + largest
    assert min(shards) > 2 * 16 * 3 * 4  # both devices hold more than the head's slots: the base's are sharded too


def test_a_trainable_change_without_compiling_again_changes_nothing_and_warns_once_naming_the_layer():
    x, y = dense_data()
    par = Parallel("mirrored", devices=2, seed=0)
    par.build(dense_base_model, optimizer="adam", loss=loss())
    par.fit(x, y, batch_size=32, epochs=1, verbose=0)
    base = par.model.get_layer("base")
    before = [w.numpy().copy() for w in base.weights]
    base.trainable = True
    with pytest.warns(UserWarning, match=r"trainable flag of layer 'base' changed since the model was compiled"):
        par.fit(x, y, batch_size=32, epochs=1, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per change
        par.fit(x, y, batch_size=32, epochs=1, verbose=0)
    for w, old in zip(base.weights, before):
        np.testing.assert_array_equal(w.numpy(), old)  # still frozen: the compile's trainable set
    assert len(par.trained_variables) == 2  # the head's kernel and bias


def test_checkpoints_across_the_second_compile(tmp_path):
    """A checkpoint after the second compile restores with the new optimizer's state; one from before it restores
    into a model compiled again (its weights; the new optimizer starts fresh, as in the guide's second phase)."""
    x, y = dense_data()
    par = Parallel("mirrored", devices=2, seed=0, shard_optimizer=True)
    par.build(dense_base_model, optimizer=keras.optimizers.Adam(HEAD_RATE), loss=loss())
    par.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    head_trained = par.save(tmp_path / "phase1")
    unfreeze(par.model, keep_statistics=True)
    par.compile(optimizer=keras.optimizers.Adam(TUNE_RATE))  # the loss is kept, as Keras keeps it
    par.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    tuned = par.save(tmp_path / "phase2")

    def recompiled() -> Parallel:
        again = Parallel("single", seed=5)
        again.build(dense_base_model, optimizer=keras.optimizers.Adam(HEAD_RATE), loss=loss())
        unfreeze(again.model, keep_statistics=True)
        again.model.compile(optimizer=keras.optimizers.Adam(TUNE_RATE), loss=loss())
        return again

    resumed = recompiled()
    # the estimate follows the trainable set: the unfrozen base's slots are counted
    unfrozen, frozen = (estimate_memory(m, optimizer="adam").optimizer_slots for m in (resumed.model, dense_base_model))
    assert unfrozen == frozen + 2 * 4 * sum(
        int(np.prod(w.shape)) for w in resumed.model.get_layer("base").trainable_weights
    )
    resumed.restore(tuned)
    assert_same_weights(resumed.model, par.model)
    for a, b in zip(resumed.model.optimizer.variables, par.model.optimizer.variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, err_msg=a.path)

    continued = recompiled()
    with pytest.warns(UserWarning, match="written under another compile .* Its weights are restored"):
        continued.restore(head_trained)
    continued.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert_same_weights(continued.model, par.model)  # as if the run had gone on from phase 1


def test_a_second_compile_the_layout_cannot_run_is_refused_before_training_and_the_first_stays():
    x, y = dense_data()
    par = Parallel("model_parallel", devices=2, micro_batches=2, schedule="1f1b", seed=0)
    par.build(dense_base_model, optimizer="adam", loss=loss())
    first = par.model.optimizer
    unfreeze(par.model, keep_statistics=True)
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-4))
    with pytest.raises(ValueError, match=r"cannot step Keras' LossScaleOptimizer .*schedule='1f1b'"):
        par.model.compile(optimizer=scaled, loss=loss())
    with pytest.raises(ValueError, match=r"unknown metric 'acuracy'"):
        par.compile(optimizer="adam", metrics=["acuracy"])
    with pytest.raises(ValueError, match=r"steps_per_execution must be an int >= 1, got 0"):
        par.compile(optimizer="adam", steps_per_execution=0)
    with pytest.raises(TypeError, match="run_eagerly is not supported"):
        par.model.compile(optimizer="adam", run_eagerly=True)
    assert par.model.optimizer is first and par.steps_per_execution == 1
    with pytest.warns(UserWarning, match="trainable flag of layer 'base'"):
        par.fit(x, y, batch_size=32, epochs=1, verbose=0)  # the first compile trains, the head only
    assert len(par.trained_variables) == 2


def test_a_second_compile_takes_its_steps_per_execution_and_metrics():
    x, y = dense_data()
    par = Parallel("mirrored", devices=2, seed=0)
    par.build(dense_base_model, optimizer="adam", loss=loss(), metrics=["accuracy"])
    par.model.compile(
        optimizer="sgd",
        loss=loss(),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="tuned")],
        steps_per_execution=4,
    )
    assert par.steps_per_execution == 4 and isinstance(par.model.optimizer, keras.optimizers.SGD)
    history = par.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert set(history.history) == {"loss", "tuned"}
