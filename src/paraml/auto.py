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

:func:`decide` is the pure rule; :class:`AutoChoice` measures the model (built once on the host, and handed to the
chosen backend so that ``model_parallel`` plans from that build instead of making its own).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
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
AUTO_OPTIONS = ("device_memory", "batch_size", "sample", "partition", "micro_batches", "schedule")

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
        if self.unmeasured:
            return self._explain_unmeasured()
        text = self._explain_measured()
        if self.figures and self.device_memory is not None:
            text += f"; {tried_figures(self.figures, self.device_memory)}"
        return f"{text}; {self.caveat}" if self.caveat else text

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
        self, model_fn: Callable[[], keras.Model], optimizer: Any, remat: bool = False
    ) -> tuple[Backend, HostModel | None]:
        """Measure the model, apply :func:`decide`, create the chosen backend; return it and the host build of the
        model when one was made (for the backend's ``build_model``). With ``remat`` (the user's), the model is
        measured with recompute; else recompute is measured when the model does not fit without it. A model that
        cannot be measured (:func:`paraml.memory.unmeasurable_reason`) trains data-parallel, which needs no
        measurement."""
        import keras

        from paraml import backends
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
        measure = {"batch_size": -(-batch_size // len(devices)), "optimizer": optimizer}
        if len(devices) > 1 or memory is not None:  # measured on the host: the model may not fit on one accelerator
            host = build_on_host(model_fn)
            if isinstance(host.model, keras.Model):  # anything else: estimate_memory names what it got
                unmeasured = unmeasurable_reason(host.model)
            if unmeasured:
                parameters = variable_bytes(host.model.weights)
            else:
                observed = host.observe(sample=sample, recompute=recomputing if remat else None)
                estimate = estimate_memory(host.model, remat=remat, observation=observed, **measure)
                as_is = observed
            if estimate is not None and memory is not None and estimate.total > memory:
                for settings in SAVINGS:
                    sharded = settings.get("shard_optimizer") or settings.get("shard_parameters")
                    with_remat = remat or settings.get("remat", False) or settings.get("shard_parameters", False)
                    if (sharded and len(devices) < 2) or (remat and settings and not with_remat):
                        continue  # sharding needs replicas; the user's remat stays on
                    shards = len(devices) if sharded else 1
                    stage = 3 if settings.get("shard_parameters") else 1
                    observed = host.observe(sample=sample, recompute=recomputing if with_remat else None)
                    saved = estimate_memory(
                        host.model,
                        remat=with_remat,
                        optimizer_shards=shards,
                        zero_stage=stage,
                        observation=observed,
                        **measure,
                    )
                    savings.append((settings, saved))
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
        chosen = backends.get_backend(self.decision.strategy)
        passed = {k: v for k, v in self.options.items() if k in chosen.option_names}
        passed.update(planned)
        if self.decision.copies > 1:
            passed["data_parallel"] = self.decision.copies
        if self.decision.tensor > 1:
            passed["tensor_parallel"] = self.decision.tensor
        for sharded in ("shard_optimizer", "shard_parameters"):
            if self.decision.settings.get(sharded):
                passed[sharded] = True
        self.backend = chosen(self.devices if len(devices) > 1 else devices, **passed)
        return self.backend, host

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
