"""``Parallel("auto")``: the rule that picks a strategy, with the numbers behind the choice.

The rule, in order:

1. ``TF_CONFIG`` describes a cluster of more than one worker -> ``multi_worker`` (decided at once: that strategy
   must exist at program start);
2. more than one device, and the estimated training memory fits on one device -> ``mirrored``;
3. more than one device, and the model fits on one device only when its activations are recomputed
   (``estimate_memory(..., remat=True)``) -> ``mirrored`` with ``remat=True``;
4. more than one device (the model does not fit on one) -> ``model_parallel`` with a balanced partition;
5. otherwise -> ``single`` (with ``remat=True`` when one device's known memory needs it).

Device memory comes from TensorFlow where it can tell (GPUs), else from the ``device_memory`` option
(``"2GiB"``, ``"512MB"`` or bytes). Unknown memory counts as "fits": data parallelism is the faster default.

:func:`decide` is the pure rule; :class:`AutoChoice` measures the model (built once on the host, and handed to the
chosen backend so that ``model_parallel`` plans from that build instead of making its own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .memory import MemoryEstimate
from .sizes import format_bytes, parse_size

if TYPE_CHECKING:  # pragma: no cover
    import keras

    from .backends.base import Backend, DeviceSpec
    from .units import HostModel

__all__ = ["AUTO_OPTIONS", "AutoChoice", "AutoDecision", "decide"]

#: Options of ``Parallel("auto")``: its own, and those it passes to ``model_parallel`` if it picks it.
AUTO_OPTIONS = ("device_memory", "batch_size", "sample", "partition", "micro_batches")


@dataclass(frozen=True)
class AutoDecision:
    """What ``auto`` chose and why: :meth:`explain` says it in words, with the numbers."""

    strategy: str
    num_workers: int
    num_devices: int
    estimate: MemoryEstimate | None
    device_memory: int | None
    remat_estimate: MemoryEstimate | None = None
    remat: bool = False

    def explain(self) -> str:
        """Why this strategy, with the numbers that decided it."""
        if self.strategy == "multi_worker":
            return f"chose 'multi_worker': TF_CONFIG describes a cluster of {self.num_workers} workers"
        have = (
            f"device memory {format_bytes(self.device_memory)}"
            if self.device_memory is not None
            else "device memory unknown (pass device_memory='16GiB' to decide by it)"
        )
        if self.num_devices <= 1 and not self.remat:
            return "chose 'single': one device is available"
        need = _needs(self.estimate)
        if self.remat:
            assert self.remat_estimate is not None
            where = "one device is available" if self.num_devices <= 1 else f"on {self.num_devices} devices"
            return (
                f"chose {self.strategy!r} with remat=True ({where}): the model fits on one device only with its "
                f"activations recomputed: {_needs(self.remat_estimate)} <= {have}; without recompute, {need}"
            )
        if self.strategy == "mirrored":
            return f"chose 'mirrored' on {self.num_devices} devices: the model fits on one device: {need}; {have}"
        more = "" if self.remat_estimate is None else f", or with remat=True {format_bytes(self.remat_estimate.total)}"
        return (
            f"chose 'model_parallel' on {self.num_devices} devices: the model does not fit on one device: "
            f"{need}{more} > {have}"
        )


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
    remat_estimate: MemoryEstimate | None = None,
) -> AutoDecision:
    """Apply the rule of this module (pure: no TensorFlow, so each branch is testable on its own).

    ``remat_estimate`` is the estimate with recompute (given when ``estimate`` does not fit): if it fits, the model
    trains data-parallel (or on its one device) with ``remat=True``.
    """
    fits = estimate is None or device_memory is None or estimate.total <= device_memory
    fits_with_remat = not fits and remat_estimate is not None and remat_estimate.total <= device_memory  # type: ignore[operator]
    if num_workers > 1:
        strategy = "multi_worker"
    elif num_devices <= 1:
        strategy = "single"
    elif fits or fits_with_remat:
        strategy = "mirrored"
    else:
        strategy = "model_parallel"
    remat = strategy != "multi_worker" and fits_with_remat
    return AutoDecision(strategy, num_workers, num_devices, estimate, device_memory, remat_estimate, remat)


class AutoChoice:
    """The pending choice of ``Parallel("auto", devices, **options)``: made at once for a cluster, else at build.

    ``backend`` is the chosen backend (None until chosen), ``decision`` the :class:`AutoDecision` behind it.
    """

    def __init__(self, devices: DeviceSpec, options: dict[str, Any]) -> None:
        from . import backends
        from .cluster import parse_tf_config

        self.devices = devices
        self.options = dict(options)
        if self.options.get("device_memory") is not None:
            self.options["device_memory"] = parse_size(self.options["device_memory"])
        self.backend: Backend | None = None
        self.decision: AutoDecision | None = None
        cluster = parse_tf_config()
        if cluster is not None and cluster.num_workers > 1:  # decided now: the strategy must exist at program start
            self.decision = decide(num_workers=cluster.num_workers, num_devices=0, estimate=None, device_memory=None)
            self.backend = backends.get_backend("multi_worker")(devices)

    def local_devices(self) -> tuple[str, ...]:
        """The devices the choice is made among."""
        from .devices import resolve_devices

        return resolve_devices(self.devices)

    def choose(
        self, model_fn: Callable[[], keras.Model], optimizer: Any, remat: bool = False
    ) -> tuple[Backend, HostModel | None]:
        """Measure the model, apply :func:`decide`, create the chosen backend; return it and the host build of the
        model when one was made (for the backend's ``build_model``). With ``remat`` (the user's), the model is
        measured with recompute; else recompute is measured when the model does not fit without it."""
        from . import backends
        from .devices import device_memory
        from .memory import estimate_memory
        from .units import build_on_host

        devices = self.local_devices()
        memory = self.options.get("device_memory")
        if memory is None:
            memory = device_memory(devices[0])
        estimate, remat_estimate, host = None, None, None
        if len(devices) > 1 or memory is not None:  # measured on the host: the model may not fit on one accelerator
            host = build_on_host(model_fn)
            measure = {"batch_size": self.options.get("batch_size", 32), "sample": self.options.get("sample")}
            estimate = estimate_memory(host.model, optimizer=optimizer, remat=remat, **measure)
            if not remat and memory is not None and estimate.total > memory:
                remat_estimate = estimate_memory(host.model, optimizer=optimizer, remat=True, **measure)
        self.decision = decide(
            num_workers=1,
            num_devices=len(devices),
            estimate=estimate,
            device_memory=memory,
            remat_estimate=remat_estimate,
        )
        chosen = backends.get_backend(self.decision.strategy)
        passed = {k: v for k, v in self.options.items() if k in chosen.option_names}
        self.backend = chosen(self.devices if len(devices) > 1 else devices, **passed)
        return self.backend, host
