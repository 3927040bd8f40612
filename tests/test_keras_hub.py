"""Models nobody here wrote: keras_hub backbones (tiny configs built from their classes, random weights, no download)
with their default dropout, trained as classifiers on several replicas."""

import keras
import keras_hub
import numpy as np
import pytest

from paraml import Parallel

SEQ, VOCAB = 8, 64


def bert_classifier():
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=SEQ
    )
    logits = keras.layers.Dense(2, name="head")(backbone.output["pooled_output"])
    return keras.Model(backbone.input, logits)


def gpt2_classifier():
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=SEQ
    )
    pooled = keras.layers.GlobalAveragePooling1D()(backbone.output)
    return keras.Model(backbone.input, keras.layers.Dense(2, name="head")(pooled))


def inputs(with_segments):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, (48, SEQ)).astype("int32")
    mask = np.ones((48, SEQ), "int32")
    mask[::3, -3:] = 0  # padded sequences
    x = {"token_ids": tokens * mask, "padding_mask": mask}
    if with_segments:
        x["segment_ids"] = np.zeros((48, SEQ), "int32")
    return x, (tokens[:, 0] > VOCAB // 2).astype("int32")


@pytest.mark.parametrize("make", [bert_classifier, gpt2_classifier], ids=["bert", "gpt2"])
# single: test_remat and test_model_parallel train these on one device; central_storage's Dropout and BatchNorm:
# test_keras_parity and test_remat
@pytest.mark.parametrize("strategy, devices", [("mirrored", 2)])
@pytest.mark.slow
def test_keras_hub_backbones_with_dropout_train(make, strategy, devices):
    x, y = inputs(make is bert_classifier)
    par = Parallel(strategy, devices=devices, seed=0)
    model = par.build(
        make,
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    before = [w.copy() for w in model.get_weights()]
    history = par.fit(x, y, batch_size=16, epochs=2, verbose=0).history
    assert np.isfinite(history["loss"]).all()
    assert any(np.max(np.abs(a - b)) > 0 for a, b in zip(model.get_weights(), before))
    # dropout is active in training: two training-mode calls differ, inference calls do not
    batch = {k: v[:4] for k, v in x.items()}
    assert np.max(np.abs(np.asarray(model(batch, training=True)) - np.asarray(model(batch, training=True)))) > 0
    np.testing.assert_allclose(par.predict(batch), np.asarray(model(batch, training=False)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make", [bert_classifier, gpt2_classifier], ids=["bert", "gpt2"])
def test_model_parallel_spreads_the_transformer_blocks_by_their_measured_activations(make):
    x, _ = inputs(make is bert_classifier)
    par = Parallel("model_parallel", devices=2, batch_size=48, sample=x)
    par.build(make, optimizer="adam", loss="sparse_categorical_crossentropy")
    stages = par.plan.stages
    blocks = [[name for name in stage.layers if name.startswith("transformer_layer")] for stage in stages]
    assert all(blocks), f"a stage without a transformer block: {blocks}"
    total = sum(stage.peak_bytes for stage in stages)
    shares = [stage.peak_bytes / total for stage in stages]
    assert all(0.4 <= share <= 0.6 for share in shares), shares
    assert all(stage.activation_bytes > stage.param_bytes for stage in stages)  # a block keeps more than it weighs
