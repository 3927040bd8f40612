"""The parallel plan: one value that says how a model is laid out over devices, read by every technique.

A plan is made once, when a backend builds the model (:meth:`paraml.backends.Backend.build_model`), and then only
read: the backend places variables and runs units where it says, :func:`paraml.parallelism.apply.apply_plan` applies
its techniques to the model in one stated order, the step, the optimizer and the checkpoints follow what that
returned, and ``describe()`` prints it. Nothing is worked out again from attributes on Keras objects.

It holds (the axes and names are those of Keras' ``DeviceMesh`` and torchtitan's parallel dimensions):

- the **layout**, data replicas x pipeline stages x tensor shards (which also share the experts of a
  mixture-of-experts layer) over all workers (:class:`Layout`), and the
  **mesh**, this worker's devices on those named axes (:class:`DeviceMesh`);
- the **stages**: which layers run on which stage (:class:`paraml.planning.partition.PartitionPlan`, with each
  stage's bytes), and the **splits**: which layers are split over a stage's shards, and how (a
  ``paraml.parallelism.tensor_parallel.TensorPlan``);
- the **schedule** of the micro-batches through the stages (:class:`paraml.planning.schedules.Schedule`);
- what is **recomputed** (``remat``) and what is **sharded** (optimizer state, ZeRO-1).

Plain Python: importing it loads no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from paraml.checks import check_int
from paraml.planning.partition import PartitionPlan, Stage
from paraml.planning.schedules import Schedule
from paraml.planning.sizes import format_bytes

__all__ = ["ZERO_OPTIONS", "DeviceMesh", "Layout", "ParallelPlan", "zero_option", "zero_stage"]


@dataclass(frozen=True)
class Layout:
    """How the devices share one global batch: ``data`` replicas x ``stages`` pipeline stages x ``tensor`` shards,
    and ``experts``: the devices a stage's mixture-of-experts layers share their experts over.

    ``data`` counts the copies of the model over all workers, each computing its slice of the global batch; a copy
    spans ``stages * shards`` devices. Experts are split over the devices of a stage's shards (Megatron-core's
    folding of expert parallelism onto the tensor-parallel devices), so ``experts`` is 1, or ``tensor`` is 1 or
    equal to it.

    >>> Layout(data=2, stages=2)
    Layout(data=2, stages=2, tensor=1, experts=1)
    >>> str(Layout(data=4)), str(Layout(experts=2))
    ('4 data replicas x 1 stage x 1 tensor shard', '1 data replica x 1 stage x 2 expert shards')
    """

    data: int = 1
    stages: int = 1
    tensor: int = 1
    experts: int = 1

    def __post_init__(self) -> None:
        for name in ("data", "stages", "tensor", "experts"):
            check_int(f"Layout.{name}", getattr(self, name))
        if self.tensor > 1 and self.experts > 1 and self.tensor != self.experts:
            raise ValueError(
                f"expert_parallel={self.experts} with tensor_parallel={self.tensor}: the experts are split over the "
                "devices of a stage's tensor shards, so the two must be equal (or one of them 1)"
            )

    @property
    def shards(self) -> int:
        """Devices one stage spans: its tensor shards, which also share its experts."""
        return max(self.tensor, self.experts)

    @property
    def devices_per_replica(self) -> int:
        """Devices one copy of the model spans."""
        return self.stages * self.shards

    def __str__(self) -> str:
        def plural(n: int, word: str) -> str:
            return f"{n} {word}" + ("" if n == 1 else "s")

        shards = plural(self.tensor, "tensor shard") if self.tensor > 1 or self.experts == 1 else ""
        if self.experts > 1:
            shards = f"{shards} (which share the experts)" if shards else plural(self.experts, "expert shard")
        return " x ".join((plural(self.data, "data replica"), plural(self.stages, "stage"), shards))


@dataclass(frozen=True)
class DeviceMesh:
    """This worker's devices on named axes: ``devices[r][s][t]`` is tensor shard ``t`` of stage ``s`` of this
    worker's data replica ``r``.

    >>> mesh = DeviceMesh.arrange(["CPU:0", "CPU:1", "CPU:2", "CPU:3"], data=2, tensor=1)
    >>> mesh.shape, mesh.stage_group(1, 1)
    ((2, 2, 1), ('CPU:3',))
    >>> DeviceMesh.arrange(["CPU:0", "CPU:1", "CPU:2"], data=2, tensor=1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: devices=3 is not a multiple of data_parallel=2: ...
    """

    devices: tuple[tuple[tuple[str, ...], ...], ...]
    axis_names: ClassVar[tuple[str, str, str]] = ("data", "stage", "tensor")

    @classmethod
    def arrange(
        cls, devices: Sequence[str], data: int = 1, tensor: int = 1, option: str = "tensor_parallel"
    ) -> DeviceMesh:
        """``devices`` in order as ``data`` copies of a pipeline whose stages each span ``tensor`` devices; the
        number of stages is what is left (devices = data x stages x tensor). ``option`` is what the user set
        ``tensor`` with (``"tensor_parallel"`` or ``"expert_parallel"``), named in the error."""
        product = data * tensor
        if not devices or len(devices) % product:
            times = f" x {option}={tensor} = {product}" if tensor > 1 else ""
            raise ValueError(
                f"devices={len(devices)} is not a multiple of data_parallel={data}{times}: each copy of the "
                f"pipeline takes the same number of devices (devices = data_parallel x stages x {option}); "
                f"use {len(devices) - len(devices) % product or product} devices, or another data_parallel or "
                f"{option}"
            )
        stages = len(devices) // product
        groups = [tuple(devices[i : i + tensor]) for i in range(0, len(devices), tensor)]
        return cls(tuple(tuple(groups[r * stages : (r + 1) * stages]) for r in range(data)))

    @property
    def shape(self) -> tuple[int, int, int]:
        """(data replicas, stages, tensor shards) of this worker."""
        return len(self.devices), len(self.devices[0]), len(self.devices[0][0])

    @property
    def flat(self) -> tuple[str, ...]:
        """Every device of this worker, replica after replica, stage after stage."""
        return tuple(d for replica in self.devices for group in replica for d in group)

    def stage_group(self, replica: int, stage: int) -> tuple[str, ...]:
        """The tensor-shard devices of ``stage`` in this worker's replica ``replica``. Under an interleaved schedule
        a pipeline has more stages (model chunks) than devices: stage ``s`` runs on the mesh's stage ``s % stages``.
        """
        pipeline = self.devices[replica % len(self.devices)]
        return pipeline[stage % len(pipeline)]

    def first_devices(self) -> tuple[tuple[str, ...], ...]:
        """``[r][s]``: the first device of each stage of each replica (where a stage's whole layers live)."""
        return tuple(tuple(group[0] for group in replica) for replica in self.devices)


#: The options that shard a data-parallel model's state per replica, by the ZeRO stage each turns on
#: (``ParallelPlan.zero_stage``; :mod:`paraml.parallelism.zero`), and what each stage keeps on one owner, in words.
ZERO_OPTIONS = {"shard_optimizer": 1, "shard_gradients": 2, "shard_parameters": 3}
_ZERO_WORDS = {
    1: "each variable's optimizer slots on one owner replica",
    2: "each variable's optimizer slots and reduced gradient on one owner replica",
    3: "each variable, its optimizer slots and its reduced gradient on one owner replica, read where it is used",
}


def zero_option(stage: int) -> str:
    """The option that turns ZeRO ``stage`` on (1: ``"shard_optimizer"``, 2: ..., 3: ...)."""
    return next(name for name, s in ZERO_OPTIONS.items() if s == stage)


def zero_stage(options: Mapping[str, Any]) -> int:
    """The ZeRO stage ``options`` ask for (0: none): the highest of :data:`ZERO_OPTIONS` set True (a stage shards what
    the ones below it shard).

    Raises:
        ValueError: for an option that is not True or False, or one set False below a higher one set True.
    """
    given = {name: options[name] for name in ZERO_OPTIONS if name in options}
    for name, value in given.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    stage = max((ZERO_OPTIONS[name] for name, value in given.items() if value), default=0)
    for name, value in given.items():
        if value is False and ZERO_OPTIONS[name] < stage:
            raise ValueError(
                f"{zero_option(stage)}=True shards the optimizer state and what the stages below it shard; "
                f"{name}=False contradicts it: leave {name} out"
            )
    return stage


@dataclass(frozen=True)
class ParallelPlan:
    """How one model is laid out and trained over devices: made once per build, read by every technique.

    Attributes:
        layout: Data replicas x stages x tensor shards, over all workers.
        mesh: This worker's devices on the ``data``, ``stage`` and ``tensor`` axes.
        partition: Which layers run on which stage, with each stage's bytes (``None``: the whole model is one stage,
            as under data parallelism).
        splits: Which layers are split over each stage's tensor shards and how (a
            ``paraml.parallelism.tensor_parallel.TensorPlan``, made for the model the plan was made for), or None.
        micro_batches: Parts each replica's batch is pipelined in.
        schedule: The order of the micro-batches' forward and backward passes through the stages, or None.
        remat: Whether units recompute their activations in the backward pass.
        zero_stage: What of each trainable variable lives on one owner replica only (:mod:`paraml.parallelism.zero`):
            0 nothing, 1 its optimizer slots, 2 also its reduced gradient, 3 also the variable itself.
        bucket_bytes: Under a ZeRO stage, the most one all-reduce of the gradients or one return of the updated values
            moves at once, one such bucket in flight (:mod:`paraml.parallelism.buckets`; option ``bucket_bytes``).
        notes: What the planner wants the reader to know (an unbalanced unit, an observation's limits).
    """

    layout: Layout
    mesh: DeviceMesh
    partition: PartitionPlan | None = None
    splits: Any = None
    micro_batches: int = 1
    schedule: Schedule | None = None
    remat: bool = False
    zero_stage: int = 0
    bucket_bytes: int = 0
    notes: tuple[str, ...] = ()

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stages of :attr:`partition` (empty without one)."""
        return self.partition.stages if self.partition is not None else ()

    @property
    def largest_stage_bytes(self) -> int:
        """The largest stage's planned bytes (0 without a partition)."""
        return self.partition.largest_stage_bytes if self.partition is not None else 0

    def stage_of(self) -> dict[str, int]:
        """Unit name -> the stage it runs on."""
        return {name: stage.index for stage in self.stages for name in stage.layers}

    def describe(self) -> str:
        """The plan in words: the layout, then each technique the plan uses, one line (or table) each."""
        lines = [f"plan: {self.layout}"]
        if self.partition is not None:
            lines.append(self.partition.describe([self.mesh.stage_group(0, s.index)[0] for s in self.stages]))
            lines += [f"stage {s.index} units: {', '.join(s.layers)}" for s in self.partition.stages]
        if self.splits is not None:
            lines.append(self.splits.describe())
        if self.schedule is not None and self.micro_batches > 1:
            lines.append(str(self.schedule))
        if self.remat:
            lines.append("remat: every unit recomputes its activations in the backward pass")
        if self.zero_stage:
            words = _ZERO_WORDS[self.zero_stage]
            lines.append(f"ZeRO-{self.zero_stage}: {words} ({zero_option(self.zero_stage)})")
            if self.bucket_bytes:
                lines.append(
                    f"buckets: gradients reduced and updated values returned {format_bytes(self.bucket_bytes)} at "
                    "a time, one bucket in flight (bucket_bytes)"
                )
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)
