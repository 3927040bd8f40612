"""The contract every backend fulfils: who it is, what it can do, and how it executes.

A backend answers the one training loop (:mod:`paraml.loop.training`) in three groups, and knows nothing of epochs,
callbacks or metrics (the loop knows nothing of devices):

- **identity**, one value: :attr:`Backend.topology`, this process's devices, the :class:`Layout` (data replicas x
  pipeline stages x tensor shards), the number of workers and this worker's index;
- **capabilities**, one value: :attr:`Backend.capabilities`, what the loop and the facade may ask of it;
- **execution**: the scope variables are created under, building the model where its variables belong, turning
  global batches into per-replica ones, running a per-replica function, the reductions, the forward pass and the
  loss, and a readable description.

A new backend is a subclass registered by name (:func:`paraml.backends.register`); ``tests/test_backends.py`` trains
through one written in a few lines.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol

import keras
import tensorflow as tf

from paraml.parallelism.apply import apply_plan
from paraml.parallelism.buckets import plan_bucket_bytes
from paraml.planning.plan import DeviceMesh, Layout, ParallelPlan

__all__ = ["Accumulator", "Backend", "Capabilities", "DeviceSpec", "Layout", "Objective", "Techniques", "Topology"]

#: What users pass as ``devices=``: None (all), a count, a device name or a sequence of names.
DeviceSpec = None | int | str | Sequence[str]

#: ``objective(x, y, y_pred, sample_weight) -> loss parts``: the loss of (a part of) a replica's batch as a vector
#: of sums that add up over micro-batches and replicas (:class:`paraml.loop.steps.ReplicaStep` divides them by the
# global
#: counts); it also updates the metrics. Call it right after the forward pass of that part: it reads
#: ``model.losses`` of the latest call.
Objective = Callable[[Any, Any, Any, Any], tf.Tensor]


class Accumulator(Protocol):
    """Gradient accumulation's running sums between updates, called in a replica's step: ``accumulate`` adds a step's
    gradients, ``with_sums`` gives the gradients the updating step hands the optimizer (this step's and the sums,
    over ``steps`` steps), ``reset`` empties the sums after the update."""

    def accumulate(self, grads: list[Any]) -> None: ...

    def with_sums(self, grads: list[Any], steps: float) -> list[Any]: ...

    def reset(self) -> None: ...


class Techniques(Protocol):
    """What the loop asks of the plan's techniques once they are applied to the model
    (:class:`paraml.parallelism.apply.AppliedPlan`): the loop reads them through the backend and imports none."""

    plan: ParallelPlan
    #: The names of the units that recompute their activations (``remat``).
    recomputed: list[str]

    def trained_variables(self, model: keras.Model) -> list[Any]:
        """The variables the gradient is taken for and the optimizer updates (a split weight's parts); for the
        compiled model, those its last compile saw."""
        ...

    def variables_of(self, layer: keras.layers.Layer) -> list[Any]:
        """Every variable of ``layer``, trainable or not, as the step sees it (a split weight's parts)."""
        ...

    def prepare_optimizer(self, optimizer: Any, model: keras.Model, topology: Topology) -> Any:
        """``optimizer`` (made under the backend's scope) as the plan trains with it, built for the model."""
        ...

    def build_optimizer(self, optimizer: Any, model: keras.Model) -> None:
        """Create ``optimizer``'s slots for :meth:`trained_variables` (a part's slots on the part's device)."""
        ...

    def prepare_loss(self, loss: Any) -> Any:
        """``loss`` as the plan computes it (a cross-entropy on split logits computed on the slices)."""
        ...

    def optimizer_state(self, optimizer: Any) -> list[Any]:
        """The optimizer's variables as a checkpoint stores them: every slot whole (a collective when sharded
        across workers)."""
        ...

    def restorable_state(self, optimizer: Any) -> list[tuple[Any | None, tuple[int, ...]]]:
        """Each saved optimizer variable as a restore fills it: the variable (None: another worker's) and its
        whole shape."""
        ...

    def owned_sums(self, variables: list[Any], topology: Topology) -> Accumulator | None:
        """Gradient accumulation's sums kept on each variable's owner only, when the plan shards the gradients
        (ZeRO-2, 3); None: the loop keeps a sum per replica. Called in the backend's scope."""
        ...


@dataclass(frozen=True)
class Topology:
    """Who and where this process is: its devices, the layout, how many workers train together and which one it is.

    >>> t = Topology(("/device:CPU:0", "/device:CPU:1"), Layout(data=2))
    >>> t.num_replicas, t.num_workers, t.is_chief
    (2, 1, True)
    """

    devices: tuple[str, ...]
    layout: Layout
    num_workers: int = 1
    worker_index: int = 0

    @property
    def num_replicas(self) -> int:
        """Copies of the model computing each global batch, over all workers (``layout.data``)."""
        return self.layout.data

    @property
    def is_chief(self) -> bool:
        """True in the one process that writes files that must exist once (checkpoints, logs): worker 0."""
        return self.worker_index == 0


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the loop and the facade read it instead of asking the backend's type.

    Attributes:
        skips_empty_replicas: A replica that a short final batch leaves without rows skips the forward pass inside a
            ``tf.cond``. A backend whose forward pass holds a sync point (``merge_call``) cannot: TF refuses one
            inside a ``cond``.
        builds_on_first_batch: A model without weights at build (a subclassed model built lazily) may get them at
            its first batch; False for a backend that places weights at build.
        xla_problem: Why the replicas' step cannot be compiled with XLA here, or None.
        loss_scaling_problem: Why Keras' ``LossScaleOptimizer`` (``mixed_float16``) cannot be stepped here, or None.
        grouped_convolution_problem: Why a convolution with ``groups > 1`` (a grouped or depthwise one, as in
            ConvNeXt) cannot run here, or None.
        own_train_step_problem: Why a model's own ``train_step`` cannot run here (as configured), or None.
        zero_stage: What of each trainable variable lives on one owner replica only (:mod:`paraml.parallelism.zero`):
            0 nothing, 1 its optimizer slots, 2 also its reduced gradient, 3 also the variable.
        colocates_gradients: A replica's step spans several devices, so each gradient op must run on its forward
            op's device (the step takes ``tf.gradients``, which places them there, rather than a tape's gradient).
    """

    skips_empty_replicas: bool = True
    builds_on_first_batch: bool = True
    xla_problem: str | None = None
    loss_scaling_problem: str | None = None
    grouped_convolution_problem: str | None = None
    own_train_step_problem: str | None = None
    zero_stage: int = 0
    colocates_gradients: bool = False


class Backend(abc.ABC):
    """Base class of paraml's backends; one subclass per strategy name, registered in :mod:`.registry`.

    A subclass sets ``option_names`` (the keyword options it accepts; the facade refuses any other before building
    anything), ``capabilities`` when it differs from the default, and :attr:`topology` in ``__init__``; it implements
    the abstract methods. ``build_model``, ``metrics_scope``, ``forward``, ``loss``,
    ``across_workers`` and ``describe`` have data-parallel, one-process defaults (the whole model on each replica).
    """

    #: The strategy name users pass to ``Parallel`` (set by ``register``).
    name: ClassVar[str] = ""
    #: Keyword options this backend accepts (anything else is rejected before training starts).
    option_names: ClassVar[tuple[str, ...]] = ()
    #: What this backend can do (a class default; an instance may narrow it from its options and plan).
    capabilities: Capabilities = Capabilities()
    #: This process's devices, the layout and its place among the workers (set by ``__init__``).
    topology: Topology
    #: The parallel plan of the model built: one value every technique reads (set by :meth:`build_model`).
    plan: ParallelPlan | None = None
    #: The plan's techniques as applied to the model built, what the loop asks of them (set by :meth:`build_model`).
    techniques: Techniques

    def __init__(self, devices: DeviceSpec = None, **options: Any) -> None:
        del devices  # each subclass resolves them into its topology
        self.options: Mapping[str, Any] = dict(options)

    # -- placement ----------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def scope(self) -> AbstractContextManager[Any]:
        """The context under which the model and its optimizer create their variables."""

    def metrics_scope(self) -> AbstractContextManager[Any]:
        """The context under which metric variables (summed across replicas) are created; default :meth:`scope`."""
        return self.scope()

    def build_model(
        self, model_fn: Callable[[], keras.Model], optimizer: Any = None, host_model: Any = None, remat: bool = False
    ) -> keras.Model:
        """Call ``model_fn`` so that the model's variables live where this backend wants them, make the plan
        (:attr:`plan`) and apply it (:attr:`techniques`).

        ``optimizer`` (what the user passed to ``build``) and ``remat`` (whether the units will be recomputed) let a
        backend that plans placement by memory count the optimizer's slots and the activations kept. ``host_model``
        is a :class:`paraml.planning.observe.HostModel` the caller already built (``auto`` measured it), for a
        backend that plans from a first build. The default: the whole model on each replica, under :meth:`scope`.
        """
        del optimizer, host_model
        with self.scope():
            model = model_fn()
        plan = ParallelPlan(
            self.topology.layout,
            DeviceMesh(tuple(((device,),) for device in self.topology.devices)),
            # ZeRO-3 reads each variable again in its unit's backward pass, recomputing it (module zero)
            remat=remat or self.capabilities.zero_stage == 3,
            zero_stage=self.capabilities.zero_stage,
            bucket_bytes=plan_bucket_bytes(
                model.trainable_variables, self.capabilities.zero_stage, self.options.get("bucket_bytes")
            ),
        )
        self.apply_plan(model, plan)
        return model

    def apply_plan(self, model: keras.Model, plan: ParallelPlan, **runtime: Any) -> None:
        """Keep ``plan`` as :attr:`plan` and apply its techniques to ``model`` in their one order
        (:func:`paraml.parallelism.apply.apply_plan`; ``runtime``: what only the backend knows while it traces, as
        a pipeline's stage devices and gates); say in :attr:`capabilities` what they rule out."""
        self.plan = plan
        self.techniques = apply_plan(model, plan, **runtime)
        if plan.remat:
            # TensorFlow cannot differentiate a recomputed unit inside a tf.cond (its backward branch reads the
            # variables again, which cond_v2 refuses): no replica or micro-batch is skipped in a cond.
            self.capabilities = replace(self.capabilities, skips_empty_replicas=False)

    # -- data and execution -------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def distribute(self, dataset: tf.data.Dataset) -> Iterable[Any]:
        """Turn a dataset of global batches into what :meth:`run` takes, one element per step."""

    @abc.abstractmethod
    def run(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        """Run ``fn(*args)`` once per replica on that replica's part of the batch (inside ``tf.function``)."""

    @abc.abstractmethod
    def all_reduce_sum(self, value: Any) -> Any:
        """Sum ``value`` (a tensor or a list of tensors) over all replicas; called inside ``fn`` of :meth:`run`."""

    @abc.abstractmethod
    def gather(self, value: Any) -> tf.Tensor:
        """Concatenate the per-replica ``value`` returned by :meth:`run` along axis 0, in replica order."""

    def across_workers(self, value: tf.Tensor) -> tf.Tensor:
        """Every worker's ``value`` (a tensor computed on the host), one row per worker: shape ``[workers, ...]``.

        Called in cross-replica context by every worker at the same point (a collective under ``multi_worker``);
        the loop sums it to agree on a stop request, checkpoints compare it to agree on where to resume. One
        process returns ``value`` with a leading axis of 1.
        """
        return tf.expand_dims(tf.convert_to_tensor(value), 0)

    # -- computation (data-parallel defaults) -------------------------------------------------------------------------
    def forward(self, model: keras.Model, x: Any, training: bool) -> Any:
        """The model's output for ``x`` on this replica."""
        return model(x, training=training)

    def loss(
        self, model: keras.Model, x: Any, y: Any, sample_weight: Any, objective: Objective, training: bool
    ) -> tuple[tf.Tensor, Any]:
        """The forward pass and ``objective`` on this replica: (the loss parts, the model's output).

        A backend that splits the batch (micro-batches) applies ``objective`` to each part right after that part's
        forward pass, as it reads the losses the layers added during that call, and adds the parts up.
        """
        y_pred = self.forward(model, x, training=training)
        return objective(x, y, y_pred, sample_weight), y_pred

    def describe(self) -> str:
        """A human description of the backend and its devices."""
        devices = self.topology.devices
        return f"{self.name} on {len(devices)} device(s): {', '.join(devices)}"
