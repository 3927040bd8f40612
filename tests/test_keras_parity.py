"""paraml against plain Keras ``model.fit`` from the same initial weights: models, compile and fit arguments.

Each check trains plain Keras (one device, no strategy) and paraml from the same weights with ``shuffle=False`` and
compares weights and logs (rtol 1e-4); data-parallel backends are compared with ``single``.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import logits_loss

import paraml
from paraml import Parallel

RTOL = 1e-4


def assert_weights_close(a, b, rtol=RTOL, atol=1e-6):
    assert len(a) == len(b)
    for wa, wb in zip(a, b):
        np.testing.assert_allclose(wa, wb, rtol=rtol, atol=atol)


def assert_history_close(got, want, keys=None, rtol=RTOL):
    for key in keys or want:
        np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=1e-6, err_msg=key)


def keras_reference(make_model, compile_args, x, y=None, initial=None, **fit_args):
    """Plain Keras: compile and fit a model from ``initial`` weights; return (weights, history)."""
    model = make_model()
    if initial is not None:
        model.set_weights(initial)
    model.compile(**compile_args())
    history = model.fit(x, y, shuffle=False, verbose=0, **fit_args)
    return model.get_weights(), history.history


def paraml_run(strategy, devices, make_model, compile_args, x, y=None, initial=None, **fit_args):
    par = Parallel(strategy, devices=devices, seed=0)
    model = par.build(make_model, **compile_args())
    if initial is not None:
        model.set_weights(initial)
    history = par.fit(x, y, shuffle=False, verbose=0, **fit_args)
    return par, model.get_weights(), history.history


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 8)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")


# -- models ---------------------------------------------------------------------------------------------------------
def two_heads():
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    return keras.Model(
        inputs, {"cls": keras.layers.Dense(3, name="cls")(h), "reg": keras.layers.Dense(2, name="reg")(h)}
    )


def two_heads_compile():
    return {
        "optimizer": keras.optimizers.SGD(0.1),
        "loss": {"cls": logits_loss(), "reg": "mse"},
        "loss_weights": {"cls": 1.0, "reg": 0.5},
        "metrics": {"cls": ["accuracy"], "reg": ["mae"]},
        "weighted_metrics": {"cls": ["accuracy"]},
    }


@pytest.mark.parametrize(
    "strategy, devices, options",
    [("single", None, {}), ("mirrored", 2, {}), ("model_parallel", 2, {"micro_batches": 2})],
    ids=["single", "mirrored", "model_parallel"],
)
def test_multi_output_model_with_loss_weights_equals_keras(data, strategy, devices, options):
    x, y = data
    targets = {"cls": y, "reg": x[:, :2]}
    initial = two_heads().get_weights()
    want_w, want_h = keras_reference(two_heads, two_heads_compile, x, targets, initial, batch_size=20, epochs=2)
    par = Parallel(strategy, devices=devices, seed=0, **options)
    model = par.build(two_heads, **two_heads_compile())
    model.set_weights(initial)
    history = par.fit(x, targets, batch_size=20, epochs=2, shuffle=False, verbose=0).history
    assert set(history) == set(want_h)  # Keras' names: loss, cls_loss, reg_loss, cls_accuracy, ...
    assert_weights_close(model.get_weights(), want_w)
    assert_history_close(history, want_h)
    result = par.evaluate(x, targets, batch_size=20)
    assert set(result) == set(want_h)
    predicted = par.predict(x, batch_size=20)
    assert set(predicted) == {"cls", "reg"} and predicted["reg"].shape == (100, 2)


class MLP(keras.Model):
    """A subclassed model: layers in __init__, a call method."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def called_mlp():
    model = MLP()
    model(np.zeros((1, 8), "float32"))
    return model


def sgd_compile():
    return {"optimizer": keras.optimizers.SGD(0.1), "loss": logits_loss(), "metrics": ["accuracy"]}


@pytest.mark.parametrize("strategy, devices", [("single", None), ("mirrored", 2), ("central_storage", 2)])
def test_subclassed_model_equals_keras(data, strategy, devices):
    x, y = data
    initial = called_mlp().get_weights()
    want_w, want_h = keras_reference(called_mlp, sgd_compile, x, y, initial, batch_size=20, epochs=2)
    _, got_w, got_h = paraml_run(strategy, devices, called_mlp, sgd_compile, x, y, initial, batch_size=20, epochs=2)
    assert_weights_close(got_w, want_w)
    assert_history_close(got_h, want_h)


def test_a_subclassed_model_built_lazily_gets_its_weights_at_the_first_batch(data):
    x, y = data

    def lazy():
        model = MLP()
        model.build((None, 8))  # Keras 3 creates a subclassed model's weights at its first call
        return model

    par = Parallel("mirrored", devices=2, seed=0)
    model = par.build(lazy, optimizer="sgd", loss=logits_loss())
    assert not model.weights
    par.fit(x, y, batch_size=20, verbose=0)
    assert len(model.weights) == 4
    assert all(len(v.value.values) == 2 for v in model.weights)  # created under the strategy: one copy a device
    assert par.predict(x).shape == (100, 3)


def embedding_model():
    return keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(200, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )


def adam_compile():
    return {"optimizer": keras.optimizers.Adam(0.01), "loss": logits_loss()}


def test_embedding_with_adam_equals_keras_sparse_gradients(data):
    """The embedding's gradient stays an IndexedSlices, as Keras passes it: Adam then updates as in Keras."""
    _, y = data
    tokens = np.random.default_rng(1).integers(0, 200, (100, 5)).astype("int32")
    initial = embedding_model().get_weights()
    want_w, _ = keras_reference(embedding_model, adam_compile, tokens, y, initial, batch_size=20, epochs=2)
    for strategy, devices in (("single", None), ("mirrored", 2)):
        _, got_w, _ = paraml_run(
            strategy, devices, embedding_model, adam_compile, tokens, y, initial, batch_size=20, epochs=2
        )
        assert_weights_close(got_w, want_w)


@pytest.mark.parametrize("strategy, devices", [("single", None), ("mirrored", 2), ("central_storage", 2)])
def test_gradient_accumulation_equals_keras(data, strategy, devices):
    x, y = data

    def accumulating():
        return {"optimizer": keras.optimizers.Adam(0.01, gradient_accumulation_steps=3), "loss": logits_loss()}

    initial = called_mlp().get_weights()
    want_w, want_h = keras_reference(called_mlp, accumulating, x, y, initial, batch_size=10, epochs=2)
    par, got_w, got_h = paraml_run(strategy, devices, called_mlp, accumulating, x, y, initial, batch_size=10, epochs=2)
    assert_weights_close(got_w, want_w)
    assert_history_close(got_h, want_h)
    assert int(par.model.optimizer.iterations.numpy()) == 20 // 3  # updates, as Keras counts them


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("strategy, devices", [("single", None), ("mirrored", 2), ("central_storage", 2)])
def test_mixed_precision_trains_evaluates_and_predicts(data, policy, strategy, devices):
    x, y = data
    keras.config.set_dtype_policy(policy)
    try:
        par = Parallel(strategy, devices=devices, seed=0)
        if strategy == "central_storage" and policy == "mixed_float16":
            with pytest.raises(ValueError, match="cannot step Keras' LossScaleOptimizer"):
                par.build(called_mlp, optimizer="adam", loss=logits_loss())
            return
        par.build(called_mlp, optimizer="adam", loss=logits_loss(), metrics=["accuracy"])
        history = par.fit(x, y, batch_size=20, epochs=2, verbose=0).history
        assert np.isfinite(history["loss"]).all()
        assert np.isfinite(par.evaluate(x, y)["loss"])
        predicted = par.predict(x)
        assert predicted.shape == (100, 3) and predicted.dtype == np.dtype(policy.split("_")[1])
    finally:
        keras.config.set_dtype_policy("float32")


# -- fit arguments --------------------------------------------------------------------------------------------------
def test_infinite_dataset_with_steps_per_epoch_runs_exactly_the_steps_asked(data):
    x, y = data
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(10).repeat()

    class Count(keras.callbacks.Callback):
        train = test = 0

        def on_train_batch_end(self, batch, logs=None):
            Count.train += 1

        def on_test_batch_end(self, batch, logs=None):
            Count.test += 1

    for strategy, devices in (("single", None), ("mirrored", 2)):
        Count.train = Count.test = 0
        par = Parallel(strategy, devices=devices, seed=0)
        par.build(called_mlp, optimizer="sgd", loss=logits_loss())
        history = par.fit(
            ds, epochs=3, steps_per_epoch=7, validation_data=ds, validation_steps=3, verbose=0, callbacks=[Count()]
        )
        assert (Count.train, Count.test) == (21, 9)
        assert int(par.model.optimizer.iterations.numpy()) == 21
        assert len(history.history["val_loss"]) == 3


def test_infinite_dataset_continues_across_epochs_as_in_keras(data):
    """An iterator kept across epochs: epoch 2 starts where epoch 1 stopped (not at the first batch again)."""
    x, y = data
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(10).repeat()
    initial = called_mlp().get_weights()
    want_w, want_h = keras_reference(called_mlp, sgd_compile, ds, None, initial, epochs=3, steps_per_epoch=4)
    _, got_w, got_h = paraml_run(
        "single", None, called_mlp, sgd_compile, ds, None, initial, epochs=3, steps_per_epoch=4
    )
    assert_weights_close(got_w, want_w)
    assert_history_close(got_h, want_h)


@pytest.mark.parametrize(
    "fit_args",
    [
        {"class_weight": {0: 1.0, 1: 2.0, 2: 0.5}},
        {"validation_split": 0.2, "validation_freq": 2},
        {"steps_per_epoch": 3},
        {"validation_data": "held_out", "validation_batch_size": 7},
    ],
    ids=["class_weight", "validation_split_freq", "steps_per_epoch_arrays", "validation_batch_size"],
)
def test_fit_arguments_equal_keras(data, fit_args):
    x, y = data
    args = dict(fit_args)
    if args.get("validation_data") == "held_out":
        args["validation_data"] = (x[:30], y[:30])
    initial = called_mlp().get_weights()
    want_w, want_h = keras_reference(called_mlp, sgd_compile, x, y, initial, batch_size=20, epochs=4, **args)
    single_w = None
    for strategy, devices in (("single", None), ("mirrored", 2)):
        _, got_w, got_h = paraml_run(
            strategy, devices, called_mlp, sgd_compile, x, y, initial, batch_size=20, epochs=4, **args
        )
        assert set(got_h) == set(want_h)
        assert_weights_close(got_w, want_w)
        assert_history_close(got_h, want_h)
        if single_w is not None:
            assert_weights_close(got_w, single_w)
        single_w = got_w


def test_sample_weight_in_fit_and_evaluate_equals_keras(data):
    x, y = data
    w = np.random.default_rng(3).uniform(0.1, 2.0, 100).astype("float32")

    def weighted():
        return {**sgd_compile(), "weighted_metrics": ["accuracy"]}

    initial = called_mlp().get_weights()
    reference = called_mlp()
    reference.set_weights(initial)
    reference.compile(**weighted())
    want = reference.fit(x, y, sample_weight=w, batch_size=20, epochs=2, shuffle=False, verbose=0).history
    par = Parallel("mirrored", devices=2, seed=0)
    model = par.build(called_mlp, **weighted())
    model.set_weights(initial)
    got = par.fit(x, y, sample_weight=w, batch_size=20, epochs=2, shuffle=False, verbose=0).history
    assert_weights_close(model.get_weights(), reference.get_weights())
    assert_history_close(got, want)
    want_eval = reference.evaluate(x, y, sample_weight=w, batch_size=20, verbose=0, return_dict=True)
    got_eval = par.evaluate(x, y, sample_weight=w, batch_size=20)
    assert got_eval == pytest.approx(want_eval, rel=1e-5)


def test_generator_and_py_dataset_inputs_equal_keras(data):
    x, y = data

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return x[i * 20 : (i + 1) * 20], y[i * 20 : (i + 1) * 20]

    def generator():
        while True:
            for i in range(5):
                yield x[i * 20 : (i + 1) * 20], y[i * 20 : (i + 1) * 20]

    initial = called_mlp().get_weights()
    want_w, want_h = keras_reference(called_mlp, sgd_compile, Batches(), None, initial, epochs=2)
    _, got_w, got_h = paraml_run("single", None, called_mlp, sgd_compile, Batches(), None, initial, epochs=2)
    assert_weights_close(got_w, want_w)
    assert_history_close(got_h, want_h)
    _, gen_w, _ = paraml_run(
        "mirrored", 2, called_mlp, sgd_compile, generator(), None, initial, epochs=2, steps_per_epoch=5
    )
    assert_weights_close(gen_w, want_w)


# -- the trained model stands on its own -------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy, devices", [("single", None), ("mirrored", 2), ("central_storage", 2)])
def test_the_trained_model_predicts_saves_and_loads_as_paraml_predicts(tmp_path, data, strategy, devices):
    x, y = data
    par = Parallel(strategy, devices=devices, seed=0)
    par.build(two_heads, **two_heads_compile())
    par.fit(x, {"cls": y, "reg": x[:, :2]}, batch_size=20, verbose=0)
    ours = par.predict(x)
    theirs = par.model.predict(x, verbose=0)
    par.model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras", compile=False)(x)
    for key in ("cls", "reg"):
        np.testing.assert_allclose(theirs[key], ours[key], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(loaded[key]), ours[key], rtol=1e-5, atol=1e-6)


# -- central_storage trains Dropout and BatchNormalization -------------------------------------------------------------
@pytest.mark.slow
def test_central_storage_trains_dropout_and_batchnorm_models():
    (x, y), (x_test, y_test) = paraml.load_digits()

    def dropout_mlp():
        return keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dropout(0.3),
                keras.layers.Dense(10),
            ]
        )

    def batchnorm_cnn():
        return keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Conv2D(16, 3, padding="same"),
                keras.layers.BatchNormalization(),
                keras.layers.ReLU(),
                keras.layers.Flatten(),
                keras.layers.Dense(10),
            ]
        )

    for make in (dropout_mlp, batchnorm_cnn):
        par = Parallel("central_storage", devices=2, seed=0)
        model = par.build(make, optimizer="adam", loss=logits_loss(), metrics=["accuracy"])
        before = [w.numpy().copy() for w in model.non_trainable_weights]
        par.fit(x, y, batch_size=64, epochs=8, verbose=0)
        assert par.evaluate(x_test, y_test)["accuracy"] >= 0.85, make.__name__
        for variable, old in zip(model.non_trainable_weights, before):  # the moving statistics moved
            assert np.max(np.abs(variable.numpy() - old)) > 1e-3, variable.path
    dropped = model.layers  # the last model is the CNN; check Dropout on the MLP directly
    del dropped
    mlp = dropout_mlp()
    assert float(tf.reduce_max(tf.abs(mlp(x[:8], training=True) - mlp(x[:8], training=False)))) > 0


def test_central_storage_refuses_a_last_batch_that_leaves_a_batchnorm_replica_empty():
    x = np.random.default_rng(0).normal(size=(33, 8)).astype("float32")

    def with_bn():
        return keras.Sequential([keras.Input((8,)), keras.layers.BatchNormalization(), keras.layers.Dense(3)])

    par = Parallel("central_storage", devices=2, seed=0)
    par.build(with_bn, optimizer="sgd", loss=logits_loss())
    with pytest.raises(ValueError, match=r"last batch has 1 sample\(s\) for 2 replicas or micro-batches"):
        par.fit(x, np.zeros(33, "int32"), batch_size=32, verbose=0)


# -- build arguments ---------------------------------------------------------------------------------------------------
def test_build_names_what_it_does_not_take():
    par = Parallel("single")
    with pytest.raises(TypeError, match="run_eagerly is not supported"):
        par.build(called_mlp, loss="mse", run_eagerly=True)
    with pytest.raises(TypeError, match=r"jit_compile is an option of Parallel"):
        par.build(called_mlp, loss="mse", jit_compile=True)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'loss_weight' \(did you mean 'loss_weights'\?\)"):
        par.build(called_mlp, loss="mse", loss_weight=[1.0])
    with pytest.raises(ValueError, match="unknown loss 'mse2'"):
        par.build(called_mlp, loss={"out": "mse2"})
    with pytest.raises(ValueError, match=r"validation_freq must be a positive int"):
        p = Parallel("single")
        p.build(called_mlp, loss=logits_loss())
        p.fit(np.zeros((4, 8), "float32"), np.zeros(4, "int32"), validation_freq=0, verbose=0)


def test_backup_and_restore_is_refused_with_advice(tmp_path, data):
    x, y = data
    par = Parallel("single")
    par.build(called_mlp, loss=logits_loss())
    with pytest.raises(ValueError, match="BackupAndRestore is not supported: use par.fit.*checkpoint_dir"):
        par.fit(x, y, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path))], verbose=0)


# -- XLA ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy, devices", [("single", None), ("mirrored", 2)])
@pytest.mark.slow
def test_jit_compile_gives_the_weights_of_no_jit(data, strategy, devices):
    x, y = data
    weights = []
    for jit in (False, True):
        par = Parallel(strategy, devices=devices, seed=0, jit_compile=jit)
        par.build(called_mlp, **sgd_compile())
        par.fit(x, y, batch_size=20, epochs=3, shuffle=False, verbose=0)
        weights.append(par.model.get_weights())
        assert ("XLA" in par.explain()) and (("jit_compile=True" in par.explain()) == jit)
    assert_weights_close(weights[1], weights[0])


def test_jit_compile_true_names_what_cannot_compile():
    class NoXLA(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.supports_jit = False

        def call(self, inputs):
            return inputs

    def model_fn():
        return keras.Sequential([keras.Input((8,)), NoXLA(name="no_xla"), keras.layers.Dense(3)])

    with pytest.raises(ValueError, match=r"jit_compile=True cannot be used: layer 'no_xla' does not support XLA"):
        Parallel("single", jit_compile=True).build(model_fn, loss="mse")
    auto = Parallel("single", jit_compile="auto")
    auto.build(model_fn, loss="mse")
    assert "XLA off" in auto.explain()
    with pytest.raises(ValueError, match=r"jit_compile=True cannot be used: under central_storage"):
        Parallel("central_storage", devices=2, jit_compile=True).build(called_mlp, loss="mse")


@pytest.mark.parametrize("options", [{"micro_batches": 2, "schedule": "1f1b"}, {"tensor_parallel": 2}])
def test_adamw_on_stages_and_shards_equals_keras(data, options):
    """AdamW's decay and update run where each variable lives (a pipeline's one-device strategy ran them all on the
    first device); a bias excluded from the decay stays excluded."""
    x, y = data

    def stack():
        layers = [keras.layers.Dense(16, activation="relu", name=f"d{i}") for i in range(3)]
        return keras.Sequential([keras.Input((8,)), *layers, keras.layers.Dense(3, name="head")])

    def adamw_compile():
        optimizer = keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.1)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        return {"optimizer": optimizer, "loss": "sparse_categorical_crossentropy"}

    initial = stack().get_weights()
    want_w, want_h = keras_reference(stack, adamw_compile, x, y, initial, batch_size=20, epochs=2)
    par = Parallel("model_parallel", devices=2, seed=0, **options)
    model = par.build(stack, **adamw_compile())
    model.set_weights(initial)
    got_h = par.fit(x, y, shuffle=False, verbose=0, batch_size=20, epochs=2).history
    # split matmuls add their parts in another order: Adam turns that round-off into 2e-6 on a weight near zero
    assert_weights_close(model.get_weights(), want_w, atol=1e-5)
    assert_history_close(got_h, want_h)
