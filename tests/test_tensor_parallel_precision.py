"""``tensor_parallel`` under mixed precision: a split layer's partial products are added in float32 and rounded once,
as one device's 16-bit matmul accumulates them (and as Megatron-LM reduces), so the split model computes what one
device computes, within the format's round-off."""

from collections.abc import Iterator

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

from paraml import Parallel
from paraml.parallelism.tensor_parallel import sparse_categorical_crossentropy


@pytest.fixture(autouse=True)
def float32_after() -> Iterator[None]:
    """Each test sets the global dtype policy it builds under; float32 again after it, whatever happens."""
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def gpt2() -> keras.Model:
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=512,
        num_layers=2,
        num_heads=4,
        hidden_dim=128,
        intermediate_dim=256,
        max_sequence_length=16,
        dropout=0.0,  # each device would draw its heads' dropout mask
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def token_data() -> tuple[dict[str, np.ndarray], np.ndarray]:
    """24 sequences of 6 to 16 tokens, padded to 16 (a real padding mask), and the next tokens as labels."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(6, 17, 24)
    mask = np.arange(16)[None, :] < lengths[:, None]
    ids = (rng.integers(1, 512, (24, 16)) * mask).astype("int32")
    return {"token_ids": ids, "padding_mask": mask}, np.roll(ids, -1, axis=1)


def built(policy: str, strategy: str, weights: list[np.ndarray] | None = None, **options: int) -> Parallel:
    """The GPT-2 built under the global ``policy`` (set here: Keras reads it when the layers are made)."""
    keras.mixed_precision.set_global_policy(policy)
    par = Parallel(strategy, seed=0, **options)
    par.build(gpt2, optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(True))
    if weights is not None:
        par.model.set_weights(weights)
    return par


def predicted(par: Parallel, x: dict[str, np.ndarray]) -> np.ndarray:
    return np.asarray(par.predict(x, batch_size=8, verbose=0), dtype="float64")


def largest(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(u - v).max()) for u, v in zip(a, b, strict=True))


@pytest.mark.slow
def test_gpt2_predictions_under_mixed_bfloat16_are_one_devices_within_round_off():
    x, _ = token_data()
    exact = built("float32", "single")
    weights = exact.model.get_weights()
    single = built("mixed_bfloat16", "single", weights)
    split = built("mixed_bfloat16", "model_parallel", weights, devices=2, tensor_parallel=2)
    assert split.model.backbone.compute_dtype == "bfloat16"
    assert {s.kind for s in split.backend.plan.splits.splits} == {"columns", "rows", "heads", "vocab"}

    want = predicted(single, x)
    round_off = np.abs(want - predicted(exact, x))  # bfloat16's own error on one device
    drift = np.abs(predicted(split, x) - want)
    # Max 2.3e-3 (round-off 4.2e-3): a rare last-place flip (another order of additions) carried through the
    # layers. Mean 2.3e-5 (round-off 6.7e-4); partials rounded to bfloat16 before the sum: 6.1e-4.
    assert drift.max() < 1e-2
    assert drift.max() < round_off.max()
    assert drift.mean() < 0.1 * round_off.mean()


@pytest.mark.slow
def test_gpt2_trained_under_mixed_bfloat16_stays_within_round_off_of_one_device():
    x, y = token_data()
    weights = None
    trained = {}
    for name, policy, options in [
        ("exact", "float32", {}),
        ("single", "mixed_bfloat16", {}),
        ("split", "mixed_bfloat16", {"devices": 2, "tensor_parallel": 2}),
    ]:
        par = built(policy, "model_parallel" if options else "single", weights, **options)
        weights = weights or par.model.get_weights()
        history = par.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)  # 6 steps of SGD
        trained[name] = (par.model.get_weights(), np.array(history.history["loss"]))

    (exact, exact_loss), (single, single_loss), (split, split_loss) = trained.values()
    assert largest(single, weights) > 1e-2  # the weights moved
    assert largest(split, single) <= largest(single, exact)  # 6.5e-5 and 1.0e-4
    assert np.abs(split_loss - single_loss).max() <= np.abs(single_loss - exact_loss).max()


def mlp() -> keras.Model:
    return keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(64, name="down")]
    )


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_rows_split_dense_under_mixed_precision_rounds_its_sum_once_as_keras(policy):
    keras.mixed_precision.set_global_policy(policy)
    split = Parallel("model_parallel", devices=2, tensor_parallel=2, seed=0)
    split.build(mlp, optimizer="sgd", loss="mse")
    assert [s.kind for s in split.backend.plan.splits.splits] == ["columns", "rows"]
    reference = mlp()  # plain Keras, one device, the same weights
    reference.set_weights(split.model.get_weights())

    x = np.random.default_rng(0).normal(size=(256, 64)).astype("float32")
    want = reference.predict(x, verbose=0)
    assert want.dtype == policy.removeprefix("mixed_")  # the unsplit layer's product and output dtype
    got = split.model.predict(x, verbose=0)
    assert got.dtype == want.dtype
    # One rounding of the whole sum, as Keras' single matmul: equal but for the order of additions (bfloat16: none
    # differ here, float16: 0.05%); rounding each partial to 16 bits before the sum changes 37% of the outputs.
    assert np.mean(got != want) < 1e-2


def test_the_cross_entropy_of_bfloat16_logit_slices_is_computed_in_float32():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    par = Parallel("model_parallel", devices=2, tensor_parallel=2, seed=0)
    par.build(
        lambda: keras.Sequential([keras.Input((32,)), keras.layers.Dense(1024, name="logits")]),  # split by columns
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    x = (8 * rng.normal(size=(64, 32))).astype("float32")  # logits of a few tens: large sums of exponentials
    labels = rng.integers(0, 1024, 64).astype("int32")

    @tf.function
    def losses(x: tf.Tensor, labels: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        logits = par.model(x)  # bfloat16, left in slices by the split layer
        return sparse_categorical_crossentropy(labels, logits, from_logits=True), logits

    loss, logits = losses(x, labels)
    assert logits.dtype == loss.dtype == tf.bfloat16  # in the logits' dtype, as Keras' own returns it
    wide = logits.numpy().astype("float64")
    shift = wide.max(axis=-1)
    exact = np.log(np.exp(wide - shift[:, None]).sum(axis=-1)) + shift - wide[np.arange(64), labels]
    # Within bfloat16's rounding of the result (half a unit in the last place: at most 2**-8 relative): computed in
    # float32, rounded once.
    np.testing.assert_allclose(loss.numpy().astype("float64"), exact, rtol=2.0**-8, atol=0)
