"""Devices: discovery, canonical names, simulated devices and device memory.

TensorFlow fixes its device layout the first time anything touches a device (creating a tensor, listing logical
devices, building a strategy). Everything here that changes the layout must therefore run first; everything that
only reads it initialises TensorFlow's devices as a side effect.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import tensorflow as tf

from paraml.checks import check_int

__all__ = [
    "DeviceInfo",
    "canonical_device",
    "describe_devices",
    "ensure_devices",
    "device_memory",
    "list_devices",
    "no_gpu_reason",
    "resolve_devices",
    "simulate_devices",
]


def canonical_device(name: str) -> str:
    """Return the canonical form of a local device string: ``"/device:TYPE:INDEX"``.

    Accepts the spellings TensorFlow users write: ``"/gpu:0"``, ``"GPU:0"``, ``"gpu:1"``, ``"/device:CPU:1"`` and
    full names such as ``"/job:localhost/replica:0/task:0/device:GPU:0"`` (the job part is dropped: devices here are
    local to the process).

    >>> canonical_device("/gpu:0")
    '/device:GPU:0'
    >>> canonical_device("cpu:1")
    '/device:CPU:1'
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"device must be a string like 'GPU:0' or '/cpu:1', got {name!r}")
    text = name.strip()
    if not text.startswith("/"):
        text = "/device:" + text if ":" in text else text
    try:
        spec = tf.DeviceSpec.from_string(text)
    except (ValueError, TypeError) as error:
        raise ValueError(f"device {name!r} is not a device string like 'GPU:0' or '/cpu:1' ({error})") from None
    if not spec.device_type or spec.device_index is None:
        raise ValueError(f"device {name!r} must name a type and an index, like 'GPU:0' or '/cpu:1'")
    return f"/device:{spec.device_type.upper()}:{spec.device_index}"


def _accelerator_type() -> str:
    """``"GPU"`` when the machine has a physical GPU, else ``"CPU"`` (the type paraml trains on by default)."""
    return "GPU" if tf.config.list_physical_devices("GPU") else "CPU"


def list_devices(device_type: str | None = None) -> tuple[str, ...]:
    """Canonical names of the local logical devices of ``device_type`` (default: GPUs if any, else CPUs).

    >>> list_devices("CPU")[0]
    '/device:CPU:0'
    """
    kind = (device_type or _accelerator_type()).upper()
    found = [tf.DeviceSpec.from_string(d.name) for d in tf.config.list_logical_devices(kind)]
    if len({(d.job, d.task) for d in found}) > 1:  # a worker of a cluster also lists the other workers' devices
        here = tf.DeviceSpec.from_string(tf.identity(0).device)  # an op runs in this process
        found = [d for d in found if (d.job, d.task) == (here.job, here.task)]
    return tuple(canonical_device(d.to_string()) for d in found)


def simulate_devices(n: int, memory_limit_mb: int | None = None) -> tuple[str, ...]:
    """Split this machine into ``n`` logical devices, so multi-device code runs on a laptop.

    With no GPU, the CPU becomes ``n`` logical CPUs; with GPUs, each physical GPU becomes ``n`` virtual GPUs (of
    ``memory_limit_mb`` each, default 1024). Call it at program start, before anything touches TensorFlow's
    devices. Calling it again with the same ``n`` is harmless; asking for another layout once TensorFlow has
    initialised its devices raises ``RuntimeError`` (TensorFlow cannot change it any more). It initialises nothing
    itself, so a ``Parallel("multi_worker")`` or a ``model_parallel`` worker of a cluster may follow it.

    Returns the canonical names of the resulting devices.

    >>> import paraml
    >>> devices = paraml.simulate_devices(4)   # at the top of a script or a conftest.py
    >>> len(devices)
    4
    """
    check_int("simulate_devices' n", n)
    kind = _accelerator_type()
    physical = tf.config.list_physical_devices(kind)
    config = tf.config.LogicalDeviceConfiguration(memory_limit=(memory_limit_mb or 1024) if kind == "GPU" else None)
    try:
        for device in physical:
            tf.config.set_logical_device_configuration(device, [config] * n)
    except RuntimeError:
        have = len(tf.config.get_logical_device_configuration(physical[0]) or [None])
        if have != n:
            raise RuntimeError(
                f"simulate_devices({n}) came too late: TensorFlow already initialised its devices with {have} "
                f"logical {kind}(s) per physical device, and that cannot change within a process. Call "
                f"paraml.simulate_devices({n}) at the start of the program (in tests: in conftest.py), before "
                "creating tensors, models or strategies."
            ) from None
    # Named, not listed: listing logical devices initialises them, after which a multi-worker strategy (created
    # next, in a worker of `paraml launch`) can no longer configure its collectives.
    return tuple(f"/device:{kind}:{i}" for i in range(n * len(physical)))


def ensure_devices(n: int) -> tuple[str, ...]:
    """At least ``n`` devices: the machine's GPUs when it has ``n``; without a GPU, the CPU split into ``n`` logical
    devices (for trying multi-device code anywhere).

    With fewer GPUs than ``n`` it raises ``ValueError``: splitting a GPU into smaller virtual ones is a choice of
    memory only the caller can make (:func:`simulate_devices` with ``memory_limit_mb``). Like
    :func:`simulate_devices`, call it at program start. Returns the canonical names of the devices.
    """
    check_int("ensure_devices' n", n)
    gpus = tf.config.list_physical_devices("GPU")  # listing *physical* devices initialises nothing
    if len(gpus) >= n:
        return list_devices("GPU")
    if gpus:
        raise ValueError(
            f"ensure_devices({n}): this machine has {len(gpus)} GPU(s). Train on them (devices={len(gpus)}), or split "
            f"each GPU on purpose with paraml.simulate_devices({n}, memory_limit_mb=...) at program start, choosing "
            "how much memory each virtual GPU gets"
        )
    return simulate_devices(n)


def no_gpu_reason() -> str:
    """Why TensorFlow most likely sees no GPU on this machine, in words (checked without initialising devices)."""
    import shutil
    import sys

    reasons = []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        reasons.append(f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU")
    if sys.platform == "darwin":
        reasons.append("TensorFlow has no CUDA support on macOS")
    elif sys.platform == "win32":
        reasons.append("TensorFlow has no GPU support on native Windows (use WSL2)")
    elif shutil.which("nvidia-smi") is None:
        reasons.append("no NVIDIA driver was found (nvidia-smi is missing)")
    if not tf.test.is_built_with_cuda():
        reasons.append("this TensorFlow was built without CUDA (on Linux: pip install 'tensorflow[and-cuda]')")
    if not reasons:
        reasons.append(
            "TensorFlow could not load CUDA's libraries: pip install 'tensorflow[and-cuda]', and run with "
            "PARAML_LOG=1 to see TensorFlow's own message"
        )
    return "TensorFlow sees no GPU, so training runs on the CPU: " + "; ".join(reasons) + "."


def resolve_devices(devices: None | int | str | Sequence[str]) -> tuple[str, ...]:
    """Turn the ``devices=`` argument of :class:`paraml.Parallel` into a tuple of canonical device names.

    ``None`` means every local GPU, else every logical CPU; an int ``n`` means the first ``n`` of those; a string
    or a sequence of strings names the devices. Raises ``ValueError`` for more devices than exist (with the
    count) and for devices that do not exist (with the ones that do).

    >>> resolve_devices(1)
    ('/device:CPU:0',)
    """
    available = list_devices()
    if devices is None:
        return available
    if isinstance(devices, bool):
        raise ValueError(f"devices must be None, an int or device names, got {devices!r}")
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"devices must be at least 1, got {devices}")
        if devices > len(available):
            hint = (
                f" (call paraml.simulate_devices({devices}) at program start to simulate them)"
                if (not available or "CPU" in available[0])
                else ""
            )
            raise ValueError(
                f"devices={devices} asks for more devices than exist: this process has {len(available)} "
                f"({', '.join(available)}){hint}"
            )
        return available[:devices]
    names = (devices,) if isinstance(devices, str) else tuple(devices)
    if not names:
        raise ValueError("devices is an empty sequence: name at least one device, e.g. ['GPU:0']")
    canonical = tuple(canonical_device(d) for d in names)
    existing = set(list_devices("GPU")) | set(list_devices("CPU"))
    for given, name in zip(names, canonical):
        if name not in existing:
            raise ValueError(f"device {given!r} does not exist; this process has: {', '.join(sorted(existing))}")
    duplicates = sorted({d for d in canonical if canonical.count(d) > 1})
    if duplicates:
        raise ValueError(f"devices name {duplicates[0]!r} more than once")
    return canonical


def device_memory(device: str) -> int | None:
    """Memory of ``device`` in bytes where TensorFlow can tell, else ``None``.

    Known for virtual GPUs with a memory limit (as made by :func:`simulate_devices`) and for physical GPUs. A CPU
    gives ``None``: TensorFlow's CPU allocator reports the whole process, not a device's capacity (pass
    ``device_memory=`` to ``Parallel("auto")`` instead).
    """
    name = canonical_device(device)
    kind, index = name.split(":")[1], int(name.split(":")[2])
    physical = tf.config.list_physical_devices(kind)
    if kind != "GPU" or not physical:
        return None
    per_gpu = tf.config.get_logical_device_configuration(physical[0])
    if per_gpu and per_gpu[0].memory_limit:
        return int(per_gpu[index % len(per_gpu)].memory_limit) * 1024 * 1024
    details = tf.config.experimental.get_device_details(physical[min(index, len(physical) - 1)])
    total = details.get("memory_limit") or details.get("total_memory")
    return int(total) if total else None


@dataclass(frozen=True)
class DeviceInfo:
    """One local device as ``paraml devices`` shows it: its canonical name, type and memory (``None`` if unknown)."""

    name: str
    device_type: str
    memory_bytes: int | None


def describe_devices() -> list[DeviceInfo]:
    """Every local logical device (GPUs first, then CPUs) with what TensorFlow can tell of its memory."""
    return [
        DeviceInfo(name, name.split(":")[1], device_memory(name))
        for kind in ("GPU", "CPU")
        for name in list_devices(kind)
    ]
