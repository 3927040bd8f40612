"""The facade and the data-parallel backends on 4 simulated CPU devices."""

import keras
import numpy as np
import pytest
from conftest import logits_loss, small_mlp

from paraml import Parallel
from paraml.backends import available


def build(strategy, devices=None, optimizer=None, regularize=False, **options):
    par = Parallel(strategy, devices=devices, seed=0, **options)
    par.build(
        lambda: small_mlp(regularize=regularize),
        optimizer=optimizer or keras.optimizers.SGD(0.1),
        loss=logits_loss(),
        metrics=["accuracy"],
    )
    return par


CONFIGS = [("mirrored", 2, {}), ("mirrored", 4, {}), ("central_storage", 4, {})]


@pytest.fixture(scope="module")
def reference(request):
    """The single-device run every backend must reproduce."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1001, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")
    par = build("single", regularize=True)
    initial = par.model.get_weights()
    history = par.fit(x, y, batch_size=64, epochs=3, verbose=0)
    return dict(
        x=x,
        y=y,
        initial=initial,
        weights=par.model.get_weights(),
        history=history.history,
        evaluate=par.evaluate(x, y, batch_size=64),
        predict=par.predict(x, batch_size=64),
    )


@pytest.mark.parametrize("strategy, devices, options", CONFIGS, ids=[f"{s}-{d}" for s, d, _ in CONFIGS])
def test_backend_parity_with_single(reference, strategy, devices, options):
    par = build(strategy, devices, regularize=True, **options)
    par.model.set_weights(reference["initial"])
    history = par.fit(reference["x"], reference["y"], batch_size=64, epochs=3, verbose=0)
    for got, want in zip(par.model.get_weights(), reference["weights"]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(history.history["loss"], reference["history"]["loss"], rtol=1e-4)
    np.testing.assert_allclose(history.history["accuracy"], reference["history"]["accuracy"], rtol=1e-6)
    # 1,001 samples in batches of 64: the last batch (41) splits unevenly over the replicas.
    evaluated = par.evaluate(reference["x"], reference["y"], batch_size=64)
    assert evaluated.keys() == reference["evaluate"].keys()
    for name, value in evaluated.items():
        assert value == pytest.approx(reference["evaluate"][name], rel=1e-5), name
    np.testing.assert_allclose(par.predict(reference["x"], batch_size=64), reference["predict"], rtol=1e-4, atol=1e-6)


def test_evaluate_counts_every_sample_once(data_1001):
    x, y = data_1001
    par = build("mirrored", 4)
    predictions = par.predict(x, batch_size=32)
    assert predictions.shape == (1001, 3)
    expected_accuracy = float(np.mean(np.argmax(predictions, axis=1) == y))
    assert par.evaluate(x, y, batch_size=32)["accuracy"] == pytest.approx(expected_accuracy, abs=1e-6)


def test_facade_properties():
    par = Parallel("mirrored", devices=["cpu:1", "CPU:2"])
    assert par.strategy == "mirrored"
    assert par.devices == ("/device:CPU:1", "/device:CPU:2")
    assert par.num_replicas == 2
    assert par.is_chief
    assert Parallel("single").devices == ("/device:CPU:0",)
    assert Parallel("mirrored").num_replicas == 4  # devices=None: every logical CPU


def test_central_storage_keeps_variables_on_parameter_device():
    par = Parallel("central_storage", devices=["CPU:0", "CPU:2"], parameter_device="cpu:1")
    par.build(small_mlp, optimizer="adam", loss=logits_loss())
    variables = par.model.weights + par.model.optimizer.variables
    assert variables
    for v in variables:
        assert v.value.device.endswith("/device:CPU:1"), (v.path, v.value.device)


def test_mirrored_has_a_copy_on_every_device():
    par = Parallel("mirrored", devices=3)
    par.build(small_mlp, optimizer="sgd", loss=logits_loss())
    for v in par.model.weights:
        copies = v.value.values
        assert [c.device.split("/")[-1] for c in copies] == ["device:CPU:0", "device:CPU:1", "device:CPU:2"]


def test_optimizer_made_outside_any_scope_works(data_1001):
    x, y = data_1001
    outside = keras.optimizers.Adam(learning_rate=0.01)  # remembers no strategy: paraml re-creates it in scope
    par = build("mirrored", 2, optimizer=outside)
    history = par.fit(x, y, batch_size=100, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]
    assert par.model.optimizer.learning_rate.numpy() == pytest.approx(0.01)


def test_steps_per_execution_gives_the_same_weights(data_1001):
    x, y = data_1001
    runs = []
    for steps in (1, 4):
        par = build("mirrored", 2, steps_per_execution=steps)
        if runs:
            par.model.set_weights(runs[0][0])
        initial = par.model.get_weights()
        par.fit(x, y, batch_size=64, epochs=2, verbose=0)
        runs.append((initial, par.model.get_weights()))
    for a, b in zip(runs[0][1], runs[1][1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# -- bad input: clear errors before training starts -------------------------------------------------------------------
def test_unknown_strategy_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown strategy 'mirored'.*'single'.*'mirrored'.*'central_storage'"):
        Parallel("mirored")
    assert {"single", "mirrored", "central_storage"} <= set(available())


def test_unknown_option_names_it_and_valid_ones():
    with pytest.raises(ValueError, match=r"unknown option 'parameter_devise'.*parameter_device"):
        Parallel("central_storage", parameter_devise="CPU:0")
    with pytest.raises(ValueError, match=r"unknown option 'micro_batches' for strategy 'mirrored'"):
        Parallel("mirrored", micro_batches=2)


def test_more_devices_than_exist():
    with pytest.raises(ValueError, match=r"devices=16.*has 4"):
        Parallel("mirrored", devices=16)


def test_fit_before_build():
    with pytest.raises(RuntimeError, match=r"fit needs a model: call par.build"):
        Parallel("single").fit(np.zeros((4, 8)), np.zeros(4))


def test_x_and_y_of_different_lengths():
    par = build("single")
    with pytest.raises(ValueError, match="x has 10 samples, y has 9"):
        par.fit(np.zeros((10, 8)), np.zeros(9), verbose=0)


def test_batch_size_smaller_than_replicas():
    par = build("mirrored", 4)
    with pytest.raises(ValueError, match=r"batch_size=2 is smaller than the number of replicas \(4\)"):
        par.fit(np.zeros((10, 8)), np.zeros(10), batch_size=2, verbose=0)


def test_non_callable_model_fn():
    with pytest.raises(TypeError, match="model_fn must be a zero-argument function"):
        Parallel("single").build(small_mlp(), loss="mse")


def test_missing_loss_and_unknown_names():
    par = Parallel("single")
    with pytest.raises(ValueError, match="loss is required"):
        par.build(small_mlp)
    with pytest.raises(ValueError, match="unknown optimizer 'adamm'"):
        par.build(small_mlp, optimizer="adamm", loss="mse")
    with pytest.raises(ValueError, match="unknown metric 'acuracy'"):
        par.build(small_mlp, loss="mse", metrics=["acuracy"])


def test_a_model_without_an_input_shape_is_built_at_its_first_batch(data_1001):
    """As Keras builds it at the first batch of fit; model_parallel places weights at build, so it needs them then."""
    x, y = data_1001
    par = Parallel("mirrored", devices=2, seed=0)
    model = par.build(lambda: keras.Sequential([keras.layers.Dense(3)]), loss=logits_loss())
    with pytest.raises(RuntimeError, match="gets them at its first batch"):
        par.save("unused")
    par.fit(x, y, batch_size=64, verbose=0)
    assert [tuple(w.shape) for w in model.weights] == [(8, 3), (3,)]
    with pytest.raises(ValueError, match=r"strategy 'model_parallel' places the weights at build.*keras.Input"):
        Parallel("model_parallel", devices=2).build(lambda: keras.Sequential([keras.layers.Dense(2)]), loss="mse")


def test_bad_steps_per_execution_and_seed():
    with pytest.raises(ValueError, match="steps_per_execution must be an int >= 1, got 0"):
        Parallel("single", steps_per_execution=0)
    with pytest.raises(ValueError, match="seed must be an int"):
        Parallel("single", seed="x")


def test_a_plain_keras_mirrored_fit_after_paraml_still_works(data_1001):
    """paraml's strategies keep their collective keys apart from strategies created after them."""
    import tensorflow as tf

    x, y = data_1001
    build("mirrored", 2).fit(x, y, batch_size=64, epochs=1, verbose=0)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    with strategy.scope():
        model = small_mlp()
        model.compile("sgd", logits_loss())
    history = model.fit(x, y, batch_size=66, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


@pytest.mark.parametrize(
    "strategy, devices, options",
    [("single", None, {}), ("mirrored", 2, {}), ("central_storage", 2, {}), ("model_parallel", 2, {})],
)
def test_every_verbose_gives_the_same_numbers(reference, strategy, devices, options, capsys):
    par = build(strategy, devices, **options)
    x, y = reference["x"][:200], reference["y"][:200]
    quiet = par.evaluate(x, y, batch_size=64, verbose=0)
    predicted = par.predict(x, batch_size=64, verbose=0)
    capsys.readouterr()
    for verbose in (1, 2, True, "auto"):
        assert par.evaluate(x, y, batch_size=64, verbose=verbose) == quiet
        np.testing.assert_array_equal(par.predict(x, batch_size=64, verbose=verbose), predicted)
    shown = capsys.readouterr().out
    assert "4/4" in shown and "loss" in shown  # Keras' progress bar for evaluate and predict


def test_a_strategy_left_with_one_device_says_so(recwarn):
    par = Parallel("mirrored", devices=1, seed=0)
    with pytest.warns(UserWarning, match="strategy 'mirrored' has one device .*CPU:0.*: it trains like 'single'"):
        par.build(lambda: small_mlp(), optimizer="sgd", loss=logits_loss())
    assert "TensorFlow sees no GPU" in par.explain()
    par.build(lambda: small_mlp(), optimizer="sgd", loss=logits_loss())  # once per Parallel
    assert not [w for w in recwarn if "has one device" in str(w.message)][1:]
    assert "one device" not in Parallel("mirrored", devices=2).explain()


def test_workers_of_a_launch_that_do_not_form_a_cluster_are_warned(monkeypatch):
    monkeypatch.setenv("PARAML_NUM_WORKERS", "2")  # what paraml launch -n 2 sets
    with pytest.warns(UserWarning, match="paraml launch started 2 workers, but strategy 'mirrored' does not make"):
        Parallel("mirrored", devices=2)


def test_central_storage_refuses_a_grouped_convolution_by_name():
    def grouped():
        return keras.Sequential(
            [keras.Input((8, 8, 4)), keras.layers.Conv2D(4, 3, groups=2, name="grouped"), keras.layers.Flatten()]
        )

    with pytest.raises(ValueError, match="strategy 'central_storage' cannot train layer 'grouped', a grouped conv"):
        Parallel("central_storage", devices=2).build(grouped, optimizer="sgd", loss="mse")
    Parallel("mirrored", devices=2).build(grouped, optimizer="sgd", loss="mse")  # its variables are on every device


def test_memory_by_device_reads_where_the_variables_live():
    def make():
        return keras.Sequential(
            [keras.Input((16,)), keras.layers.Dense(64), keras.layers.Dense(64), keras.layers.Dense(2)]
        )

    found = {}
    for strategy, devices in [("single", None), ("mirrored", 2), ("central_storage", 2), ("model_parallel", 2)]:
        par = Parallel(strategy, devices=devices)
        par.build(make, optimizer="adam", loss="mse")
        found[strategy] = par.memory_by_device()
    ((one, single),) = found["single"].items()
    params = (16 * 64 + 64 + 64 * 64 + 64 + 64 * 2 + 2) * 4
    assert single["parameters"] == params and single["optimizer"] == 2 * params + 12  # Adam: 2 slots + 3 scalars
    assert list(found["mirrored"].values()) == [single, single]  # a full copy on each replica
    assert list(found["central_storage"].values()) == [single]  # one copy, on the parameter device
    staged = found["model_parallel"]
    assert len(staged) == 2 and all(b["parameters"] < params for b in staged.values())
    assert sum(b["parameters"] for b in staged.values()) == params
    slots = sum(b["optimizer"] for b in staged.values())
    assert 2 * params <= slots <= 2 * params + 12  # every slot once, next to its variable
    assert "parameters" in par.describe() and "/device:CPU:1" in par.describe()
