"""model_parallel on simulated devices: any keras.Model staged by its own call, parity with single, real placement,
balanced stages, clear errors at build."""

import itertools

import keras
import keras_hub
import numpy as np
import pytest
from conftest import logits_loss

from paraml import Parallel
from paraml.memory import layer_costs
from paraml.planning.partition import layer_cost


# -- models -------------------------------------------------------------------------------------------------------
def sequential():
    layers = [keras.layers.Dense(16, activation="relu", name=f"d{i}") for i in range(4)]
    return keras.Sequential([keras.Input((8,)), *layers, keras.layers.Dense(3, name="out")])


def with_skip():
    """A functional model whose skip connection crosses the stage boundary (d1 on stage 0 feeds add on stage 1)."""
    inputs = keras.Input((8,))
    h1 = keras.layers.Dense(16, activation="relu", name="d1")(inputs)
    h2 = keras.layers.Dense(16, activation="relu", name="d2")(h1)
    h3 = keras.layers.Dense(16, name="d3")(h2)
    added = keras.layers.Add(name="add")([h1, h3])
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(added))


def ops_between_layers():
    inputs = keras.Input((8,))
    h1 = keras.layers.Dense(16, name="h1")(inputs)
    h2 = keras.layers.Dense(16, name="h2")(inputs)
    h = keras.ops.relu(h1 + h2) * 0.5
    h = keras.layers.Dense(16, name="h3")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(keras.ops.tanh(h) + h))


def nested():
    body = keras.Input((8,))
    features = keras.layers.Dense(16, activation="relu", name="b1")(body)
    features = keras.layers.Dense(16, activation="relu", name="b2")(features)
    backbone = keras.Model(body, features, name="backbone")
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, name="head_hidden")(backbone(inputs))
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


def shared_layer():
    inputs = keras.Input((8,))
    dense = keras.layers.Dense(8, activation="tanh", name="shared")
    h = keras.layers.Dense(8, name="first")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(dense(dense(h))))


class Subclassed(keras.Model):
    def __init__(self) -> None:
        super().__init__(name="subclassed")
        self.first = keras.layers.Dense(16, activation="relu", name="first")
        self.second = keras.layers.Dense(16, name="second")
        self.out = keras.layers.Dense(3, name="out")

    def call(self, x, training=False):  # noqa: ANN001, ANN201
        h = self.first(x)
        return self.out(keras.ops.relu(self.second(h)) + h)


def subclassed():
    model = Subclassed()
    model(np.zeros((1, 8), "float32"))
    return model


def transformer():
    """A functional Transformer block: attention called as mha(x, x) with a mask, residuals, layer norms."""
    inputs = keras.Input((6, 8))
    h = keras.layers.Dense(16, name="embed")(inputs)
    mask = keras.ops.ones((6, 6), dtype="bool")
    attended = keras.layers.MultiHeadAttention(2, 8, name="mha")(h, h, attention_mask=mask)
    h = keras.layers.LayerNormalization(name="ln1")(h + attended)
    ffn = keras.layers.Dense(16, name="ffn2")(keras.layers.Dense(32, activation="relu", name="ffn1")(h))
    h = keras.layers.LayerNormalization(name="ln2")(h + ffn)
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(keras.layers.GlobalAveragePooling1D(name="pool")(h)))


def gpt2(num_layers=4, num_heads=2):
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=100,
        num_layers=num_layers,
        num_heads=num_heads,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=16,
        dropout=0.0,  # parity with micro-batches needs no dropout: each micro-batch would draw its own mask
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def bert():
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=100,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=16,
        dropout=0.0,
    )
    inputs = {name: keras.Input((None,), dtype="int32", name=name) for name in backbone.input}
    pooled = backbone(inputs)["pooled_output"]
    return keras.Model(inputs, keras.layers.Dense(2, name="classifier")(pooled))


def mobilenet():
    backbone = keras.applications.MobileNetV2(
        weights=None, alpha=0.35, input_shape=(32, 32, 3), include_top=False, pooling="avg"
    )
    inputs = keras.Input((32, 32, 3))
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(backbone(inputs)))


def token_loss(y_true, y_pred):  # noqa: ANN001, ANN201
    """Next-token cross-entropy, averaged over the sequence: one loss per sample."""
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True), axis=-1)


def dense_data(rows=32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 8)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")


def token_data():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 100, (24, 16)).astype("int32")
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}, rng.integers(0, 100, (24, 16)).astype("int32")


def bert_data():
    rng = np.random.default_rng(2)
    ids = rng.integers(1, 100, (24, 16)).astype("int32")
    lengths = rng.integers(4, 17, 24)
    mask = (np.arange(16)[None, :] < lengths[:, None]).astype("int32")  # real padding: masked positions
    x = {"token_ids": ids * mask, "segment_ids": np.zeros_like(ids), "padding_mask": mask}
    return x, (lengths > 10).astype("int32")


def image_data():
    rng = np.random.default_rng(3)
    return rng.normal(size=(16, 32, 32, 3)).astype("float32"), rng.integers(0, 3, 16).astype("int32")


def sequence_data():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(32, 6, 8)).astype("float32")
    return x, (x[:, 0, 0] > 0).astype("int32")


def build(strategy, model_fn, devices=None, optimizer=None, loss=None, **options):
    par = Parallel(strategy, devices=devices, seed=0, **options)
    par.build(model_fn, optimizer=optimizer or keras.optimizers.SGD(0.05), loss=loss or logits_loss())
    return par


def train(strategy, model_fn, data, loss=None, epochs=2, **options):
    par = build(strategy, model_fn, devices=2 if strategy == "model_parallel" else None, loss=loss, **options)
    history = par.fit(*data, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    return par, history.history["loss"]


def assert_same_training(model_fn, data, loss=None, micro_batches=(1, 2), epochs=2):
    reference, want = train("single", model_fn, data, loss, epochs)
    for m in micro_batches:
        par, got = train("model_parallel", model_fn, data, loss, epochs, micro_batches=m)
        np.testing.assert_allclose(got, want, rtol=1e-4, err_msg=f"loss history, micro_batches={m}")
        for a, b in zip(par.model.get_weights(), reference.model.get_weights(), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=f"weights, micro_batches={m}")
    return par


def unit_devices(par):
    """{variable id: the device of the stage of the unit that owns it}."""
    return {id(v): device for _, layer, device in par.backend.placement for v in layer.variables}


def assert_placed(par, max_share=None):
    """Every variable on exactly one stage device, the one of its unit's stage; both devices used."""
    owner = unit_devices(par)
    per_device = dict.fromkeys(par.devices, 0)
    for v in par.model.weights:
        on = [d for d in par.devices if v.value.device.endswith(d.replace("/device:", ""))]
        assert len(on) == 1, (v.path, v.value.device)
        if id(v) in owner:
            assert on[0] == owner[id(v)], (v.path, v.value.device, owner[id(v)])
        per_device[on[0]] += int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
    assert all(b > 0 for b in per_device.values()), per_device
    if max_share is not None:
        assert max(per_device.values()) <= max_share * sum(per_device.values()), per_device
    return per_device


# -- parity with single -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model_fn, data",
    [
        (sequential, dense_data),
        (with_skip, dense_data),
        (ops_between_layers, dense_data),
        (nested, dense_data),
        (shared_layer, dense_data),
        (transformer, sequence_data),
    ],
    ids=["sequential", "skip", "ops-between-layers", "nested", "shared-layer", "transformer"],
)
@pytest.mark.slow
def test_parity_with_single(model_fn, data):
    par = assert_same_training(model_fn, data())
    assert_placed(par)


@pytest.mark.slow
def test_parity_subclassed():
    par = assert_same_training(subclassed, dense_data())
    assert [s.layers for s in par.plan.stages] in ([("first",), ("second", "out")], [("first", "second"), ("out",)])


@pytest.mark.slow
def test_gpt2_causal_lm_parity_and_placement():
    par = assert_same_training(gpt2, token_data(), loss=token_loss)
    assert_placed(par)
    names = [name for s in par.plan.stages for name in s.layers]
    assert names.count("token_embedding") == 1  # the tied embedding (input and logits) is one unit
    assert sum(name.startswith("transformer_layer_") for name in names) == 4  # the backbone was descended into
    assert all(any(n.startswith("transformer_layer_") for n in s.layers) for s in par.plan.stages)


@pytest.mark.slow
def test_bert_classifier_parity_with_a_padding_mask():
    assert_same_training(bert, bert_data())


@pytest.mark.slow
def test_mobilenet_v2_parity_with_batch_norm_in_training():
    par = assert_same_training(mobilenet, image_data(), micro_batches=(1,), epochs=1)
    assert_placed(par)
    assert len([n for s in par.plan.stages for n in s.layers]) > 100  # the application was descended into


@pytest.mark.parametrize("model_fn", [gpt2, bert], ids=["gpt2", "bert"])
@pytest.mark.slow
def test_transformers_balance_their_parameters(model_fn):
    """Planned for the batch they train with and Adam: the larger device holds at most 60% of the parameters."""
    loss = token_loss if model_fn is gpt2 else logits_loss()
    par = build("model_parallel", model_fn, devices=2, optimizer="adam", batch_size=8, loss=loss)
    assert_placed(par, max_share=0.60)
    on = {v.value.device for v in par.model.optimizer.variables if len(v.shape) > 0}
    assert len(on) == 2  # Adam's slots follow their variables onto both devices


def test_same_seed_same_initial_weights_as_single():
    single = build("single", with_skip)
    staged = build("model_parallel", with_skip, devices=2)
    for a, b in zip(single.model.get_weights(), staged.model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_predict_and_evaluate_match_single():
    x, y = dense_data(40)
    reference = build("single", nested)
    staged = build("model_parallel", nested, devices=2, micro_batches=3)
    np.testing.assert_allclose(staged.predict(x, batch_size=16), reference.predict(x, batch_size=16), rtol=1e-5)
    assert staged.evaluate(x, y, batch_size=16)["loss"] == pytest.approx(
        reference.evaluate(x, y, batch_size=16)["loss"]
    )


def test_every_variable_of_stage_k_lives_on_device_k():
    par = build("model_parallel", sequential, devices=["CPU:1", "CPU:3"], optimizer="adam")
    stage_of = {name: s.index for s in par.plan.stages for name in s.layers}
    assert len(par.plan.stages) == 2
    for layer in par.model.layers:
        device = par.devices[stage_of[layer.name]]
        for v in layer.weights:
            assert v.value.device.endswith(device), (v.path, v.value.device, device)
    per_device = {d: sum(v.value.device.endswith(d) for v in par.model.optimizer.variables) for d in par.devices}
    assert all(count > 0 for count in per_device.values())


def big_among_small():
    layers = [keras.layers.Dense(8, name=f"s{i}") for i in range(3)]
    layers += [keras.layers.Dense(256, name="big"), keras.layers.Dense(8, name="after")]
    layers += [keras.layers.Dense(8, name=f"t{i}") for i in range(3)]
    return keras.Sequential([keras.Input((8,)), *layers])


@pytest.mark.parametrize("stages", [2, 3])
def test_balanced_is_no_worse_than_the_best_contiguous_split(stages):
    par = build("model_parallel", big_among_small, devices=stages, optimizer="adam")
    costs = [layer_cost(c, 2) for c in layer_costs(big_among_small(), batch_size=32)]
    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
        for cuts in itertools.combinations(range(1, len(costs)), stages - 1)
    )
    assert par.plan.largest_stage_bytes <= best
    assert "note: unit 'big' needs" in par.describe()  # one unit larger than a device's share is reported


def test_explicit_partitions_and_describe_names_the_units():
    par = build("model_parallel", sequential, devices=2, partition=[["d0"], ["d1", "d2", "d3", "out"]])
    assert [s.layers for s in par.plan.stages] == [("d0",), ("d1", "d2", "d3", "out")]
    even = build("model_parallel", sequential, devices=2, partition="even")
    assert [len(s.layers) for s in even.plan.stages] == [3, 2]
    bounds = build("model_parallel", sequential, devices=2, partition=[2])
    assert bounds.plan.stages[1].layers[0] == "d2"
    text = par.describe()
    assert "/device:CPU:0" in text and "/device:CPU:1" in text and "micro_batches=1" in text
    assert "stage 0 units: d0\n" in text and "stage 1 units: d1, d2, d3, out" in text


def test_nested_unit_names_are_the_layers_of_the_nested_model():
    par = build("model_parallel", nested, devices=2, partition=[["b1", "b2"], ["head_hidden", "head"]])
    assert [s.layers for s in par.plan.stages] == [("b1", "b2"), ("head_hidden", "head")]


# -- clear errors at build ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "partition, message",
    [
        ([["d0", "nope"], ["d1", "d2", "d3", "out"]], "'nope', which the model does not have.*'d0'"),
        ([["d0"], ["d1", "d2", "d3"]], "out"),
        ([["d0", "d1"], ["d1", "d2", "d3", "out"]], "d1"),
        ([["d1", "d0"], ["d2", "d3", "out"]], "order"),
        ("greedy", "greedy.*'balanced', 'even'"),
    ],
    ids=["unknown-unit", "left-out", "twice", "out-of-order", "unknown-name"],
)
def test_bad_partitions_name_the_problem(partition, message):
    par = Parallel("model_parallel", devices=2, partition=partition)
    with pytest.raises(ValueError, match=message):
        par.build(sequential, optimizer="sgd", loss=logits_loss())


def test_more_stages_than_units():
    par = Parallel("model_parallel", devices=4)
    with pytest.raises(ValueError, match=r"4 stages.*2 layers|2 layers.*4 stages"):
        par.build(
            lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(2)]), loss="mse"
        )


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_micro_batches(bad):
    with pytest.raises(ValueError, match=f"micro_batches must be an int >= 1, got {bad!r}"):
        Parallel("model_parallel", devices=2, micro_batches=bad)


def test_a_model_fn_that_builds_a_different_model_the_second_time():
    calls = []

    def changing():
        calls.append(1)
        width = 16 if len(calls) == 1 else 32
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(width), keras.layers.Dense(3)])

    with pytest.raises(ValueError, match="model_fn built a different model the second time"):
        Parallel("model_parallel", devices=2).build(changing, loss=logits_loss())

    def growing():
        calls.append(1)
        extra = [keras.layers.Dense(8)] * (len(calls) % 2 == 0)
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), *extra, keras.layers.Dense(3)])

    calls.clear()
    with pytest.raises(ValueError, match="model_fn built a different model the second time.*variables"):
        Parallel("model_parallel", devices=2).build(growing, loss=logits_loss())


def test_a_unit_larger_than_a_device_is_named_with_its_size():
    par = Parallel("model_parallel", devices=2, device_memory="64KiB")
    with pytest.raises(ValueError, match=r"unit 'big' needs .*KiB.*than a device's 64.00 KiB.*tensor_parallel=2"):
        par.build(big_among_small, optimizer="adam", loss="mse")


def test_a_model_without_weights_at_build_is_refused():
    with pytest.raises(ValueError, match="places the weights at build"):
        Parallel("model_parallel", devices=2).build(lambda: keras.Sequential([keras.layers.Dense(2)]), loss="mse")


def test_regularization_and_a_last_batch_smaller_than_micro_batches_match_single():
    def regularized():
        dense = [keras.layers.Dense(8, kernel_regularizer=keras.regularizers.L2(0.01), name=f"r{i}") for i in range(2)]
        return keras.Sequential([keras.Input((8,)), *dense, keras.layers.Dense(3, name="out")])

    # 33 rows: the last batch has 1 row, so 2 of its 3 micro-batches are empty (and skipped)
    assert_same_training(regularized, dense_data(33), micro_batches=(3,))


class _AddedLoss(keras.layers.Layer):
    """A VAE-style term: a loss the layer adds during its call."""

    def call(self, z):
        self.add_loss(1e-2 * keras.ops.mean(keras.ops.square(z)))
        return z


def _with_layer_losses():
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activity_regularizer=keras.regularizers.L2(1e-2))(inputs)
    return keras.Model(inputs, keras.layers.Dense(3)(_AddedLoss()(h)))


def test_losses_added_by_layers_under_micro_batches_equal_single():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(50, 6)).astype("float32"), rng.integers(0, 3, 50)  # 50: a short last batch of 2
    results = {}
    for strategy, devices, options in [("single", None, {}), ("model_parallel", 2, {"micro_batches": 2})]:
        par = Parallel(strategy, devices=devices, seed=0, **options)
        par.build(
            _with_layer_losses, optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        history = par.fit(x, y, batch_size=16, epochs=2, verbose=0, validation_data=(x, y))
        results[strategy] = (par.model.get_weights(), history.history, par.evaluate(x, y, batch_size=16))
    (weights, history, evaluated), (want_weights, want_history, want_evaluated) = results.values()
    for got, want in zip(weights, want_weights):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    for name in ("loss", "val_loss"):
        np.testing.assert_allclose(history[name], want_history[name], rtol=1e-5)
    assert evaluated["loss"] == pytest.approx(want_evaluated["loss"], rel=1e-5)
