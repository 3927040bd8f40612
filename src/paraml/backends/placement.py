"""Where ``model_parallel`` puts a model's variables: each on its stage's devices, a split one as parts.

``model_fn`` creates its variables while it runs, before any partition is known. So the model is built twice: once
on the host to observe it and plan the stages and splits (:func:`paraml.planning.observe.build_on_host`; under
``"auto"``, the build ``auto`` measured), then again under a ``tf.variable_creator_scope`` that creates the i-th
variable on the device of the stage whose unit owns it (:class:`StageCreator`, one copy per pipeline), and the first
build's variables are copied over (so the same seed gives the same initial weights, and random-seed states, as on
every other backend). ``model_fn`` must build the same model each time it is called; a different second model is
refused at build. The result is the model and its :class:`paraml.planning.plan.ParallelPlan`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import keras
import tensorflow as tf

from paraml.devices import device_memory
from paraml.parallelism.remat import recomputing
from paraml.parallelism.tensor_parallel import WholeVariable, plan_splits
from paraml.planning.footprint import part_sizes
from paraml.planning.observe import HostModel, StageHolding, build_on_host, model_units, observation_notes
from paraml.planning.optimizers import optimizer_slots_per_param
from paraml.planning.partition import LayerCost, PartitionPlan, make_plan
from paraml.planning.plan import DeviceMesh, ParallelPlan
from paraml.planning.sizes import format_bytes

__all__ = ["StageCreator", "place_model"]

#: A unit whose cost exceeds this share of a perfect 1/K split keeps the stages from balancing: describe() says so.
UNBALANCED_SHARE = 1.0


class StageCreator:
    """A variable creator, entered below the strategy's (so that the strategy's calls it once per copy), that moves
    each copy of the variable being placed to its pipeline's device named by :meth:`placing`."""

    def __init__(self) -> None:
        self._devices: Iterator[str] | None = None  # the devices of the variable being placed, one per pipeline

    @contextlib.contextmanager
    def placing(self, devices: Sequence[str]) -> Iterator[None]:
        """Create the variable made inside the block once per pipeline, copy r on ``devices[r]``."""
        self._devices = iter(devices)
        try:
            yield
        finally:
            self._devices = None

    def __call__(self, next_creator: Callable[..., tf.Variable], **kwargs: Any) -> tf.Variable:
        device = next(self._devices, None) if self._devices is not None else None
        if device is None:  # not a model variable (an optimizer slot follows its variable; a step counter)
            return next_creator(**kwargs)
        with tf.device(device):
            return next_creator(**kwargs)


def place_model(
    b: Any,
    model_fn: Callable[[], keras.Model],
    optimizer: Any = None,
    host_model: HostModel | None = None,
    remat: bool = False,
) -> tuple[keras.Model, ParallelPlan | None]:
    """Build the model of ``model_fn`` with every variable on its stage's devices for backend ``b`` (a
    :class:`paraml.backends.model_parallel.ModelParallelBackend`), and the plan it was placed by.

    The model is built twice: once on the host (``host_model``, or now) to observe its units and plan the stages and
    splits, then under a variable creator that makes the i-th variable on its stage's devices (a split one as parts
    on the stage's tensor shards), and the first build's values are copied over (the same seed gives the same
    weights on every backend). Returns ``(model, None)`` for a model that cannot be placed (no weights, not a
    model): the facade says what is wrong with it.
    """
    host = host_model if host_model is not None else build_on_host(model_fn)
    probe, created = host.model, host.created
    if not isinstance(probe, keras.Model) or not probe.built or not probe.weights:
        return probe, None  # the facade reports what is wrong with it
    observation = host.observe(sample=b.sample, recompute=recomputing if remat else None)
    if not observation.units:
        raise ValueError(f"model {probe.name!r} has no layers to place on stages")
    notes = observation_notes(observation)
    slots = optimizer_slots_per_param(optimizer) if optimizer is not None else 0
    held = StageHolding.of(observation, b.schedule, b.batch_size, remat)
    costs = held.costs
    tensor_plan = plan_splits(probe, b.tensor_parallel, b.sample, b.expert_parallel) if b.shards > 1 else None
    if tensor_plan is not None:  # a stage's device holds the largest part of each split variable (activations: whole)
        saved = {u.name: tensor_plan.saved_bytes(u.layer) for u in observation.units}
        costs = [replace(c, param_bytes=c.param_bytes - saved.get(c.name, 0)) for c in costs]
    partition = make_plan(  # one stage per model chunk: more than the devices under an interleaved schedule
        costs, b.partition, b.schedule.chunks, slots, in_flight=held.in_flight, output_bytes=held.output_bytes
    )
    notes += _check_fits(b, partition, costs, slots, held)
    if b.schedule.held_is_a_bound:
        notes.append(
            f"under gpipe the stages' figures are upper bounds: they count all {b.schedule.micro_batches} "
            "micro-batches' activations, and TensorFlow's executor frees some earlier; schedule='1f1b' bounds them "
            "by its order"
        )
    if held.batch_bytes:
        notes.append(
            f"the stages' figures leave out the batch of {b.batch_size} rows, which the process holds besides them "
            f"({format_bytes(held.batch_bytes)})"
        )

    device_of_unit = {name: b.schedule.device_of(s.index) for s in partition.stages for name in s.layers}
    owner = {id(v.value): u.name for u in observation.units for v in u.layer.variables}
    placed_on = [device_of_unit.get(owner.get(id(v)), 0) for v in created]  # position along the pipeline
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
        stage = placed_on[index]
        axis = split_axis.get(id(created[index]))
        if axis is not None:
            return _split_variable(b, next_creator, kwargs, stage, tuple(created[index].shape), axis)
        with b.creator.placing([pipeline[stage] for pipeline in b.grid]):  # one copy per pipeline
            return next_creator(**kwargs)

    with b.scope(), tf.variable_creator_scope(place):
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
    notes = [  # named as the final model names its units
        re.sub(r"unit '([^']+)'", lambda m: f"unit {renamed.get(m.group(1), m.group(1))!r}", note) for note in notes
    ]
    partition = PartitionPlan(tuple(replace(s, layers=tuple(renamed[n] for n in s.layers)) for s in partition.stages))
    plan = ParallelPlan(
        b.topology.layout,
        DeviceMesh(b.groups),
        partition=partition,
        splits=None if tensor_plan is None else tensor_plan.moved_to(probe, model),
        micro_batches=b.micro_batches,
        schedule=b.schedule,
        remat=remat,
        notes=tuple(notes),
    )
    return model, plan


def _split_variable(
    b: Any, next_creator: Callable[..., Any], kwargs: dict[str, Any], stage: int, shape: tuple[int, ...], axis: int
) -> Any:
    """A variable of ``shape`` split on ``axis`` over ``stage``'s devices: its parts (each made by the creators
    below, one copy per pipeline), behind a :class:`paraml.parallelism.tensor_parallel.WholeVariable`. The parts
    start at zero: the first build's values are assigned next."""
    parts = []
    name = kwargs.get("name") or "variable"
    for k, size in enumerate(part_sizes(shape[axis], b.shards)):
        part_shape = list(shape)
        part_shape[axis] = size
        dtype = kwargs.get("dtype") or "float32"
        initial = {"initial_value": tf.zeros(part_shape, dtype), "name": f"{name}_part{k}", "shape": None}
        with b.creator.placing([pipeline[stage][k] for pipeline in b.groups]):
            parts.append(next_creator(**{**kwargs, **initial}))
    return WholeVariable(parts, axis, name)


def _check_fits(b: Any, plan: PartitionPlan, costs: list[LayerCost], slots: int, held: StageHolding) -> list[str]:
    """Refuse (at build) a unit or a stage larger than a device; the notes on a unit that keeps the stages of
    ``plan`` from balancing. A unit's size is what it holds on its stage: its parameters, gradients and optimizer
    slots, and its activations for the micro-batches in flight there."""
    stage_of = {name: s.index for s in plan.stages for name in s.layers}
    flight = held.in_flight

    def size(c: LayerCost) -> int:
        return c.param_bytes * (2 + slots) + flight[stage_of[c.name]] * c.activation_bytes + c.recompute_bytes

    sizes = [(c.name, size(c)) for c in costs]
    devices = b.stage_devices
    memory = b.device_memory
    if memory is None:
        known = [device_memory(d) for d in devices]
        memory = min(known) if known and all(m is not None for m in known) else None
    per_device = [0] * len(devices)  # a device runs several stages (model chunks) under an interleaved schedule
    for stage in plan.stages:
        per_device[b.schedule.device_of(stage.index)] += stage.peak_bytes
    share = sum(per_device) / len(devices)
    name, largest = max(sizes, key=lambda item: item[1])
    micro = b.schedule.micro_batches
    held_here = flight[stage_of[name]]
    batch = (
        f"a batch of {b.batch_size}"
        if micro == 1
        else f"{held_here} micro-batch(es) of {held.rows} rows in flight on its stage under {b.schedule.kind}"
    )
    what = f"unit {name!r} needs {format_bytes(largest)} (parameters, gradients, optimizer slots and activations "
    what += f"for {batch})"
    t = b.shards
    if memory is not None and largest > memory:
        if t > 1:
            split = "tensor_parallel" if b.tensor_parallel > 1 else "expert_parallel"
            layers = "Dense, attention and Embedding layers" if b.tensor_parallel > 1 else "experts"
            layers += " (and its experts)" if b.tensor_parallel > 1 and b.expert_parallel > 1 else ""
            raise ValueError(
                f"{what} on each of its stage's {t} devices with its {layers} split over them ({split}={t}), more "
                f"than a device's {format_bytes(memory)}: use a larger {split} or devices with more memory"
            )
        raise ValueError(
            f"{what}, more than a device's {format_bytes(memory)}: model_parallel places each unit (a layer) on "
            "one stage's devices. Split its Dense, attention and Embedding layers over several devices with "
            "tensor_parallel=2 (or more), a mixture-of-experts model's experts with expert_parallel=2, or use "
            "devices with more memory"
        )
    if memory is not None and max(per_device) > memory:
        what = "the largest stage" if len(plan.stages) == len(devices) else "the device with the most model chunks"
        raise ValueError(
            f"{what} needs {format_bytes(max(per_device))}, more than a device's "
            f"{format_bytes(memory)}: the model does not fit on {len(devices)} device(s); use more devices"
            + (
                " (or schedule='1f1b' with micro_batches > 1)"
                if b.schedule.kind == "gpipe"
                else " or more micro_batches"
            )
        )
    if len(devices) > 1 and largest > share * UNBALANCED_SHARE:
        return [
            f"{what}, more than a device's share {format_bytes(round(share))}: the stages cannot balance better "
            + ("(tensor_parallel=2 would split its layers over devices)" if t == 1 else "")
        ]
    return []


def _signature(units: list[tuple[str, keras.layers.Layer]]) -> list[tuple[str, list[tuple[int, ...]]]]:
    return [(type(layer).__name__, [tuple(v.shape) for v in layer.variables]) for _, layer in units]
