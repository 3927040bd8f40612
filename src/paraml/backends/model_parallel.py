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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import keras
import tensorflow as tf

from paraml.backends.base import Capabilities, DeviceSpec, Layout, Objective, Topology
from paraml.backends.distribute import StrategyBackend, mirrored_strategy, multi_worker_strategy, workers
from paraml.backends.pipeline import Pipeline
from paraml.backends.placement import StageCreator, place_model
from paraml.backends.registry import register
from paraml.checks import check_choice, check_int
from paraml.cluster.detect import setup_tf_config
from paraml.devices import resolve_devices
from paraml.planning.observe import HostModel, model_units
from paraml.planning.plan import DeviceMesh
from paraml.planning.schedules import SCHEDULES, Schedule
from paraml.planning.sizes import parse_size

__all__ = ["ModelParallelBackend"]

#: Default batch size the activations are estimated for when planning stages (option ``batch_size``).
PLANNING_BATCH = 32


@register("model_parallel")
class ModelParallelBackend(StrategyBackend):
    """Units (layers; nested models descended into) split into contiguous stages, one per device, with micro-batches.

    Options: ``partition`` (``"balanced"``: minimise the largest stage's parameters + gradients + optimizer slots +
    activations; ``"even"``: the same number of units per stage; a list of lists of unit names; a list of stage
    start indices), ``micro_batches`` (default 1), ``schedule`` (the order of the micro-batches' passes,
    :mod:`paraml.planning.schedules`: ``"gpipe"`` (default), ``"1f1b"``, ``"interleaved"`` with ``virtual_stages``
    model chunks per device (default 2; chunk c on device c mod stages), ``"zero_bubble"``), ``batch_size`` (the
    batch the activations are estimated for when planning, default 32: the training batch is not known at build),
    ``sample`` (a batch of inputs, any number of rows: the sequence length or image size the activations are
    measured at, when the model leaves them unknown), ``device_memory`` (``"16GiB"``, bytes, or None: what
    TensorFlow tells; a unit or a stage larger than that is refused at build) and ``data_parallel`` (default 1: R
    copies of the pipeline, each on ``devices / R`` devices and its slice of the global batch, their gradients
    all-reduced) and ``tensor_parallel`` (default 1: each stage on T devices, its Dense, attention and Embedding
    layers split over them, :mod:`paraml.parallelism.tensor_parallel`; devices = data_parallel x stages x T) and
    ``expert_parallel`` (default 1: each mixture-of-experts layer's experts split over E devices, each holding and
    computing its experts; a stage spans E devices, shared with its tensor shards when ``tensor_parallel=E``). In a
    cluster of several workers (``TF_CONFIG`` or a scheduler's variables) each worker runs one pipeline over its
    devices and the workers are its copies.

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
        "virtual_stages",
        "device_memory",
        "batch_size",
        "sample",
        "data_parallel",
        "tensor_parallel",
        "expert_parallel",
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
        virtual_stages = options.get("virtual_stages")
        if virtual_stages is not None:
            check_int("virtual_stages", virtual_stages)
        memory = options.get("device_memory")
        self.data_parallel: int = check_int("data_parallel", options.get("data_parallel", 1))
        self.tensor_parallel: int = check_int("tensor_parallel", options.get("tensor_parallel", 1))
        self.expert_parallel: int = check_int("expert_parallel", options.get("expert_parallel", 1))
        #: Devices a stage spans (:attr:`Layout.shards`); a Layout checks the two degrees before any device is used.
        self.shards: int = Layout(tensor=self.tensor_parallel, experts=self.expert_parallel).shards
        cluster = setup_tf_config()  # TF_CONFIG, else set from a scheduler's variables (paraml.cluster.detect)
        #: Whether this process is one worker of a cluster: its pipeline is data parallel with the other workers'.
        self.in_cluster: bool = cluster is not None and cluster.num_workers > 1
        #: ``groups[r][s]``: the :attr:`shards` devices of stage ``s`` of this worker's pipeline ``r``, and
        #: ``grid[r][s]`` the first of them, where the stage's whole layers live (set by ``make_strategy``).
        self.groups: tuple[tuple[tuple[str, ...], ...], ...] = ()
        self.grid: tuple[tuple[str, ...], ...] = ()
        #: Moves each copy of a model variable to its pipeline's stage device while the model is placed.
        self.creator = StageCreator()
        super().__init__(devices, **options)
        self.partition = partition
        self.device_memory: int | None = None if memory is None else parse_size(memory)
        #: The pipeline schedule (:mod:`paraml.planning.schedules`): printable, and the rule the stages' gates follow.
        self.schedule = Schedule(schedule, len(self.grid[0]), self.micro_batches, virtual_stages)
        #: Runs each replica's batch through the stages in micro-batches, in the schedule's order.
        self.pipeline = Pipeline(
            self.schedule,
            skips_empty=lambda: self.capabilities.skips_empty_replicas,
            trained_variables=lambda model: self.techniques.trained_variables(model),
        )
        if schedule != "gpipe":
            # Each micro-batch's gradient is taken on its own; a gate cannot reach into a tf.cond's branch.
            self.capabilities = replace(
                self.capabilities,
                skips_empty_replicas=False,
                loss_scaling_problem=f"schedule={schedule!r} takes each micro-batch's gradient before the loss "
                "scale applies, so float16 gradients could underflow; use schedule='gpipe'",
            )
        if self.micro_batches > 1:
            self.capabilities = replace(
                self.capabilities,
                own_train_step_problem=f"micro_batches={self.micro_batches} pipelines parts of each batch, while a "
                "model's own train_step takes the whole batch and applies its update itself; use micro_batches=1",
            )
        if self.shards > 1:
            set_ = {"tensor_parallel": self.tensor_parallel, "expert_parallel": self.expert_parallel}
            given = [name for name, degree in set_.items() if degree > 1]
            self.capabilities = replace(
                self.capabilities,
                own_train_step_problem=f"{', '.join(f'{n}={set_[n]}' for n in given)} trains the parts of each "
                "split weight, while a model's own train_step takes gradients with respect to "
                f"model.trainable_variables, which read them whole; use {' and '.join(f'{n}=1' for n in given)}",
            )
        #: The final model's units and the device each runs on (first pipeline), in pipeline order.
        self.placement: list[tuple[str, keras.layers.Layer, str]] = []

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
        """Share ``devices`` (this worker's) as ``data_parallel`` pipelines of stages of :attr:`shards` devices."""
        option = "tensor_parallel" if self.tensor_parallel > 1 or self.expert_parallel == 1 else "expert_parallel"
        mesh = DeviceMesh.arrange(devices, data=self.data_parallel, tensor=self.shards, option=option)
        self.groups, self.grid = mesh.devices, mesh.first_devices()

    def make_topology(self) -> Topology:
        """This worker's devices (every pipeline's); one data replica per pipeline, over all workers."""
        devices = tuple(d for pipeline in self.groups for group in pipeline for d in group)
        layout = Layout(
            data=int(self.strategy.num_replicas_in_sync),
            stages=len(self.grid[0]),
            tensor=self.tensor_parallel,
            experts=self.expert_parallel,
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
        with tf.variable_creator_scope(self.creator), self.strategy.scope() as strategy:
            yield strategy

    def distribute(self, dataset: tf.data.Dataset) -> Iterable[Any]:
        if self.topology.num_replicas == 1:
            return dataset  # one pipeline takes the whole batch
        return super().distribute(dataset)

    # -- placement ----------------------------------------------------------------------------------------------------
    def build_model(
        self,
        model_fn: Callable[[], keras.Model],
        optimizer: Any = None,
        host_model: HostModel | None = None,
        remat: bool = False,
    ) -> keras.Model:
        model, plan = place_model(self, model_fn, optimizer, host_model, remat)
        if plan is None:
            return model  # the facade reports what is wrong with it
        self.apply_plan(model, plan, gate=self.pipeline.gate)
        by_name = dict(model_units(model))
        self.placement = [
            (name, by_name[name], self.grid[0][self.schedule.device_of(stage.index)])
            for stage in plan.stages
            for name in stage.layers
        ]
        self.pipeline.variable_stage = {  # the parts of split variables by their own; frozen ones too (a compile
            id(v.value): stage.index  # again may train them)
            for stage in plan.stages
            for name in stage.layers
            for v in self.techniques.variables_of(by_name[name])
        }
        return model

    # -- computation ---------------------------------------------------------------------------------------------------
    def forward(self, model: keras.Model, x: Any, training: bool) -> Any:
        return self.pipeline.forward(model, x, training)

    def loss(
        self, model: keras.Model, x: Any, y: Any, sample_weight: Any, objective: Objective, training: bool
    ) -> tuple[tf.Tensor, Any]:
        return self.pipeline.loss(model, x, y, sample_weight, objective, training)

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
        if self.shards > 1:
            lines += [
                f"pipeline {r} stage {i}: {', '.join(group)}"
                for r, pipeline in enumerate(self.groups)
                for i, group in enumerate(pipeline)
            ]
        elif len(self.grid) > 1:
            lines += [f"pipeline {r}: {', '.join(pipeline)}" for r, pipeline in enumerate(self.grid)]
        plan = self.plan
        if plan is None or plan.partition is None:
            return "\n".join(lines)
        lines.append(plan.partition.describe([devices[self.schedule.device_of(s.index)] for s in plan.stages]))
        if self.shards > 1:
            lines.append(
                f"(per device of a stage: a 1/{self.shards} share of its split layers, its whole layers; "
                "activations counted whole)"
            )
        lines += [f"stage {s.index} units: {', '.join(s.layers)}" for s in plan.stages]
        if plan.splits is not None:
            lines.append(plan.splits.describe())
        lines += [f"note: {note}" for note in plan.notes]
        if self.micro_batches > 1:
            lines.append(str(self.schedule))
        return "\n".join(lines)
