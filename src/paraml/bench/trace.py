"""Which device ran what, and when, in one training step: :func:`trace_step` and the :class:`StepTrace` it returns.

The evidence for a pipeline schedule on a machine without GPUs is the step itself: each device's executed ops with
their start and end times, the busy intervals they make (overlapping ops merged), and each device's idle fraction
over the step, to set next to the idle fraction the schedule predicts (:attr:`paraml.planning.schedules.Schedule.
bubble`).

How it is measured. The step is paraml's own: :meth:`paraml.Parallel.fit` on the batch repeated, a callback
recording around one batch. TensorFlow 2.21 no longer fills the step stats of a function's run metadata, so:

* the times come from TensorFlow's profiler (``tf.profiler.experimental``): one event per op the executor ran, named
  after the node (``dense_1/MatMul:MatMul``), on the thread that ran it;
* the device of each node comes from the partition graphs TensorFlow records for the step's function when it
  instantiates it, at the first step. So the first step a :class:`~paraml.Parallel` trains must run under
  :func:`trace_step` (a freshly built one); later calls on the same ``Parallel`` reuse what was recorded then.

Ops of the step only: those of the input pipeline's own threads and of other functions are not counted; the
asynchronous receives between devices (``_Recv``, which wait rather than compute) are not busy time either. Busy
means an op of the device was running, whatever it waited on inside. On logical CPUs the devices share the
machine's cores and one thread pool: an idle fraction measured there is evidence of the dataflow (what could run
when), not a GPU's figure; the profiler adds a few microseconds per op.

Example (a sketch; see ``benchmarks/bench_schedules.py``)::

    par = Parallel("model_parallel", devices=2, micro_batches=4, schedule="1f1b")
    par.build(make_model, optimizer="sgd", loss="mse")
    trace = trace_step(par, x_batch, y_batch)
    print(trace)  # one row per device: '#' busy, '.' idle; and the idle fractions
    trace.idle_fractions()  # {'/device:CPU:0': 0.21, '/device:CPU:1': 0.34}
"""

from __future__ import annotations

import glob
import os
import tempfile
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf

from paraml.checks import check_int
from paraml.internals import read_xspace, start_graph_collection, stop_graph_collection

if TYPE_CHECKING:
    from paraml.parallel import Parallel

__all__ = ["OpRun", "StepTrace", "trace_step", "trace_steps"]

#: Columns of the text timeline ``str(trace)`` draws.
TIMELINE_WIDTH = 60

#: Ops recorded but not counted as busy: they wait for another device (``_Recv`` runs asynchronously) or only mark
#: the function's arguments and results.
NOT_WORK = frozenset({"_Recv", "_HostRecv", "_Arg", "_Retval", "_DeviceArg", "_DeviceRetval", "NoOp"})


@dataclass(frozen=True)
class OpRun:
    """One op of a traced step: the node ``name``, its ``op`` type, the ``device`` it ran on, and its ``start`` and
    ``end`` in seconds from the step's first op."""

    name: str
    op: str
    device: str
    start: float
    end: float


@dataclass(frozen=True)
class StepTrace:
    """One traced training step: every device of the ``Parallel`` (``devices``, in its order, then any other device
    an op ran on) and the ``ops`` each ran, in seconds from the first op's start.

    The step's span runs from its first op's start to its last op's end; a device's busy intervals are its ops'
    intervals merged where they overlap (ops of one device may run at once on several threads).
    """

    devices: tuple[str, ...]
    ops: tuple[OpRun, ...]
    #: Seconds the loop spent on the traced batch (from the batch's start to its end, as a callback sees them): the
    #: span plus what the host did around it (0.0 when not measured).
    wall: float = 0.0
    #: When the step waited for the input pipeline's next batch (``tf.data``'s get-next on the host), in seconds from
    #: the first op's start (negative: before it).
    input_waits: tuple[tuple[float, float], ...] = ()

    @property
    def span(self) -> float:
        """Seconds from the step's first op start to its last op end (0.0 for a step without ops)."""
        if not self.ops:
            return 0.0
        return max(op.end for op in self.ops) - min(op.start for op in self.ops)

    def _check_device(self, device: str) -> str:
        if device not in self.devices:
            raise ValueError(f"device {device!r} is not one of this trace's devices: {', '.join(self.devices)}")
        return device

    def busy(self, device: str) -> list[tuple[float, float]]:
        """The (start, end) intervals in which ``device`` ran an op, sorted, overlapping ops merged.

        Raises:
            ValueError: for a device that is not in :attr:`devices` (naming them).
        """
        self._check_device(device)
        return merge_intervals((op.start, op.end) for op in self.ops if op.device == device)

    def idle_fraction(self, device: str) -> float:
        """``1 - busy seconds / span`` of ``device``: 0.0 when it ran ops all along, 1.0 when it ran none."""
        span = self.span
        if span <= 0:
            return 1.0
        return 1.0 - sum(end - start for start, end in self.busy(device)) / span

    def idle_fractions(self) -> dict[str, float]:
        """:meth:`idle_fraction` of every device, in :attr:`devices` order."""
        return {device: self.idle_fraction(device) for device in self.devices}

    def timeline(self, width: int = TIMELINE_WIDTH) -> list[str]:
        """One row of ``width`` columns per device, each column a slice of the span: ``#`` when the device ran an op
        in it, ``.`` when it ran none."""
        width = check_int("width", width)
        span = self.span or 1.0
        rows = []
        for device in self.devices:
            cells = ["."] * width
            for start, end in self.busy(device):
                first = min(width - 1, int(start / span * width))
                last = min(width - 1, int(end / span * width))
                cells[first : last + 1] = ["#"] * (last + 1 - first)
            rows.append("".join(cells))
        return rows

    def __str__(self) -> str:
        label = max((len(d) for d in self.devices), default=0)
        head = f"one step, {self.span * 1e3:.2f} ms from the first op's start to the last op's end ('#' busy, '.' idle)"
        rows = [
            f"{device.ljust(label)}  {row}  idle {self.idle_fraction(device):.3f}"
            for device, row in zip(self.devices, self.timeline())
        ]
        return "\n".join([head, *rows])


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """``intervals`` sorted, with those that overlap or touch joined into one.

    Example:
        >>> merge_intervals([(3.0, 4.0), (0.0, 1.0), (0.5, 2.0)])
        [(0.0, 2.0), (3.0, 4.0)]
    """
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


# -- tracing a step ----------------------------------------------------------------------------------------------------
#: Per Parallel, the device of each node of its training step's function: recorded at its first step, which is the
#: only time TensorFlow records it; weak, so a Parallel that is gone takes its record with it.
_NODE_DEVICES: weakref.WeakKeyDictionary[Parallel, dict[str, str]] = weakref.WeakKeyDictionary()


def trace_step(par: Parallel, x: Any, y: Any = None, *, sample_weight: Any = None, warmup: int = 2) -> StepTrace:
    """One training step of ``par`` on the global batch ``(x, y)`` (numpy arrays, or dicts or lists of them, as
    :meth:`paraml.Parallel.fit` takes), traced: which device ran which op, and when.

    The batch is trained ``warmup`` times untraced first (the first step traces the function; its weights change as
    in any step). See :func:`trace_steps`.
    """
    return trace_steps(par, x, y, sample_weight=sample_weight, steps=1, warmup=warmup)[0]


def trace_steps(
    par: Parallel, x: Any, y: Any = None, *, sample_weight: Any = None, steps: int = 1, warmup: int = 2
) -> list[StepTrace]:
    """``steps`` training steps of ``par``, each on the global batch ``(x, y)`` (or the next batch of ``x``, a
    ``tf.data.Dataset`` of global batches) and traced on its own, after ``warmup`` untraced ones, all in one
    :meth:`paraml.Parallel.fit` call (one epoch, no shuffling).

    The first step ``par`` ever trains must run here (``warmup`` >= 1 for it): TensorFlow records which device runs
    each op of the step when it first runs it.

    Raises:
        ValueError: for counts below 1, or when ``par`` trained before without being traced (no record of the devices).
        tf.errors.AlreadyExistsError: when TensorFlow's profiler is already running.
    """
    steps = check_int("steps", steps)
    warmup = check_int("warmup", warmup)
    recorder = _StepRecorder(par, first_traced=warmup, steps=steps)
    fit_recorded(par, x, y, sample_weight, recorder)
    return recorder.traces


def fit_recorded(par: Parallel, x: Any, y: Any, sample_weight: Any, recorder: _StepRecorder) -> None:
    """Train ``par`` on the global batch ``(x, y)`` once per batch ``recorder`` watches or warms up with (its
    ``traced`` range's end), in one :meth:`paraml.Parallel.fit` call, one epoch, no shuffling. ``x`` may be a
    ``tf.data.Dataset`` of global batches instead (repeated: its own pipeline, map functions and all, is what the steps
    wait for)."""
    repeat = recorder.traced.stop
    try:
        if isinstance(x, tf.data.Dataset):
            par.fit(x.repeat(), steps_per_epoch=repeat, epochs=1, verbose=0, callbacks=[recorder])
            return
        rows = len(np.asarray(tf.nest.flatten(x)[0]))
        par.fit(
            _repeated(x, repeat),
            _repeated(y, repeat),
            sample_weight=_repeated(sample_weight, repeat),
            batch_size=rows,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[recorder],
        )
    finally:
        recorder.close()  # a step that failed leaves neither the profiler nor the graph collection running


def _repeated(value: Any, times: int) -> Any:
    """``value`` (arrays, or dicts, lists or tuples of them, or None) stacked ``times`` times along the batch axis."""
    return tf.nest.map_structure(lambda a: None if a is None else np.concatenate([np.asarray(a)] * times), value)


class _StepRecorder(keras.callbacks.Callback):
    """A Keras callback: records the node devices at the first batch (when ``par`` has no record yet) and profiles
    batches ``first_traced`` .. ``first_traced + steps - 1``, each into a :class:`StepTrace`."""

    def __init__(self, par: Parallel, first_traced: int, steps: int) -> None:
        super().__init__()
        self.par = par
        self.traced = range(first_traced, first_traced + steps)
        self.traces: list[StepTrace] = []
        self._collecting = False
        self._profile_dir: tempfile.TemporaryDirectory[str] | None = None
        self._began = time.perf_counter()

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if batch == 0 and self.par not in _NODE_DEVICES:
            start_graph_collection()
            self._collecting = True
        if batch in self.traced:
            self._profile_dir = tempfile.TemporaryDirectory(prefix="paraml-trace-")
            tf.profiler.experimental.start(self._profile_dir.name)
            self._began = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        wall = time.perf_counter() - self._began
        if self._collecting:
            self._collecting = False
            _NODE_DEVICES[self.par] = _node_devices(stop_graph_collection())
        if self._profile_dir is not None:
            tf.profiler.experimental.stop()
            with self._profile_dir as directory:
                self._profile_dir = None
                self.traces.append(_read_trace(directory, _NODE_DEVICES[self.par], self.par.devices, wall))

    def close(self) -> None:
        """Stop what a failed step left running."""
        if self._collecting:
            self._collecting = False
            stop_graph_collection()
        if self._profile_dir is not None:
            tf.profiler.experimental.stop()
            self._profile_dir.cleanup()
            self._profile_dir = None


def _node_devices(graphs: list[Any]) -> dict[str, str]:
    """Each node's device in the partition ``graphs`` recorded at a Parallel's first step."""
    node_devices = {node.name: node.device for graph in graphs for node in graph.node}
    if not node_devices:
        raise ValueError(
            "trace_step found no record of which device runs each op of the step: TensorFlow records it when the "
            "step first runs, and this Parallel had trained before; build a new Parallel and trace its first steps"
        )
    return node_devices


#: The host event of ``tf.data``'s get-next: how long the step waited for its batch.
INPUT_WAIT = "IteratorGetNextOp::DoCompute"


def _read_trace(directory: str, node_devices: dict[str, str], devices: Sequence[str], wall: float = 0.0) -> StepTrace:
    """The ops of the step in the profile written to ``directory``, on paraml's names of ``devices``; ``wall``: the
    batch's seconds as the loop saw them."""
    (path,) = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
    with open(path, "rb") as file:
        space = read_xspace(file.read())
    names = _device_names(set(node_devices.values()), devices)
    found = []  # (start, end) in picoseconds since the epoch: exact integers, subtracted before they become floats
    waits = []
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if name == INPUT_WAIT:
                    start = line.timestamp_ns * 1000 + event.offset_ps
                    waits.append((start, start + event.duration_ps))
                    continue
                node, _, op = name.partition(":")
                device = node_devices.get(node)
                if not device or op in NOT_WORK:
                    continue
                start = line.timestamp_ns * 1000 + event.offset_ps
                found.append((start, start + event.duration_ps, node, op.split("#")[0], names[device]))
    origin = min((start for start, *_ in found), default=0)
    ops = tuple(
        OpRun(node, op, device, (start - origin) * 1e-12, (end - origin) * 1e-12)
        for start, end, node, op, device in sorted(found, key=lambda run: (run[0], run[4], run[2]))
    )
    others = sorted({op.device for op in ops} - set(devices))
    input_waits = tuple(((start - origin) * 1e-12, (end - origin) * 1e-12) for start, end in sorted(waits))
    return StepTrace((*devices, *others), ops, wall, input_waits)


def _device_names(placed: set[str], devices: Sequence[str]) -> dict[str, str]:
    """Each device TensorFlow placed a node on (``/job:localhost/replica:0/task:0/device:CPU:1``) under the name
    ``devices`` (the Parallel's: ``/device:CPU:1``) give it, or its own when none does."""

    def key(name: str) -> tuple[str, int | None]:
        spec = tf.DeviceSpec.from_string(name)
        return (spec.device_type or "").upper(), spec.device_index

    ours = {key(device): device for device in devices}
    return {device: ours.get(key(device), device) for device in placed if device}
