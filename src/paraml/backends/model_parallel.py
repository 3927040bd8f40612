"""``model_parallel``: a model too big for one device, split into stages of units on different devices.

How it works, and why:

- **Units.** A unit is a layer that is not itself a model (:func:`paraml.planning.observe.model_units`): nested models
(a
  keras_hub backbone inside its task, a backbone inside backbone + head) are descended into, so a 12-layer
  transformer's blocks spread over the stages; a transformer block, an attention layer or a Dense is one unit. A
  layer called several times (a tied embedding) is one unit, counted once.
- **Order and sizes.** One training step of the model is traced on small batches with each unit's ``call`` wrapped
  (:func:`paraml.planning.observe.observe_units`): the order in which the units first run is the pipeline order, and the
  tensors each unit keeps for the backward pass (with ``remat=True``: when recomputed) are the activations the
  balanced planner weighs next to the parameters, gradients and optimizer slots. Option ``sample`` (a batch of
  inputs) gives the sequence length or image size when the model leaves them unknown.
- **Placement.** ``model_fn`` creates its variables while it runs, before any partition is known. So the model is
  built twice: once on the host to observe it and plan the stages (:func:`paraml.planning.observe.build_on_host`; under
  ``"auto"``, the build ``auto`` measured), then again under a ``tf.variable_creator_scope``
  that creates the i-th variable on the device of the stage whose unit owns it, and the first build's variables are
  copied over (so the same seed gives the same initial weights, and random-seed states, as on every other backend).
  ``model_fn`` must build the same model each time it is called; a different second model is refused at build.
- **Computation.** The model runs its own ``call``: Keras does what it always does (several tensor and keyword
  arguments, masks, keras ops between layers, nested, Sequential, functional and subclassed models), and each unit's
  ``call`` (an instance attribute set at build, a public method) runs under ``tf.device(stage)``. Ops between units
  run on the device of the enclosing scope; TensorFlow copies a tensor once to each device that consumes it.
- **Pipelining.** With ``micro_batches=M`` each batch is split into M micro-batches (every leaf of ``x``, ``y`` and
  the sample weights, along axis 0) that all go through the stages in one ``tf.function``. TensorFlow's dataflow
  executor runs an op as soon as its inputs are ready, so stage k works on micro-batch i while stage k+1 works on
  micro-batch i-1 (the GPipe schedule, without a hand-written scheduler). The gradient of the summed micro-batch
  losses is the accumulated gradient; one optimizer update per batch. When a batch does not divide by M, the first
  ``batch % M`` micro-batches get one sample more.
- **Copies of the pipeline.** The backend is a ``tf.distribute`` strategy with one replica per copy of the pipeline:
  ``OneDeviceStrategy`` for one, ``MirroredStrategy`` over the copies' first devices for ``data_parallel`` > 1,
  ``MultiWorkerMirroredStrategy`` with one replica per worker in a cluster. A variable creator entered before the
  strategy's scope moves copy r of each variable onto pipeline r's device of the variable's stage, and each unit
  runs on its stage's device of the pipeline of the replica being traced. So distributing the batches, the gradient
  all-reduce, the optimizer update and the checkpoints are the data-parallel backends' own.
- **Layers split over devices.** With ``tensor_parallel=T`` a stage spans T devices: the same creator makes each
  split weight's parts there (:mod:`paraml.parallelism.tensor_parallel` plans the splits on the first build), and the
  split
  layers' calls compute on the parts. A step spans devices, so its gradient is taken with ``tf.gradients``, which runs
  each gradient op on its forward op's device (a tape's would all run on the first device).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import keras
import tensorflow as tf

from paraml.backends.base import Capabilities, DeviceSpec, Layout, Objective, Topology
from paraml.backends.distribute import StrategyBackend, mirrored_strategy, multi_worker_strategy, workers
from paraml.backends.registry import register
from paraml.checks import check_choice, check_int
from paraml.cluster.detect import setup_tf_config
from paraml.devices import device_memory, resolve_devices
from paraml.internals import concat_with_masks, keras_masks
from paraml.parallelism.remat import recomputing
from paraml.parallelism.tensor_parallel import (
    SplitLayers,
    TensorPlan,
    WholeVariable,
    part_sizes,
    plan_splits,
    trained_variables,
)
from paraml.planning.observe import HostModel, build_on_host, model_units, nested_layers, observation_notes, unit_costs
from paraml.planning.optimizers import optimizer_slots_per_param
from paraml.planning.partition import LayerCost, PartitionPlan, Stage, layer_cost, make_plan
from paraml.planning.schedules import SCHEDULES, Schedule
from paraml.planning.sizes import format_bytes, parse_size

__all__ = ["ModelParallelBackend"]

#: Default batch size the activations are estimated for when planning stages (option ``batch_size``).
PLANNING_BATCH = 32

#: A unit whose cost exceeds this share of a perfect 1/K split keeps the stages from balancing: describe() says so.
UNBALANCED_SHARE = 1.0


@register("model_parallel")
class ModelParallelBackend(StrategyBackend):
    """Units (layers; nested models descended into) split into contiguous stages, one per device, with micro-batches.

    Options: ``partition`` (``"balanced"``: minimise the largest stage's parameters + gradients + optimizer slots +
    activations; ``"even"``: the same number of units per stage; a list of lists of unit names; a list of stage
    start indices), ``micro_batches`` (default 1), ``batch_size`` (the batch the activations are estimated for when
    planning, default 32: the training batch is not known at build), ``sample`` (a batch of inputs, any number of
    rows: the sequence length or image size the activations are measured at, when the model leaves them unknown),
    ``device_memory`` (``"16GiB"``, bytes, or None: what TensorFlow tells; a unit or a stage larger than that is
    refused at build) and ``data_parallel`` (default 1: R copies of the pipeline, each on ``devices / R`` devices and
    its slice of the global batch, their gradients all-reduced) and ``tensor_parallel`` (default 1: each stage on T
    devices, its Dense, attention and Embedding layers split over them, :mod:`paraml.parallelism.tensor_parallel`;
    devices =
    data_parallel x stages x T). In a cluster of several workers (``TF_CONFIG`` or a scheduler's variables) each
    worker runs one pipeline over its devices and the workers are its copies.

    >>> import keras
    >>> from paraml import Parallel
    >>> par = Parallel("model_parallel", devices=2, micro_batches=2)
    >>> _ = par.build(lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)]),
    ...               optimizer="sgd", loss="mse")
    >>> [stage.layers for stage in par.plan.stages]
    [('dense',), ('dense_1',)]
    """

    option_names = (
        "partition",
        "micro_batches",
        "schedule",
        "device_memory",
        "batch_size",
        "sample",
        "data_parallel",
        "tensor_parallel",
    )
    capabilities = Capabilities(
        builds_on_first_batch=False,  # variables are placed at build, so the model must have them then
        xla_problem="under model_parallel one step spans several devices, and an XLA computation runs on one",
        colocates_gradients=True,  # each stage's (and part's) backward pass on its own device
    )

    def __init__(self, devices: DeviceSpec = None, **options: Any) -> None:
        self.micro_batches: int = check_int("micro_batches", options.get("micro_batches", 1))
        partition = options.get("partition", "balanced")
        if not isinstance(partition, (str, list, tuple)):
            raise ValueError(
                f"partition must be 'balanced', 'even', a list of lists of unit names or a list of ints, "
                f"got {partition!r}"
            )
        self.batch_size: int = check_int("batch_size", options.get("batch_size", PLANNING_BATCH))
        self.sample: Any = options.get("sample")
        schedule = check_choice("schedule", options.get("schedule", "gpipe"), SCHEDULES)
        memory = options.get("device_memory")
        self.data_parallel: int = check_int("data_parallel", options.get("data_parallel", 1))
        self.tensor_parallel: int = check_int("tensor_parallel", options.get("tensor_parallel", 1))
        cluster = setup_tf_config()  # TF_CONFIG, else set from a scheduler's variables (paraml.cluster.detect)
        #: Whether this process is one worker of a cluster: its pipeline is data parallel with the other workers'.
        self.in_cluster: bool = cluster is not None and cluster.num_workers > 1
        #: ``groups[r][s]``: the ``tensor_parallel`` devices of stage ``s`` of this worker's pipeline ``r``, and
        #: ``grid[r][s]`` the first of them, where the stage's whole layers live (set by ``make_strategy``).
        self.groups: tuple[tuple[tuple[str, ...], ...], ...] = ()
        self.grid: tuple[tuple[str, ...], ...] = ()
        self._components: Iterator[str] | None = None  # the devices of the variable being placed, one per pipeline
        super().__init__(devices, **options)
        self.partition = partition
        self.device_memory: int | None = None if memory is None else parse_size(memory)
        stages = len(self.grid[0])
        #: The pipeline schedule (:mod:`paraml.planning.schedules`): printable, and the rule the stages' gates follow.
        self.schedule = Schedule(schedule, stages, self.micro_batches)
        # Under 1F1B, (stage, micro-batch) -> the ops of that micro-batch's backward pass on that stage, and the
        # micro-batch being traced: a stage's forward pass waits for the backward pass the schedule names.
        self._backward_done: dict[tuple[int, int], Any] = {}
        self._tracing: int | None = None
        self._variable_stage: dict[int, int] = {}  # id of a variable's value -> the stage it lives on
        if schedule == "1f1b":
            # Each micro-batch's gradient is taken on its own; a gate cannot reach into a tf.cond's branch.
            self.capabilities = replace(
                self.capabilities,
                skips_empty_replicas=False,
                loss_scaling_problem="schedule='1f1b' takes each micro-batch's gradient before the loss scale "
                "applies, so float16 gradients could underflow; use schedule='gpipe'",
            )
        if self.micro_batches > 1:
            self.capabilities = replace(
                self.capabilities,
                own_train_step_problem=f"micro_batches={self.micro_batches} pipelines parts of each batch, while a "
                "model's own train_step takes the whole batch and applies its update itself; use micro_batches=1",
            )
        if self.tensor_parallel > 1:
            self.capabilities = replace(
                self.capabilities,
                own_train_step_problem=f"tensor_parallel={self.tensor_parallel} trains the parts of each split "
                "weight, while a model's own train_step takes gradients with respect to model.trainable_variables, "
                "which read them whole; use tensor_parallel=1",
            )
        self.plan: PartitionPlan | None = None
        #: Which layers are split over each stage's devices, and how (``tensor_parallel`` > 1, after build).
        self.tensor_plan: TensorPlan | None = None
        #: The final model's units and the device each runs on, in pipeline order.
        self.placement: list[tuple[str, keras.layers.Layer, str]] = []
        self.notes: list[str] = []

    def make_strategy(self, devices: DeviceSpec) -> tf.distribute.Strategy:
        """One replica per pipeline: ``OneDeviceStrategy`` for one, ``MirroredStrategy`` over the pipelines' first
        devices for ``data_parallel`` > 1, ``MultiWorkerMirroredStrategy`` (one replica per worker) in a cluster.
        A replica's variables live on its pipeline's stage devices (:meth:`scope`), not on the replica's device."""
        if self.in_cluster:
            if self.data_parallel != 1:
                raise ValueError(
                    f"data_parallel={self.data_parallel} in a cluster of several workers: each worker "
                    "runs one pipeline over its devices and the workers are its data-parallel copies; use "
                    "data_parallel=1 (the default)"
                )
            strategy = multi_worker_strategy({}, "model_parallel", one_replica=True)  # before the devices are listed
            self._arrange(resolve_devices(devices))
            return strategy
        self._arrange(resolve_devices(devices))
        resolved = [d for pipeline in self.grid for d in pipeline]
        if self.data_parallel == 1:
            return tf.distribute.OneDeviceStrategy(resolved[0])
        return mirrored_strategy([pipeline[0] for pipeline in self.grid])

    def _arrange(self, devices: list[str]) -> None:
        """Share ``devices`` (this worker's) as ``data_parallel`` pipelines of stages of ``tensor_parallel`` devices."""
        per_stage, copies = self.tensor_parallel, self.data_parallel
        if len(devices) % (per_stage * copies):
            product = per_stage * copies
            times = f" x tensor_parallel={per_stage} = {product}" if per_stage > 1 else ""
            raise ValueError(
                f"devices={len(devices)} is not a multiple of data_parallel={copies}{times}: each copy of the "
                "pipeline takes the same number of devices (devices = data_parallel x stages x tensor_parallel); "
                f"use {len(devices) - len(devices) % product or product} devices, or another data_parallel or "
                "tensor_parallel"
            )
        stages = len(devices) // (per_stage * copies)
        groups = [tuple(devices[i : i + per_stage]) for i in range(0, len(devices), per_stage)]
        self.groups = tuple(tuple(groups[r * stages : (r + 1) * stages]) for r in range(copies))
        self.grid = tuple(tuple(group[0] for group in pipeline) for pipeline in self.groups)

    def make_topology(self) -> Topology:
        """This worker's devices (every pipeline's); one data replica per pipeline, over all workers."""
        devices = tuple(d for pipeline in self.groups for group in pipeline for d in group)
        layout = Layout(
            data=int(self.strategy.num_replicas_in_sync), stages=len(self.grid[0]), tensor=self.tensor_parallel
        )
        topology = Topology(devices, layout)
        return replace(topology, **workers(self.strategy)) if self.in_cluster else topology

    @property
    def stage_devices(self) -> tuple[str, ...]:
        """The devices of this worker's first pipeline, stage after stage (the others are its copies)."""
        return self.grid[0]

    @contextlib.contextmanager
    def scope(self) -> Iterator[Any]:
        # The strategy makes one copy of a variable per replica, on the replica's device; a creator below it (entered
        # first, so the strategy's creator calls it once per copy) moves each copy to its pipeline's stage device.
        def on_stage_devices(next_creator: Callable[..., tf.Variable], **kwargs: Any) -> tf.Variable:
            device = next(self._components, None) if self._components is not None else None
            if device is None:  # not a model variable (an optimizer slot follows its variable; a step counter)
                return next_creator(**kwargs)
            with tf.device(device):
                return next_creator(**kwargs)

        with tf.variable_creator_scope(on_stage_devices), self.strategy.scope() as strategy:
            yield strategy

    def distribute(self, dataset: tf.data.Dataset) -> Iterable[Any]:
        if self.topology.num_replicas == 1:
            return dataset  # one pipeline takes the whole batch
        return super().distribute(dataset)

    def stage_device(self, stage: int) -> str:
        """The device of ``stage`` for the replica being traced (its pipeline's), or of the first pipeline."""
        return self.stage_group(stage)[0]

    def stage_group(self, stage: int) -> tuple[str, ...]:
        """The ``tensor_parallel`` devices of ``stage`` for the replica being traced, or of the first pipeline."""
        context = tf.distribute.get_replica_context()
        replica = tf.get_static_value(context.replica_id_in_sync_group) if context is not None else 0
        return self.groups[int(replica or 0) % len(self.groups)][stage]

    # -- placement ----------------------------------------------------------------------------------------------------
    def build_model(
        self,
        model_fn: Callable[[], keras.Model],
        optimizer: Any = None,
        host_model: HostModel | None = None,
        remat: bool = False,
    ) -> keras.Model:
        host = host_model if host_model is not None else build_on_host(model_fn)
        probe, created = host.model, host.created
        if not isinstance(probe, keras.Model) or not probe.built or not probe.weights:
            return probe  # the facade reports what is wrong with it
        observation = host.observe(sample=self.sample, recompute=recomputing if remat else None)
        if not observation.units:
            raise ValueError(f"model {probe.name!r} has no layers to place on stages")
        self.notes = observation_notes(observation)
        slots = optimizer_slots_per_param(optimizer) if optimizer is not None else 0
        costs = unit_costs(observation, self.batch_size, remat=remat)
        tensor_plan = plan_splits(probe, self.tensor_parallel, self.sample) if self.tensor_parallel > 1 else None
        if tensor_plan is not None:  # a device of a stage holds 1/T of each split variable (activations: whole)
            t = self.tensor_parallel
            shared = {u.name: tensor_plan.split_bytes(u.layer) * (t - 1) // t for u in observation.units}
            costs = [replace(c, param_bytes=c.param_bytes - shared.get(c.name, 0)) for c in costs]
        devices = self.stage_devices
        self.plan = make_plan(costs, self.partition, len(devices), slots)
        self._check_fits(costs, slots)

        stage_device = {name: devices[s.index] for s in self.plan.stages for name in s.layers}
        owner = {id(v.value): u.name for u in observation.units for v in u.layer.variables}
        placed_on = [stage_device.get(owner.get(id(v)), devices[0]) for v in created]
        stage_of = {device: index for index, device in enumerate(devices)}
        axes = {} if tensor_plan is None else tensor_plan.axes
        split_axis = {id(v.value): axes[id(v)] for v in probe.weights if id(v) in axes}
        count = iter(range(len(placed_on) + 1))
        different = (
            "model_fn built a different model the second time ({}): it must build the same model on every call "
            "(model_parallel calls it twice: once to plan the stages, once to place the variables)"
        )

        def place(next_creator: Callable[..., tf.Variable], **kwargs: Any) -> tf.Variable:
            index = next(count)
            if index >= len(placed_on):
                raise ValueError(different.format(f"more than the {len(placed_on)} variables of the first"))
            stage = stage_of[placed_on[index]]
            axis = split_axis.get(id(created[index]))
            if axis is not None:
                return self._split_variable(next_creator, kwargs, stage, tuple(created[index].shape), axis)
            self._components = iter([pipeline[stage] for pipeline in self.grid])  # one copy per pipeline
            try:
                return next_creator(**kwargs)
            finally:
                self._components = None

        with self.scope(), tf.variable_creator_scope(place):
            model = model_fn()
        made = next(count)
        if made != len(placed_on):
            raise ValueError(different.format(f"{made} variables instead of {len(placed_on)}"))
        final_units = model_units(model)
        probe_units = model_units(probe)
        if _signature(final_units) != _signature(probe_units):
            raise ValueError(different.format("its layers differ in kind or in variable shapes"))
        for target, source in zip(model.variables, probe.variables):  # weights and random-seed states
            target.assign(source)
        # The second build may name its layers differently (Keras numbers auto-names per process): match by position.
        renamed = {old: new for (old, _), (new, _) in zip(probe_units, final_units)}
        self.notes = [  # named as the final model names its units
            re.sub(r"unit '([^']+)'", lambda m: f"unit {renamed.get(m.group(1), m.group(1))!r}", note)
            for note in self.notes
        ]
        by_name = dict(final_units)
        order = [renamed[u.name] for u in observation.units]
        self.plan = PartitionPlan(
            tuple(
                Stage(s.index, tuple(renamed[n] for n in s.layers), s.param_bytes, s.state_bytes, s.activation_bytes)
                for s in self.plan.stages
            )
        )
        device_of = {renamed[name]: device for name, device in stage_device.items()}
        self.placement = [(name, by_name[name], device_of[name]) for name in order]
        if tensor_plan is not None:
            self._split_layers(tensor_plan.moved_to(probe, model), model, stage_of)
        self._variable_stage = {  # the parts of split variables by their own
            id(v.value): stage_of[d] for _, layer, d in self.placement for v in trained_variables(layer)
        }
        for _, layer, device in self.placement:
            stage = stage_of[device]
            _stage_call(layer, lambda stage=stage: self.stage_device(stage), lambda stage=stage: self._gate(stage))
        return model

    def _split_layers(self, plan: TensorPlan, model: keras.Model, stage_of: dict[str, int]) -> None:
        """Make ``plan``'s split layers of ``model`` compute on their parts, on their stage's devices."""
        self.tensor_plan = plan
        stage_of_layer: dict[int, int] = {}
        for _, layer, device in self.placement:
            for sub in nested_layers(layer):
                stage_of_layer.setdefault(id(sub), stage_of[device])
        SplitLayers(plan, lambda layer: self.stage_group(stage_of_layer[id(layer)])).attach(model)

    def _split_variable(
        self, next_creator: Callable[..., Any], kwargs: dict[str, Any], stage: int, shape: tuple[int, ...], axis: int
    ) -> Any:
        """A variable of ``shape`` split on ``axis`` over ``stage``'s devices: its parts (each made by the creators
        below, one copy per pipeline), behind a :class:`paraml.parallelism.tensor_parallel.WholeVariable`. The parts
        start at
        zero: the first build's values are assigned next."""
        parts = []
        name = kwargs.get("name") or "variable"
        for k, size in enumerate(part_sizes(shape[axis], self.tensor_parallel)):
            part_shape = list(shape)
            part_shape[axis] = size
            self._components = iter([pipeline[stage][k] for pipeline in self.groups])
            try:
                dtype = kwargs.get("dtype") or "float32"
                initial = {"initial_value": tf.zeros(part_shape, dtype), "name": f"{name}_part{k}", "shape": None}
                parts.append(next_creator(**{**kwargs, **initial}))
            finally:
                self._components = None
        return WholeVariable(parts, axis, name)

    def _gate(self, stage: int) -> list[Any]:
        """What ``stage``'s forward pass of the micro-batch being traced waits for (1F1B), or nothing."""
        if self._tracing is None:
            return []
        earlier = self.schedule.waits_for(stage, self._tracing)
        done = self._backward_done.get((stage, earlier)) if earlier is not None else None
        return [] if done is None else [done]

    def _check_fits(self, costs: list[LayerCost], slots: int) -> None:
        """Refuse (at build) a unit or a stage larger than a device; note a unit that keeps stages from balancing."""
        assert self.plan is not None
        sizes = [(c.name, layer_cost(c, slots)) for c in costs]
        devices = self.stage_devices
        memory = self.device_memory
        if memory is None:
            known = [device_memory(d) for d in devices]
            memory = min(known) if known and all(m is not None for m in known) else None
        share = sum(size for _, size in sizes) / len(devices)
        name, size = max(sizes, key=lambda item: item[1])
        what = (
            f"unit {name!r} needs {format_bytes(size)} (parameters, gradients, optimizer slots and activations "
            f"for a batch of {self.batch_size})"
        )
        t = self.tensor_parallel
        if memory is not None and size > memory:
            if t > 1:
                raise ValueError(
                    f"{what} on each of its stage's {t} devices with its Dense, attention and Embedding layers "
                    f"split over them (tensor_parallel={t}), more than a device's {format_bytes(memory)}: use a larger "
                    "tensor_parallel or devices with more memory"
                )
            raise ValueError(
                f"{what}, more than a device's {format_bytes(memory)}: model_parallel places each unit (a layer) on "
                "one stage's devices. Split its Dense, attention and Embedding layers over several devices with "
                "tensor_parallel=2 (or more), or use devices with more memory"
            )
        if memory is not None and self.plan.largest_stage_bytes > memory:
            raise ValueError(
                f"the largest stage needs {format_bytes(self.plan.largest_stage_bytes)}, more than a device's "
                f"{format_bytes(memory)}: the model does not fit on {len(devices)} device(s); use more devices"
            )
        if len(devices) > 1 and size > share * UNBALANCED_SHARE:
            self.notes.append(
                f"{what}, more than a device's share {format_bytes(round(share))}: the stages cannot balance better "
                + ("(tensor_parallel=2 would split its layers over devices)" if t == 1 else "")
            )

    # -- computation ---------------------------------------------------------------------------------------------------
    def _split(self, value: Any, rows: tf.Tensor) -> list[Any]:
        """``value`` (a structure of batch-major tensors, or None) as ``micro_batches`` parts of ``rows`` in all."""
        m = self.micro_batches
        sizes = rows // m + tf.cast(tf.range(m) < rows % m, rows.dtype)
        leaves = tf.nest.flatten(value)
        parts = [[None] * m if t is None else tf.split(t, sizes, num=m) for t in leaves]
        return [tf.nest.pack_sequence_as(value, [p[i] for p in parts]) for i in range(m)]

    def _parts(self, *values: Any) -> list[tuple[Any, ...]]:
        if self.micro_batches == 1:
            return [values]
        first = next(t for t in tf.nest.flatten(values) if t is not None)
        rows = tf.shape(first, out_type=tf.int32)[0]
        return list(zip(*(self._split(v, rows) for v in values)))

    def _run(
        self, model: keras.Model, parts: list[tuple[Any, ...]], training: bool, objective: Objective | None
    ) -> Any:
        """Each part through the model (and ``objective``); returns (the joined outputs, the summed loss parts).

        A part after the first is empty when the batch has fewer rows than ``micro_batches`` (a short last batch):
        it is skipped (in a ``tf.cond`` when its size is known only at run time), as an empty batch would feed NaN
        into layers such as BatchNormalization. The joined outputs keep the parts' Keras masks.
        """
        outputs, masks, losses = [], [], []
        for i, (x_part, *rest) in enumerate(parts):

            def step(x_part: Any = x_part, rest: list[Any] = rest) -> tuple[Any, list[tf.Tensor], tf.Tensor]:
                y_pred = model(x_part, training=training)
                loss = tf.zeros(()) if objective is None else objective(x_part, rest[0], y_pred, rest[1])
                return y_pred, [m for m in keras_masks(y_pred) if m is not None], loss

            if i == 0:
                y_pred, mask, loss = step()
                present = [m is not None for m in keras_masks(y_pred)]
            else:
                first = next(t for t in tf.nest.flatten(x_part) if t is not None)
                static = first.shape[0]
                if static == 0:
                    continue
                if static is None and self.capabilities.skips_empty_replicas:
                    empty = tf.nest.map_structure(lambda t: t[:0], (outputs[0], masks[0]))
                    y_pred, mask, loss = tf.cond(
                        tf.shape(first)[0] > 0, step, lambda empty=empty: (*empty, tf.zeros_like(losses[0]))
                    )
                else:
                    y_pred, mask, loss = step()
            outputs.append(y_pred)
            masks.append(mask)
            losses.append(loss)
        if len(outputs) == 1:
            return outputs[0], losses[0]
        # A tf.cond's outputs carry no mask: the parts' masks travel beside them, in the order of the outputs.
        full = [[next(given) if has else None for has in present] for given in map(iter, masks)]
        return concat_with_masks(outputs, full), tf.add_n(losses)

    def forward(self, model: keras.Model, x: Any, training: bool) -> Any:
        return self._run(model, self._parts(x, None, None), training, None)[0]

    def loss(
        self, model: keras.Model, x: Any, y: Any, sample_weight: Any, objective: Objective, training: bool
    ) -> tuple[tf.Tensor, Any]:
        parts = self._parts(x, y, sample_weight)
        if training and self.schedule.kind == "1f1b" and len(parts) > 1:
            return self._one_forward_one_backward(model, parts, objective)
        y_pred, total = self._run(model, parts, training, objective)
        return total, y_pred

    @tf.autograph.experimental.do_not_convert  # a Python loop over the micro-batches, traced as written
    def _one_forward_one_backward(
        self, model: keras.Model, parts: list[tuple[Any, ...]], objective: Objective
    ) -> tuple[tf.Tensor, Any]:
        """The loss parts of a training batch whose micro-batches each run forward and then backward, in the 1F1B
        order (:mod:`paraml.planning.schedules`): each micro-batch's gradient is taken as soon as its loss exists,
        and each
        stage's forward pass of micro-batch ``i`` waits (a control dependency) for the backward pass the schedule
        names. The caller's tape sees one op whose gradient is the sum of the micro-batches' gradients, scaled by what
        flows back into the loss (the replica's division by the global batch, a loss scale)."""
        variables = trained_variables(model)
        y_preds: list[Any] = []
        masks: list[list[Any]] = []

        totals, summed = [], None
        for i, (x_part, y_part, w_part) in enumerate(parts):
            if tf.nest.flatten(x_part)[0].shape[0] == 0:
                continue
            self._tracing = i
            try:
                y_pred = model(x_part, training=True)
                part = objective(x_part, y_part, y_pred, w_part)
            finally:
                self._tracing = None
            mask = keras_masks(y_pred)
            if any(m is not None for m in mask):
                raise ValueError(
                    "schedule='1f1b' takes each micro-batch's gradient before the next one's loss exists, but a loss "
                    "over masked tokens is a mean over the whole batch's tokens; use schedule='gpipe'"
                )
            # tf.gradients places each gradient op on its forward op's device (a tape's go to the default device)
            grads = tf.gradients(part[0], variables)
            by_stage: dict[int, list[Any]] = {}
            for g, v in zip(grads, variables):
                stage = self._variable_stage.get(id(v.value))
                if g is not None and stage is not None:
                    by_stage.setdefault(stage, []).append(_values(g))
            for stage, done in by_stage.items():
                self._backward_done[(stage, i)] = tf.group(*done)
            summed = grads if summed is None else [_add(a, g) for a, g in zip(summed, grads)]
            totals.append(part)
            y_preds.append(y_pred)
            masks.append(mask)
        self._backward_done.clear()
        # The caller's tape differentiates this: the loss parts' value, with the summed gradients as their gradient
        # (a sum of each variable times its gradient, held constant), so what flows back into the loss (the replica's
        # division by the global batch, a loss scale) scales them.
        total = tf.stop_gradient(tf.add_n(totals))
        surrogate = tf.add_n([_dot(g, v) for g, v in zip(summed or [], variables) if g is not None] or [tf.zeros(())])
        total += tf.stack([surrogate - tf.stop_gradient(surrogate), 0.0, 0.0])
        return total, concat_with_masks(y_preds, masks)

    def describe(self) -> str:
        devices = self.stage_devices
        header = f"model_parallel on {len(self.topology.devices)} device(s), micro_batches={self.micro_batches}"
        header += f", schedule={self.schedule.kind!r}" if self.micro_batches > 1 else ""
        t = self.topology
        if t.num_replicas > 1:
            header += f"; {t.layout}: copies of the pipeline, their gradients all-reduced"
            if self.in_cluster:
                header += f" (one per worker; this is worker {t.worker_index} of {t.num_workers})"
        lines = [header]
        if self.tensor_parallel > 1:
            lines += [
                f"pipeline {r} stage {i}: {', '.join(group)}"
                for r, pipeline in enumerate(self.groups)
                for i, group in enumerate(pipeline)
            ]
        elif len(self.grid) > 1:
            lines += [f"pipeline {r}: {', '.join(pipeline)}" for r, pipeline in enumerate(self.grid)]
        if self.plan is None:
            return "\n".join(lines)
        lines.append(self.plan.describe(devices))
        if self.tensor_parallel > 1:
            lines.append(
                f"(per device of a stage: a 1/{self.tensor_parallel} share of its split layers, its whole layers; "
                "activations counted whole)"
            )
        lines += [f"stage {s.index} units: {', '.join(s.layers)}" for s in self.plan.stages]
        if self.tensor_plan is not None:
            lines.append(self.tensor_plan.describe())
        lines += [f"note: {note}" for note in self.notes]
        if self.micro_batches > 1:
            lines.append(str(self.schedule))
        return "\n".join(lines)


def _signature(units: list[tuple[str, keras.layers.Layer]]) -> list[tuple[str, list[tuple[int, ...]]]]:
    return [(type(layer).__name__, [tuple(v.shape) for v in layer.variables]) for _, layer in units]


def _stage_call(layer: keras.layers.Layer, device: Callable[[], str], gate: Callable[[], list[Any]]) -> None:
    """Make ``layer``'s computation run on ``device()`` (its stage's, in the pipeline of the replica being traced),
    after what ``gate()`` returns (the 1F1B schedule's wait): its ``call`` (the public method) wrapped, on this
    instance."""
    original = layer.call

    def call(*args: Any, **kwargs: Any) -> Any:
        with tf.device(device()), tf.control_dependencies(gate()):
            return original(*args, **kwargs)

    layer.call = call


def _values(gradient: Any) -> Any:
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _add(a: Any, b: Any) -> Any:
    """Two gradients of one variable summed; two sparse ones (an Embedding's) stay sparse, as TensorFlow adds them."""
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0), a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def _dot(gradient: Any, variable: Any) -> tf.Tensor:
    """``sum(gradient * variable)`` with the gradient held constant: its gradient w.r.t. ``variable`` is ``gradient``
    (sparse for a sparse one: only the rows it names are read)."""
    # The gradient of this term is the gradient itself: kept on the variable's device, where it was made.
    with tf.device(getattr(variable, "value", variable).device):
        if isinstance(gradient, tf.IndexedSlices):
            rows = tf.gather(variable, gradient.indices)
            return tf.reduce_sum(
                tf.cast(tf.stop_gradient(gradient.values) * tf.cast(rows, gradient.values.dtype), "float32")
            )
        return tf.reduce_sum(tf.cast(tf.stop_gradient(gradient) * tf.cast(variable, gradient.dtype), "float32"))
