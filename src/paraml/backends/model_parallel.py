"""``model_parallel``: a model too big for one device, split into stages of layers on different devices.

How it works, and why:

- **Placement.** ``model_fn`` creates its variables while it runs (a model that starts with ``keras.Input``), before
  any partition is known. So the model is built twice: once on the host to measure it and plan the stages, then
  again under a ``tf.variable_creator_scope`` that creates the i-th variable on the device of the stage that owns
  it, and the first build's weights are copied over (so the same seed gives the same initial weights as on every
  other backend). Only public APIs are used; ``model_fn`` must build the same model each time it is called.
- **Computation.** The model is run layer by layer in its own topological order, each layer under
  ``tf.device(stage)``: a layer's inputs may come from any earlier stage (skip connections and branches work), and
  TensorFlow copies a tensor once to each device that consumes it.
- **Pipelining.** With ``micro_batches=M`` each batch is split into M micro-batches that all go through the stages
  in one ``tf.function``. TensorFlow's dataflow executor runs an op as soon as its inputs are ready, so stage k works
  on micro-batch i while stage k+1 works on micro-batch i-1 (the GPipe schedule, without a hand-written scheduler).
  The gradient of the summed micro-batch losses is the accumulated gradient; one optimizer update per batch. When a
  batch does not divide by M, the first ``batch % M`` micro-batches get one sample more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

import keras
import tensorflow as tf

from ..memory import layer_costs, optimizer_slots_per_param
from ..partition import PartitionPlan, make_plan
from .base import Backend, DeviceSpec, Objective
from .registry import register

__all__ = ["ModelParallelBackend"]

#: Batch size used to estimate activations when planning stages (only the proportions between layers matter).
PLANNING_BATCH = 32


@register("model_parallel")
class ModelParallelBackend(Backend):
    """Layers split into contiguous stages, one per device, with micro-batch pipelining.

    Options: ``partition`` (``"balanced"``: minimise the largest stage's parameters + gradients + optimizer slots +
    activations; ``"even"``: the same number of layers per stage; a list of lists of layer names; a list of stage
    start indices) and ``micro_batches`` (default 1).

    >>> import keras
    >>> from paraml import Parallel
    >>> par = Parallel("model_parallel", devices=2, micro_batches=2)
    >>> _ = par.build(lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)]),
    ...               optimizer="sgd", loss="mse")
    >>> [stage.layers for stage in par.plan.stages]
    [('dense',), ('dense_1',)]
    """

    option_names = ("partition", "micro_batches")

    def __init__(self, devices: DeviceSpec = None, **options: Any) -> None:
        micro_batches = options.get("micro_batches", 1)
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
        partition = options.get("partition", "balanced")
        if not isinstance(partition, (str, list, tuple)):
            raise ValueError(
                f"partition must be 'balanced', 'even', a list of lists of layer names or a list of ints, "
                f"got {partition!r}"
            )
        super().__init__(devices, **options)
        self.micro_batches: int = micro_batches
        self.partition = partition
        self.plan: PartitionPlan | None = None
        self._program: list[tuple[keras.layers.Layer, str]] = []

    @property
    def num_replicas(self) -> int:
        return 1  # one copy of the model, spread over the devices

    def scope(self) -> AbstractContextManager[Any]:
        return nullcontext()

    # -- placement ----------------------------------------------------------------------------------------------------
    def build_model(self, model_fn: Callable[[], keras.Model], optimizer: Any = None) -> keras.Model:
        created: list[tf.Variable] = []

        def record(next_creator: Callable[..., tf.Variable], **kwargs: Any) -> tf.Variable:
            variable = next_creator(**kwargs)
            created.append(variable)
            return variable

        with tf.device("/device:CPU:0"), tf.variable_creator_scope(record):  # measure on the host
            probe = model_fn()
        if not isinstance(probe, keras.Model) or not probe.built:
            return probe  # the facade reports what is wrong with it
        layers = _compute_layers(probe)
        costs = layer_costs(probe, batch_size=PLANNING_BATCH)
        slots = optimizer_slots_per_param(optimizer) if optimizer is not None else 0
        self.plan = make_plan(costs, self.partition, len(self.devices), slots)
        owner = {id(v.value): layer.name for layer in layers for v in layer.variables}
        stage_device = {name: self.devices[s.index] for s in self.plan.stages for name in s.layers}
        devices = [stage_device.get(owner.get(id(v)), self.devices[0]) for v in created]

        count = iter(range(len(devices) + 1))

        def place(next_creator: Callable[..., tf.Variable], **kwargs: Any) -> tf.Variable:
            index = next(count)
            if index >= len(devices):
                raise RuntimeError("model_fn built a different model the second time: it must build the same one")
            with tf.device(devices[index]):
                return next_creator(**kwargs)

        with tf.variable_creator_scope(place):
            model = model_fn()
        if next(count) != len(devices):
            raise RuntimeError("model_fn built a different model the second time: it must build the same one")
        model.set_weights(probe.get_weights())
        # The second build may name its layers differently (Keras numbers auto-names per process): match by position.
        final_layers = _compute_layers(model)
        renamed = {old.name: new.name for old, new in zip(layers, final_layers)}
        self.plan = PartitionPlan(
            tuple(replace(s, layers=tuple(renamed[name] for name in s.layers)) for s in self.plan.stages)
        )
        self._program = [(new, stage_device[old.name]) for old, new in zip(layers, final_layers)]
        return model

    # -- data and execution (one replica: the whole batch goes through the stages) -------------------------------------
    def distribute(self, dataset: tf.data.Dataset) -> Iterable[Any]:
        return dataset

    def run(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        return fn(*args)

    def all_reduce_sum(self, value: tf.Tensor) -> tf.Tensor:
        return value

    def gather(self, value: Any) -> tf.Tensor:
        return value

    # -- computation ---------------------------------------------------------------------------------------------------
    def _staged_call(self, model: keras.Model, x: Any, training: bool) -> Any:
        """Run the model layer by layer, each layer on its stage's device."""
        flat_x = _match_inputs(model, x)
        values = {id(t): v for t, v in zip(model.inputs, flat_x)}
        for layer, device in self._program:
            with tf.device(device):
                args = tf.nest.map_structure(lambda t: values[id(t)], layer.input)
                outputs = layer(args, training=training)
            for symbolic, value in zip(tf.nest.flatten(layer.output), tf.nest.flatten(outputs)):
                values[id(symbolic)] = value
        result = [values[id(t)] for t in model.outputs]
        return result[0] if len(result) == 1 else result

    def _split(self, value: Any) -> list[Any]:
        """``value`` (a structure of batch-major tensors) as ``micro_batches`` parts; earlier parts take the rest."""
        rows = tf.shape(tf.nest.flatten(value)[0])[0]
        m = self.micro_batches
        sizes = rows // m + tf.cast(tf.range(m) < rows % m, tf.int32)
        parts = [tf.split(t, sizes, num=m) for t in tf.nest.flatten(value)]
        return [tf.nest.pack_sequence_as(value, [p[i] for p in parts]) for i in range(m)]

    def forward(self, model: keras.Model, x: Any, training: bool) -> Any:
        if self.micro_batches == 1:
            return self._staged_call(model, x, training)
        outputs = [self._staged_call(model, part, training) for part in self._split(x)]
        return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *outputs)

    def gradients(
        self, model: keras.Model, x: Any, y: Any, sample_weight: tf.Tensor, objective: Objective
    ) -> tuple[list[tf.Tensor], Any]:
        parts = (
            zip(self._split(x), self._split(y), self._split(sample_weight))
            if self.micro_batches > 1
            else [(x, y, sample_weight)]
        )
        with tf.GradientTape() as tape:
            outputs, losses = [], []
            for i, (x_part, y_part, w_part) in enumerate(parts):
                y_pred = self._staged_call(model, x_part, training=True)
                losses.append(objective(y_pred, y_part, w_part, i == 0))
                outputs.append(y_pred)
            total = tf.add_n(losses)
        y_pred = tf.nest.map_structure(lambda *p: tf.concat(p, axis=0), *outputs)
        return tape.gradient(total, model.trainable_variables), y_pred

    def describe(self) -> str:
        header = f"model_parallel on {len(self.devices)} device(s), micro_batches={self.micro_batches}"
        return header if self.plan is None else header + "\n" + self.plan.describe(self.devices)


def _compute_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The model's layers that compute, in topological order (input layers carry no computation)."""
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    # A functional model's config lists each layer's calls ("inbound_nodes"); a layer called twice has no single input.
    config = {c.get("name"): c.get("inbound_nodes", ()) for c in model.get_config().get("layers", ())}
    for layer in layers:
        nodes = config.get(layer.name, ())
        problem = "it is called more than once" if len(nodes) > 1 else None
        for node in nodes if isinstance(nodes, list) else ():
            if isinstance(node, dict) and (
                len(node.get("args", ())) > 1 or "__keras_tensor__" in str(node.get("kwargs"))
            ):
                problem = "it takes several tensor arguments, e.g. attention(query, value)"
        try:
            layer.input  # noqa: B018 - raises for a layer that was never called
        except (AttributeError, ValueError) as error:
            problem = str(error)
        if problem:
            raise ValueError(
                f"model_parallel runs a functional or Sequential model layer by layer; layer {layer.name!r} has no "
                f"single input ({problem}). Use each layer once with one input (a tensor or a list of tensors), "
                "or wrap the block in a custom layer."
            )
    return layers


def _match_inputs(model: keras.Model, x: Any) -> list[Any]:
    """``x`` (a tensor, a list or a dict keyed by input name) in the order of ``model.inputs``."""
    if isinstance(x, dict):
        names = [t.name for t in model.inputs]
        layer_names = [layer.name for layer in model.layers if isinstance(layer, keras.layers.InputLayer)]
        keys = names if all(n in x for n in names) else layer_names
        return [x[k] for k in keys]
    return tf.nest.flatten(x)
