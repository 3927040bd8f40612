"""``paraml.internals``: each access to Keras' or TensorFlow's internals, pinned against the installed versions.

When one of these fails after an upgrade of Keras or TensorFlow, its message names what changed and the name in
``paraml.internals`` to update; no other module of paraml reads those internals (tests/test_architecture.py).
Everything here is real Keras and TensorFlow: layers, optimizers, a ``MirroredStrategy`` over logical CPUs,
checkpoints written to disk.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from conftest import NUM_DEVICES  # noqa: E402

import paraml  # noqa: E402
from paraml import internals  # noqa: E402
from paraml.internals import (  # noqa: E402
    ALL_REDUCE_GRADIENTS,
    ALLOCATOR_STATS,
    DISTRIBUTED_UPDATE_STEP,
    EMA_OVERWRITE,
    EMA_UPDATE,
    SAVEABLE_METHODS,
    VARIABLE_VALUE_KEY,
    WEIGHT_DECAY,
    WEIGHT_DECAY_EXCLUSIONS,
    all_to_all,
    allocator_events,
    attention_projections,
    autocast,
    autocast_dtype,
    concat_with_masks,
    copy_weight_decay_exclusions,
    direct_sublayers,
    distributed_update_step,
    flatten_layers,
    has_distributed_update_step,
    keras_mask,
    keras_masks,
    optimizer_strategy,
    optimizer_variable_list,
    own_trainable_variables,
    read_xspace,
    replace_weight_decay,
    resource_variable,
    shift_collective_keys,
    start_graph_collection,
    state_unlocked,
    stop_graph_collection,
    tensor_list_element_dtype,
    trackable_base,
    untracked,
    uses_gate,
    while_body_graph,
)

DEVICES = paraml.simulate_devices(NUM_DEVICES)  # before anything touches TensorFlow's devices (as conftest.py)
VERSIONS = f"TensorFlow {tf.__version__}, Keras {keras.__version__}"


def changed(what: str, name: str) -> str:
    """The message of a pin that broke: the versions, what changed, and what to update."""
    return f"{VERSIONS}: {what}; paraml.internals.{name} must be updated (tested with TF 2.21, Keras 3.15)"


@pytest.fixture(scope="module")
def strategy() -> tf.distribute.MirroredStrategy:
    from paraml.backends.distribute import mirrored_strategy

    return mirrored_strategy(DEVICES[:2])  # on collective keys of its own (shift_collective_keys)


# -- the module itself ----------------------------------------------------------------------------------------------
def test_all_is_complete_and_each_name_says_what_it_reads():
    defined = {
        name
        for name, value in vars(internals).items()
        if not name.startswith("_")
        and (getattr(value, "__module__", None) == internals.__name__ or name.isupper())
        and not inspect.ismodule(value)
        and name not in ("TYPE_CHECKING", "annotations", "Any", "Callable")
    }
    assert set(internals.__all__) == defined, "paraml.internals.__all__ differs from the names the module defines"
    source = Path(internals.__file__).read_text()
    for name in internals.__all__:
        value = getattr(internals, name)
        if callable(value):
            assert inspect.getdoc(value), f"paraml.internals.{name} has no docstring"
        else:  # a constant: documented by a #: comment above it
            assert re.search(rf"#:.*\n(#:.*\n)*{name} = ", source), f"paraml.internals.{name} has no #: comment"
    notes = (Path(__file__).resolve().parents[1] / "docs" / "tensorflow-notes.md").read_text()
    section = notes.split("## Versions and internals", 1)[-1]
    missing = [name for name in internals.__all__ if f"`{name}`" not in section]
    assert not missing, f"docs/tensorflow-notes.md's 'Versions and internals' does not list {missing}"


def test_importing_it_is_cheap():
    import subprocess
    import sys

    code = (
        "import sys, paraml.internals\n"
        "bad = sorted(m for m in ('tensorflow', 'keras') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- Keras masks ----------------------------------------------------------------------------------------------------
def test_a_keras_mask_is_read_from_the_tensor():
    ids = tf.constant([[3, 1, 0], [2, 0, 0]])
    embedded = keras.layers.Embedding(5, 2, mask_zero=True)(ids)
    mask = keras_mask(embedded)
    assert mask is not None, changed(
        "Keras no longer keeps a layer output's mask in the tensor's _keras_mask", "keras_mask"
    )
    np.testing.assert_array_equal(mask.numpy(), ids.numpy() != 0)
    assert keras_mask(tf.constant(1.0)) is None
    masks = keras_masks({"a": embedded, "b": tf.constant(1.0)})
    assert masks[0] is mask and masks[1] is None


def test_a_joined_mask_is_the_one_keras_losses_read():
    y_pred = tf.constant([[1.0], [3.0]])
    joined = concat_with_masks([y_pred[:1], y_pred[1:]], [[tf.constant([True])], [tf.constant([False])]])
    np.testing.assert_array_equal(keras_mask(joined).numpy(), [True, False])
    loss = float(keras.losses.MeanSquaredError()(tf.zeros((2, 1)), joined))
    assert loss == pytest.approx(1.0), changed(
        f"a Keras loss no longer reads y_pred's mask from _keras_mask (got {loss}, 1.0 masked, 5.0 unmasked)",
        "concat_with_masks",
    )
    unmasked = concat_with_masks([y_pred[:1], y_pred[1:]], [[tf.constant([True])], [None]])
    assert keras_mask(unmasked) is None  # a part without a mask: none joined


# -- Keras' attribute tracking --------------------------------------------------------------------------------------
class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def _built_subclassed() -> keras.Model:
    model = _Subclassed()
    model(np.zeros((1, 3), "float32"))  # built at its first call; Keras then locks its state
    with pytest.raises(ValueError, match="cannot add new elements of state"):
        model.tracker = keras.metrics.Mean(name="refused")
    return model


def test_a_built_models_state_is_unlocked_for_a_block():
    model = _built_subclassed()
    with state_unlocked(model):
        model.tracker = keras.metrics.Mean(name="taken")
    assert "taken" in [m.name for m in model.metrics], changed(
        "a metric set on a model whose _tracker is unlocked is no longer tracked", "state_unlocked"
    )
    with pytest.raises(ValueError, match="cannot add new elements of state"):  # locked again, with Keras' message
        model.other = keras.metrics.Mean(name="after")
    unbuilt = _Subclassed()
    with state_unlocked(unbuilt):  # not locked: left as it is
        unbuilt.tracker = keras.metrics.Mean(name="free")
    unbuilt.later = keras.metrics.Mean(name="still_free")


def test_attributes_set_untracked_are_not_a_layers_state():
    model = _built_subclassed()
    with untracked():
        model.probe = keras.metrics.Mean(name="untracked")
    assert model.probe.name == "untracked"
    assert "untracked" not in [m.name for m in model.metrics], changed(
        "DotNotTrackScope no longer keeps an attribute out of a layer's tracked state", "untracked"
    )
    with pytest.raises(ValueError, match="cannot add new elements of state"):  # tracking on again afterwards
        model.other = keras.metrics.Mean(name="after")


# -- tf.distribute --------------------------------------------------------------------------------------------------
def test_collective_keys_shift_for_the_next_mirrored_strategy():
    assert hasattr(tf.distribute.MirroredStrategy, "_collective_key_base"), changed(
        "tf.distribute.MirroredStrategy has no class attribute _collective_key_base any more (several "
        "MirroredStrategy instances in one process would share collective group keys)",
        "shift_collective_keys",
    )
    before = tf.distribute.MirroredStrategy._collective_key_base
    assert shift_collective_keys(tf.distribute.MirroredStrategy, 1000)
    assert tf.distribute.MirroredStrategy._collective_key_base == before + 1000
    created = tf.distribute.MirroredStrategy(list(DEVICES[:3]))
    shift_collective_keys(tf.distribute.MirroredStrategy, 1000)  # later strategies keep off this one's keys
    assert getattr(created.extended, "_collective_key_base", None) == before + 1000, changed(
        "a new MirroredStrategy no longer takes its collective keys from the class's _collective_key_base",
        "shift_collective_keys",
    )
    assert created.reduce("SUM", created.run(lambda: tf.constant(1.0)), axis=None).numpy() == 3.0

    class NoKeys:
        pass

    assert not shift_collective_keys(NoKeys, 5) and not hasattr(NoKeys, "_collective_key_base")


def test_a_resource_variable_skips_the_strategy_creator(strategy):
    def plain_on_second(next_creator, **kwargs):
        del next_creator
        for mirrored_only in ("colocate_with", "use_resource", "experimental_batch_ndims"):
            kwargs.pop(mirrored_only, None)
        with tf.device(DEVICES[1]):
            return resource_variable(**kwargs)

    with strategy.scope():
        mirrored = tf.Variable(1.0)
        with tf.variable_creator_scope(plain_on_second):
            plain = tf.Variable(2.0)
    assert hasattr(mirrored, "values")  # the strategy's creator ran for the mirrored one
    assert isinstance(plain, tf.Variable) and not hasattr(plain, "values"), changed(
        f"ResourceVariable(...) inside a strategy's scope made a {type(plain).__name__}, not a plain variable",
        "resource_variable",
    )
    assert tf.DeviceSpec.from_string(plain.device).device_index == 1
    assert float(plain.numpy()) == 2.0


# -- Keras optimizers on TensorFlow -----------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", [keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.AdamW])
def test_keras_optimizers_update_through_the_strategy_in_one_method(optimizer):
    assert has_distributed_update_step(optimizer), changed(
        f"{optimizer.__name__} has no {DISTRIBUTED_UPDATE_STEP} (Keras' TensorFlow optimizer no longer hands each "
        "variable to the strategy there)",
        "DISTRIBUTED_UPDATE_STEP",
    )
    parameters = list(inspect.signature(distributed_update_step(optimizer)).parameters)
    assert parameters == ["self", "distribution", "grads_and_vars", "learning_rate"], changed(
        f"{optimizer.__name__}.{DISTRIBUTED_UPDATE_STEP} takes {parameters}", "distributed_update_step"
    )


def test_keras_calls_the_overridden_update_step_with_the_strategy(strategy):
    calls = []

    def recording(self, distribution, grads_and_vars, learning_rate):
        grads_and_vars = list(grads_and_vars)
        calls.append((distribution, len(grads_and_vars)))
        return distributed_update_step(keras.optimizers.SGD)(self, distribution, grads_and_vars, learning_rate)

    recorded = type("RecordedSGD", (keras.optimizers.SGD,), {DISTRIBUTED_UPDATE_STEP: recording})
    with strategy.scope():
        variable = keras.Variable(np.ones((2,), "float32"))
        optimizer = recorded(learning_rate=0.1)
        optimizer.build([variable])
    assert optimizer_strategy(optimizer) is strategy, changed(
        "a Keras optimizer no longer keeps the strategy it was created under in _distribution_strategy",
        "optimizer_strategy",
    )

    @tf.function
    def step():
        strategy.run(lambda: optimizer.apply_gradients([(tf.constant([1.0, 1.0]), variable)]))

    step()
    assert calls and calls[0][0] is strategy and calls[0][1] == 1, changed(
        f"apply_gradients under a strategy no longer calls {DISTRIBUTED_UPDATE_STEP}(distribution, grads_and_vars, "
        f"learning_rate) (calls: {calls})",
        "DISTRIBUTED_UPDATE_STEP",
    )
    for copy in variable.value.values:  # the gradients of 2 replicas summed: 1 - 0.1 * 2
        np.testing.assert_allclose(copy.numpy(), [0.8, 0.8], rtol=1e-6)


def test_keras_all_reduces_the_gradients_in_one_method_before_the_update_step(strategy):
    order = []

    def all_reduce(self, grads_and_vars):
        order.append("all-reduce")
        return getattr(keras.optimizers.SGD, ALL_REDUCE_GRADIENTS)(self, grads_and_vars)

    def update(self, distribution, grads_and_vars, learning_rate):
        order.append("update")
        return distributed_update_step(keras.optimizers.SGD)(self, distribution, grads_and_vars, learning_rate)

    recorded = type(
        "RecordedSGD", (keras.optimizers.SGD,), {ALL_REDUCE_GRADIENTS: all_reduce, DISTRIBUTED_UPDATE_STEP: update}
    )
    with strategy.scope():
        variable = keras.Variable(np.ones((2,), "float32"))
        optimizer = recorded(learning_rate=0.1)
        optimizer.build([variable])

    @tf.function
    def step():
        strategy.run(lambda: optimizer.apply_gradients([(tf.constant([1.0, 1.0]), variable)]))

    step()
    assert order == ["all-reduce"] * 2 + ["update"], changed(  # each replica all-reduces, then one update
        f"apply_gradients under a strategy no longer calls {ALL_REDUCE_GRADIENTS} then {DISTRIBUTED_UPDATE_STEP} "
        f"(called: {order})",
        "ALL_REDUCE_GRADIENTS",
    )


def test_keras_decays_weights_in_one_method_with_a_predicate():
    apply, use = WEIGHT_DECAY
    optimizer = keras.optimizers.AdamW(weight_decay=0.1)
    variable = keras.Variable(np.ones((2,), "float32"), name="kernel")
    optimizer.build([variable])
    assert list(inspect.signature(getattr(keras.optimizers.AdamW, apply)).parameters) == ["self", "variables"], changed(
        f"AdamW.{apply} no longer takes (variables)", "WEIGHT_DECAY"
    )
    assert getattr(optimizer, use)(variable.value) is True, changed(
        f"AdamW.{use}(variable) is not a predicate", "WEIGHT_DECAY"
    )
    optimizer.exclude_from_weight_decay(var_names=["kernel"])
    assert getattr(optimizer, use)(variable.value) is False, changed(
        f"AdamW.{use} does not read exclude_from_weight_decay", "WEIGHT_DECAY"
    )


def test_keras_keeps_weight_decay_exclusions_outside_the_config():
    optimizer = keras.optimizers.AdamW(weight_decay=0.1)
    kernel = keras.Variable(np.ones((2,), "float32"), name="kernel")
    bias = keras.Variable(np.ones((2,), "float32"), name="bias")
    optimizer.exclude_from_weight_decay(var_list=[kernel], var_names=["bias"])
    for name in WEIGHT_DECAY_EXCLUSIONS:
        assert getattr(optimizer, name, None), changed(f"AdamW no longer keeps exclusions in {name}", "WEIGHT_DECAY")
    plain = keras.optimizers.AdamW.from_config(optimizer.get_config())
    assert plain._use_weight_decay(bias.value), "the config now holds the exclusions: the copy can go"
    again = keras.optimizers.AdamW.from_config(optimizer.get_config())
    copy_weight_decay_exclusions(optimizer, again)
    assert not again._use_weight_decay(bias.value) and not again._use_weight_decay(kernel), changed(
        "copied exclusions no longer exclude", "WEIGHT_DECAY_EXCLUSIONS"
    )


def test_a_replaced_weight_decay_is_what_apply_gradients_calls():
    optimizer = keras.optimizers.AdamW(learning_rate=0.5, weight_decay=0.1)
    variable = keras.Variable(np.ones((2,), "float32"))
    decayed = []
    keras_decay = replace_weight_decay(optimizer, decayed.append)
    optimizer.apply_gradients([(np.zeros((2,), "float32"), variable)])
    assert len(decayed) == 1 and decayed[0][0] is variable, changed(
        f"apply_gradients no longer decays through {WEIGHT_DECAY[0]}", "WEIGHT_DECAY"
    )
    np.testing.assert_allclose(variable.numpy(), [1.0, 1.0])  # Keras' own decay did not run
    keras_decay([variable])
    np.testing.assert_allclose(variable.numpy(), [0.95, 0.95])  # 1 - 0.5 * 0.1


def test_keras_steps_and_overwrites_the_average_of_the_weights_in_two_methods():
    """EMA_UPDATE and EMA_OVERWRITE: ZeRO-3 makes both do nothing and does their work on each variable's owner."""
    calls = []

    class Recorded(keras.optimizers.SGD):
        pass

    for name in (EMA_UPDATE, EMA_OVERWRITE):
        original = getattr(keras.optimizers.SGD, name)

        def recorded(self, trainable_variables, name=name, original=original):
            calls.append(name)
            return original(self, trainable_variables)

        setattr(Recorded, name, recorded)
        assert list(inspect.signature(original).parameters) == ["self", "trainable_variables"], changed(
            f"Optimizer.{name} no longer takes (trainable_variables)",
            "EMA_UPDATE" if name == EMA_UPDATE else "EMA_OVERWRITE",
        )
    optimizer = Recorded(learning_rate=1.0, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=1)
    variable = keras.Variable(np.ones((2,), "float32"))
    optimizer.apply_gradients([(np.ones((2,), "float32"), variable)])
    assert calls == [EMA_UPDATE, EMA_OVERWRITE], changed(
        f"apply_gradients with use_ema no longer calls {EMA_UPDATE} then {EMA_OVERWRITE} (called: {calls})",
        "EMA_UPDATE",
    )


def test_an_all_to_all_on_the_strategys_launchers(strategy):
    @tf.function
    def exchange():
        def sent(context):  # replica r sends [10 r, 10 r + 1]: row j to replica j
            r = tf.cast(context.replica_id_in_sync_group, tf.float32)
            return tf.stack([[10 * r], [10 * r + 1]])

        values = strategy.experimental_distribute_values_from_function(sent)
        return [all_to_all(strategy, i, v) for i, v in enumerate(strategy.experimental_local_results(values))]

    got = [g.numpy().ravel().tolist() for g in exchange()]
    assert got == [[0.0, 10.0], [1.0, 11.0]], changed(
        f"CollectiveAllToAllV2 on the strategy's launchers exchanged {got}", "all_to_all"
    )


def test_the_autocast_scope_a_mixed_precision_layer_reads_its_variables_in():
    seen = []

    class Probe(keras.layers.Layer):
        def build(self, input_shape):
            self.w = self.add_weight(shape=(2,), initializer="ones")

        def call(self, x):
            seen.append(autocast_dtype())
            with autocast(None):  # nothing changes
                inner = self.w.value.dtype
            return x * self.w, inner

    probe = Probe(dtype="mixed_float16")
    probe(tf.ones((1, 2)))
    assert seen == ["float16"] and autocast_dtype() is None, changed(
        f"Layer.__call__ of a mixed_float16 layer entered an autocast scope of {seen}", "autocast_dtype"
    )
    variable = keras.Variable(np.ones((2,), "float32"))
    with autocast("float16"):
        assert keras.ops.convert_to_tensor(variable).dtype == "float16", changed(
            "AutocastScope('float16') no longer casts a float32 variable where it is read", "autocast"
        )
    assert keras.ops.convert_to_tensor(variable).dtype == "float32"


def test_an_optimizers_own_list_restores_variables_created_later(tmp_path):
    trained = keras.optimizers.SGD(0.1, momentum=0.9)
    trained.apply_gradients([(tf.constant([1.0, 2.0, 3.0]), keras.Variable(np.ones((3,), "float32")))])
    own = optimizer_variable_list(trained)
    assert own is not None and [id(v) for v in own] == [id(v) for v in trained.variables], changed(
        "a Keras optimizer no longer keeps its variables in _variables", "optimizer_variable_list"
    )
    assert isinstance(own, trackable_base())
    path = tf.train.Checkpoint(extra=own).write(str(tmp_path / "ckpt"))

    fresh = keras.optimizers.SGD(0.1, momentum=0.9)
    tf.train.Checkpoint(extra=optimizer_variable_list(fresh)).read(path)
    fresh.build([keras.Variable(np.ones((3,), "float32"))])  # the momentum is created after the restore
    for got, want in zip(fresh.variables, trained.variables, strict=True):
        np.testing.assert_allclose(
            got.numpy(),
            want.numpy(),
            err_msg=changed(
                f"{got.path} was not restored when the optimizer created it after a checkpoint read into _variables",
                "optimizer_variable_list",
            ),
        )


# -- TensorFlow checkpoints: the saveable protocol --------------------------------------------------------------------
def test_the_saveable_protocol_of_a_trackable():
    base = trackable_base()
    for method in SAVEABLE_METHODS:
        assert callable(getattr(base, method, None)), changed(
            f"TensorFlow's Trackable ({base.__module__}.{base.__qualname__}) has no {method}", "SAVEABLE_METHODS"
        )
    keys = set(tf.Variable(1.0)._serialize_to_tensors())
    assert keys == {VARIABLE_VALUE_KEY}, changed(f"a tf.Variable saves its value under {keys}", "VARIABLE_VALUE_KEY")


def test_a_whole_variable_saves_as_a_plain_variable_and_back(tmp_path):
    from paraml.parallelism.tensor_parallel import WholeVariable

    parts = [tf.Variable([[1.0], [2.0]]), tf.Variable([[3.0], [4.0]])]
    whole = WholeVariable(parts, axis=1, name="w")
    assert isinstance(whole, trackable_base())
    path = tf.train.Checkpoint(v=whole).write(str(tmp_path / "whole"))
    plain = tf.Variable(tf.zeros((2, 2)))
    tf.train.Checkpoint(v=plain).read(path).assert_consumed()
    np.testing.assert_array_equal(
        plain.numpy(),
        [[1.0, 3.0], [2.0, 4.0]],
        err_msg=changed(
            f"a Trackable's {SAVEABLE_METHODS[0]} is no longer what a TensorFlow checkpoint saves", "trackable_base"
        ),
    )

    path = tf.train.Checkpoint(v=tf.Variable([[5.0, 6.0], [7.0, 8.0]])).write(str(tmp_path / "plain"))
    tf.train.Checkpoint(v=whole).read(path).assert_consumed()
    np.testing.assert_array_equal(
        parts[1].numpy(),
        [[6.0], [8.0]],
        err_msg=changed(
            f"a Trackable's {SAVEABLE_METHODS[1]} is no longer what a TensorFlow checkpoint restores through",
            "trackable_base",
        ),
    )


# -- Keras layers -----------------------------------------------------------------------------------------------------
class _Scaled(keras.layers.Layer):
    """A layer with a weight of its own and a sublayer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(3)

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones")
        self.inner.build(input_shape)

    def call(self, x):
        return self.inner(x) * self.scale


def test_layers_nested_own_and_direct():
    inner = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(3)])
    scaled = _Scaled()
    model = keras.Sequential([keras.Input((2,)), inner, scaled])
    model.build((None, 2))
    every = flatten_layers(model)
    assert len(every) == len({id(layer) for layer in every}) and model not in every
    expected = {id(layer) for layer in (inner, *inner.layers, scaled, scaled.inner)}
    assert expected <= {id(layer) for layer in every}, changed(
        f"_flatten_layers(include_self=False, recursive=True) gave {[layer.name for layer in every]}",
        "flatten_layers",
    )
    dense = inner.layers[0]
    assert [id(v) for v in own_trainable_variables(dense)] == [id(dense.kernel), id(dense.bias)], changed(
        "a layer's own trainable variables are no longer in _trainable_variables", "own_trainable_variables"
    )
    assert [id(v) for v in own_trainable_variables(scaled)] == [id(scaled.scale)]  # not the sublayer's
    assert own_trainable_variables(model) == []
    assert [id(layer) for layer in direct_sublayers(scaled)] == [id(scaled.inner)], changed(
        "a layer's directly tracked sublayers are no longer in _layers", "direct_sublayers"
    )
    assert direct_sublayers(dense) == []
    assert {id(inner), id(scaled)} <= {id(layer) for layer in direct_sublayers(model)}


def _called(layer: keras.layers.Layer) -> keras.layers.Layer:
    x = np.zeros((1, 3, 8), "float32")
    layer(x, x)
    return layer


@pytest.mark.parametrize("gate", [False, True], ids=["plain", "gated"])
def test_multi_head_attention_projections(gate):
    layer = _called(keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, use_gate=gate))
    assert uses_gate(layer) is gate, changed("MultiHeadAttention no longer keeps use_gate in _use_gate", "uses_gate")
    projections = attention_projections(layer)
    roles = ["query", "key", "value", *(["gate"] if gate else []), "output"]
    assert projections is not None and list(projections) == roles, changed(
        "MultiHeadAttention no longer keeps its projections in _query_dense, _key_dense, _value_dense"
        f"{', _gate_dense' if gate else ''}, _output_dense",
        "attention_projections",
    )
    for role, dense in projections.items():
        assert isinstance(dense, keras.layers.EinsumDense) and len(dense.kernel.shape) == 3, changed(
            f"MultiHeadAttention's {role} projection is a {type(dense).__name__}", "attention_projections"
        )
        assert int(dense.kernel.shape[0 if role == "output" else 1]) == 2  # the heads' axis


def test_no_projections_for_other_layers():
    assert attention_projections(keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)) is None  # not built
    assert attention_projections(keras.layers.Dense(3)) is None
    assert not uses_gate(keras.layers.Dense(3))


def test_keras_hub_attention_classes_have_keras_projections():
    keras_hub = pytest.importorskip("keras_hub")
    from paraml.parallelism.tensor_parallel import ATTENTION_CLASSES

    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=50, num_layers=1, num_query_heads=4, num_key_value_heads=2, hidden_dim=16, intermediate_dim=32
    )
    found = {}
    for layer in flatten_layers(backbone):
        kind = type(layer)
        found.setdefault(f"{kind.__module__}.{kind.__qualname__}", layer)
    for name in ATTENTION_CLASSES:
        assert name in found, f"keras-hub {keras_hub.__version__}: no layer of class {name} in LlamaBackbone"
        projections = attention_projections(found[name])
        assert projections is not None and list(projections) == ["query", "key", "value", "output"], changed(
            f"keras-hub {keras_hub.__version__}'s {name} no longer keeps its projections in _query_dense, "
            "_key_dense, _value_dense, _output_dense",
            "attention_projections",
        )


# -- TensorFlow graphs ------------------------------------------------------------------------------------------------
def test_a_while_loops_body_and_accumulators():
    @tf.function(autograph=False)
    def gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            _, y = tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, tf.sin(y) * 2.0), (tf.constant(0), x))
        return tape.gradient(y, x)

    graph = gradient.get_concrete_function(tf.TensorSpec([4], tf.float32)).graph
    loops = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
    assert loops, f"{VERSIONS}: no While op in a traced tf.while_loop"
    body = while_body_graph(loops[0])
    assert body is not None and hasattr(body, "outputs"), changed(
        "a while_v2 op no longer carries its body's graph in _body_graph", "while_body_graph"
    )
    accumulators = [t for t in loops[0].outputs if t.dtype == tf.variant]
    assert accumulators, f"{VERSIONS}: a differentiated while loop has no TensorList accumulators"
    for handle in accumulators:
        assert tensor_list_element_dtype(handle) == tf.float32, changed(
            "a TensorList's handle data no longer gives its element dtype", "tensor_list_element_dtype"
        )
    assert while_body_graph(graph.get_operations()[0]) is None


# -- TensorFlow's record of a step ------------------------------------------------------------------------------------
def two_device_function():
    """A new function (so TensorFlow instantiates it at its next call) with one named matmul on each of 2 devices."""

    @tf.function
    def twice(a):
        with tf.device(DEVICES[0]):
            b = tf.matmul(a, a, name="on_first")
        with tf.device(DEVICES[1]):
            return tf.matmul(b, b, name="on_second")

    return twice


def test_graph_collection_records_each_nodes_device_when_a_function_is_instantiated():
    twice, a = two_device_function(), tf.ones((8, 8))
    start_graph_collection()
    try:
        twice(a)
    finally:
        graphs = stop_graph_collection()
    devices = {node.name: node.device for graph in graphs for node in graph.node}
    assert devices.get("on_first", "").endswith("device:CPU:0") and devices.get("on_second", "").endswith(
        "device:CPU:1"
    ), changed(
        "the partition graphs recorded at a function's first call no longer name each node's device",
        "stop_graph_collection",
    )
    start_graph_collection()
    twice(a)  # instantiated already: nothing is recorded again
    assert stop_graph_collection() == [], changed("graphs are recorded at every call", "stop_graph_collection")


def test_the_profilers_xspace_has_one_event_per_op_named_node_colon_type(tmp_path):
    twice, a = two_device_function(), tf.ones((64, 64))
    twice(a)
    tf.profiler.experimental.start(str(tmp_path))
    twice(a)
    tf.profiler.experimental.stop()
    (path,) = tmp_path.rglob("*.xplane.pb")
    space = read_xspace(path.read_bytes())
    names = {
        plane.event_metadata[event.metadata_id].name: event.duration_ps
        for plane in space.planes
        for line in plane.lines
        for event in line.events
    }
    ops = {name.split(":")[0] for name in names if name.split(":")[0] in ("on_first", "on_second")}
    assert ops == {"on_first", "on_second"}, changed(
        "the profile's op events are no longer named '<node>:<type>'", "read_xspace"
    )


# -- TensorFlow's allocators in a profile -----------------------------------------------------------------------------
def test_the_profile_records_each_allocation_with_its_node_bytes_address_and_bytes_in_use(tmp_path):
    @tf.function
    def buffers(a):
        with tf.device(DEVICES[1]):
            big = tf.add(a, 1.0, name="one_mib")  # 1 MiB: the CPU allocator records buffers of 256 KiB or more
            return tf.reduce_sum(big)

    a = tf.ones((512, 512))
    buffers(a)
    tf.profiler.experimental.start(str(tmp_path))
    buffers(a)
    tf.profiler.experimental.stop()
    (path,) = tmp_path.rglob("*.xplane.pb")
    space = read_xspace(path.read_bytes())
    found = {
        plane.stat_metadata[stat.metadata_id].name
        for plane in space.planes
        for line in plane.lines
        for event in line.events
        if plane.event_metadata[event.metadata_id].name in ("MemoryAllocation", "MemoryDeallocation")
        for stat in event.stats
    }
    missing = sorted(set(ALLOCATOR_STATS) - found)
    assert not missing, changed(f"the allocator's memory events have no stats {missing}", "ALLOCATOR_STATS")
    events = allocator_events(space)
    allocations = {e.op: e for e in events if not e.freed}
    assert "one_mib" in allocations, changed(
        f"the allocations no longer name their node in 'tf_op' (found {sorted(allocations)})", "allocator_events"
    )
    one_mib = allocations["one_mib"]
    assert one_mib.nbytes >= 512 * 512 * 4 and one_mib.address and one_mib.allocator, one_mib
    freed = [e for e in events if e.freed and (e.allocator, e.address) == (one_mib.allocator, one_mib.address)]
    assert freed and freed[0].nbytes == one_mib.nbytes, changed(
        "a deallocation no longer names its buffer", "AllocatorEvent"
    )
    by_allocator = [e for e in events if e.allocator == one_mib.allocator]
    for before, after in zip(by_allocator, by_allocator[1:]):  # each event moves the bytes in use by its own bytes
        assert after.in_use == before.in_use + (-after.nbytes if after.freed else after.nbytes), changed(
            "'bytes_allocated' is no longer the allocator's bytes in use after the event", "allocator_events"
        )
