"""remat=True: every unit recomputes its activations in the backward pass, on every backend, with the same weights.

What it saves is measured in benchmarks/bench_memory.py (the allocator's peak, one configuration per process)."""

import keras
import keras_hub
import numpy as np
import pytest

from paraml import Parallel


def noisy_mlp() -> keras.Model:
    """Dropout (a seed state) and BatchNormalization (moving statistics): state the recompute must not disturb."""
    return keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(24, activation="gelu"),
            keras.layers.Dropout(0.3),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(3),
        ]
    )


def plain_mlp() -> keras.Model:
    layers = [keras.layers.Dense(24, activation="gelu"), keras.layers.LayerNormalization(), keras.layers.Dense(3)]
    return keras.Sequential([keras.Input((12,)), *layers])


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 12)).astype("float32")
    return x, x[:, :3] * 2.0


def train(strategy, devices, model_fn, remat, **options):
    par = Parallel(strategy, devices=devices, seed=4, remat=remat, **options)
    par.build(model_fn, optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    x, y = data()
    history = par.fit(x, y, batch_size=32, epochs=2, verbose=0)
    return par, history.history["loss"], par.model.get_weights()


@pytest.mark.parametrize(
    "strategy, devices, options",
    [("mirrored", 2, {}), ("central_storage", 2, {}), ("model_parallel", 2, {"micro_batches": 2})],
    ids=["mirrored", "central_storage", "model_parallel"],  # single: the transformer test below
)
@pytest.mark.slow
def test_remat_keeps_the_weights_with_dropout_and_batch_statistics(strategy, devices, options):
    _, plain_loss, plain = train(strategy, devices, noisy_mlp, False, **options)
    par, loss, weights = train(strategy, devices, noisy_mlp, True, **options)
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-5)
    for got, want in zip(weights, plain):  # the moving statistics included
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert "remat=True: 4 units recompute" in par.explain()


@pytest.mark.parametrize(
    "strategy, devices, options", [("mirrored", 2, {}), ("model_parallel", 2, {"micro_batches": 2})]
)
@pytest.mark.slow
def test_remat_on_other_backends_equals_single_without_it(strategy, devices, options):
    _, want_loss, want = train("single", None, plain_mlp, False)
    _, loss, weights = train(strategy, devices, plain_mlp, True, **options)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-4)
    for got, expected in zip(weights, want):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_remat_under_mixed_precision_recomputes_in_the_forward_pass_dtype():
    """The backward pass runs a unit's call again outside Keras' autocast scope: it must read float16 weights as the
    forward pass did (before, its MatMul got float32 weights and float16 inputs and failed to trace)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        found = [train("single", None, plain_mlp, remat) for remat in (False, True)]
    finally:
        keras.mixed_precision.set_global_policy("float32")
    (_, plain_loss, plain), (_, loss, weights) = found
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-3)
    for got, want in zip(weights, plain):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_remat_keeps_a_keras_hub_transformer_with_dropout_exact():
    def gpt2():
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=8
        )
        return keras.Model(backbone.input, keras.layers.Dense(50, name="lm_head")(backbone.output))

    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 50, (32, 8)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    results = []
    for remat in (False, True):
        par = Parallel("single", seed=2, remat=remat)
        par.build(gpt2, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        results.append(
            (par.fit(x, tokens, batch_size=16, epochs=1, verbose=0).history["loss"], par.model.get_weights())
        )
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5)
    for got, want in zip(results[1][1], results[0][1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class Counting(keras.layers.Layer):
    """A Dense that counts how often its computation is built (each trace of a forward pass)."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)
        self.calls = 0

    def call(self, x):
        self.calls += 1
        return self.dense(x)


def test_remat_runs_a_units_forward_again_for_its_gradient():
    def calls_in_one_fit(remat):
        counting = Counting()
        par = Parallel("single", remat=remat)
        par.build(lambda: keras.Sequential([keras.Input((12,)), counting]), optimizer="sgd", loss="mse")
        x, y = data()
        par.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)  # one training step: traced once
        return counting.calls

    assert calls_in_one_fit(True) == calls_in_one_fit(False) + 1  # the recompute in the gradient's trace


def test_remat_must_be_a_bool():
    with pytest.raises(ValueError, match="remat must be True or False, got 'yes'"):
        Parallel("single", remat="yes")
