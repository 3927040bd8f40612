"""A model's own train_step, written as the Keras guides write it: nested logs flattened as Keras flattens them, and
the one-time warning that such a step under data parallelism is not the one-device step.

Each check trains plain Keras (one device, or ``MirroredStrategy`` on the same 2 logical devices where per-replica
effects are meant) and paraml from the same initial weights with ``shuffle=False``.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from paraml import OwnStepWarning, Parallel

RTOL = 1e-4


class GuideModel(keras.Model):
    """The "Customizing what happens in fit()" guide's ``CustomModel``: it returns every metric, so its logs are nested
    (Keras 3's ``compile_metrics`` tracker's result is a dict)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class DeepLogs(GuideModel):
    """Logs nested three deep, with a Python number and an integer tensor among them."""

    def train_step(self, data):
        logs = super().train_step(data)
        return {"outer": {"inner": logs, "steps": self.optimizer.iterations}, "constant": 2.5}


def guide_model(cls=GuideModel) -> keras.Model:
    keras.utils.set_random_seed(1)
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)  # two layers: model_parallel splits them in 2 stages
    return cls(inputs, keras.layers.Dense(1)(hidden))


def guide_compile():
    return dict(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.random((96, 32)).astype("float32")
    y = (x[:, :1] - x[:, 1:2] + 0.1 * rng.random((96, 1))).astype("float32")
    return x[:64], y[:64], (x[64:], y[64:])


def keras_fit(strategy, initial, data, cls=GuideModel):
    """Keras' own ``fit`` (under ``strategy``'s scope) from ``initial``: (weights, history)."""
    x, y, validation = data
    with strategy.scope():
        model = guide_model(cls)
        model.set_weights(initial)
        model.compile(**guide_compile())
    history = model.fit(x, y, batch_size=16, epochs=2, validation_data=validation, shuffle=False, verbose=0)
    return model.get_weights(), history.history


def paraml_fit(strategy, devices, data, cls=GuideModel):
    """paraml's ``fit``: (initial weights, weights, history, warnings of the fit)."""
    x, y, validation = data
    par = Parallel(strategy, devices=devices)
    model = par.build(lambda: guide_model(cls), **guide_compile())
    initial = model.get_weights()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = par.fit(x, y, batch_size=16, epochs=2, validation_data=validation, shuffle=False, verbose=0)
    return initial, model.get_weights(), history.history, [w for w in caught if w.category is OwnStepWarning]


def assert_same(got_weights, got_history, want_weights, want_history):
    assert got_history.keys() == want_history.keys()
    for got, want in zip(got_weights, want_weights, strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-6)
    for name, values in want_history.items():
        np.testing.assert_allclose(got_history[name], values, rtol=RTOL, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("strategy, devices", [("single", None), ("model_parallel", 2), ("mirrored", 2)])
@pytest.mark.slow
def test_the_guides_train_step_returning_every_metric_trains_as_in_keras(data, strategy, devices):
    initial, weights, history, _ = paraml_fit(strategy, devices, data)
    # Keras' fit under the same strategy: one device, or MirroredStrategy on the same 2 logical devices.
    keras_strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]) if strategy == "mirrored" else None
    want_weights, want_history = keras_fit(keras_strategy or tf.distribute.get_strategy(), initial, data)
    assert set(want_history) == {"loss", "mae", "val_loss", "val_mae"}  # Keras' names: the nesting flattened
    assert_same(weights, history, want_weights, want_history)


def test_logs_nested_at_any_depth_with_python_numbers_are_flattened_as_keras_does(data):
    initial, weights, history, _ = paraml_fit("single", None, data, DeepLogs)
    want_weights, want_history = keras_fit(tf.distribute.get_strategy(), initial, data, DeepLogs)
    assert set(want_history) == {"constant", "steps", "loss", "mae", "val_loss", "val_mae"}
    assert_same(weights, history, want_weights, want_history)
    assert history["steps"] == [4.0, 8.0] and history["constant"] == [2.5, 2.5]


def test_a_log_that_is_not_a_number_is_named():
    class Named(GuideModel):
        def train_step(self, data):
            return {"outer": {"note": tf.constant("text")}}

    par = Parallel("single")
    par.build(lambda: guide_model(Named), **guide_compile())
    x = np.zeros((8, 32), "float32")
    with pytest.raises(TypeError, match=r"Named\.train_step logged 'note' as a string tensor: a log must be a number"):
        par.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)


# -- the one-time warning under data parallelism ---------------------------------------------------------------------
def test_an_own_train_step_on_several_replicas_warns_once_with_the_exact_way(data):
    x, y, _ = data
    par = Parallel("mirrored", devices=2)
    par.build(guide_model, **guide_compile())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        par.fit(x, y, batch_size=16, epochs=2, verbose=0)  # 8 steps
        par.fit(x, y, batch_size=8, epochs=1, verbose=0)  # another step function, another fit
        par.evaluate(x, y, batch_size=16)
    own = [w for w in caught if w.category is OwnStepWarning]
    assert len(own) == 1
    message = str(own[0].message)
    for said in ("GuideModel.train_step", "2 replicas", "sums the replicas' gradients", "compute_average_loss"):
        assert said in message
    assert own[0].filename == __file__  # shown at the user's line, not inside paraml


def test_an_own_train_step_on_one_device_does_not_warn(data):
    *_, caught = paraml_fit("single", None, data)
    assert caught == []


class ExactStep(keras.Model):
    """The step the warning describes: the loss is this replica's share of the global batch's mean."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.loss_tracker]

    def train_step(self, data):
        x, y = data
        global_rows = tf.distribute.get_replica_context().all_reduce("sum", tf.shape(x)[0])
        with tf.GradientTape() as tape:
            per_example = keras.losses.mean_squared_error(y, self(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_rows)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        self.loss_tracker.update_state(per_example)
        return {"loss": self.loss_tracker.result()}


def test_the_warnings_exact_step_equals_one_device_also_on_an_uneven_last_batch(data):
    x, y, (x_more, y_more) = data
    x, y = np.concatenate([x, x_more])[:67], np.concatenate([y, y_more])[:67]  # a last batch of 3: 2 and 1 rows
    par = Parallel("mirrored", devices=2)
    model = par.build(lambda: guide_model(ExactStep), optimizer=keras.optimizers.SGD(0.1))
    initial = model.get_weights()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OwnStepWarning)
        history = par.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    reference = guide_model(ExactStep)
    reference.set_weights(initial)
    reference.compile(optimizer=keras.optimizers.SGD(0.1))
    want = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    assert_same(model.get_weights(), history, reference.get_weights(), want)
