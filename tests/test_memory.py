"""Tests for paraml.memory, paraml.planning.observe and paraml.planning.optimizers.

Expected byte counts are worked out by hand from the layer shapes, not by
calling the code under test.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from paraml.memory import MemoryEstimate, estimate_memory, layer_costs  # noqa: E402
from paraml.planning.observe import (  # noqa: E402
    build_on_host,
    model_units,
    observation_notes,
    observe_units,
    unit_costs,
)
from paraml.planning.optimizers import fresh_optimizer, optimizer_slots_per_param, slot_bytes  # noqa: E402
from paraml.planning.partition import LayerCost, plan_balanced  # noqa: E402
from paraml.planning.sizes import format_bytes, parse_size  # noqa: E402

F32 = 4  # bytes per float32

# ------------------------------------------------------------------------ sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (1024, 1024),
        ("1024", 1024),
        ("2GiB", 2 * 1024**3),
        ("2 GiB", 2 * 1024**3),
        ("2gib", 2 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1.5GB", 1_500_000_000),
        ("100kB", 100_000),
        ("100KB", 100_000),
        ("3KiB", 3072),
        ("1TB", 10**12),
        ("1TiB", 1024**4),
        ("7B", 7),
        ("7 b", 7),
        ("0.5KiB", 512),
        (" 1.5 mib ", 1572864),
        (".5KiB", 512),
        ("1e3", 1000),
    ],
)
def test_parse_size(text: int | str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("2 GiBs", r"unknown unit 'GiBs'.*KiB, MiB, GiB, TiB"),
        ("2XB", r"unknown unit 'XB'.*accepted units"),
        ("lots", r"cannot parse size 'lots'.*accepted units"),
        ("", r"cannot parse size ''"),
        ("1.5", r"'1.5' is not a whole number of bytes"),
        ("-1GiB", r"must be >= 0 bytes, got '-1GiB'"),
        (-5, r"must be >= 0 bytes, got -5"),
        (True, r"got True"),
        (1.5, r"got 1.5.*accepted units"),
        (None, r"got None"),
    ],
)
def test_parse_size_errors(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_size(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (1024**2 - 1, "1.00 MiB"),
        (2 * 1024**3, "2.00 GiB"),
        (5 * 1024**4, "5.00 TiB"),
        (-2048, "-2.00 KiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_format_and_parse_round_trip() -> None:
    for n in (1024, 3 * 1024**2, 2 * 1024**3):
        assert parse_size(format_bytes(n)) == n


# ------------------------------------------------------------------- optimizers


def _count_slots_by_hand(optimizer: keras.optimizers.Optimizer) -> float:
    """Slots per parameter for a (16, 16) float32 kernel, counted on Keras directly."""
    kernel = keras.Variable(np.zeros((16, 16), "float32"))
    optimizer.build([kernel])
    elements = sum(int(np.prod(v.shape)) for v in optimizer.variables if len(v.shape) > 0)
    return elements / 256


# Every entry of the documented table, checked against Keras itself.
SLOT_TABLE = [
    ("adam", keras.optimizers.Adam, {}, 2),
    ("adam", keras.optimizers.Adam, {"amsgrad": True}, 3),
    ("adamw", keras.optimizers.AdamW, {}, 2),
    ("adamw", keras.optimizers.AdamW, {"amsgrad": True}, 3),
    ("adamax", keras.optimizers.Adamax, {}, 2),
    ("nadam", keras.optimizers.Nadam, {}, 2),
    ("lamb", keras.optimizers.Lamb, {}, 2),
    ("lion", keras.optimizers.Lion, {}, 1),
    ("adagrad", keras.optimizers.Adagrad, {}, 1),
    ("rmsprop", keras.optimizers.RMSprop, {}, 1),
    ("rmsprop", keras.optimizers.RMSprop, {"momentum": 0.9}, 2),
    ("rmsprop", keras.optimizers.RMSprop, {"centered": True}, 2),
    ("rmsprop", keras.optimizers.RMSprop, {"momentum": 0.9, "centered": True}, 3),
    ("sgd", keras.optimizers.SGD, {}, 0),
    ("sgd", keras.optimizers.SGD, {"momentum": 0.9}, 1),
    ("sgd", keras.optimizers.SGD, {"momentum": 0.9, "nesterov": True}, 1),
    ("adadelta", keras.optimizers.Adadelta, {}, 2),
    ("ftrl", keras.optimizers.Ftrl, {}, 2),
    ("adafactor", keras.optimizers.Adafactor, {}, 1),
    ("muon", keras.optimizers.Muon, {}, 1),
    ("schedulefreeadamw", keras.optimizers.ScheduleFreeAdamW, {}, 2),
    ("adam", keras.optimizers.Adam, {"use_ema": True}, 3),
    ("sgd", keras.optimizers.SGD, {"gradient_accumulation_steps": 2}, 1),
]


@pytest.mark.parametrize(("name", "cls", "kwargs", "slots"), SLOT_TABLE)
def test_slots_per_param_matches_keras(name: str, cls: type, kwargs: dict, slots: int) -> None:
    assert round(_count_slots_by_hand(cls(**kwargs))) == slots
    assert optimizer_slots_per_param(cls(**kwargs)) == slots
    if not kwargs:  # the default configuration is what the name table holds
        assert optimizer_slots_per_param(name) == slots
        assert optimizer_slots_per_param(cls.__name__) == slots


def test_slots_per_param_loss_scale_optimizer_delegates() -> None:
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(amsgrad=True))
    assert optimizer_slots_per_param(lso) == 3


class _TwoSlotOptimizer(keras.optimizers.Optimizer):
    """A custom optimizer unknown to paraml's table: two slots per variable."""

    def build(self, variables):  # noqa: ANN001, ANN201
        super().build(variables)
        self.a = [self.add_variable_from_reference(v, "a") for v in variables]
        self.b = [self.add_variable_from_reference(v, "b") for v in variables]

    def update_step(self, gradient, variable, learning_rate):  # noqa: ANN001, ANN201
        variable.assign_sub(gradient * learning_rate)


def test_slots_per_param_unknown_optimizer_is_counted() -> None:
    assert optimizer_slots_per_param(_TwoSlotOptimizer(learning_rate=0.1)) == 2


def test_slots_per_param_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown optimizer 'adamz'.*adam, adamax"):
        optimizer_slots_per_param("adamz")


def test_slots_per_param_does_not_touch_the_given_optimizer() -> None:
    opt = keras.optimizers.Adam()
    optimizer_slots_per_param(opt)
    assert not opt.built


@pytest.mark.parametrize("name", ["adam", "Adam", "ADAM", " adam "])
def test_fresh_optimizer_name_is_case_insensitive(name: str) -> None:
    opt = fresh_optimizer(name)
    assert type(opt) is keras.optimizers.Adam
    assert not opt.built


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("schedule_free_adamw", "ScheduleFreeAdamW"),
        ("Lamb", "Lamb"),  # keras.optimizers.get does not know it by name
        ("rms-prop", "RMSprop"),
        ("sgd", "SGD"),
    ],
)
def test_fresh_optimizer_names_from_the_table(name: str, cls: str) -> None:
    assert type(fresh_optimizer(name)) is getattr(keras.optimizers, cls)


def test_fresh_optimizer_from_a_config_dict_leaves_the_dict_alone() -> None:
    config = {"class_name": "Adam", "config": {"learning_rate": 0.25}}
    opt = fresh_optimizer(config)
    assert type(opt) is keras.optimizers.Adam
    assert float(opt.learning_rate) == 0.25
    assert config == {"class_name": "Adam", "config": {"learning_rate": 0.25}}
    lamb = fresh_optimizer(keras.optimizers.serialize(keras.optimizers.Lamb(learning_rate=0.5)))
    assert type(lamb) is keras.optimizers.Lamb
    assert float(lamb.learning_rate) == 0.5


def test_fresh_optimizer_recreates_an_instance_with_its_config() -> None:
    opt = keras.optimizers.RMSprop(learning_rate=0.5, momentum=0.9, centered=True)
    fresh = fresh_optimizer(opt)
    assert fresh is not opt and type(fresh) is keras.optimizers.RMSprop
    assert (float(fresh.learning_rate), fresh.momentum, fresh.centered) == (0.5, 0.9, True)
    custom = fresh_optimizer(_TwoSlotOptimizer(learning_rate=0.1))
    assert type(custom) is _TwoSlotOptimizer


@pytest.mark.parametrize("identifier", ["adamz", None, 42, {"class_name": "nope", "config": {}}, keras.optimizers.Adam])
def test_fresh_optimizer_unknown(identifier: object) -> None:
    with pytest.raises(ValueError, match=r"^unknown optimizer .*known names: adadelta, .*, sgd"):
        fresh_optimizer(identifier)


def test_fresh_optimizer_bad_config_says_why() -> None:
    with pytest.raises(ValueError, match=r"invalid config for keras.optimizers.Adam in \{.*ValueError.*'bogus'"):
        fresh_optimizer({"class_name": "adam", "config": {"bogus": 1}})


def test_fresh_optimizer_under_a_strategy_scope() -> None:
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    given = keras.optimizers.Adam()  # made outside any scope
    with strategy.scope():
        model = _dense_model()
        opt = fresh_optimizer(given)
        opt.build(model.trainable_variables)
        assert opt.iterations.value.distribute_strategy is strategy
    assert not given.built


def test_slot_bytes_counts_slots_in_the_variables_dtype() -> None:
    kernel = keras.Variable(np.zeros((4, 3), "float16"))
    assert slot_bytes("adam", [kernel]) == 2 * 12 * 2
    assert slot_bytes(keras.optimizers.SGD(), [kernel]) == 0


# ----------------------------------------------------------------- models


def _dense_model() -> keras.Model:
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d1"), keras.layers.Dense(2, name="d2")])


DENSE_PARAMS = ((4 * 3 + 3) + (3 * 2 + 2)) * F32  # 92


def _conv_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(2, 3, name="conv"),
            keras.layers.Flatten(name="flat"),
            keras.layers.Dense(1, name="out"),
        ]
    )


CONV_PARAMS = ((3 * 3 * 1 * 2 + 2) + (6 * 6 * 2 * 1 + 1)) * F32  # (20 + 73) * 4


def _embedding_model() -> keras.Model:
    inputs = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(10, 4, name="emb")(inputs)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = keras.layers.Dense(1, name="out")(x)
    return keras.Model(inputs, outputs)


EMBEDDING_PARAMS = (10 * 4 + (4 * 1 + 1)) * F32  # 180


@pytest.mark.parametrize(
    ("build", "params"),
    [(_dense_model, DENSE_PARAMS), (_conv_model, CONV_PARAMS), (_embedding_model, EMBEDDING_PARAMS)],
    ids=["dense", "conv2d", "embedding"],
)
@pytest.mark.parametrize(
    ("optimizer", "slots"),
    [
        (lambda: "adam", 2),
        (keras.optimizers.Adam, 2),
        (lambda: keras.optimizers.SGD(momentum=0.9), 1),
        (lambda: "sgd", 0),
    ],
    ids=["adam-name", "adam", "sgd-momentum", "sgd"],
)
def test_parameter_and_slot_bytes_are_exact(build, params: int, optimizer, slots: int) -> None:  # noqa: ANN001
    est = estimate_memory(build(), batch_size=8, optimizer=optimizer())
    assert est.parameters == params
    assert est.gradients == params  # every variable is trainable
    assert est.optimizer_slots == slots * params
    assert est.total == est.parameters + est.gradients + est.optimizer_slots + est.activations
    assert est.note == ""


def test_slot_fallback_uses_slots_per_param() -> None:
    est = estimate_memory(_dense_model(), optimizer="adam", exact_slots=False)
    assert est.optimizer_slots == 2 * DENSE_PARAMS


def test_dense_activations() -> None:
    est = estimate_memory(_dense_model(), batch_size=5)
    # A Dense's gradient reads its input, not its output: d1's output is kept for d2's kernel gradient, counted with
    # d1 (which made it); the batch and the model's outputs (the loss reads them) are counted besides.
    assert est.activations == 5 * 4 * F32 + 5 * 3 * F32 + 5 * 2 * F32
    assert est.batch_size == 5
    assert est.per_layer == (
        ("d1", (4 * 3 + 3) * F32, 5 * 3 * F32),
        ("d2", (3 * 2 + 2) * F32, 0),
    )


def test_conv_and_embedding_activations() -> None:
    conv = estimate_memory(_conv_model(), batch_size=2)
    # the batch, Flatten's output (read by the Dense's kernel gradient) and the outputs
    assert conv.activations == 2 * (8 * 8 + 72 + 1) * F32  # Flatten's output is the conv's buffer, reshaped
    emb = estimate_memory(_embedding_model(), batch_size=3)
    per_layer = {name: activations for name, _, activations in emb.per_layer}
    # the lookup's gradient reads the token ids (int32), the Dense's its input (the pooled rows)
    assert per_layer == {"emb": 3 * 5 * 4, "pool": 3 * 4 * F32, "out": 0}


def test_non_trainable_variables_count_as_parameters_only() -> None:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization()])
    trainable = (4 * 3 + 3 + 3 + 3) * F32  # kernel, bias, gamma, beta
    frozen = (3 + 3) * F32  # moving mean and variance
    est = estimate_memory(model, optimizer="adam")
    assert est.parameters == trainable + frozen
    assert est.gradients == trainable
    assert est.optimizer_slots == 2 * trainable


def test_float16_variables_use_two_bytes() -> None:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype="float16")])
    est = estimate_memory(model, batch_size=2, optimizer="adam")
    assert est.parameters == (4 * 3 + 3) * 2
    assert est.optimizer_slots == 2 * (4 * 3 + 3) * 2  # slots follow the variable dtype
    # the float32 batch, its float16 copy (read by the kernel's gradient) and the float16 outputs
    assert est.activations == 2 * 4 * F32 + 2 * 4 * 2 + 2 * 3 * 2


def test_sharded_slots_are_the_fullest_devices() -> None:
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="a"), keras.layers.Dense(8, name="b")])
    full = estimate_memory(model, batch_size=2, optimizer="adam")
    halves = estimate_memory(model, batch_size=2, optimizer="adam", optimizer_shards=2)
    # kernels of 256 bytes go one to each device, the biases (32 bytes) one to each: half of Adam's slots each
    assert halves.optimizer_slots == full.optimizer_slots // 2
    assert halves.parameters == full.parameters and "2 shards" in halves.note
    with pytest.raises(ValueError, match="optimizer_shards must be an int >= 1"):
        estimate_memory(model, optimizer_shards=0)


def test_estimate_accepts_model_fn() -> None:
    est = estimate_memory(_dense_model, batch_size=4, optimizer="sgd")
    assert est.parameters == DENSE_PARAMS
    assert est.optimizer_slots == 0


def test_estimate_does_not_build_the_given_optimizer() -> None:
    opt = keras.optimizers.Adam()
    estimate_memory(_dense_model(), optimizer=opt)
    assert not opt.built


def test_subclassed_model_activations_are_measured_from_a_call() -> None:
    class Sub(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(3, name="inner")

        def call(self, x):  # noqa: ANN001, ANN201
            return keras.ops.relu(self.dense(x))

    model = Sub()
    model(np.zeros((1, 4), "float32"))
    est = estimate_memory(model, batch_size=5, optimizer="adam")
    assert est.parameters == (4 * 3 + 3) * F32
    assert est.optimizer_slots == 2 * (4 * 3 + 3) * F32
    assert est.per_layer == (("inner", (4 * 3 + 3) * F32, 5 * 3 * F32),)
    assert est.note == ""
    assert model.call.__func__ is Sub.call  # the observation left the model as it was


class _NeedsTwo(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.a = keras.layers.Dense(3, name="a")
        self.a.build((None, 4))

    def call(self, pair):  # noqa: ANN001, ANN201
        return self.a(pair[0]) + pair[1]


def _needs_two() -> keras.Model:
    """A subclassed model built with a shape it cannot actually be called with."""
    model = _NeedsTwo()
    model.build((2, 4))
    return model


def test_a_model_that_cannot_be_called_falls_back_to_declaration_order() -> None:
    model = _needs_two()
    est = estimate_memory(model, optimizer="sgd")
    assert [name for name, _, _ in est.per_layer] == ["a"]
    assert "could not be called on a probe batch" in est.note


def test_units_descend_into_nested_models_and_count_a_shared_layer_once() -> None:
    inner_in = keras.Input((4,))
    inner = keras.Model(inner_in, keras.layers.Dense(4, name="dense")(inner_in), name="backbone")
    inputs = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    h = shared(shared(inner(inputs)))
    model = keras.Model(inputs, keras.layers.Dense(2, name="dense")(h))
    obs = observe_units(model)
    assert [(u.name, u.calls) for u in obs.units] == [("backbone/dense", 1), ("shared", 2), ("dense", 1)]
    costs = layer_costs(model, batch_size=3)
    assert costs[1] == LayerCost("shared", (4 * 4 + 4) * F32, 2 * 3 * 4 * F32)  # params once, outputs of both calls
    assert [name for name, _ in model_units(model)] == ["backbone/dense", "shared", "dense"]


def test_unknown_dimensions_are_probed_and_noted() -> None:
    inputs = keras.Input((None, 4))
    model = keras.Model(inputs, keras.layers.Dense(2, activation="tanh", name="d")(inputs))
    est = estimate_memory(model, batch_size=1)
    # tanh's output, and the input as Keras' tensordot transposes it for the kernel's gradient
    assert est.per_layer == (("d", (4 * 2 + 2) * F32, 8 * (2 + 4) * F32),)
    assert "set to 8" in est.note
    sample = np.ones((1, 5, 4), "float32")
    given = estimate_memory(model, batch_size=3, sample=sample)
    assert given.per_layer == (("d", (4 * 2 + 2) * F32, 3 * 5 * (2 + 4) * F32),)
    assert "set to" not in given.note


def test_estimate_errors() -> None:
    with pytest.raises(ValueError, match="not built"):
        estimate_memory(keras.Sequential([keras.layers.Dense(2)]))
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        estimate_memory(_dense_model(), batch_size=0)
    with pytest.raises(ValueError, match="expected a keras.Model"):
        estimate_memory(42)
    with pytest.raises(ValueError, match="unknown optimizer 'nope'"):
        estimate_memory(_dense_model(), optimizer="nope")


def test_estimate_under_a_distribution_strategy() -> None:
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = _dense_model()
    est = estimate_memory(model, optimizer=keras.optimizers.Adam())
    assert est.optimizer_slots == 2 * DENSE_PARAMS


def test_str_and_as_dict() -> None:
    est = estimate_memory(_dense_model(), batch_size=5)
    text = str(est)
    for word in ("parameters", "gradients", "optimizer slots", "activations", "total", "d1", "d2"):
        assert word in text
    assert "batch size 5" in text
    assert format_bytes(est.total) in text
    d = est.as_dict()
    assert d["total"] == est.total
    assert d["parameters"] == DENSE_PARAMS
    assert d["per_layer"][0] == {"layer": "d1", "param_bytes": 60, "activation_bytes": 60}


def test_memory_estimate_total() -> None:
    est = MemoryEstimate(1, 2, 3, 4, batch_size=1)
    assert est.total == 10
    assert est.per_layer == ()


# ----------------------------------------------------------------- layer costs


def test_layer_costs_feed_the_planner() -> None:
    costs = layer_costs(_conv_model, batch_size=2)
    assert costs == [
        LayerCost("conv", (3 * 3 * 1 * 2 + 2) * F32, 2 * 6 * 6 * 2 * F32),  # Flatten reshapes this buffer
        LayerCost("flat", 0, 0),
        LayerCost("out", (72 + 1) * F32, 0),
    ]
    plan = plan_balanced(costs, 2, slots_per_param=optimizer_slots_per_param("adam"))
    assert [s.layers for s in plan.stages] == [("conv",), ("flat", "out")]


def test_layer_costs_skip_input_layers_of_functional_models() -> None:
    names = [c.name for c in layer_costs(_embedding_model(), batch_size=1)]
    assert names == ["emb", "pool", "out"]


def test_layer_costs_errors() -> None:
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got True"):
        layer_costs(_dense_model(), batch_size=True)
    with pytest.raises(ValueError, match="not built"):
        layer_costs(keras.Sequential([keras.layers.Dense(2)]), batch_size=1)


# ----------------------------------------------------------------- units


def test_unit_costs_scale_to_the_batch_and_match_the_estimate() -> None:
    model = _conv_model()
    observation = observe_units(model)
    costs = unit_costs(observation, 4)
    assert costs == [
        LayerCost("conv", (3 * 3 * 1 * 2 + 2) * F32, 4 * 6 * 6 * 2 * F32),  # Flatten reshapes this buffer
        LayerCost("flat", 0, 0),
        LayerCost("out", (72 + 1) * F32, 0),
    ]
    est = estimate_memory(model, batch_size=4)
    assert est.per_layer == tuple((c.name, c.param_bytes, c.activation_bytes) for c in costs)
    assert observation_notes(observation) == []
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        unit_costs(observation, 0)


def test_unit_costs_fall_back_to_symbolic_outputs_when_the_model_cannot_be_called() -> None:
    class Refuses(keras.layers.Layer):
        def call(self, x):  # noqa: ANN001, ANN201
            raise RuntimeError("no real data, please")

        def compute_output_shape(self, input_shape):  # noqa: ANN001, ANN201
            return input_shape  # so the functional model has a symbolic output for it

    inputs = keras.Input((4,))
    h = keras.layers.Dense(3, name="d")(inputs)
    model = keras.Model(inputs, Refuses(name="refuses")(h))
    observation = observe_units(model)
    assert observation.problem.startswith(f"model {model.name!r} could not be called on a probe batch (RuntimeError")
    assert unit_costs(observation, 5) == [
        LayerCost("d", (4 * 3 + 3) * F32, 5 * 3 * F32),
        LayerCost("refuses", 0, 5 * 3 * F32),
    ]
    assert observation_notes(observation) == [f"{observation.problem}: units in declaration order"]


def test_observation_notes_name_units_without_activations() -> None:
    model = _needs_two()
    observation = observe_units(model)
    assert unit_costs(observation, 3) == [LayerCost("a", (4 * 3 + 3) * F32, 0)]
    notes = observation_notes(observation)
    assert notes[0].endswith("units in declaration order")
    assert notes[1] == "activations unknown (counted as 0) for: a"


def test_build_on_host_records_variables_and_observes_once() -> None:
    host = build_on_host(_dense_model)
    assert [tuple(v.shape) for v in host.created] == [(4, 3), (3,), (3, 2), (2,)]
    assert all("CPU" in v.device for v in host.created)
    first = host.observe()
    assert [u.name for u in first.units] == ["d1", "d2"]
    assert host.observe() is first


def test_host_model_refuses_a_model_that_creates_variables_when_called() -> None:
    class Lazy(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.d = keras.layers.Dense(2, name="d")

        def build(self, input_shape):  # noqa: ANN001, ANN201
            self.w = self.add_weight(shape=(1,), name="w")  # a weight, but not the Dense's

        def call(self, x):  # noqa: ANN001, ANN201
            return self.d(x) * self.w

    def make() -> keras.Model:
        model = Lazy()
        model.build((None, 4))
        return model

    host = build_on_host(make)
    with pytest.raises(ValueError, match="created variables when it was first called"):
        host.observe()


@pytest.mark.parametrize("module", ["memory", "planning.observe", "planning.optimizers"])
def test_module_import_is_cheap(module: str) -> None:
    import subprocess
    import sys
    from pathlib import Path

    import paraml.memory

    package_dir = str(Path(paraml.memory.__file__).parent)
    code = (
        "import importlib, sys, types\n"
        "pkg = types.ModuleType('paraml_probe')\n"
        f"pkg.__path__ = [{package_dir!r}]\n"
        "sys.modules['paraml_probe'] = pkg\n"
        f"importlib.import_module('paraml_probe.{module}')\n"
        "bad = sorted(m for m in ('tensorflow', 'keras', 'numpy') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
