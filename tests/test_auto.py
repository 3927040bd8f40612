"""Parallel("auto"): the rule, and explain() with the numbers."""

import os
import subprocess
import sys
from pathlib import Path

import keras
import pytest

from paraml import Parallel
from paraml.auto import decide
from paraml.memory import MemoryEstimate


def wide():
    return keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(256), keras.layers.Dense(4)]
    )


def estimate(total):
    return MemoryEstimate(parameters=total, gradients=0, optimizer_slots=0, activations=0, batch_size=32)


@pytest.mark.parametrize(
    "workers, devices, need, have, expected",
    [
        (2, 4, 10, 1, "multi_worker"),
        (1, 1, 10, 1, "single"),
        (1, 2, 10, 100, "mirrored"),
        (1, 2, 100, 10, "model_parallel"),
        (1, 2, 100, None, "mirrored"),  # unknown memory: data parallel is the faster default
    ],
)
def test_the_rule(workers, devices, need, have, expected):
    assert decide(num_workers=workers, num_devices=devices, estimate=estimate(need), device_memory=have).strategy == (
        expected
    )


def test_the_first_saving_that_fits_is_taken():
    savings = [({"shard_optimizer": True}, estimate(90)), ({"remat": True}, estimate(40))]
    chosen = decide(num_workers=1, num_devices=2, estimate=estimate(100), device_memory=50, savings=savings)
    assert (chosen.strategy, chosen.remat, chosen.shard_optimizer) == ("mirrored", True, False)
    assert "with remat=True" in chosen.explain()
    none_fit = decide(num_workers=1, num_devices=2, estimate=estimate(100), device_memory=30, savings=savings)
    assert none_fit.strategy == "model_parallel" and "with shard_optimizer=True" in none_fit.explain()
    fits = decide(num_workers=1, num_devices=2, estimate=estimate(20), device_memory=30, savings=savings)
    assert (fits.strategy, fits.settings) == ("mirrored", {})


def test_a_model_that_does_not_fit_picks_model_parallel():
    # a replica (16 of the 32 rows) needs ~1.31 MiB, ~1.17 MiB with its Adam state sharded
    par = Parallel("auto", devices=2, device_memory="1.1MiB", micro_batches=2)
    assert par.strategy == "auto"  # decided at build, when the model is known
    par.build(wide, optimizer="adam", loss="mse")
    assert par.strategy == "model_parallel"
    assert par.backend.micro_batches == 2
    text = par.explain()
    assert "does not fit" in text and "1.10 MiB" in text and "optimizer slots" in text and "MiB" in text


def test_auto_runs_copies_of_the_shortest_pipeline_that_fits():
    """4 devices, a model that fits on 2 but not 1: two copies of a 2-stage pipeline, not one of 4 stages."""
    par = Parallel("auto", devices=4, device_memory="1.1MiB")  # a replica needs ~1.3 MiB, its largest unit ~1.0
    par.build(wide, optimizer="adam", loss="mse")
    assert par.strategy == "model_parallel"
    assert (par.num_replicas, par.backend.topology.layout.stages) == (2, 2)
    assert "as 2 copies of a 2-stage pipeline (data_parallel=2)" in par.explain()


def test_a_layer_larger_than_a_device_is_named_when_auto_picks_model_parallel():
    par = Parallel("auto", devices=2, device_memory="64KiB")  # even split over both devices, half of it is too large
    needs = r"unit 'dense_\d+' needs 5\d\d.\d\d KiB .*tensor_parallel=2.*than a device's 64"
    with pytest.raises(ValueError, match=needs):
        par.build(wide, optimizer="adam", loss="mse")


def test_a_model_that_fits_picks_mirrored():
    par = Parallel("auto", devices=2, device_memory="2GiB")
    par.build(wide, optimizer="adam", loss="mse")
    assert par.strategy == "mirrored" and par.num_replicas == 2
    assert "fits on one device" in par.explain() and "2.00 GiB" in par.explain()


def deep_gelu():
    layers = [keras.layers.Dense(64, activation="gelu") for _ in range(6)]
    return keras.Sequential([keras.Input((16,)), *layers, keras.layers.Dense(2)])


def test_remat_when_only_recompute_makes_the_model_fit_one_device():
    import numpy as np

    from paraml import estimate_memory

    # a replica's share of the global batch of 64 on 2 devices is what must fit one device
    plain = estimate_memory(deep_gelu(), batch_size=32, optimizer="sgd").total
    recomputed = estimate_memory(deep_gelu(), batch_size=32, optimizer="sgd", remat=True).total
    assert recomputed < plain  # GELU keeps four tensors of its size; recomputed, a unit keeps its input
    budget = (plain + recomputed) // 2
    assert decide(num_workers=1, num_devices=2, estimate=estimate(plain), device_memory=budget).strategy == (
        "model_parallel"
    )
    x = np.random.default_rng(0).normal(size=(128, 16)).astype("float32")
    y = np.arange(128) % 2
    pars = {
        "single": Parallel("single", seed=1),
        "auto": Parallel("auto", devices=2, seed=1, device_memory=budget, batch_size=64),
    }
    for name in pars:
        pars[name].build(deep_gelu, optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        pars[name].fit(x, y, batch_size=64, epochs=1, verbose=0)
    par = pars["auto"]
    assert par.strategy == "mirrored" and par.remat
    text = par.explain()
    assert "with remat=True" in text and "only with its activations recomputed" in text, text
    assert "remat=True: 7 units recompute" in text
    for got, want in zip(par.model.get_weights(), pars["single"].model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_shard_optimizer_when_only_sharded_adam_state_fits_one_device():
    from paraml import estimate_memory

    plain = estimate_memory(wide, batch_size=4, optimizer="adam").total  # a replica's share of 8 rows
    # auto compares the states and activations: neither figure counts its collectives' buffers (AutoChoice._savings)
    with_buffers = estimate_memory(wide, batch_size=4, optimizer="adam", optimizer_shards=2)
    sharded = with_buffers.total - with_buffers.collectives
    assert sharded < plain and with_buffers.collectives > 0
    budget = (plain + sharded) // 2
    par = Parallel("auto", devices=2, device_memory=budget, batch_size=8)
    par.build(wide, optimizer="adam", loss="mse")
    assert par.strategy == "mirrored" and par.backend.capabilities.zero_stage == 1 and not par.remat
    assert "with shard_optimizer=True" in par.explain() and "optimizer state sharded" in par.explain()


def test_one_device_picks_single():
    par = Parallel("auto", devices=1)
    par.build(wide, optimizer="adam", loss="mse")
    assert par.strategy == "single"
    assert "one device" in par.explain()


def test_auto_before_build_and_bad_options():
    par = Parallel("auto", devices=2)
    assert par.devices == ("/device:CPU:0", "/device:CPU:1")
    with pytest.raises(RuntimeError, match="chooses its strategy when it sees the model"):
        par.num_replicas  # noqa: B018
    with pytest.raises(ValueError, match="unknown option 'parameter_device' for strategy 'auto'"):
        Parallel("auto", parameter_device="CPU:0")
    with pytest.raises(ValueError, match="2 lots"):
        Parallel("auto", device_memory="2 lots")


@pytest.mark.slow
def test_a_two_worker_tf_config_picks_multi_worker():
    script = Path(__file__).parent / "scripts" / "auto_strategy.py"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    done = subprocess.run(
        [sys.executable, "-m", "paraml", "launch", "-n", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("strategy=multi_worker workers=2") == 2
    assert "TF_CONFIG describes a cluster of 2 workers" in done.stdout


VOCABULARY = ["a", "b", "c", "d"]


def text_classifier():
    """Strings in, through a StringLookup: the host build and its probe must handle text inputs."""
    inputs = keras.Input((1,), dtype="string")
    h = keras.layers.Flatten()(keras.layers.StringLookup(vocabulary=VOCABULARY, output_mode="one_hot")(inputs))
    h = keras.layers.Dense(8, activation="relu")(h)
    return keras.Model(inputs, keras.layers.Dense(2)(h))


@pytest.mark.parametrize(
    "strategy, options, chosen",
    [
        ("model_parallel", {}, "model_parallel"),
        ("auto", {"device_memory": "1GiB"}, "mirrored"),
    ],
)
def test_whatever_auto_picks_starts_and_ends_like_single(strategy, options, chosen):
    import numpy as np

    x = np.array([[VOCABULARY[i % 4]] for i in range(64)])
    y = np.arange(64) % 2

    def train(name, devices=None, **kwargs):
        par = Parallel(name, devices=devices, seed=3, **kwargs)
        par.build(text_classifier, optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        initial = par.model.get_weights()
        par.fit(x, y, batch_size=16, epochs=2, verbose=0)
        return par, initial

    reference, reference_initial = train("single")
    par, initial = train(strategy, 2, **options)
    assert par.strategy == chosen
    for got, want in zip(initial + par.model.get_weights(), reference_initial + reference.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_replica_is_sized_by_its_share_of_the_global_batch():
    from paraml import estimate_memory

    per_replica = estimate_memory(deep_gelu(), batch_size=32, optimizer="sgd").total
    whole_batch = estimate_memory(deep_gelu(), batch_size=64, optimizer="sgd").total
    assert per_replica < whole_batch
    budget = (per_replica + whole_batch) // 2  # fits a replica's 32 rows, not the global batch's 64
    par = Parallel("auto", devices=2, device_memory=budget, batch_size=64)
    par.build(deep_gelu, optimizer="sgd", loss="mse")
    assert par.strategy == "mirrored" and not par.remat, par.explain()
    assert "activations for batch 32" in par.explain()


def test_auto_picking_model_parallel_starts_and_ends_like_single():
    """Activations dominate the text classifier, so a pipeline never fits where a replica's share of the batch does
    not: the model whose parameters dominate is the one auto pipelines."""
    import numpy as np

    x = np.random.default_rng(0).normal(size=(64, 64)).astype("float32")
    y = np.random.default_rng(1).normal(size=(64, 4)).astype("float32")

    def train(name, devices=None, **kwargs):
        par = Parallel(name, devices=devices, seed=3, **kwargs)
        par.build(wide, optimizer="adam", loss="mse")
        initial = par.model.get_weights()
        par.fit(x, y, batch_size=32, epochs=2, verbose=0)
        return par, initial

    reference, reference_initial = train("single")
    par, initial = train("auto", 2, device_memory="1.1MiB")
    assert par.strategy == "model_parallel", par.explain()
    for got, want in zip(initial + par.model.get_weights(), reference_initial + reference.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_shard_parameters_when_only_sharded_parameters_fit_one_device():
    from paraml import estimate_memory

    def tall():  # eight equal units: a device holds its owner's share plus one unit's weights
        return keras.Sequential([keras.Input((64,)), *[keras.layers.Dense(128) for _ in range(8)]])

    both = estimate_memory(tall, batch_size=4, optimizer="adam", optimizer_shards=2, remat=True)
    owned = estimate_memory(tall, batch_size=4, optimizer="adam", optimizer_shards=2, zero_stage=3)
    assert owned.total < both.total and "largest unit's read where it runs" in owned.note
    states = [e.total - e.collectives for e in (owned, both)]  # what auto compares (AutoChoice._savings)
    par = Parallel("auto", devices=2, device_memory=sum(states) // 2, batch_size=8)
    par.build(tall, optimizer="adam", loss="mse")
    assert par.strategy == "mirrored" and par.backend.capabilities.zero_stage == 3, par.explain()
    assert "with shard_parameters=True" in par.explain() and "parameters, gradients and optimizer state sharded" in (
        par.explain()
    )
    placed = par.memory_by_device()  # the estimate's parameters: the owner's share plus the largest unit's
    assert max(b["parameters"] for b in placed.values()) <= owned.parameters
