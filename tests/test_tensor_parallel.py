"""``model_parallel`` with ``tensor_parallel=T``: the Dense, attention and Embedding layers of each stage split over T
devices (Megatron-LM's column/row, heads and vocabulary splits), the model's face whole."""

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from conftest import logits_loss
from test_model_parallel import bert, bert_data, token_data, token_loss
from test_model_parallel import gpt2 as model_parallel_gpt2

from paraml import Parallel, estimate_memory
from paraml.memory import variable_bytes_by_device
from paraml.parallelism.tensor_parallel import plan_splits, sparse_categorical_crossentropy


def gpt2():
    """A 2-block keras_hub GPT-2 with 4 heads, no dropout (each device draws its heads' attention-dropout mask, so
    only without dropout are the numbers single's)."""
    return model_parallel_gpt2(num_layers=2, num_heads=4)


def mlp():
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(32),
            keras.layers.EinsumDense("ab,bc->ac", output_shape=48, bias_axes="c", activation="gelu"),
            keras.layers.EinsumDense("ab,bc->ac", output_shape=3),  # an EinsumDense that computes as a Dense
        ]
    )


def mlp_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 8)).astype("float32")  # 100 rows in batches of 32: a last batch of 4
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")


def trained(strategy, model_fn, data, loss, optimizer=None, **options):
    par = Parallel(strategy, seed=0, **options)
    par.build(model_fn, optimizer=optimizer or keras.optimizers.SGD(0.05), loss=loss)
    history = par.fit(*data, batch_size=8 if isinstance(data[0], dict) else 32, epochs=2, verbose=0)
    return par, history.history["loss"]


def assert_same_training(par, reference, got, want, x):
    np.testing.assert_allclose(got, want, rtol=1e-4)
    for a, b in zip(par.model.get_weights(), reference.model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(par.predict(x), reference.predict(x), rtol=1e-4, atol=1e-5)


def largest_share(par):
    """The largest share of the parameter bytes one device holds, as memory_by_device reports it and as the
    variables' devices show."""
    reported = {d: b["parameters"] for d, b in par.memory_by_device().items()}
    assert reported == variable_bytes_by_device(par.model.weights)
    placed: dict[str, int] = {}
    for v in par.model.weights:
        for part in getattr(v.value, "parts", [v.value]):
            device = "/device:" + part.device.split("device:")[-1]
            placed[device] = placed.get(device, 0) + part.numpy().nbytes
    assert placed == reported
    return max(reported.values()) / sum(reported.values())


@pytest.mark.parametrize(
    "model_fn, data, loss",
    [(mlp, mlp_data, logits_loss()), (gpt2, token_data, token_loss), (bert, bert_data, logits_loss())],
    ids=["mlp", "gpt2", "bert"],
)
@pytest.mark.slow
def test_tensor_parallel_over_two_devices_trains_as_single(model_fn, data, loss):
    reference, want = trained("single", model_fn, data(), loss)
    par, got = trained("model_parallel", model_fn, data(), loss, devices=2, tensor_parallel=2)
    assert_same_training(par, reference, got, want, data()[0])
    assert par.backend.topology.layout.tensor == 2 and par.backend.topology.layout.stages == 1
    assert largest_share(par) <= 0.6  # embeddings included
    kinds = {s.kind for s in par.backend.plan.splits.splits}
    assert kinds == ({"columns", "rows"} if model_fn is mlp else {"columns", "rows", "heads", "vocab"})


def llama():
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=100,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,  # grouped-query attention: 2 query heads per key/value head
        hidden_dim=32,
        intermediate_dim=64,
        dropout=0.0,
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


@pytest.mark.slow
def test_llama_with_grouped_query_attention_trains_as_single():
    cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference, want = trained("single", llama, token_data(), cross_entropy)
    par, got = trained("model_parallel", llama, token_data(), cross_entropy, devices=2, tensor_parallel=2)
    assert_same_training(par, reference, got, want, token_data()[0])
    kinds = {s.layer.split("/")[-1]: s.kind for s in par.backend.plan.splits.splits}
    assert kinds["self_attention"] == "heads" and kinds["token_embedding"] == "vocab"
    assert kinds["feedforward_gate_dense"] == "columns"  # gate * up between the layers: joined, then split again
    assert largest_share(par) <= 0.6


@pytest.mark.slow
def test_two_stages_of_two_tensor_shards_train_as_single():
    reference, want = trained("single", gpt2, token_data(), token_loss)
    par, got = trained("model_parallel", gpt2, token_data(), token_loss, devices=4, tensor_parallel=2, micro_batches=2)
    assert_same_training(par, reference, got, want, token_data()[0])
    assert par.backend.groups == ((tuple(par.devices[:2]), tuple(par.devices[2:])),)
    assert largest_share(par) <= 0.4
    text = par.describe()
    assert str(par.backend.topology.layout) == "1 data replica x 2 stages x 2 tensor shards"
    assert "self_attention: by attention heads" in text and "token_embedding: by vocabulary rows" in text


@pytest.mark.slow
def test_copies_of_a_tensor_parallel_pipeline_train_as_single():
    reference, want = trained("single", mlp, mlp_data(), logits_loss())
    par, got = trained("model_parallel", mlp, mlp_data(), logits_loss(), devices=4, tensor_parallel=2, data_parallel=2)
    assert_same_training(par, reference, got, want, mlp_data()[0])
    assert par.num_replicas == 2
    kernel = par.model.layers[0].kernel.value
    assert [[c.device[-5:] for c in part.values] for part in kernel.parts] == [["CPU:0", "CPU:2"], ["CPU:1", "CPU:3"]]


@pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer")  # a .keras file holds the parts' slots
@pytest.mark.slow
def test_a_tensor_parallel_model_saves_loads_and_restores_on_any_backend(tmp_path):
    x = token_data()[0]
    adam = keras.optimizers.Adam(0.01)
    par, _ = trained("model_parallel", gpt2, token_data(), token_loss, optimizer=adam, devices=2, tensor_parallel=2)
    reference, _ = trained("single", gpt2, token_data(), token_loss, optimizer=keras.optimizers.Adam(0.01))
    predicted = par.predict(x)

    par.model.save(tmp_path / "model.keras")  # a Keras file of whole tensors
    loaded = keras.models.load_model(tmp_path / "model.keras", compile=False)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), predicted, rtol=1e-5, atol=1e-6)

    par.save(tmp_path / "checkpoints")
    single = Parallel("single", seed=7)
    single.build(gpt2, optimizer=keras.optimizers.Adam(0.01), loss=token_loss)
    state = single.restore(tmp_path / "checkpoints")
    assert state.epoch == 2
    np.testing.assert_allclose(single.predict(x), predicted, rtol=1e-5, atol=1e-6)
    # The parts' Adam slots were saved joined: the same state as training under single from the same start.
    restored = [np.asarray(v) for v in single.model.optimizer.variables]
    own = [np.asarray(v) for v in reference.model.optimizer.variables]
    assert [a.shape for a in restored] == [a.shape for a in own]
    for a, b in zip(restored, own):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

    reference.save(tmp_path / "from_single")  # and back, into another split
    again = Parallel("model_parallel", devices=4, tensor_parallel=4, seed=3)
    again.build(gpt2, optimizer=keras.optimizers.Adam(0.01), loss=token_loss)
    again.restore(tmp_path / "from_single")
    np.testing.assert_allclose(again.predict(x), reference.predict(x), rtol=1e-5, atol=1e-6)


def big_embedding():
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(4000, 64, name="embedding")(inputs)  # 1 MB of parameters, 4 MB with Adam
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


def test_a_layer_larger_than_a_device_trains_when_split():
    options = dict(devices=2, device_memory="3MB", batch_size=8)
    with pytest.raises(ValueError, match=r"unit 'embedding' needs .* tensor_parallel=2"):
        Parallel("model_parallel", **options).build(big_embedding, optimizer="adam", loss=logits_loss())
    rng = np.random.default_rng(0)
    data = rng.integers(0, 4000, (64, 6)).astype("int32"), rng.integers(0, 3, 64).astype("int32")
    par = Parallel("model_parallel", tensor_parallel=2, seed=0, **options)
    par.build(big_embedding, optimizer="adam", loss=logits_loss())
    par.fit(*data, batch_size=8, epochs=1, verbose=0)
    reference = Parallel("single", seed=0)
    reference.build(big_embedding, optimizer="adam", loss=logits_loss())
    reference.fit(*data, batch_size=8, epochs=1, verbose=0)
    for a, b in zip(par.model.get_weights(), reference.model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_auto_splits_a_unit_larger_than_a_device():
    par = Parallel("auto", devices=2, device_memory="3MB", batch_size=8, seed=0)
    par.build(big_embedding, optimizer="adam", loss=logits_loss())
    assert par.backend.name == "model_parallel" and par.backend.tensor_parallel == 2
    assert "tensor_parallel=2" in par.explain()


def test_plan_pairs_columns_with_rows_and_says_what_stays_whole():
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(32, activation="relu", name="up"),
            keras.layers.Dense(8, name="down"),
            keras.layers.LayerNormalization(name="norm"),
            keras.layers.Dense(16, name="alone"),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(1, name="one"),
        ]
    )
    plan = plan_splits(model, 2)
    assert [(s.layer, s.kind) for s in plan.splits] == [("up", "columns"), ("down", "rows"), ("alone", "columns")]
    assert [w.split(" ")[0] for w in plan.whole] == ["norm", "one"]
    assert "fewer than tensor_parallel=2" in plan.whole[1]
    assert [s.kind for s in plan_splits(mlp(), 2).splits] == ["columns", "rows", "columns", "rows"]
    # every split width is even: the device holding most keeps half of each split variable's bytes
    assert plan.saved_bytes(model) == (8 * 32 + 32 + 32 * 8 + 8 * 16 + 16) * 4 // 2


@pytest.mark.parametrize(
    "strategy, options, message",
    [
        ("model_parallel", {"devices": 3, "tensor_parallel": 2}, r"devices=3 is not a multiple of .* tensor_parallel"),
        ("model_parallel", {"devices": 2, "tensor_parallel": 0}, r"tensor_parallel"),
        ("mirrored", {"tensor_parallel": 2}, r"tensor_parallel.*only 'model_parallel'"),
    ],
)
def test_bad_tensor_parallel_settings_fail_at_construction(strategy, options, message):
    with pytest.raises(ValueError, match=message):
        Parallel(strategy, **options)


def test_the_estimate_per_device_is_what_the_first_device_holds():
    par = Parallel("model_parallel", devices=2, tensor_parallel=2)
    par.build(mlp, optimizer="adam", loss="mse")
    held = par.memory_by_device()[par.devices[0]]
    estimate = estimate_memory(mlp, batch_size=8, optimizer="adam", tensor_parallel=2)
    whole = estimate_memory(mlp, batch_size=8, optimizer="adam")
    assert estimate.parameters == held["parameters"] < 0.6 * whole.parameters
    assert abs(estimate.optimizer_slots - held["optimizer"]) <= 16  # the step counter and learning rate
    assert "tensor-parallel" in estimate.note


def test_gradient_accumulation_keeps_each_parts_sums_on_its_device():
    def adam():
        return keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)

    reference, want = trained("single", mlp, mlp_data(), logits_loss(), optimizer=adam())
    par, got = trained("model_parallel", mlp, mlp_data(), logits_loss(), optimizer=adam(), devices=2, tensor_parallel=2)
    assert_same_training(par, reference, got, want, mlp_data()[0])
    accumulated = [a.device for a in par._trainer.step.accumulator.sums]
    parts = par.trained_variables
    assert accumulated == [v.value.device for v in parts]  # each part's on the part's device
    assert len(set(accumulated)) == 2


@pytest.mark.slow
def test_the_cross_entropy_of_split_logits_is_computed_on_the_slices():
    cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference, want = trained("single", gpt2, token_data(), cross_entropy)
    par, got = trained("model_parallel", gpt2, token_data(), cross_entropy, devices=2, tensor_parallel=2)
    assert par.model.loss.fn is sparse_categorical_crossentropy  # Keras' loss object, computed on the slices
    assert_same_training(par, reference, got, want, token_data()[0])

    x, y = (tf.nest.map_structure(lambda a: a[:8], part) for part in token_data())
    model, variables = par.model, par.trained_variables

    def consumed_logits(loss_fn):
        """Tensors of the whole logits' shape that an op of one traced training step reads."""

        @tf.function
        def step(x, y):
            loss = tf.reduce_mean(loss_fn(y, model(x, training=True), from_logits=True))
            return tf.gradients(loss, variables)

        graph = step.get_concrete_function(x, y).graph
        whole = [t for op in graph.get_operations() for t in op.outputs if t.shape.as_list() == [8, 16, 100]]
        assert whole  # the joined logits exist in the graph (for a consumer that needs them whole)...
        return [t.name for t in whole if t.consumers()]

    assert consumed_logits(sparse_categorical_crossentropy) == []  # ...and nothing reads them: never computed
    assert consumed_logits(keras.losses.sparse_categorical_crossentropy) != []  # Keras' own joins them

    logits = np.random.default_rng(0).normal(size=(4, 5)).astype("float32")  # not split: Keras' own numbers
    labels = np.array([0, 4, 2, 1])
    np.testing.assert_allclose(
        sparse_categorical_crossentropy(labels, logits, from_logits=True),
        keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True),
    )
