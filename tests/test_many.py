"""fit_many: many models at once, one model per device, on the 4 simulated CPUs (real TensorFlow, no mocks)."""

import io
import re

import keras
import numpy as np
import pytest
from conftest import logits_loss, small_mlp

from paraml import Parallel
from paraml.devices import canonical_device
from paraml.many import Job, JobResult, default_seed, fit_many

TWO = ("/device:CPU:0", "/device:CPU:1")


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")
    return x, y


def classifier_job(name, data, *, epochs=2, **overrides):
    settings = dict(
        model_fn=small_mlp,
        compile={"optimizer": keras.optimizers.SGD(0.1), "loss": logits_loss(), "metrics": ["accuracy"]},
        data=data,
        fit={"batch_size": 32, "epochs": epochs},
    )
    settings.update(overrides)
    return Job(name, **settings)


def placements(model):
    """The canonical devices of every variable of a trained model and of its optimizer."""
    variables = list(model.variables) + list(model.optimizer.variables)
    return {canonical_device(v.value.device) for v in variables}


def test_three_jobs_on_two_devices_each_get_their_own_results(data):
    x, y = data
    jobs = [
        classifier_job("a", data),
        classifier_job("b", data, seed=7),
        # lazy data with a validation split, and an evaluation after training
        classifier_job("c", lambda: (x[:64], y[:64], x[64:], y[64:]), evaluate=(x, y)),
    ]
    out = io.StringIO()
    results = fit_many(jobs, devices=2, out=out)
    assert list(results) == ["a", "b", "c"]
    for name, result in results.items():
        assert isinstance(result, JobResult) and result.name == name
        assert result.ok, result.error
        assert result.device in TWO
        assert len(result.history["loss"]) == 2
        assert result.seconds > 0
    assert results["a"].history != results["b"].history != results["c"].history
    assert results["a"].history["loss"] != results["c"].history["loss"]
    # without `evaluate`: the last epoch's logs; with it: the evaluation (here on data the job also validated on)
    assert results["a"].metrics == {k: v[-1] for k, v in results["a"].history.items()}
    assert "val_loss" in results["c"].history
    assert set(results["c"].metrics) == {"loss", "accuracy"}
    assert results["c"].metrics["loss"] != results["c"].history["loss"][-1]
    log = out.getvalue()
    assert re.search(r"\[fit_many\] job 'a' started on /device:CPU:\d \(1/2 running, 2 queued\)", log), log
    assert re.search(r"\[fit_many\] job 'c' finished on /device:CPU:\d in [\d.]+s: loss [\d.]+, accuracy", log), log
    assert log.rstrip().endswith("3 ok, 0 failed")


def test_a_job_whose_model_fn_raises_fails_alone(data):
    def broken():
        raise ValueError("no such layer size")

    jobs = [classifier_job(name, data) for name in ("a", "b", "c")]
    jobs.insert(1, classifier_job("broken", data, model_fn=broken))
    out = io.StringIO()
    results = fit_many(jobs, devices=2, out=out)
    assert list(results) == ["a", "broken", "b", "c"]
    failed = results["broken"]
    assert not failed.ok
    assert failed.error == "ValueError: no such layer size"
    assert failed.model is None and failed.history == {} and failed.device in TWO
    assert all(results[name].ok for name in ("a", "b", "c"))
    assert "job 'broken' failed on /device:CPU:" in out.getvalue()
    assert ": ValueError: no such layer size" in out.getvalue()


def test_a_job_whose_loss_becomes_nan_fails_alone(data):
    x, _ = data
    nan_targets = np.full((len(x), 1), np.nan, dtype="float32")
    regression = {"optimizer": "sgd", "loss": "mse"}
    jobs = [
        classifier_job("a", data),
        Job("nan", lambda: small_mlp(classes=1), regression, (x, nan_targets), {"batch_size": 32, "epochs": 3}),
        classifier_job("b", data),
    ]
    out = io.StringIO()
    results = fit_many(jobs, devices=2, out=out, verbose=0)
    assert out.getvalue() == ""  # verbose=0 prints nothing (not even TerminateOnNaN's message)
    assert results["nan"].error == "FloatingPointError: loss became NaN at epoch 1"
    assert len(results["nan"].history["loss"]) == 1  # TerminateOnNaN stopped it in its first epoch
    assert results["a"].ok and results["b"].ok


@pytest.mark.slow
def test_twenty_jobs_on_two_devices_each_run_on_exactly_one(data):
    x, y = data
    small = (x[:32], y[:32])
    jobs = [classifier_job(f"job{i:02d}", small, epochs=1, model_fn=lambda: small_mlp()) for i in range(20)]
    out = io.StringIO()
    results = fit_many(jobs, devices=["CPU:2", "CPU:3"], out=out)
    assert len(results) == 20 and all(r.ok for r in results.values())
    used = set()
    for name, result in results.items():
        # Every variable of the trained model and of its optimizer lives on the one device the job was given.
        assert placements(result.model) == {result.device}, name
        assert out.getvalue().count(f"job {name!r} started on") == 1
        assert f"job {name!r} started on {result.device}" in out.getvalue()
        used.add(result.device)
    assert used == {"/device:CPU:2", "/device:CPU:3"}


def test_final_weights_are_the_same_alone_and_among_others(data):
    def with_dropout():
        hidden = [keras.layers.Dense(16, activation="relu"), keras.layers.Dropout(0.3)]
        return keras.Sequential([keras.Input((8,)), *hidden, keras.layers.Dense(3)])

    def job(name):
        return classifier_job(name, data, epochs=2, model_fn=with_dropout, seed=5 if name == "target" else None)

    alone = fit_many([job("target")], devices=["CPU:3"], verbose=0)["target"]
    crowd = fit_many([job("x"), job("y"), job("target"), job("z")], devices=2, verbose=0)
    among = crowd["target"]
    assert alone.ok and among.ok
    assert among.history == alone.history
    for got, want in zip(among.model.get_weights(), alone.model.get_weights()):
        np.testing.assert_array_equal(got, want)
    # and the other jobs (other seeds, derived from their names) did train other models
    assert crowd["x"].history != among.history


def test_initial_weights_are_those_parallel_builds_with_the_job_seed(data):
    frozen = {"optimizer": keras.optimizers.SGD(0.0), "loss": logits_loss()}  # a learning rate of 0 keeps them
    jobs = [classifier_job(name, data, epochs=1, compile=frozen) for name in ("p", "q")]
    results = fit_many(jobs, devices=2, verbose=0)
    for job in jobs:
        par = Parallel("single", devices=[results[job.name].device], seed=job.seed)
        expected = par.build(small_mlp, optimizer="sgd", loss=logits_loss()).get_weights()
        for got, want in zip(results[job.name].model.get_weights(), expected):
            np.testing.assert_array_equal(got, want)


def test_job_seed_defaults_to_a_stable_hash_of_the_name(data):
    assert classifier_job("a", data).seed == default_seed("a") == classifier_job("a", data).seed
    assert classifier_job("b", data).seed != classifier_job("a", data).seed
    assert classifier_job("a", data, seed=3).seed == 3


def test_fit_many_rejects_duplicate_names_and_empty_lists(data):
    with pytest.raises(ValueError, match="the name 'a' appears twice"):
        fit_many([classifier_job("a", data), classifier_job("b", data), classifier_job("a", data)], verbose=0)
    with pytest.raises(ValueError, match="jobs is empty"):
        fit_many([], verbose=0)
    with pytest.raises(TypeError, match="single Job"):
        fit_many(classifier_job("a", data), verbose=0)
    with pytest.raises(TypeError, match="Job objects"):
        fit_many([("a", small_mlp)], verbose=0)
    with pytest.raises(ValueError, match="more devices than exist"):
        fit_many([classifier_job("a", data)], devices=5, verbose=0)


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        ({"name": ""}, ValueError, "Job.name"),
        ({"name": 3}, TypeError, "Job.name"),
        ({"model_fn": None}, TypeError, "model_fn"),
        ({"model_fn": "small_mlp"}, TypeError, "model_fn"),
        ({"compile": ["sgd", "mse"]}, TypeError, "compile must be a mapping"),
        ({"compile": {"optimizer": "sgd"}}, ValueError, "compile needs a 'loss'"),
        ({"compile": {"loss": "mse", "lr": 0.1}}, ValueError, "unknown compile argument 'lr'"),
        ({"fit": None}, TypeError, "fit must be a mapping"),
        ({"fit": {"epoch": 2}}, ValueError, "unknown fit argument 'epoch'"),
        ({"data": np.zeros(3)}, TypeError, "data must be a tuple"),
        ({"data": (1, 2, 3)}, ValueError, "data must be"),
        ({"data": (1, 2, 3, 4), "fit": {"validation_data": (1, 2)}}, ValueError, "give only one"),
        ({"seed": "0"}, TypeError, "seed"),
        ({"seed": True}, TypeError, "seed"),
        ({"evaluate": (1, 2, 3)}, ValueError, "evaluate"),
    ],
)
def test_job_rejects_bad_fields(data, overrides, error, message):
    settings = {"name": "j", "data": data, **overrides}
    name, job_data = settings.pop("name"), settings.pop("data")
    with pytest.raises(error, match=message):
        classifier_job(name, job_data, **settings)


def test_a_model_instance_is_not_a_model_fn(data):
    with pytest.raises(TypeError, match="not the model"):
        classifier_job("j", data, model_fn=small_mlp())


def test_lazy_data_that_returns_garbage_fails_that_job_only(data):
    jobs = [classifier_job("bad-data", lambda: (1, 2, 3)), classifier_job("good", data, epochs=1)]
    results = fit_many(jobs, devices=1, verbose=0)
    assert results["bad-data"].error.startswith("ValueError: Job 'bad-data': data() must be")
    assert results["good"].ok


def test_a_failure_of_fit_many_itself_is_raised_not_swallowed(data):
    closed = io.StringIO()
    closed.close()
    with pytest.raises(ValueError, match="closed file"):
        fit_many([classifier_job("a", data, epochs=1)], devices=1, out=closed)


def test_jobs_inherit_the_callers_dtype_policy():
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        job = Job(
            "policy",
            lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
            compile={"optimizer": "sgd", "loss": "mse"},
            data=(np.ones((8, 4), "float32"), np.ones((8, 1), "float32")),
            fit={"batch_size": 4, "epochs": 1},
        )
        result = fit_many([job], devices=1, verbose=0)["policy"]
        assert result.ok, result.error
        assert result.model.layers[0].compute_dtype == "bfloat16"
    finally:
        keras.config.set_dtype_policy("float32")


def test_jobs_of_two_devices_train_as_pipelines_side_by_side(data):
    """devices_per_job=2 on 4 devices: two jobs at once, each a model_parallel pipeline over its own two devices,
    ending with the weights it gets alone under single."""
    jobs = [classifier_job(name, data, seed=3) for name in ("a", "b")]
    results = fit_many(jobs, devices=4, devices_per_job=2, verbose=0)
    groups = {results[name].devices for name in ("a", "b")}
    assert groups == {("/device:CPU:0", "/device:CPU:1"), ("/device:CPU:2", "/device:CPU:3")}
    alone = Parallel("single", seed=3)
    alone.build(small_mlp, optimizer=keras.optimizers.SGD(0.1), loss=logits_loss())
    alone.fit(*data, batch_size=32, epochs=2, verbose=0)
    for name in ("a", "b"):
        result = results[name]
        assert result.ok, result.error
        assert placements(result.model) <= set(result.devices) and len(placements(result.model)) == 2
        for got, want in zip(result.model.get_weights(), alone.model.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="devices_per_job=3 needs at least that many devices, got 2"):
        fit_many(jobs, devices=2, devices_per_job=3)
