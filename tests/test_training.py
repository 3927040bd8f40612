"""The one training loop: input forms, Keras callbacks, progress bar, the demo."""

import csv
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import logits_loss, small_mlp

from paraml import Parallel


def make(strategy="mirrored", devices=2, optimizer="sgd", metrics=("accuracy",)):
    par = Parallel(strategy, devices=devices, seed=1)
    par.build(small_mlp, optimizer=optimizer, loss=logits_loss(), metrics=list(metrics))
    return par


def test_dataset_input_equals_numpy_input(data_1001):
    x, y = data_1001
    a, b = make(), make()
    b.model.set_weights(a.model.get_weights())
    a.fit(x, y, batch_size=50, epochs=2, shuffle=False, verbose=0)
    b.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(50), epochs=2, verbose=0)
    for wa, wb in zip(a.model.get_weights(), b.model.get_weights()):
        np.testing.assert_allclose(wa, wb, rtol=1e-5, atol=1e-7)
    dataset_eval = b.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(50))
    assert dataset_eval["loss"] == pytest.approx(b.evaluate(x, y, batch_size=50)["loss"], rel=1e-6)


def test_dataset_of_unknown_length(data_1001):
    x, y = data_1001
    par = make()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64).filter(lambda a, b: True)  # cardinality unknown
    history = par.fit(ds, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert par.predict(ds.map(lambda a, b: a)).shape == (1001, 3)


def test_dict_inputs_for_a_multi_input_model(data_1001):
    x, y = data_1001

    def two_inputs():
        a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
        h = keras.layers.Concatenate()([keras.layers.Dense(8)(a), keras.layers.Dense(8)(b)])
        return keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(h))

    par = Parallel("mirrored", devices=2, seed=0)
    par.build(two_inputs, optimizer="adam", loss=logits_loss(), metrics=["accuracy"])
    inputs = {"a": x[:, :4], "b": x[:, 4:]}
    history = par.fit(inputs, y, batch_size=64, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert par.predict(inputs).shape == (1001, 3)


def test_history_validation_and_early_stopping(data_1001):
    x, y = data_1001
    par = make(optimizer=keras.optimizers.SGD(0.0))  # nothing changes, so val_loss never improves
    stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=1)
    history = par.fit(x, y, batch_size=100, epochs=10, validation_data=(x[:100], y[:100]), callbacks=[stop], verbose=0)
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert len(history.history["loss"]) == 2  # epoch 0, then one epoch without improvement
    assert history.epoch == [0, 1]


def test_model_checkpoint_csv_logger_and_lr_scheduler(tmp_path, data_1001):
    x, y = data_1001
    par = make()
    callbacks = [
        keras.callbacks.ModelCheckpoint(str(tmp_path / "w-{epoch}.weights.h5"), save_weights_only=True),
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        keras.callbacks.LearningRateScheduler(lambda epoch: 0.5 / (epoch + 1)),
    ]
    par.fit(x, y, batch_size=100, epochs=3, callbacks=callbacks, verbose=0)
    assert sorted(os.listdir(tmp_path)) == ["log.csv", "w-1.weights.h5", "w-2.weights.h5", "w-3.weights.h5"]
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    assert float(par.model.optimizer.learning_rate.numpy()) == pytest.approx(0.5 / 3)
    restored = small_mlp()
    restored.load_weights(str(tmp_path / "w-3.weights.h5"))
    for a, b in zip(restored.get_weights(), par.model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_tensorboard_writes_events(tmp_path, data_1001):
    x, y = data_1001
    par = make()
    par.fit(x, y, batch_size=100, epochs=2, callbacks=[keras.callbacks.TensorBoard(str(tmp_path))], verbose=0)
    events = [f for _, _, files in os.walk(tmp_path) for f in files if "tfevents" in f]
    assert events


def test_terminate_on_nan_stops_training():
    par = Parallel("mirrored", devices=2)
    par.build(small_mlp, optimizer="sgd", loss="mse")
    x, y = np.ones((256, 8), "float32"), np.full((256, 3), np.nan, "float32")
    history = par.fit(x, y, batch_size=32, epochs=5, callbacks=[keras.callbacks.TerminateOnNaN()], verbose=0)
    assert len(history.history["loss"]) == 1 and np.isnan(history.history["loss"][0])


def test_verbose_shows_the_keras_progress_bar(capsys, data_1001):
    x, y = data_1001
    make().fit(x, y, batch_size=100, epochs=2, verbose=1)
    out = capsys.readouterr().out
    assert "Epoch 1/2" in out and "Epoch 2/2" in out and "11/11" in out and "loss:" in out


@pytest.mark.slow
def test_regression_metrics_and_loss_strings(data_1001):
    x, _ = data_1001
    target = x[:, :2] * 2.0
    par = Parallel("mirrored", devices=4, seed=0)
    par.build(lambda: keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)]), "adam", "mse", ["mae"])
    par.fit(x, target, batch_size=64, epochs=2, verbose=0)
    result = par.evaluate(x, target)
    predictions = par.predict(x)
    assert result["loss"] == pytest.approx(float(np.mean((predictions - target) ** 2)), rel=1e-4)
    assert result["mae"] == pytest.approx(float(np.mean(np.abs(predictions - target))), rel=1e-4)


@pytest.mark.slow
def test_demo_trains_every_backend_to_90_percent_in_6_epochs():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(
        [sys.executable, "-m", "paraml", "demo", "--devices", "2", "--epochs", "6"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line[:1].isalpha() and len(line.split()) == 5]
    table = {r[0]: float(r[2]) for r in rows}
    assert {"single", "mirrored", "central_storage"} <= set(table)
    assert min(table.values()) >= 0.9


def test_shuffling_depends_only_on_the_seed_and_the_epoch(data_1001):
    """Building another model with another seed (which sets TF's global seed) must not change this run's order."""
    x, y = data_1001
    alone = Parallel("single", seed=0)
    alone.build(small_mlp, optimizer="sgd", loss=logits_loss())
    initial = alone.model.get_weights()
    expected = alone.fit(x, y, batch_size=64, epochs=2, verbose=0).history["loss"]
    first = Parallel("single", seed=0)
    first.build(small_mlp, optimizer="sgd", loss=logits_loss())
    Parallel("single", seed=1).build(small_mlp, optimizer="sgd", loss=logits_loss())
    first.model.set_weights(initial)
    assert first.fit(x, y, batch_size=64, epochs=2, verbose=0).history["loss"] == pytest.approx(expected, rel=1e-6)


def test_batchnorm_with_a_replica_left_empty_by_the_last_batch():
    """33 samples in batches of 32 on 2 replicas: the last batch gives one replica 1 row and the other none."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(33, 8)).astype("float32"), rng.integers(0, 3, 33)

    def with_bn():
        return keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(8), keras.layers.BatchNormalization(), keras.layers.Dense(3)]
        )

    par = Parallel("mirrored", devices=2, seed=0)
    par.build(with_bn, optimizer="sgd", loss=logits_loss())
    par.fit(x, y, batch_size=32, epochs=2, verbose=0)
    for v in par.model.weights:
        for copy in v.value.values:
            assert np.all(np.isfinite(copy.numpy())), v.path
    assert np.isfinite(par.evaluate(x, y, batch_size=32)["loss"])


@pytest.mark.parametrize("weight_shape", [(64,), (64, 1)])
def test_sample_weights_from_a_dataset_match_keras(weight_shape):
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64,)).astype("float32")
    w = rng.uniform(0.1, 2.0, size=weight_shape).astype("float32")

    def linear():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1), keras.layers.Flatten()])

    par = Parallel("mirrored", devices=2, seed=0)
    model = par.build(linear, optimizer="sgd", loss="mse")
    got = par.evaluate(tf.data.Dataset.from_tensor_slices((x, y, w)).batch(16))["loss"]
    reference = linear()
    reference.set_weights(model.get_weights())
    reference.compile(loss="mse")
    want = reference.evaluate(x, y, sample_weight=w, batch_size=16, verbose=0)
    assert got == pytest.approx(want, rel=1e-5)


def test_a_loss_that_returns_a_scalar(data_1001):
    x, _ = data_1001
    target = x[:, :3]

    def mean_squared(y_true, y_pred):
        return tf.reduce_mean(tf.square(y_true - y_pred))

    losses = []
    for strategy, devices in (("single", 1), ("mirrored", 4)):
        par = Parallel(strategy, devices=devices, seed=0)
        par.build(small_mlp, optimizer="sgd", loss=mean_squared)
        losses.append(par.fit(x, target, batch_size=64, epochs=2, shuffle=False, verbose=0).history["loss"])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)


def test_mixed_precision_steps_with_loss_scaling():
    """Under mixed_float16, gradients far below float16's range survive (Keras' loss scaling), as in model.fit."""
    keras.config.set_dtype_policy("mixed_float16")
    try:

        def zero_linear():
            return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="zeros")])

        par = Parallel("single", seed=0)
        model = par.build(zero_linear, keras.optimizers.SGD(1.0), "mse")
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        x, y = np.ones((32, 4), "float32"), np.full((32, 1), 2e-7, "float32")
        par.fit(x, y, batch_size=32, verbose=0)
        reference = zero_linear()
        reference.compile(keras.optimizers.SGD(1.0), "mse")
        reference.fit(x, y, batch_size=32, verbose=0)
        assert np.all(model.get_weights()[0] != 0)
        np.testing.assert_allclose(model.get_weights()[0], reference.get_weights()[0], rtol=1e-2)
    finally:
        keras.config.set_dtype_policy("float32")


def test_a_list_of_input_arrays_feeds_a_two_input_model(data_1001):
    x, y = data_1001

    def two_inputs():
        a, b = keras.Input((4,)), keras.Input((4,))
        return keras.Model([a, b], keras.layers.Dense(3)(keras.layers.Concatenate()([a, b])))

    par = Parallel("mirrored", devices=2, seed=0)
    par.build(two_inputs, optimizer="sgd", loss=logits_loss(), metrics="accuracy")  # a metric name alone works too
    history = par.fit([x[:, :4], x[:, 4:]], y, batch_size=64, verbose=0)
    assert set(history.history) == {"loss", "accuracy"}


def test_infinite_and_empty_inputs_are_clear_errors(data_1001):
    x, y = data_1001
    par = make()
    with pytest.raises(ValueError, match="infinite"):
        par.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat(), verbose=0)
    with pytest.raises(ValueError, match="input is empty"):
        par.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(32).take(0))


def test_bad_fit_arguments_fail_before_anything_changes(tmp_path, data_1001):
    x, y = data_1001
    par = make()
    par.save(tmp_path)
    before = [w.copy() for w in par.model.get_weights()]
    for kwargs, message in [({"keep": 0}, "keep must be an int >= 1"), ({"verbose": 7}, "verbose must be")]:
        with pytest.raises(ValueError, match=message):
            par.fit(x, y, checkpoint_dir=tmp_path, **kwargs)
    for a, b in zip(before, par.model.get_weights()):
        np.testing.assert_array_equal(a, b)


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.events = []

    def on_train_batch_begin(self, batch, logs=None):
        self.events.append(f"B{batch}")

    def on_train_batch_end(self, batch, logs=None):
        self.events.append(f"E{batch}")

    def on_test_begin(self, logs=None):
        self.events.append("test_begin")

    def on_test_end(self, logs=None):
        self.events.append("test_end")


def test_callback_hooks_pair_up_as_in_keras(data_1001):
    x, y = data_1001
    recorder = Recorder()
    make().fit(
        x[:96], y[:96], batch_size=32, epochs=1, validation_data=(x[:32], y[:32]), callbacks=[recorder], verbose=0
    )
    assert recorder.events == ["B0", "E0", "B1", "E1", "B2", "E2", "test_begin", "test_end"]


def test_stopping_mid_epoch_checkpoints_where_it_stopped(tmp_path, data_1001):
    from paraml.loop.checkpoint import latest_checkpoint, restore_checkpoint

    class StopAfterTwo(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.stop_training = True

    x, y = data_1001
    par = make()
    par.fit(x[:256], y[:256], batch_size=64, epochs=3, callbacks=[StopAfterTwo()], verbose=0, checkpoint_dir=tmp_path)
    state = restore_checkpoint(latest_checkpoint(tmp_path), par.model, par.model.optimizer)
    assert (state.epoch, state.step) == (0, 2)


def test_a_shape_error_shows_the_users_batch():
    x = np.zeros((200, 4), "float32")
    y = np.eye(3, dtype="float32")[np.arange(200) % 3]  # 3 classes; the model says 5
    par = Parallel("single")
    par.build(
        lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(5)]),
        optimizer="sgd",
        loss="categorical_crossentropy",
    )
    with pytest.raises(ValueError, match=r"target\.shape=\(64, 3\), output\.shape=\(64, 5\)"):
        par.fit(x, y, batch_size=64, verbose=0)
