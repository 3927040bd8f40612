"""The tf.distribute backends: ``single``, ``mirrored``, ``central_storage`` and ``multi_worker``.

They share every line of their behaviour and differ only in how the ``tf.distribute.Strategy`` is built, so each is
a ``make_strategy`` on top of :class:`StrategyBackend`.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import keras
import tensorflow as tf

from ..cluster import ClusterConfigError, parse_tf_config
from ..devices import canonical_device
from .base import Backend, DeviceSpec
from .registry import register

__all__ = ["CentralStorageBackend", "MirroredBackend", "MultiWorkerBackend", "SingleBackend", "StrategyBackend"]


class StrategyBackend(Backend):
    """A backend that is a ``tf.distribute.Strategy``; subclasses only say how to build the strategy."""

    def __init__(self, devices: DeviceSpec = None, **options: Any) -> None:
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

    def distribute(self, dataset: tf.data.Dataset) -> Iterable[Any]:
        # One replica splits nothing: a plain iterator does what the distributed one does, and creating and
        # destroying it costs ~0.1 s less per fit call (measured, benchmarks/bench_overhead.py). An accelerator
        # still gets its batches prefetched onto it.
        if "CPU" in self.devices[0]:
            return dataset
        return dataset.apply(tf.data.experimental.prefetch_to_device(self.devices[0]))


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
        strategy = tf.distribute.MirroredStrategy(list(self.devices))
        _new_collective_key_range(tf.distribute.MirroredStrategy)  # and keep later strategies off this one's keys
        return strategy


_KEY_RANGE = 100_000


def _new_collective_key_range(strategy_class: type) -> None:
    """Give the next strategy of ``strategy_class`` collective keys no earlier instance used.

    Every MirroredStrategy numbers its collective groups from the same start, so a second one over a different set
    of devices in the same process (a test suite, a notebook, fit_many, a plain Keras ``fit`` after paraml's) reuses
    group keys and TF aborts with "is joining a group with size 4, but that group has size 2". TF's own
    test-combinations shift this class attribute for the same reason; without it (a future TF), nothing changes.
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
    # Updating the aggregated non-trainable state (below) is a merge_call in the forward pass: no cond around it.
    skips_empty_replicas = False

    @property
    def parameter_device(self) -> str:
        """Canonical name of the device that holds every variable."""
        return canonical_device(self.options.get("parameter_device") or "CPU:0")

    def make_strategy(self) -> tf.distribute.Strategy:
        return tf.distribute.experimental.CentralStorageStrategy(
            list(self.devices), parameter_device=self.parameter_device
        )

    @contextlib.contextmanager
    def scope(self) -> Iterator[Any]:
        # CentralStorageStrategy refuses to update, from a replica, a variable without an aggregation. Keras creates
        # its non-trainable state that way (BatchNormalization's moving statistics, the SeedGenerator of Dropout and
        # of random layers, LossScaleOptimizer's scale), so Keras' own fit fails under this strategy at the first
        # step. Variables created under this scope get an aggregation: floats the mean of the replicas' updates
        # (BatchNorm's moving statistics follow the average of the replicas' batch statistics), integers (seed and
        # step counters, equal on every replica) the first replica's.
        def with_aggregation(next_creator: Callable[..., Any], **kwargs: Any) -> Any:
            unset = kwargs.get("aggregation") in (None, tf.VariableAggregation.NONE)
            if kwargs.get("trainable") is False and unset:
                dtype = tf.as_dtype(kwargs.get("dtype") or tf.float32)
                kwargs["aggregation"] = (
                    tf.VariableAggregation.MEAN if dtype.is_floating else tf.VariableAggregation.ONLY_FIRST_REPLICA
                )
            return next_creator(**kwargs)

        with self.strategy.scope() as strategy, tf.variable_creator_scope(with_aggregation):
            yield strategy

    def check_optimizer(self, optimizer: Any) -> None:
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "strategy 'central_storage' cannot step Keras' LossScaleOptimizer (mixed_float16): it updates its "
                "loss scale from each replica inside a cond, which CentralStorageStrategy cannot aggregate. Use "
                "'mirrored', or the mixed_bfloat16 policy (no loss scaling), or build(..., auto_scale_loss=False)"
            )

    def xla_problem(self) -> str | None:
        return "under central_storage the forward pass updates aggregated variables (a sync point XLA cannot hold)"

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


_COMMUNICATION = {"auto": "AUTO", "ring": "RING", "nccl": "NCCL"}


@register("multi_worker")
class MultiWorkerBackend(StrategyBackend):
    """Many machines (``tf.distribute.MultiWorkerMirroredStrategy``): every worker process runs the same script;
    TensorFlow's collective all-reduce over gRPC keeps their variables identical.

    The cluster comes from ``TF_CONFIG`` (``paraml launch`` sets it for local runs) or from the option
    ``cluster_resolver`` (any ``tf.distribute.cluster_resolver`` object, e.g. ``SlurmClusterResolver``).
    ``communication`` is ``"auto"``, ``"ring"`` or ``"nccl"``. Each worker uses its local devices (every GPU, else
    the CPU). Create it at program start: TensorFlow must not have initialised its devices yet.

    Each worker::

        par = Parallel("multi_worker")          # reads TF_CONFIG
        par.build(make_model, optimizer="adam", loss="mse")
        par.fit(x, y, batch_size=256)           # the global batch; each worker reads its shard
        if par.is_chief:
            par.model.save_weights("model.weights.h5")
    """

    option_names = ("cluster_resolver", "communication")

    def resolve_devices(self, devices: DeviceSpec) -> tuple[str, ...]:
        if devices is not None:
            raise ValueError(
                f"strategy 'multi_worker' uses each worker's local devices, got devices={devices!r}: leave devices "
                "unset and choose a worker's devices with CUDA_VISIBLE_DEVICES (or tf.config.set_visible_devices)"
            )
        communication = self.options.get("communication", "auto")
        if communication not in _COMMUNICATION:
            raise ValueError(
                f"communication must be one of {', '.join(map(repr, _COMMUNICATION))}, got {communication!r}"
            )
        resolver = self.options.get("cluster_resolver")
        if resolver is None:
            self.cluster = parse_tf_config()
            if self.cluster is None:
                raise ClusterConfigError(
                    "strategy 'multi_worker' needs a cluster: TF_CONFIG is not set. Start the script with "
                    "`paraml launch -n 2 script.py` (it sets TF_CONFIG), set TF_CONFIG yourself, or pass "
                    "cluster_resolver="
                )
        elif not isinstance(resolver, tf.distribute.cluster_resolver.ClusterResolver):
            raise ValueError(f"cluster_resolver must be a tf.distribute.cluster_resolver object, got {resolver!r}")
        # The strategy must exist before anything initialises TensorFlow's devices (field notes, 5), so it is
        # built here, ahead of the device lookup, and its devices are read back from it.
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=getattr(
                tf.distribute.experimental.CommunicationImplementation, _COMMUNICATION[communication]
            )
        )
        try:
            self._strategy = tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=resolver, communication_options=options
            )
        except RuntimeError as error:
            raise RuntimeError(
                f"could not start MultiWorkerMirroredStrategy ({error}); create Parallel('multi_worker') at program "
                "start, before anything creates tensors or lists devices"
            ) from None
        return tuple(canonical_device(d) for d in self._strategy.extended.worker_devices)

    def make_strategy(self) -> tf.distribute.Strategy:
        return self._strategy

    @property
    def _resolver(self) -> tf.distribute.cluster_resolver.ClusterResolver:
        return self.strategy.cluster_resolver

    @property
    def num_workers(self) -> int:
        spec = self._resolver.cluster_spec()
        return sum(spec.num_tasks(job) for job in ("chief", "worker") if job in spec.jobs)

    @property
    def worker_index(self) -> int:
        spec, resolver = self._resolver.cluster_spec(), self._resolver
        has_chief = "chief" in spec.jobs
        if resolver.task_type == "chief":
            return 0
        return int(resolver.task_id) + (1 if has_chief else 0)

    def any_worker(self, flag: tf.Tensor) -> tf.Tensor:
        per_replica = self.strategy.run(lambda: tf.identity(flag))
        # Each worker's replicas all carry its flag: dividing by the local replicas counts each worker once.
        local = len(self.strategy.extended.worker_devices)
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None) / local

    def check_same_on_every_worker(self, value: int, what: str) -> None:
        """Raise on every worker unless all workers pass the same ``value`` (a collective: all must call it)."""
        per_replica = self.strategy.run(lambda: tf.constant([value], tf.int64))
        values = sorted({int(v) for v in self.strategy.gather(per_replica, axis=0).numpy()})
        if len(values) > 1:
            raise RuntimeError(f"the workers disagree on {what}: {values}")

    def describe(self) -> str:
        return f"multi_worker: worker {self.worker_index} of {self.num_workers}, " + super().describe()
