"""The tf.distribute backends: ``single``, ``mirrored`` and ``central_storage``.

They share every line of their behaviour and differ only in how the ``tf.distribute.Strategy`` is built, so each is
a ``make_strategy`` on top of :class:`StrategyBackend`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import tensorflow as tf

from ..devices import canonical_device
from .base import Backend
from .registry import register

__all__ = ["CentralStorageBackend", "MirroredBackend", "SingleBackend", "StrategyBackend"]


class StrategyBackend(Backend):
    """A backend that is a ``tf.distribute.Strategy``; subclasses only say how to build the strategy."""

    def __init__(self, devices: Sequence[str], **options: Any) -> None:
        super().__init__(devices, **options)
        self.strategy: tf.distribute.Strategy = self.make_strategy()

    @abc.abstractmethod
    def make_strategy(self) -> tf.distribute.Strategy:
        """Build the strategy from ``self.devices`` and ``self.options``."""

    @property
    def num_replicas(self) -> int:
        return int(self.strategy.num_replicas_in_sync)

    def scope(self) -> AbstractContextManager[Any]:
        return self.strategy.scope()

    def distribute(self, dataset: tf.data.Dataset) -> Iterable[Any]:
        return self.strategy.experimental_distribute_dataset(dataset)

    def run(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        return self.strategy.run(fn, args=tuple(args))

    def all_reduce_sum(self, value: tf.Tensor) -> tf.Tensor:
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value)

    def gather(self, value: Any) -> tf.Tensor:
        return self.strategy.gather(value, axis=0)


@register("single")
class SingleBackend(StrategyBackend):
    """One device (``tf.distribute.OneDeviceStrategy``): the reference every other backend is compared with.

    >>> from paraml import Parallel
    >>> Parallel("single").num_replicas
    1
    """

    uses_all_devices = False

    def make_strategy(self) -> tf.distribute.Strategy:
        if len(self.devices) != 1:
            raise ValueError(f"strategy 'single' uses exactly one device, got {len(self.devices)}: {self.devices}")
        return tf.distribute.OneDeviceStrategy(self.devices[0])


@register("mirrored")
class MirroredBackend(StrategyBackend):
    """One machine, many devices (``tf.distribute.MirroredStrategy``): a copy of every variable on each device,
    gradients summed by all-reduce.

    >>> from paraml import Parallel
    >>> Parallel("mirrored", devices=2).num_replicas
    2
    """

    def make_strategy(self) -> tf.distribute.Strategy:
        _new_collective_key_range(tf.distribute.MirroredStrategy)
        return tf.distribute.MirroredStrategy(list(self.devices))


_KEY_RANGE = 100_000


def _new_collective_key_range(strategy_class: type) -> None:
    """Give the next strategy of ``strategy_class`` collective keys no earlier instance used.

    Every MirroredStrategy numbers its collective groups from the same start, so a second one over a different set
    of devices in the same process (a test suite, a notebook, fit_many) reuses group keys and TF aborts with "is
    joining a group with size 4, but that group has size 2". TF's own test-combinations shift this class attribute
    for the same reason; without it (a future TF), nothing changes.
    """
    if hasattr(strategy_class, "_collective_key_base"):
        strategy_class._collective_key_base += _KEY_RANGE


@register("central_storage")
class CentralStorageBackend(StrategyBackend):
    """Variables on one device, compute on all (``tf.distribute.experimental.CentralStorageStrategy``).

    Option ``parameter_device`` (default ``"CPU:0"``) is where every variable lives. It fits machines whose
    accelerators are short of memory or lack a fast interconnect.

    >>> from paraml import Parallel
    >>> Parallel("central_storage", devices=2, parameter_device="CPU:0").num_replicas
    2
    """

    option_names = ("parameter_device",)

    @property
    def parameter_device(self) -> str:
        """Canonical name of the device that holds every variable."""
        return canonical_device(self.options.get("parameter_device") or "CPU:0")

    def make_strategy(self) -> tf.distribute.Strategy:
        return tf.distribute.experimental.CentralStorageStrategy(
            list(self.devices), parameter_device=self.parameter_device
        )

    def metrics_scope(self) -> AbstractContextManager[Any]:
        # Metric variables made under this strategy's scope sum wrongly from the second update on (each replica
        # adds its *new value*, not its increment; measured with keras.metrics.Mean). Plain variables on the
        # parameter device, updated from every replica, sum right.
        return tf.device(self.parameter_device)

    def distribute(self, dataset: tf.data.Dataset) -> Iterable[Any]:
        # No `options` argument: TF's CentralStorageStrategy has a typo on that path (field notes, 3).
        return self.strategy.experimental_distribute_dataset(dataset)

    def describe(self) -> str:
        return super().describe() + f"; variables on {self.parameter_device}"
