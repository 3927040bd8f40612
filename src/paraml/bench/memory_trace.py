"""What each device holds at its peak in one training step: :func:`device_memory_peaks` and the
:class:`DeviceMemory` it returns.

Logical CPUs share one allocator, so ``tf.config.experimental.get_memory_info`` gives the whole process's peak, not a
device's. Measured here instead, from the allocator's own record of the step:

* the step runs under TensorFlow's profiler (as :func:`paraml.bench.trace.trace_step`), whose profile holds one event
  per allocation and deallocation of the allocator, each with its bytes, its address, the node that allocated it and
  the allocator's bytes in use after it (:func:`paraml.internals.allocator_events`);
* each buffer allocated in the step belongs to the device of the node that allocated it (the partition graphs
  recorded at the Parallel's first step, shared with :mod:`paraml.bench.trace`) until its deallocation frees it;
* replaying the events in order gives each device's live bytes at every moment of the step, and its **buffer peak**
  the most it held at once; a device's **peak** adds the variables and optimizer state that live on it (exact, from
  where they live: :meth:`paraml.Parallel.memory_by_device`), resident all along;
* the same replay, summed over owners, reproduces the allocator's bytes in use at every event, so its maximum is the
  process's peak (:attr:`DeviceMemory.process_peak_bytes`), checked against the allocator's own
  (:attr:`DeviceMemory.allocator_peak_bytes`).

What no device accounts for is reported, not spread: buffers allocated by a node without a known device (the input
pipeline's threads, eager ops) and what the process held when the step began beyond the variables (the batches Keras
copied into tensors), together :attr:`DeviceMemory.unattributed_bytes` at their peak. On CPU the allocator records
allocations of 256 KiB or more only (docs/tensorflow-notes.md, note 29): smaller buffers are not in the buffer peaks,
while the state bytes count every variable. A device's peaks need not fall at the same moment as another's, so the
devices' peaks add up to at least the process's peak less what is unattributed, not to it.

On GPUs each device has its own allocator; its events are replayed the same way, and the allocator's own peak of each
GPU (``get_memory_info("GPU:i")["peak"]``) is the figure to set next to the device's (``benchmarks/gpu_check.py``).

Example (a sketch; see ``benchmarks/bench_device_memory.py``)::

    par = Parallel("model_parallel", devices=2, micro_batches=8, schedule="1f1b")
    par.build(make_model, optimizer="adam", loss="mse")
    memory = device_memory_peaks(par, x_batch, y_batch)
    print(memory)  # one row per device: state, buffer peak, peak; then the unattributed and process figures
    memory.peak_bytes("/device:CPU:1")
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from paraml.bench.harness import format_table
from paraml.bench.trace import _NODE_DEVICES, _device_names, _StepRecorder, fit_recorded
from paraml.checks import check_int
from paraml.internals import AllocatorEvent, allocator_events, read_xspace

if TYPE_CHECKING:
    from paraml.parallel import Parallel

__all__ = ["DeviceMemory", "DevicePeak", "device_memory_peaks", "replay"]

MIB = 1 << 20


@dataclass(frozen=True)
class DevicePeak:
    """One device's memory over a step: ``state_bytes`` of variables and optimizer state living on it, and
    ``buffer_peak_bytes``, the most bytes of buffers its ops allocated in the step that were live at once."""

    device: str
    state_bytes: int
    buffer_peak_bytes: int

    @property
    def peak_bytes(self) -> int:
        """What the device holds at its peak: its state and its buffer peak."""
        return self.state_bytes + self.buffer_peak_bytes


@dataclass(frozen=True)
class DeviceMemory:
    """The memory of one training step, by device (see the module's docstring for how it is measured).

    Attributes:
        devices: one :class:`DevicePeak` per device of the ``Parallel`` in its order, then any other device a node
            that allocated ran on.
        unattributed_bytes: the peak of what no device accounts for: buffers of nodes without a known device, and
            what the process held when the step began beyond the variables' bytes.
        held_before_bytes: the allocators' bytes in use when the step began (the variables among them).
        process_peak_bytes: the peak of the allocators' bytes in use over the step, from replaying their events.
        allocator_peak_bytes: each allocator's own peak over the step (``get_memory_info(device)["peak"]``, reset
            before the step), by device of the ``Parallel``; on logical CPUs each is the whole process's.
        events: how many allocator events the step had.
    """

    devices: tuple[DevicePeak, ...]
    unattributed_bytes: int
    held_before_bytes: int
    process_peak_bytes: int
    allocator_peak_bytes: Mapping[str, int]
    events: int

    def device(self, name: str) -> DevicePeak:
        """The :class:`DevicePeak` of the device ``name``.

        Raises:
            ValueError: for a device that is not in :attr:`devices` (naming them).
        """
        for peak in self.devices:
            if peak.device == name:
                return peak
        raise ValueError(f"device {name!r} is not one of the measured devices: {', '.join(self.device_names)}")

    @property
    def device_names(self) -> tuple[str, ...]:
        """The names of :attr:`devices`, in order."""
        return tuple(peak.device for peak in self.devices)

    def peak_bytes(self, device: str) -> int:
        """:attr:`DevicePeak.peak_bytes` of ``device``."""
        return self.device(device).peak_bytes

    def __str__(self) -> str:
        rows = [
            [p.device, f"{p.state_bytes / MIB:.1f}", f"{p.buffer_peak_bytes / MIB:.1f}", f"{p.peak_bytes / MIB:.1f}"]
            for p in self.devices
        ]
        rows.append(["unattributed", "", "", f"{self.unattributed_bytes / MIB:.1f}"])
        table = format_table(rows, ["device", "state MiB", "buffer peak MiB", "peak MiB"])
        allocators = ", ".join(sorted({f"{peak / MIB:.1f}" for peak in self.allocator_peak_bytes.values()}))
        return (
            f"one step, {self.events} allocator events; per-device peaks need not fall at the same moment\n{table}\n"
            f"process peak {self.process_peak_bytes / MIB:.1f} MiB replayed, {allocators} MiB by the allocator; "
            f"{self.held_before_bytes / MIB:.1f} MiB held when the step began"
        )


def device_memory_peaks(
    par: Parallel, x: Any, y: Any = None, *, sample_weight: Any = None, warmup: int = 2
) -> DeviceMemory:
    """What each device of ``par`` holds at its peak in one training step on the global batch ``(x, y)`` (numpy
    arrays, or dicts or lists of them, as :meth:`paraml.Parallel.fit` takes).

    The batch is trained ``warmup`` times first, then once under the profiler with the allocators' peaks reset, all
    in one :meth:`paraml.Parallel.fit` call (as :func:`paraml.bench.trace.trace_step`: the first step ``par`` ever
    trains must run here, ``warmup`` >= 1, or ``par`` must have been traced by ``trace_step`` before).

    Raises:
        ValueError: for ``warmup`` below 1, or when ``par`` trained before without being traced (no record of the
            devices of its nodes).
        tf.errors.AlreadyExistsError: when TensorFlow's profiler is already running.
    """
    warmup = check_int("warmup", warmup)
    recorder = _MemoryRecorder(par, first_traced=warmup)
    fit_recorded(par, x, y, sample_weight, recorder)
    node_devices = _NODE_DEVICES[par]
    names = _device_names(set(node_devices.values()), par.devices)
    owners = {node: names[device] for node, device in node_devices.items() if device}
    state = par.memory_by_device()
    state_names = _device_names(set(state), par.devices)
    state_bytes = {state_names[d]: b["parameters"] + b["optimizer"] for d, b in state.items()}
    return replay(recorder.events, owners, state_bytes, par.devices, recorder.allocator_peaks)


def replay(
    events: Sequence[AllocatorEvent],
    owners: Mapping[str, str],
    state_bytes: Mapping[str, int],
    devices: Sequence[str] = (),
    allocator_peak_bytes: Mapping[str, int] | None = None,
) -> DeviceMemory:
    """Replay one step's allocator ``events`` (in time order) into each device's peak.

    ``owners`` maps a node's name to its device; a buffer allocated by a node not in it is unattributed.
    ``state_bytes`` are the bytes of variables and optimizer state on each device. ``devices`` come first in the
    result, in their order, then any other device that owned a buffer or state, sorted. A deallocation of a buffer
    allocated before the step frees part of what the process held when it began.
    """
    held_before: dict[str, int] = {}  # per allocator: its bytes in use when the step began
    live: dict[tuple[str, int], tuple[str | None, int]] = {}  # (allocator, address) -> (owner, bytes)
    holding: dict[str | None, int] = {}  # per owner (None: no known device) its live bytes
    buffer_peaks: dict[str, int] = {}
    freed_before = 0  # bytes freed in the step of buffers allocated before it
    total_state = sum(state_bytes.values())
    unattributed_peak = process_peak = 0
    for event in events:
        if event.allocator not in held_before:
            held_before[event.allocator] = event.in_use + (event.nbytes if event.freed else -event.nbytes)
        key = (event.allocator, event.address)
        if event.freed:
            owner, nbytes = live.pop(key, (None, -1))
            if nbytes < 0:
                freed_before += event.nbytes
            else:
                holding[owner] -= nbytes
        else:
            owner = owners.get(event.op)
            live[key] = (owner, event.nbytes)
            holding[owner] = holding.get(owner, 0) + event.nbytes
            if owner is not None:
                buffer_peaks[owner] = max(buffer_peaks.get(owner, 0), holding[owner])
        resident = sum(held_before.values()) - freed_before
        process_peak = max(process_peak, resident + sum(holding.values()))
        # what the process held before the step beyond the variables (never below 0: the allocator leaves out small
        # variables the state bytes count), and the buffers of nodes without a known device
        unattributed_peak = max(unattributed_peak, max(0, resident - total_state) + holding.get(None, 0))
    before = sum(held_before.values())
    if not events:
        unattributed_peak = process_peak = 0
    others = sorted((set(buffer_peaks) | set(state_bytes)) - set(devices))
    peaks = tuple(
        DevicePeak(device, int(state_bytes.get(device, 0)), buffer_peaks.get(device, 0))
        for device in (*devices, *others)
    )
    return DeviceMemory(
        devices=peaks,
        unattributed_bytes=unattributed_peak,
        held_before_bytes=before,
        process_peak_bytes=max(process_peak, before),
        allocator_peak_bytes=dict(allocator_peak_bytes or {}),
        events=len(events),
    )


class _MemoryRecorder(_StepRecorder):
    """:class:`paraml.bench.trace._StepRecorder` for one step (records the node devices at the first batch, profiles
    the traced one), keeping the profile's allocator events and the allocators' own peaks over that step."""

    def __init__(self, par: Parallel, first_traced: int) -> None:
        super().__init__(par, first_traced=first_traced, steps=1)
        self.events: list[AllocatorEvent] = []
        self.allocator_peaks: dict[str, int] = {}

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if batch in self.traced:
            for device in self.par.devices:
                tf.config.experimental.reset_memory_stats(device)
        super().on_train_batch_begin(batch, logs)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self._profile_dir is not None:
            tf.profiler.experimental.stop()
            self.allocator_peaks = {
                device: int(tf.config.experimental.get_memory_info(device)["peak"]) for device in self.par.devices
            }
            with self._profile_dir as directory:
                self._profile_dir = None
                (path,) = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
                with open(path, "rb") as file:
                    self.events = allocator_events(read_xspace(file.read()))
        super().on_train_batch_end(batch, logs)  # records the node devices after the first batch
