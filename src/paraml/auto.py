"""``Parallel("auto")``: the rule that picks a strategy, with the numbers behind the choice.

The rule, in order:

1. ``TF_CONFIG`` (or a scheduler's variables, :mod:`paraml.cluster.detect`) describes a cluster of more than one worker
   -> ``multi_worker`` (decided at once: that strategy must exist at program start);
2. more than one device, and the estimated training memory fits on one device -> ``mirrored``;
3. more than one device, and the model fits on one device with less memory per device for the same weights
   (:data:`SAVINGS`, in order: the optimizer state sharded over the replicas, the activations recomputed, both, the
   parameters sharded as well) -> ``mirrored`` with the first that fits (``shard_optimizer=True``, ``remat=True``,
   ``shard_parameters=True``);
4. more than one device (the model does not fit on one) -> ``model_parallel`` with a balanced partition, over the
   fewest stages whose largest fits a device, the other devices running copies of that pipeline (``data_parallel``,
   :func:`fit_pipeline`); when one unit alone does not fit a device, its layers split over the fewest devices
   that hold it (``tensor_parallel``). The pipelines of :data:`PIPELINES` are tried in order:
   as it is, with the 1F1B schedule and micro-batches (a stage then holds only the micro-batches in flight), with
   the activations recomputed, with both; the first that fits is taken. Each is sized with the figures the
   ``model_parallel`` placement plans and checks with (:class:`paraml.planning.observe.StageHolding`), so the
   backend refuses nothing ``auto`` found to fit;
5. otherwise -> ``single`` (with ``remat=True`` when one device's known memory needs it).

When the device memory is known and nothing fits (no saving, no pipeline), ``auto`` refuses at build with an error
naming the devices it was given, every figure it tried and what to change; it never picks a layout its backend would
refuse. :meth:`AutoDecision.explain` lists every figure tried (:class:`Figure`), in bytes on the device holding most.

A model that cannot be measured (:func:`paraml.memory.unmeasurable_reason`: a GAN trained by its own ``train_step``
through its parts has no ``call`` to trace; an unbuilt model) trains data-parallel, which needs no measurement
(``mirrored`` on several devices, ``single`` on one), and :meth:`AutoDecision.explain` says why and, with
``device_memory``, that whether it fits is unknown.

Device memory comes from TensorFlow where it can tell (GPUs), else from the ``device_memory`` option
(``"2GiB"``, ``"512MB"`` or bytes). Unknown memory counts as "fits": data parallelism is the faster default.

With ``measure=True`` the estimate only says what fits, and a measurement says what is fastest. On more than one
device, ``auto`` takes the layouts that fit by the estimate (all of them when the device memory is unknown), at most
:data:`MAX_CANDIDATES`, in the order the rule prefers them (:class:`Candidate`): ``mirrored`` as it is; ``mirrored``
with the first saving of :data:`SAVINGS` that fits; copies of a 2-stage ``model_parallel`` pipeline (the
``schedule`` and ``micro_batches`` given, else 1F1B with :data:`DEFAULT_MICRO_BATCHES`). Each is built by its
real backend, compiled with ``build``'s optimizer (a fresh one each) and loss, and trained for a warm-up step (its
trace) and :data:`TIMED_STEPS` timed steps on ``batch_size`` rows (``sample``'s, else the probe batch of ones the
estimate traced; targets of zeros shaped for the loss); the fastest median step is chosen (:class:`Measurement`),
and the model ``build`` returns is built under it, seeded as without measuring. A candidate that fails is reported
and left out.
With fewer than two candidates nothing is timed and the rule's choice stands (:meth:`AutoDecision.explain` says why).
The step times are kept in a JSON file (:class:`MeasureCache`, ``$PARAML_CACHE_DIR/auto_measure.json``) keyed by
the model, devices, batch, optimizer, loss, versions and machine (:func:`cache_key`): a later run with the same key
reads them and times nothing.

:func:`decide` is the pure rule; :class:`AutoChoice` measures the model (built once on the host, and handed to the
chosen backend so that ``model_parallel`` plans from that build instead of making its own).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paraml.memory import MemoryEstimate
from paraml.planning.observe import StageHolding
from paraml.planning.partition import LayerCost, make_plan
from paraml.planning.schedules import Schedule
from paraml.planning.sizes import format_bytes, parse_size

if TYPE_CHECKING:  # pragma: no cover
    import keras

    from paraml.backends.base import Backend, DeviceSpec
    from paraml.planning.observe import HostModel

__all__ = [
    "AUTO_OPTIONS",
    "PIPELINES",
    "SAVINGS",
    "AutoChoice",
    "AutoDecision",
    "Figure",
    "decide",
    "fit_pipeline",
]

#: Options of ``Parallel("auto")``: its own, and those it passes to ``model_parallel`` if it picks it.
AUTO_OPTIONS = ("device_memory", "batch_size", "sample", "partition", "micro_batches", "schedule", "measure")

#: The micro-batches ``auto`` gives a 1F1B pipeline when the user named none (``micro_batches`` not given).
DEFAULT_MICRO_BATCHES = 4

#: The pipelines ``auto`` tries, in order, when no saving of :data:`SAVINGS` makes a replica fit one device: as it
#: is, with the 1F1B schedule (and micro-batches), with recompute, with both. 1F1B comes before recompute: it costs no
#: extra forward pass, and its micro-batches shrink the pipeline's idle time as well as its activations.
PIPELINES: tuple[dict[str, Any], ...] = (
    {},
    {"schedule": "1f1b"},
    {"remat": True},
    {"remat": True, "schedule": "1f1b"},
)


#: What ``auto`` tries, in order, when the model does not fit one device as it is: fewer bytes per device for the
#: same weights. Each is a set of ``Parallel`` settings; the first whose estimate fits is taken.
SAVINGS: tuple[dict[str, bool], ...] = (
    {"shard_optimizer": True},
    {"remat": True},
    {"remat": True, "shard_optimizer": True},
    {"shard_parameters": True},  # ZeRO-3: the parameters too, each unit recomputed
)


@dataclass(frozen=True)
class Figure:
    """One layout ``auto`` estimated: ``layout`` in words, ``bytes`` on the device holding most, and whether that
    fits the device memory it was compared with.

    Example:
        >>> str(Figure("mirrored (a replica's 16 rows)", 3 * 2**20, fits=False))
        "mirrored (a replica's 16 rows) 3.00 MiB (does not fit)"
    """

    layout: str
    bytes: int
    fits: bool

    def __str__(self) -> str:
        return f"{self.layout} {format_bytes(self.bytes)} ({'fits' if self.fits else 'does not fit'})"


@dataclass(frozen=True)
class AutoDecision:
    """What ``auto`` chose and why: :meth:`explain` says it in words, with the numbers.

    ``settings`` are the memory savings it turned on (``{"remat": True}``, ``{"shard_optimizer": True}``), with
    ``saved_estimate`` the estimate with them (``mirrored``, ``single``); ``tried`` every saving estimated, when none
    made the model fit. ``copies`` are the copies of the ``model_parallel`` pipeline (``data_parallel``),
    ``largest_stage`` the bytes of its largest stage, ``tensor`` the devices each stage's split layers span
    (``tensor_parallel``), ``micro_batches`` and ``schedule`` the pipeline's (None: the user's, or the default).
    ``figures`` are every layout and saving estimated, in the order tried (:class:`Figure`).
    ``unmeasured`` says why the model could not be measured (then ``estimate`` is None), with ``parameters`` the
    bytes of its variables; ``caveat`` what the estimate could not see (a probe batch the model refused).
    With ``measure=True``, ``measurement`` holds the candidates timed and their step times (:class:`Measurement`:
    the fastest was chosen), or ``not_timed`` says why nothing was timed (the rule chose).
    """

    strategy: str
    num_workers: int
    num_devices: int
    estimate: MemoryEstimate | None
    device_memory: int | None
    settings: dict[str, bool] = field(default_factory=dict)
    saved_estimate: MemoryEstimate | None = None
    tried: tuple[tuple[dict[str, bool], MemoryEstimate], ...] = ()
    copies: int = 1
    largest_stage: int | None = None
    tensor: int = 1
    unmeasured: str = ""
    parameters: int | None = None
    caveat: str = ""
    figures: tuple[Figure, ...] = ()
    micro_batches: int | None = None
    schedule: str | None = None
    measurement: Measurement | None = None
    not_timed: str = ""

    @property
    def remat(self) -> bool:
        """Whether ``auto`` turned recompute on."""
        return self.settings.get("remat", False)

    @property
    def shard_optimizer(self) -> bool:
        """Whether ``auto`` sharded the optimizer state."""
        return self.settings.get("shard_optimizer", False)

    @property
    def fits(self) -> bool | None:
        """Whether the chosen layout fits the device memory: None when that is unknown (no memory, no measurement,
        or a pipeline not sized by ``auto``)."""
        if self.device_memory is None or self.estimate is None:
            return None
        if self.strategy == "model_parallel":
            return None if self.largest_stage is None else self.largest_stage <= self.device_memory
        chosen = self.saved_estimate if self.saved_estimate is not None else self.estimate
        return chosen.total <= self.device_memory

    def explain(self) -> str:
        """Why this strategy, with the numbers that decided it, and every figure tried."""
        if self.strategy == "multi_worker":
            return f"chose 'multi_worker': TF_CONFIG describes a cluster of {self.num_workers} workers"
        if self.measurement is not None:
            text = self.measurement.explain()
            return f"{text}; {self.caveat}" if self.caveat else text
        text = self._explain_unmeasured() if self.unmeasured else self._explain_measured()
        if self.figures and self.device_memory is not None and not self.unmeasured:
            text += f"; {tried_figures(self.figures, self.device_memory)}"
        if self.caveat and not self.unmeasured:
            text += f"; {self.caveat}"
        return f"{text}; measure=True timed nothing: {self.not_timed}" if self.not_timed else text

    def _explain_unmeasured(self) -> str:
        where = f"on {self.num_devices} devices" if self.num_devices > 1 else "(one device is available)"
        text = (
            f"the model could not be measured ({self.unmeasured}): chose {self.strategy!r} {where}, which needs no "
            "measurement"
        )
        if self.device_memory is None:
            return text
        limit = format_bytes(self.device_memory)
        if self.parameters is not None and self.parameters > self.device_memory:
            return (
                f"{text}; its variables alone take {format_bytes(self.parameters)} > device memory {limit}: it does "
                "not fit one device, and auto splits only a model it can measure"
            )
        held = f" (its variables alone take {format_bytes(self.parameters)})" if self.parameters else ""
        return f"{text}; whether it fits device memory {limit} is unknown{held}"

    def _explain_measured(self) -> str:
        have = (
            f"device memory {format_bytes(self.device_memory)}"
            if self.device_memory is not None
            else "device memory unknown (pass device_memory='16GiB' to decide by it)"
        )
        if self.num_devices <= 1 and not self.settings:
            return "chose 'single': one device is available"
        need = _needs(self.estimate)
        if self.settings and self.strategy != "model_parallel":
            assert self.saved_estimate is not None
            where = "one device is available" if self.num_devices <= 1 else f"on {self.num_devices} devices"
            return (
                f"chose {self.strategy!r} with {_settings(self.settings)} ({where}): the model fits on one device only "
                f"{_WHY[tuple(sorted(self.settings))]}: {_needs(self.saved_estimate)} <= {have}; as it is, {need}"
            )
        if self.strategy == "mirrored":
            return f"chose 'mirrored' on {self.num_devices} devices: the model fits on one device: {need}; {have}"
        more = "".join(f", with {_settings(k)} {format_bytes(e.total)}" for k, e in self.tried)
        layout = ""
        if self.tensor > 1:
            layout += (
                f"; a unit does not fit one device, so its layers are split over {self.tensor} devices "
                f"(tensor_parallel={self.tensor})"
            )
        stages = self.num_devices // self.copies // self.tensor
        if self.copies > 1 and self.largest_stage is not None:
            layout += (
                f"; as {self.copies} copies of a {stages}-stage pipeline (data_parallel={self.copies}): the fewest "
                f"stages whose largest fits, {format_bytes(self.largest_stage)}"
            )
        elif self.largest_stage is not None:
            layout += f"; as a {stages}-stage pipeline whose largest stage needs {format_bytes(self.largest_stage)}"
        if self.settings or self.schedule == "1f1b":
            how = [f"{name}=True" for name in sorted(self.settings)]
            if self.schedule == "1f1b":
                how.append(f"schedule='1f1b' and micro_batches={self.micro_batches}")
            layout += f", with {' and '.join(how)} (a pipeline as it is does not fit)"
        return (
            f"chose 'model_parallel' on {self.num_devices} devices: the model does not fit on one device: "
            f"{need}{more} > {have}{layout}"
        )


def tried_figures(figures: Sequence[Figure], device_memory: int) -> str:
    """Every figure ``auto`` tried, in order, against the device memory, in one sentence.

    Example:
        >>> tried_figures([Figure("mirrored", 3072, False), Figure("2-stage pipeline", 1024, True)], 2048)
        'tried (bytes on the device holding most, vs device memory 2.00 KiB): mirrored 3.00 KiB (does not fit), 2-stage pipeline 1.00 KiB (fits)'
    """  # noqa: E501
    listed = ", ".join(map(str, figures))
    return f"tried (bytes on the device holding most, vs device memory {format_bytes(device_memory)}): {listed}"


_WHY = {
    ("shard_optimizer",): "with its optimizer state sharded over the replicas",
    ("remat",): "with its activations recomputed",
    ("remat", "shard_optimizer"): "with its activations recomputed and its optimizer state sharded",
    ("shard_parameters",): "with its parameters, gradients and optimizer state sharded over the replicas (its "
    "activations recomputed)",
}


def _settings(settings: dict[str, bool]) -> str:
    return " and ".join(f"{name}=True" for name in sorted(settings))


def _needs(estimate: MemoryEstimate | None) -> str:
    if estimate is None:
        return "memory unknown"
    parts = [
        ("parameters", estimate.parameters),
        ("gradients", estimate.gradients),
        ("optimizer slots", estimate.optimizer_slots),
        (f"activations for batch {estimate.batch_size}", estimate.activations),
    ]
    listed = ", ".join(f"{name} {format_bytes(size)}" for name, size in parts)
    return f"estimated training memory {format_bytes(estimate.total)} ({listed})"


def decide(
    *,
    num_workers: int,
    num_devices: int,
    estimate: MemoryEstimate | None,
    device_memory: int | None,
    savings: Sequence[tuple[dict[str, bool], MemoryEstimate]] = (),
    unmeasured: str = "",
    parameters: int | None = None,
) -> AutoDecision:
    """Apply the rule of this module (pure: no TensorFlow, so each branch is testable on its own).

    ``savings`` are the estimates with each of :data:`SAVINGS` that applies (given when ``estimate`` does not fit):
    the first that fits is taken, and the model trains data-parallel (or on its one device) with it.
    ``unmeasured`` says why the model could not be measured (``parameters``: its variables' bytes): it trains
    data-parallel, which needs no measurement.

    Example:
        >>> chosen = decide(num_workers=1, num_devices=2, estimate=None, device_memory=2**30, unmeasured="no call")
        >>> chosen.strategy, chosen.explain().split("; ")[1]
        ('mirrored', 'whether it fits device memory 1.00 GiB is unknown')
    """
    if unmeasured:  # nothing to decide by: data parallelism needs no measurement
        estimate, savings = None, ()
    known: dict[str, Any] = {"unmeasured": unmeasured, "parameters": parameters}
    fits = estimate is None or device_memory is None or estimate.total <= device_memory
    saved = None if fits else next(((k, e) for k, e in savings if e.total <= device_memory), None)  # type: ignore[operator]
    if num_workers > 1:
        return AutoDecision("multi_worker", num_workers, num_devices, estimate, device_memory, **known)
    if num_devices <= 1:
        strategy = "single"
    elif fits or saved is not None:
        strategy = "mirrored"
    else:
        strategy = "model_parallel"
    figures: tuple[Figure, ...] = ()
    if estimate is not None and device_memory is not None:
        base = (
            f"mirrored (a replica's {estimate.batch_size} rows)"
            if num_devices > 1
            else f"single ({estimate.batch_size} rows)"
        )
        figures = (Figure(base, estimate.total, fits),) + tuple(
            Figure(f"{base} with {_settings(k)}", e.total, e.total <= device_memory) for k, e in savings
        )
    if saved is None:
        tried = () if fits else tuple(savings)
        return AutoDecision(
            strategy, num_workers, num_devices, estimate, device_memory, tried=tried, figures=figures, **known
        )
    return AutoDecision(
        strategy, num_workers, num_devices, estimate, device_memory, dict(saved[0]), saved[1], figures=figures, **known
    )


def fit_pipeline(
    costs: Sequence[LayerCost] | Callable[[int], Sequence[LayerCost] | StageHolding],
    num_devices: int,
    device_memory: int,
    slots_per_param: int,
    partition: Any = "balanced",
    min_stages: int = 2,
) -> tuple[int, int, bool]:
    """The fewest stages (a divisor of ``num_devices``, at least ``min_stages``) whose largest stage fits
    ``device_memory``, that largest stage's bytes, and True; when none fits, the most stages tried, their largest
    stage's bytes, and False. ``costs`` may depend on the number of stages: a callable of it giving the units' costs
    or what the stages hold under a schedule (:class:`paraml.planning.observe.StageHolding`, the figures the
    ``model_parallel`` placement plans and checks with). An explicit ``partition`` (lists) has the stages it names:
    all the devices.

    Example:
        >>> from paraml.planning.partition import LayerCost
        >>> costs = [LayerCost(f"dense_{i}", 100, 0) for i in range(8)]    # 100 bytes each, no activations
        >>> fit_pipeline(costs, 4, device_memory=1700, slots_per_param=2)  # two stages of 1600 fit
        (2, 1600, True)
        >>> fit_pipeline(costs, 4, device_memory=700, slots_per_param=2)   # not even four stages of 800
        (4, 800, False)
    """
    explicit = not isinstance(partition, str)
    tried = [num_devices] if explicit else [n for n in range(min_stages, num_devices + 1) if num_devices % n == 0]
    result = (num_devices, 0, False)
    for stages in tried:
        found = costs(stages) if callable(costs) else costs
        held = found if isinstance(found, StageHolding) else None
        units = list(held.costs if held is not None else found)
        if stages > len(units):
            break
        schedule = {"in_flight": held.in_flight, "output_bytes": held.output_bytes} if held is not None else {}
        largest = make_plan(units, partition, stages, slots_per_param, **schedule).largest_stage_bytes
        result = (stages, largest, largest <= device_memory)
        if largest <= device_memory:
            break
    return result


#: The most layouts ``Parallel("auto", measure=True)`` times: each costs a build, a trace and a few steps.
MAX_CANDIDATES = 3

#: Steps timed per candidate, after one warm-up step (its trace); their median is the candidate's step time.
TIMED_STEPS = 5


@dataclass(frozen=True)
class Candidate:
    """A layout ``auto`` may choose: its ``strategy``, the ``options`` its backend gets, the ``layout`` in words,
    its estimated ``bytes`` on the device holding most (None: not sized), the memory savings it turns on
    (``settings``, as :attr:`AutoDecision.settings`) and, for ``mirrored``, the estimate it was sized with."""

    strategy: str
    options: dict[str, Any]
    layout: str
    bytes: int | None
    settings: dict[str, bool] = field(default_factory=dict)
    estimate: MemoryEstimate | None = None


@dataclass(frozen=True)
class StepTrial:
    """How ``auto`` times a candidate: the user's model, optimizer and compile arguments (``build``'s), and a global
    batch of ``batch_size`` rows (``x``, its zero targets ``y``: set by :meth:`with_batch`)."""

    model_fn: Callable[[], Any]
    optimizer: Any
    remat: bool
    compile_args: dict[str, Any]
    jit_compile: bool | str
    batch_size: int
    steps: int = TIMED_STEPS
    x: Any = None
    y: Any = None

    def with_batch(self, host: HostModel, sample: Any) -> StepTrial:
        """This trial with the rows it trains on: ``sample``'s rows (repeated), else the probe batch of ones the
        memory estimate traced, and targets of zeros shaped for the model's outputs and the compiled loss."""
        import tensorflow as tf

        from paraml.planning.observe import probe_inputs, repeat_rows, zero_targets

        rows = self.batch_size * (1 + self.steps)  # a warm-up step, then the timed ones
        x = repeat_rows(sample, rows) if sample is not None else probe_inputs(host.model, rows)[0]
        with tf.device("/device:CPU:0"):  # where the host build lives
            outputs = host.model(repeat_rows(x, 1), training=False)
        y = repeat_rows(zero_targets(host.model, self.compile_args.get("loss"), outputs), rows)
        return replace(self, x=x, y=y)

    def time(self, backend: Backend, remat: bool = False) -> float:
        """Median seconds of one training step of the model built and compiled under ``backend`` (a fresh
        optimizer from the same identifier), after a warm-up step; the model is dropped afterwards."""
        import statistics

        from paraml.loop.batches import global_batches
        from paraml.loop.compiling import compile_model
        from paraml.loop.training import Trainer

        model = backend.build_model(self.model_fn, self.optimizer, None, self.remat or remat)
        compiled = compile_model(backend, model, dict(self.compile_args), self.jit_compile)
        trainer = Trainer(backend, model, 1, compiled.accumulation_steps, compiled.xla)
        source = global_batches(self.x, self.y, batch_size=self.batch_size, num_replicas=backend.topology.num_replicas)
        timer = _step_timer()
        trainer.fit(source, epochs=1, callbacks=[timer])
        return statistics.median(timer.seconds[1:])


def _step_timer() -> Any:
    """A Keras callback recording the wall time of every training step (``seconds``). ``fit`` reads a step's logs
    before the step ends, so its time includes waiting for the result."""
    import keras

    class StepTimer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.seconds: list[float] = []
            self.started = 0.0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.seconds.append(time.perf_counter() - self.started)

    return StepTimer()


@dataclass(frozen=True)
class Measurement:
    """What ``Parallel("auto", measure=True)`` timed: every candidate (:class:`Candidate`) with its median step time
    in seconds (None: it failed, ``errors`` says why), the index of the fastest (``chosen``), the cache file the
    times were kept in, how many candidates were timed in this process (0: the times came from the cache), and the
    steps, global batch and device memory they were timed and sized with."""

    candidates: tuple[Candidate, ...]
    seconds: tuple[float | None, ...]
    chosen: int
    cache: str
    timed_now: int
    steps: int
    batch_size: int
    device_memory: int | None
    errors: tuple[str, ...] = ()

    def decided(self, decision: AutoDecision) -> AutoDecision:
        """``decision`` (the rule's) made the fastest candidate's, with this measurement."""
        winner = self.candidates[self.chosen]
        options = winner.options
        return replace(
            decision,
            strategy=winner.strategy,
            settings=dict(winner.settings),
            saved_estimate=winner.estimate if winner.settings else None,
            copies=options.get("data_parallel", 1),
            tensor=options.get("tensor_parallel", 1),
            largest_stage=winner.bytes if winner.strategy == "model_parallel" else None,
            micro_batches=options.get("micro_batches"),
            schedule=options.get("schedule"),
            measurement=self,
        )

    def explain(self) -> str:
        """Every candidate with its estimated bytes and measured step time, which was chosen, and where the times
        came from."""
        memory = (
            f"device memory {format_bytes(self.device_memory)}"
            if self.device_memory is not None
            else "device memory unknown, so every layout counts as fitting"
        )
        listed = ", ".join(self._figure(i) for i in range(len(self.candidates)))
        source = (
            f"step times read from the cache {self.cache}: no candidate was timed in this process"
            if self.timed_now == 0
            else f"{self.timed_now} candidates timed in this process, saved to the cache {self.cache}"
        )
        return (
            f"chose {self.candidates[self.chosen].layout} (measure=True): the fastest of {len(self.candidates)} "
            f"layouts that fit by the estimate ({memory}), each timed for {self.steps} training steps of batch "
            f"{self.batch_size} after a warm-up step (estimated bytes on the device holding most: median step "
            f"time): {listed}; {source}"
        )

    def _figure(self, i: int) -> str:
        candidate, seconds = self.candidates[i], self.seconds[i]
        size = format_bytes(candidate.bytes) if candidate.bytes is not None else "not sized"
        if seconds is None:
            return f"{candidate.layout} ({size}): failed ({self.errors[i]})"
        chosen = " (the fastest: chosen)" if i == self.chosen else ""
        return f"{candidate.layout} ({size}): {seconds * 1e3:.3f} ms{chosen}"


class MeasureCache:
    """The step times ``Parallel("auto", measure=True)`` measured, in one JSON file:
    ``$PARAML_CACHE_DIR/auto_measure.json`` (default ``~/.cache/paraml/auto_measure.json``), keyed by
    :func:`cache_key`. Written atomically (a temporary file, then ``os.replace``); a file that cannot be read is
    ignored with a warning (and replaced at the next write).
    """

    FILE_NAME = "auto_measure.json"

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        default = os.environ.get("PARAML_CACHE_DIR") or Path.home() / ".cache" / "paraml"
        self.path = Path(directory or default) / self.FILE_NAME

    def _entries(self) -> dict[str, Any]:
        try:
            entries = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            warnings.warn(f"ignoring the auto measure cache {self.path}: cannot read it ({error})", stacklevel=4)
            return {}
        if not isinstance(entries, dict):
            warnings.warn(f"ignoring the auto measure cache {self.path}: not a JSON object", stacklevel=4)
            return {}
        return entries

    def lookup(self, key: dict[str, Any]) -> tuple[list[float | None] | None, list[str]]:
        """The step times (and errors) stored under ``key``, or (None, []) when there are none."""
        entry = self._entries().get(_digest(key))
        if not isinstance(entry, dict) or entry.get("key") != key:
            return None, []
        times, errors = entry.get("seconds"), entry.get("errors")
        if not isinstance(times, list) or not all(t is None or isinstance(t, (int, float)) for t in times):
            return None, []
        return list(times), list(errors) if isinstance(errors, list) else [""] * len(times)

    def store(
        self,
        key: dict[str, Any],
        candidates: Sequence[Candidate],
        seconds: Sequence[float | None],
        errors: Sequence[str],
    ) -> None:
        """Keep ``seconds`` (per candidate) under ``key``, beside the file's other entries; a write that fails is a
        warning (the choice is made anyway)."""
        entries = self._entries()
        layouts = [c.layout for c in candidates]
        entries[_digest(key)] = {"key": key, "layouts": layouts, "seconds": list(seconds), "errors": list(errors)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as file:
                json.dump(entries, file, indent=1)
            os.replace(file.name, self.path)  # readers see the old file or the new one, never half of one
        except OSError as error:
            warnings.warn(f"could not write the auto measure cache {self.path}: {error}", stacklevel=4)


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def cache_key(model: Any, trial: StepTrial, devices: Sequence[str], candidates: Sequence[Candidate]) -> dict[str, Any]:
    """What a measured step time depends on: the model (its layers' classes, its variables' shapes and dtypes, its
    input batch's shapes and dtypes), the devices (how many, their kind), the global batch, the optimizer and loss,
    recompute and XLA, the candidates, TensorFlow's and Keras' versions, and the machine."""
    import keras
    import tensorflow as tf

    from paraml.planning.observe import nested_layers

    key = {
        "layers": [type(layer).__name__ for layer in nested_layers(model)],
        "variables": [[list(v.shape), str(v.dtype)] for v in model.weights],
        "inputs": [[list(a.shape[1:]), str(a.dtype)] for a in tf.nest.flatten(trial.x)],
        "devices": [len(devices), sorted({d.split(":")[-2] for d in devices})],  # "/device:GPU:0" -> "GPU"
        "batch_size": trial.batch_size,
        "optimizer": _identifier(trial.compile_args.get("optimizer", trial.optimizer)),
        "loss": _identifier(trial.compile_args.get("loss")),
        "remat": trial.remat,
        "jit_compile": trial.jit_compile,
        "candidates": [[c.strategy, sorted(c.options.items()), c.settings] for c in candidates],
        "versions": [tf.__version__, keras.__version__],
        "machine": [platform.node(), os.cpu_count()],
    }
    return json.loads(json.dumps(key))  # as the cache file gives it back: tuples as lists


def _identifier(value: Any) -> Any:
    """A JSON name of an optimizer or a loss (a structure of names for one per output)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _identifier(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_identifier(v) for v in value]
    return getattr(value, "__name__", None) or type(value).__name__


class AutoChoice:
    """The pending choice of ``Parallel("auto", devices, **options)``: made at once for a cluster, else at build.

    ``backend`` is the chosen backend (None until chosen), ``decision`` the :class:`AutoDecision` behind it.
    """

    def __init__(self, devices: DeviceSpec, options: dict[str, Any]) -> None:
        from paraml import backends
        from paraml.cluster.detect import detect_cluster

        self.devices = devices
        self.options = dict(options)
        if self.options.get("device_memory") is not None:
            self.options["device_memory"] = parse_size(self.options["device_memory"])
        if not isinstance(self.options.get("measure", False), bool):
            raise ValueError(f"measure must be True or False, got {self.options['measure']!r}")
        if self.options.get("schedule") == "interleaved":  # its stages are model chunks, several per device
            raise ValueError(
                "Parallel('auto') sizes pipelines of one stage per device, and schedule='interleaved' puts several "
                "model chunks on each: use Parallel('model_parallel', schedule='interleaved', virtual_stages=2), or "
                "give auto schedule='gpipe', '1f1b' or 'zero_bubble'"
            )
        self.backend: Backend | None = None
        self.decision: AutoDecision | None = None
        #: When no pipeline holds the model's largest unit: that unit's bytes at best, and the sentence naming it.
        self._unit_problems: list[tuple[int, str]] = []
        cluster = detect_cluster()  # TF_CONFIG or a scheduler's variables
        if cluster is not None and cluster.num_workers > 1:  # decided now: the strategy must exist at program start
            self.decision = decide(num_workers=cluster.num_workers, num_devices=0, estimate=None, device_memory=None)
            self.backend = backends.get_backend("multi_worker")(devices)

    def local_devices(self) -> tuple[str, ...]:
        """The devices the choice is made among."""
        from paraml.devices import resolve_devices

        return resolve_devices(self.devices)

    def choose(
        self,
        model_fn: Callable[[], keras.Model],
        optimizer: Any,
        remat: bool = False,
        *,
        compile_args: dict[str, Any] | None = None,
        jit_compile: bool | str = False,
    ) -> tuple[Backend, HostModel | None]:
        """Measure the model, apply :func:`decide`, create the chosen backend; return it and the host build of the
        model when one was made (for the backend's ``build_model``). With ``remat`` (the user's), the model is
        measured with recompute; else recompute is measured when the model does not fit without it. A model that
        cannot be measured (:func:`paraml.memory.unmeasurable_reason`) trains data-parallel, which needs no
        measurement.

        With the option ``measure=True``, the layouts that fit by the estimate are timed (:meth:`_measure`) on the
        model compiled with ``compile_args`` (``build``'s optimizer, loss...) and ``jit_compile``, and the fastest
        is chosen instead."""
        import keras

        from paraml.devices import device_memory
        from paraml.memory import estimate_memory, unmeasurable_reason
        from paraml.parallelism.remat import recomputing
        from paraml.planning.observe import build_on_host, variable_bytes

        devices = self.local_devices()
        memory = self.options.get("device_memory")
        if memory is None:
            memory = device_memory(devices[0])
        estimate, savings, host, as_is, unmeasured, parameters = None, [], None, None, "", None
        sample = self.options.get("sample")
        batch_size = self.options.get("batch_size", 32)  # the global batch, as fit's batch_size
        # a data-parallel replica computes its share of the global batch: that is what must fit one device
        sizing = {"batch_size": -(-batch_size // len(devices)), "optimizer": optimizer}
        if len(devices) > 1 or memory is not None:  # measured on the host: the model may not fit on one accelerator
            host = build_on_host(model_fn)
            if isinstance(host.model, keras.Model):  # anything else: estimate_memory names what it got
                unmeasured = unmeasurable_reason(host.model)
            if unmeasured:
                parameters = variable_bytes(host.model.weights)
            else:
                observed = host.observe(sample=sample, recompute=recomputing if remat else None)
                estimate = estimate_memory(host.model, remat=remat, observation=observed, **sizing)
                as_is = observed
            if estimate is not None and memory is not None and estimate.total > memory:
                savings = list(self._savings(host, remat, sizing, len(devices)))
        self.decision = decide(
            num_workers=1,
            num_devices=len(devices),
            estimate=estimate,
            device_memory=memory,
            savings=savings,
            unmeasured=unmeasured,
            parameters=parameters,
        )
        if as_is is not None and as_is.problem:
            caveat = (
                f"{as_is.problem}: its activations were not measured (counted from its layers' outputs where known)"
            )
            if sample is None:
                caveat += "; pass sample=<a batch of the model's inputs> to let auto measure them"
            self.decision = replace(self.decision, caveat=caveat)
        planned: dict[str, Any] = {}  # what the chosen pipeline passes model_parallel
        if self.decision.strategy == "model_parallel" and as_is is not None and memory is not None:
            planned = self._size_pipeline(host, optimizer, remat, batch_size, memory, len(devices))
        if self.decision.fits is False:  # nothing fits: refused now, not by the backend or at the first step
            raise ValueError(self._refusal(devices, memory, batch_size))
        chosen = self._rule_candidate(planned)
        if self.options.get("measure"):
            trial = StepTrial(model_fn, optimizer, remat, dict(compile_args or {}), jit_compile, batch_size)
            chosen = self._measure(host, estimate, trial, memory, len(devices)) or chosen
        self.backend = self._backend_of(chosen)
        return self.backend, host

    def _savings(
        self, host: HostModel, remat: bool, sizing: dict[str, Any], num_devices: int
    ) -> Iterator[tuple[dict[str, bool], MemoryEstimate]]:
        """The estimate with each saving of :data:`SAVINGS` that applies, in order (computed as they are read)."""
        from paraml.memory import estimate_memory
        from paraml.parallelism.remat import recomputing

        sample = self.options.get("sample")
        for settings in SAVINGS:
            sharded = settings.get("shard_optimizer") or settings.get("shard_parameters")
            with_remat = remat or settings.get("remat", False) or settings.get("shard_parameters", False)
            if (sharded and num_devices < 2) or (remat and settings and not with_remat):
                continue  # sharding needs replicas; the user's remat stays on
            shards = num_devices if sharded else 1
            stage = 3 if settings.get("shard_parameters") else 1
            observed = host.observe(sample=sample, recompute=recomputing if with_remat else None)
            saved = estimate_memory(
                host.model,
                remat=with_remat,
                optimizer_shards=shards,
                zero_stage=stage,
                observation=observed,
                **sizing,
            )
            # like against like: the estimate as it is does not count the unsharded all-reduce's buffers either
            yield settings, replace(saved, collectives=0)

    def _rule_candidate(self, planned: dict[str, Any]) -> Candidate:
        """The layout :attr:`decision` chose by the rule, as the options its backend gets (``planned``: those of
        the pipeline :meth:`_size_pipeline` sized)."""
        assert self.decision is not None
        passed = dict(planned)
        if self.decision.copies > 1:
            passed["data_parallel"] = self.decision.copies
        if self.decision.tensor > 1:
            passed["tensor_parallel"] = self.decision.tensor
        for sharded in ("shard_optimizer", "shard_parameters"):
            if self.decision.settings.get(sharded):
                passed[sharded] = True
        return Candidate(self.decision.strategy, passed, self.decision.strategy, None, dict(self.decision.settings))

    def _backend_of(self, candidate: Candidate) -> Backend:
        """A new backend for ``candidate``, with the user's options that backend takes."""
        from paraml import backends

        chosen = backends.get_backend(candidate.strategy)
        passed = {k: v for k, v in self.options.items() if k in chosen.option_names}
        passed.update(candidate.options)
        devices = self.local_devices()
        return chosen(self.devices if len(devices) > 1 else devices, **passed)

    # -- measure=True -------------------------------------------------------------------------------------------------
    def _measure(
        self,
        host: HostModel | None,
        estimate: MemoryEstimate | None,
        trial: StepTrial,
        memory: int | None,
        num_devices: int,
    ) -> Candidate | None:
        """Time the layouts of :meth:`_candidates` (or read their times from the cache) and keep the measurement in
        :attr:`decision`; return the fastest, or None when nothing was timed (the rule's choice stands, and
        :attr:`decision` says why)."""
        assert self.decision is not None
        candidates: list[Candidate] = []
        if num_devices < 2:
            why_not = "one device: there is nothing to choose between"
        elif host is None or estimate is None:
            why_not = "the model could not be measured, so no layout was sized"
        else:
            candidates = self._candidates(host, estimate, trial, memory, num_devices)
            why_not = "only one layout fits by the estimate" if len(candidates) < 2 else ""
        if why_not:
            self.decision = replace(self.decision, not_timed=why_not)
            return None
        assert host is not None
        trial = trial.with_batch(host, self.options.get("sample"))
        cache = MeasureCache()
        key = cache_key(host.model, trial, self.local_devices(), candidates)
        seconds, errors = cache.lookup(key)
        timed_now = 0
        if seconds is None or len(seconds) != len(candidates):
            results = [self._time(candidate, trial) for candidate in candidates]
            seconds, errors = [s for s, _ in results], [e for _, e in results]
            timed_now = len(candidates)
            cache.store(key, candidates, seconds, errors)
        ran = {i: s for i, s in enumerate(seconds) if s is not None}
        if not ran:  # every candidate failed: the rule's choice, with the reasons
            self.decision = replace(self.decision, not_timed="every candidate failed: " + "; ".join(errors))
            return None
        fastest = min(ran, key=ran.__getitem__)
        measured = Measurement(
            tuple(candidates),
            tuple(seconds),
            fastest,
            str(cache.path),
            timed_now,
            trial.steps,
            trial.batch_size,
            memory,
            tuple(errors),
        )
        self.decision = measured.decided(self.decision)
        return candidates[fastest]

    def _time(self, candidate: Candidate, trial: StepTrial) -> tuple[float | None, str]:
        """The median step time of ``candidate`` (None and why, when it failed: the others still compete)."""
        import gc

        try:
            return trial.time(self._backend_of(candidate), remat=candidate.settings.get("remat", False)), ""
        except Exception as error:  # a layout the backend refuses for this model: said in explain(), not fatal
            warnings.warn(f"Parallel('auto', measure=True): {candidate.layout} failed: {error}", stacklevel=4)
            return None, f"{type(error).__name__}: {str(error)[:200]}"
        finally:
            gc.collect()  # the candidate's model and optimizer state leave the devices before the next is built

    def _candidates(
        self, host: HostModel, estimate: MemoryEstimate, trial: StepTrial, memory: int | None, num_devices: int
    ) -> list[Candidate]:
        """The layouts worth timing, at most :data:`MAX_CANDIDATES`, in the order the rule prefers them, each that
        fits by the estimate (all, when the device memory is unknown): ``mirrored`` as it is; ``mirrored`` with the
        first saving of :data:`SAVINGS` that fits; copies of a 2-stage ``model_parallel`` pipeline (1F1B and
        micro-batches unless the user chose)."""
        sizing = {"batch_size": -(-trial.batch_size // num_devices), "optimizer": trial.optimizer}  # a replica's share

        def fits(size: int) -> bool:
            return memory is None or size <= memory

        found = []
        if fits(estimate.total):
            found.append(Candidate("mirrored", {}, "mirrored", estimate.total, estimate=estimate))
        saved = next(((k, e) for k, e in self._savings(host, trial.remat, sizing, num_devices) if fits(e.total)), None)
        if saved is not None:
            settings, with_saving = saved
            options = {k: True for k in settings if k != "remat"}
            layout = f"mirrored with {_settings(settings)}"
            found.append(Candidate("mirrored", options, layout, with_saving.total, dict(settings), with_saving))
        pipeline = self._pipeline_candidate(host, trial, num_devices)
        if pipeline is not None and fits(pipeline.bytes or 0):
            found.append(pipeline)
        return found[:MAX_CANDIDATES]

    def _pipeline_candidate(self, host: HostModel, trial: StepTrial, num_devices: int) -> Candidate | None:
        """Copies of a 2-stage ``model_parallel`` pipeline over the devices, sized as :meth:`_size_pipeline` sizes
        one (None: an odd number of devices, an explicit partition, fewer than 2 units)."""
        from paraml.parallelism.remat import recomputing
        from paraml.planning.optimizers import optimizer_slots_per_param

        partition = self.options.get("partition", "balanced")
        if num_devices % 2 or not isinstance(partition, str):
            return None
        stages, copies = 2, num_devices // 2
        k = self.options.get("micro_batches") or DEFAULT_MICRO_BATCHES
        k = k if k <= trial.batch_size // copies else 1  # micro-batches without rows
        schedule = self.options.get("schedule") or ("1f1b" if k > 1 else "gpipe")
        observed = host.observe(sample=self.options.get("sample"), recompute=recomputing if trial.remat else None)
        held = StageHolding.of(observed, Schedule(schedule, stages, k), trial.batch_size, remat=trial.remat)
        slots = optimizer_slots_per_param(trial.optimizer)
        unlimited = 2**62  # sized here, compared with the device memory by the caller
        found, largest, _ = fit_pipeline(lambda _: held, stages, unlimited, slots, partition, min_stages=stages)
        if found != stages or largest == 0:
            return None  # more stages than units
        how = _pipeline_words(False, schedule, k, 1)
        copied = f" x {copies} copies" if copies > 1 else ""
        layout = f"model_parallel: 2-stage pipeline{copied}{how and ' ' + how}"
        options = {"data_parallel": copies, "schedule": schedule, "micro_batches": k, "batch_size": trial.batch_size}
        return Candidate("model_parallel", options, layout, largest)

    def _size_pipeline(
        self, host: HostModel | None, optimizer: Any, remat: bool, batch_size: int, memory: int, num_devices: int
    ) -> dict[str, Any]:
        """Size the pipelines of :data:`PIPELINES` in order and keep the first that fits in :attr:`decision` (its
        copies, tensor shards, stages, recompute, schedule; every figure tried); return the options it passes
        ``model_parallel``. When none fits, :attr:`decision` keeps the last one tried, which does not fit.

        A pipeline's stages are sized for the whole global batch (each copy of it sees its share at most) under its
        schedule: what each stage holds of its micro-batches in flight (:class:`paraml.planning.observe.StageHolding`,
        the figures ``model_parallel`` plans and checks its stages with, so that it finds what ``auto`` found)."""
        from paraml.parallelism.remat import recomputing
        from paraml.parallelism.tensor_parallel import plan_splits
        from paraml.planning.optimizers import optimizer_slots_per_param
        from paraml.planning.partition import layer_cost

        assert host is not None and self.decision is not None
        sample = self.options.get("sample")
        partition = self.options.get("partition", "balanced")
        slots = optimizer_slots_per_param(optimizer)
        user_k = self.options.get("micro_batches")
        user_schedule = self.options.get("schedule")
        shards_saved: dict[int, list[int]] = {}

        def saved_bytes(shards: int) -> list[int]:  # per unit, as the placement will count them with that split
            if shards not in shards_saved:
                split = plan_splits(host.model, shards, sample)
                shards_saved[shards] = [split.saved_bytes(u.layer) for u in host.observe(sample=sample).units]
            return shards_saved[shards]

        figures = list(self.decision.figures)
        self._unit_problems = []
        # the pipelines to try: (recompute, schedule, micro-batches), each once
        tries: list[tuple[bool, str, int]] = []
        for pipeline in PIPELINES:
            if pipeline.get("remat") and remat:
                continue  # the user's remat is on in every pipeline already
            if pipeline.get("schedule") and user_schedule not in (None, pipeline["schedule"]):
                continue  # the user chose the schedule
            schedule = pipeline.get("schedule", user_schedule or "gpipe")
            k = user_k if user_k is not None else (DEFAULT_MICRO_BATCHES if schedule == "1f1b" else 1)
            if k > batch_size and user_k is None:
                continue  # micro-batches without rows
            key = (remat or pipeline.get("remat", False), schedule if k > 1 else "gpipe", k)
            if key not in tries:
                tries.append(key)

        def holding_at(stages: int, tensor: int, with_remat: bool, schedule: str, k: int) -> StageHolding:
            # what the stages hold under the schedule, as the placement will plan and check them
            observed = host.observe(sample=sample, recompute=recomputing if with_remat else None)
            held = StageHolding.of(observed, Schedule(schedule, stages, k), batch_size, remat=with_remat)
            if tensor == 1:
                return held
            costs = [replace(c, param_bytes=c.param_bytes - s) for c, s in zip(held.costs, saved_bytes(tensor))]
            return replace(held, costs=costs)

        # Without splitting layers first (tensor_parallel talks at every layer), each pipeline of ``tries`` in order,
        # the fewest stages first; then with each layer split over 2 devices, and so on.
        shards = [t for t in range(1, num_devices + 1) if num_devices % t == 0] if isinstance(partition, str) else [1]
        last: dict[str, Any] = {}
        for tensor in shards:
            pipes = num_devices // tensor
            for with_remat, schedule, k in tries:
                stages, largest, fits = fit_pipeline(
                    functools.partial(holding_at, tensor=tensor, with_remat=with_remat, schedule=schedule, k=k),
                    pipes,
                    memory,
                    slots,
                    partition,
                    min_stages=1 if pipes == 1 else 2,
                )
                if largest == 0 and not fits:
                    continue  # more stages than units: model_parallel refuses that with its own words
                copies = pipes // stages
                how = _pipeline_words(with_remat and not remat, schedule, k, tensor)
                layout = f"{stages}-stage pipeline" + (f" x {copies} copies" if copies > 1 else "")
                rows = Schedule(schedule, stages, k).micro_batch_rows(batch_size)
                figures.append(Figure(f"{layout}{how and ' ' + how} ({rows} rows a micro-batch)", largest, fits))
                last = {
                    "settings": {"remat": True} if with_remat and not remat else {},
                    "copies": copies,
                    "largest_stage": largest,
                    "tensor": tensor,
                    "micro_batches": k,
                    "schedule": schedule,
                    "passed": {"micro_batches": k, "schedule": schedule, "batch_size": batch_size},
                }
                if fits:
                    break
            if last and last["largest_stage"] <= memory:
                break
        else:  # none fits: is it one unit that no split and no pipeline holds?
            tensor = shards[-1]
            unit_problems = []
            for with_remat, schedule, k in tries:
                costs = holding_at(num_devices // tensor, tensor, with_remat, schedule, k).costs
                unit = max(costs, key=lambda c: layer_cost(c, slots))
                how = _pipeline_words(with_remat and not remat, schedule, k, tensor)
                unit_problems.append((layer_cost(unit, slots), f"unit {unit.name!r} needs {{}} {how or 'as it is'}"))
            if unit_problems and min(unit_problems)[0] > memory:
                needs, words = min(unit_problems)
                self._unit_problems = [(needs, words.format(format_bytes(needs)))]
        passed = last.pop("passed", {})
        if not last:  # no pipeline could be sized (more stages than units): refused with the figures tried
            last = {"largest_stage": memory + 1}
        self.decision = replace(self.decision, figures=tuple(figures), **last)
        return passed

    def _refusal(self, devices: Sequence[str], memory: int | None, batch_size: int) -> str:
        """Why nothing fits: the devices given, every figure tried, and what to change."""
        assert self.decision is not None and memory is not None
        given = "batch_size" in self.options
        text = (
            f"Parallel('auto') found no layout that fits the {len(devices)} device(s) it was given "
            f"({', '.join(devices)}), with {format_bytes(memory)} each: "
            f"{tried_figures(self.decision.figures, memory)}"
        )
        problems = self._unit_problems
        if problems:
            limit = format_bytes(memory)
            text += f"; no pipeline holds its largest unit: at best, {problems[0][1]}, more than a device's {limit}"
        batch = f"batch_size={batch_size}" + ("" if given else ", the default auto sizes for")
        return (
            f"{text}. To train it, give more devices, a larger device_memory (if the devices have more than "
            f"{format_bytes(memory)}), or a smaller global batch (now {batch})"
        )


def _pipeline_words(remat: bool, schedule: str, micro_batches: int, tensor: int) -> str:
    """How a pipeline ``auto`` sized runs, in words ("" for one as it is)."""
    words = []
    if tensor > 1:
        words.append(f"tensor_parallel={tensor}")
    if remat:
        words.append("remat=True")
    if micro_batches > 1:
        words.append(f"schedule={schedule!r} x {micro_batches} micro-batches")
    return f"with {', '.join(words)}" if words else ""
