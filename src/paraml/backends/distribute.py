"""The tf.distribute backends: ``single``, ``mirrored``, ``central_storage`` and ``multi_worker``.

They share every line of their behaviour and differ only in how the ``tf.distribute.Strategy`` is built, so each is
a ``make_strategy`` on top of :class:`StrategyBackend`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import tensorflow as tf

from paraml.backends.base import Backend, Capabilities, DeviceSpec, Layout, Topology
from paraml.backends.registry import register
from paraml.checks import check_choice
from paraml.cluster.config import connect_timeout, global_worker_index, wait_for_workers
from paraml.cluster.detect import setup_tf_config
from paraml.devices import canonical_device, resolve_devices
from paraml.internals import shift_collective_keys
from paraml.parallelism.buckets import check_bucket_bytes
from paraml.parallelism.zero import ShardedSlots, owned_variables
from paraml.planning.plan import zero_stage

__all__ = [
    "CentralStorageBackend",
    "MirroredBackend",
    "MultiWorkerBackend",
    "SingleBackend",
    "StrategyBackend",
    "mirrored_strategy",
    "multi_worker_strategy",
    "workers",
]


class StrategyBackend(Backend):
    """A backend that is a ``tf.distribute.Strategy``; subclasses only say how to build the strategy."""

    def __init__(self, devices: DeviceSpec = None, **options: Any) -> None:
        stage = zero_stage(options)
        check_bucket_bytes(options.get("bucket_bytes"), stage)
        super().__init__(devices, **options)
        if stage:  # options only the data-parallel backends that copy the state per replica name
            self.capabilities = dataclasses.replace(self.capabilities, zero_stage=stage)
        self.strategy: tf.distribute.Strategy = self.make_strategy(devices)
        self.topology = self.make_topology()
        #: ZeRO-3: where each trainable variable was made (its owner; across workers, whether this one holds it)
        self.placed = ShardedSlots()

    @abc.abstractmethod
    def make_strategy(self, devices: DeviceSpec) -> tf.distribute.Strategy:
        """Build the strategy for the ``devices=`` argument and ``self.options``."""

    def make_topology(self) -> Topology:
        """One process whose replicas are the strategy's devices, one data replica each."""
        devices = tuple(canonical_device(d) for d in self.strategy.extended.worker_devices)
        return Topology(devices, Layout(data=int(self.strategy.num_replicas_in_sync)))

    @contextlib.contextmanager
    def scope(self) -> Iterator[Any]:
        with self.strategy.scope() as strategy:
            if self.capabilities.zero_stage < 3:
                yield strategy
                return
            t = self.topology
            # ZeRO-3: each trainable variable once, on its owner
            with owned_variables(t.devices, self.placed, t.num_workers, t.worker_index):
                yield strategy

    def apply_plan(self, model: Any, plan: Any, **runtime: Any) -> None:
        if self.capabilities.zero_stage == 3 and self.topology.num_workers > 1:
            runtime["placed"] = self.placed  # each unit gathers its weights from the other workers
        super().apply_plan(model, plan, **runtime)

    def distribute(self, dataset: tf.data.Dataset) -> Iterable[Any]:
        return self.strategy.experimental_distribute_dataset(dataset)

    def describe(self) -> str:
        plan = getattr(self, "plan", None)
        if plan is None or not plan.zero_stage:
            return super().describe()
        return "\n".join([super().describe(), *plan.describe().splitlines()[1:]])  # ZeRO, its buckets, remat

    def run(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        return self.strategy.run(fn, args=tuple(args))

    def all_reduce_sum(self, value: Any) -> Any:
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value)

    def gather(self, value: Any) -> tf.Tensor:
        return self.strategy.gather(value, axis=0)

    def across_workers(self, value: tf.Tensor) -> tf.Tensor:
        if self.topology.num_workers == 1:
            return super().across_workers(value)
        per_replica = self.strategy.run(lambda: tf.expand_dims(tf.identity(value), 0))
        # One row per replica, worker after worker: keep each worker's first.
        per_worker = int(self.strategy.num_replicas_in_sync) // self.topology.num_workers
        return self.strategy.gather(per_replica, axis=0)[::per_worker]


@register("single")
class SingleBackend(StrategyBackend):
    """One device (``tf.distribute.OneDeviceStrategy``): the reference every other backend is compared with.

    >>> from paraml import Parallel
    >>> Parallel("single").num_replicas
    1
    """

    def make_strategy(self, devices: DeviceSpec) -> tf.distribute.Strategy:
        resolved = resolve_devices(1 if devices is None else devices)  # None: the first device
        if len(resolved) != 1:
            raise ValueError(f"strategy 'single' uses exactly one device, got {len(resolved)}: {resolved}")
        return tf.distribute.OneDeviceStrategy(resolved[0])

    def distribute(self, dataset: tf.data.Dataset) -> Iterable[Any]:
        # One replica splits nothing: a plain iterator does what the distributed one does, and creating and
        # destroying it costs ~0.1 s less per fit call (measured on CPU with TF 2.21). An accelerator
        # still gets its batches prefetched onto it.
        device = self.topology.devices[0]
        if "CPU" in device:
            return dataset
        return dataset.apply(tf.data.experimental.prefetch_to_device(device))


@register("mirrored")
class MirroredBackend(StrategyBackend):
    """One machine, many devices (``tf.distribute.MirroredStrategy``): a copy of every variable on each device,
    gradients summed by all-reduce.

    Option ``shard_optimizer=True`` keeps each variable's optimizer slots on one device only, which runs its update
    and broadcasts the result (ZeRO stage 1, :mod:`paraml.parallelism.zero`): the same weights, 1/N of the optimizer
    state per device. ``shard_gradients=True`` also reduces each gradient to that device only (ZeRO-2);
    ``shard_parameters=True`` also keeps the variable there only, read where it is used, its unit recomputed in the
    backward pass (ZeRO-3): 1/N of the parameters per device.

    >>> from paraml import Parallel
    >>> Parallel("mirrored", devices=2).num_replicas
    2
    """

    option_names = ("shard_optimizer", "shard_gradients", "shard_parameters", "bucket_bytes")

    def make_strategy(self, devices: DeviceSpec) -> tf.distribute.Strategy:
        return mirrored_strategy(resolve_devices(devices))


_KEY_RANGE = 100_000


def mirrored_strategy(devices: Sequence[str]) -> tf.distribute.MirroredStrategy:
    """``MirroredStrategy`` over ``devices``, on collective keys no other strategy of this process uses."""
    _new_collective_key_range(tf.distribute.MirroredStrategy)
    strategy = tf.distribute.MirroredStrategy(list(devices))
    _new_collective_key_range(tf.distribute.MirroredStrategy)  # and keep later strategies off this one's keys
    return strategy


def _new_collective_key_range(strategy_class: type) -> None:
    """Give the next strategy of ``strategy_class`` collective keys no earlier instance used.

    Every MirroredStrategy numbers its collective groups from the same start, so a second one over a different set
    of devices in the same process (a test suite, a notebook, fit_many, a plain Keras ``fit`` after paraml's) reuses
    group keys and TF aborts with "is joining a group with size 4, but that group has size 2". TF's own
    test-combinations shift this class attribute for the same reason; without it (a future TF), nothing changes.
    """
    shift_collective_keys(strategy_class, _KEY_RANGE)


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
    capabilities = Capabilities(
        # Updating the aggregated non-trainable state (see scope) is a merge_call in the forward pass: no cond.
        skips_empty_replicas=False,
        xla_problem="under central_storage the forward pass updates aggregated variables (a sync point XLA cannot "
        "hold)",
        loss_scaling_problem="it updates its loss scale from each replica inside a cond, which "
        "CentralStorageStrategy cannot aggregate",
        # Keras runs a grouped convolution as an XLA computation, which cannot read a variable that lives on
        # another device ("Trying to access resource ... located in device CPU:0"); Keras' own fit fails alike.
        grouped_convolution_problem="Keras compiles a grouped convolution with XLA, which cannot read the kernel "
        "from the parameter device",
    )

    @property
    def parameter_device(self) -> str:
        """Canonical name of the device that holds every variable."""
        return canonical_device(self.options.get("parameter_device") or "CPU:0")

    def make_strategy(self, devices: DeviceSpec) -> tf.distribute.Strategy:
        return tf.distribute.experimental.CentralStorageStrategy(
            list(resolve_devices(devices)), parameter_device=self.parameter_device
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

    def metrics_scope(self) -> AbstractContextManager[Any]:
        # Metric variables made under this strategy's scope sum wrongly from the second update on (each replica
        # adds its *new value*, not its increment; measured with keras.metrics.Mean). Plain variables on the
        # parameter device, updated from every replica, sum right.
        return tf.device(self.parameter_device)

    def distribute(self, dataset: tf.data.Dataset) -> Iterable[Any]:
        # No `options` argument: TF 2.21's CentralStorageStrategy has a typo on that path (an AttributeError on
        # 'experimental_replication_moden').
        return self.strategy.experimental_distribute_dataset(dataset)

    def describe(self) -> str:
        return super().describe() + f"; variables on {self.parameter_device}"


_COMMUNICATION = {"auto": "AUTO", "ring": "RING", "nccl": "NCCL"}


@register("multi_worker")
class MultiWorkerBackend(StrategyBackend):
    """Many machines (``tf.distribute.MultiWorkerMirroredStrategy``): every worker process runs the same script;
    TensorFlow's collective all-reduce over gRPC keeps their variables identical.

    The cluster comes from ``TF_CONFIG`` (``paraml launch`` sets it), else from a scheduler's variables (Slurm,
    Vertex AI, Kubernetes, Kubeflow, SageMaker, MPI: :mod:`paraml.cluster.detect`), or from the option
    ``cluster_resolver`` (any ``tf.distribute.cluster_resolver`` object).
    ``communication`` is ``"auto"``, ``"ring"`` or ``"nccl"``. Each worker uses its local devices (every GPU, else
    the CPU). Create it at program start: TensorFlow must not have initialised its devices yet. Option
    ``shard_optimizer=True`` keeps each variable's optimizer slots on one replica of one worker
    (:mod:`paraml.parallelism.zero`); ``shard_gradients=True`` also reduces each gradient to that replica only;
    ``shard_parameters=True`` also keeps the variable there only (another worker holds an empty placeholder), each
    unit's weights gathered from their owners where it runs, in the forward pass and again in its recomputed
    backward pass. The model then computes inside ``fit``, ``evaluate`` and ``predict`` only, and ``par.save``
    writes whole tensors.

    Each worker::

        par = Parallel("multi_worker")          # reads TF_CONFIG
        par.build(make_model, optimizer="adam", loss="mse")
        par.fit(x, y, batch_size=256)           # the global batch; each worker reads its shard
        if par.is_chief:
            par.model.save_weights("model.weights.h5")
    """

    option_names = (
        "cluster_resolver",
        "communication",
        "shard_optimizer",
        "shard_gradients",
        "shard_parameters",
        "bucket_bytes",
    )

    def make_strategy(self, devices: DeviceSpec) -> tf.distribute.Strategy:
        if devices is not None:
            raise ValueError(
                f"strategy 'multi_worker' uses each worker's local devices, got devices={devices!r}: leave devices "
                "unset and choose a worker's devices with CUDA_VISIBLE_DEVICES (or tf.config.set_visible_devices)"
            )
        return multi_worker_strategy(self.options, "multi_worker")

    def make_topology(self) -> Topology:
        return dataclasses.replace(super().make_topology(), **workers(self.strategy))

    def describe(self) -> str:
        t = self.topology
        return f"multi_worker: worker {t.worker_index} of {t.num_workers}, " + super().describe()


def multi_worker_strategy(
    options: Mapping[str, Any], strategy: str, *, one_replica: bool = False
) -> tf.distribute.MultiWorkerMirroredStrategy:
    """TensorFlow's ``MultiWorkerMirroredStrategy`` for the cluster of ``options`` (``cluster_resolver``, else
    ``TF_CONFIG``) and its ``communication``; ``strategy`` names the caller in errors. ``one_replica``: one replica
    per worker, on its first device (a pipeline over the worker's devices), instead of one per local GPU.

    Must run before anything initialises TensorFlow's devices: the strategy configures them.
    """
    communication = check_choice("communication", options.get("communication", "auto"), _COMMUNICATION)
    resolver = options.get("cluster_resolver")
    if resolver is None:
        cluster = setup_tf_config(required=True)  # TF_CONFIG, else set from a scheduler's variables
        if cluster.num_workers > 1:  # TensorFlow's own wait for the others can be ended by nothing
            wait_for_workers(cluster, connect_timeout())
        if one_replica:
            resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    elif not isinstance(resolver, tf.distribute.cluster_resolver.ClusterResolver):
        raise ValueError(f"cluster_resolver must be a tf.distribute.cluster_resolver object, got {resolver!r}")
    if one_replica:  # without GPUs the strategy has one CPU replica per worker already
        gpus = min(1, len(tf.config.list_physical_devices("GPU")))
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            resolver.cluster_spec(),
            task_type=resolver.task_type,
            task_id=resolver.task_id,
            rpc_layer=resolver.rpc_layer or "grpc",
            num_accelerators={"GPU": gpus} if gpus else None,
        )
    implementation = getattr(tf.distribute.experimental.CommunicationImplementation, _COMMUNICATION[communication])
    try:
        return tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=resolver,
            communication_options=tf.distribute.experimental.CommunicationOptions(implementation=implementation),
        )
    except RuntimeError as error:
        raise RuntimeError(
            f"could not start MultiWorkerMirroredStrategy ({error}); create Parallel({strategy!r}) at program "
            "start, before anything creates tensors or lists devices"
        ) from None


def workers(strategy: tf.distribute.Strategy) -> dict[str, int]:
    """``num_workers`` and ``worker_index`` of a ``MultiWorkerMirroredStrategy``'s cluster (the chief first)."""
    resolver = strategy.cluster_resolver
    spec = resolver.cluster_spec()
    jobs = {job: spec.num_tasks(job) for job in ("chief", "worker") if job in spec.jobs}
    index = global_worker_index(resolver.task_type, int(resolver.task_id), has_chief="chief" in jobs)
    return {"num_workers": sum(jobs.values()), "worker_index": index}
