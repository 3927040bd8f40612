"""The contract every backend fulfils.

A backend answers four questions for the one training loop in :mod:`paraml.training`: under which scope are the
model's variables created (and where do they live), how does a global batch reach the devices, how is a
per-replica function run, and how are values combined across replicas. It knows nothing of epochs, callbacks or
metrics; the loop knows nothing of devices.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import keras
import tensorflow as tf

from ..devices import resolve_devices

__all__ = ["Backend", "DeviceSpec", "Objective"]

#: What users pass as ``devices=``: None (all), a count, a device name or a sequence of names.
DeviceSpec = None | int | str | Sequence[str]

#: ``objective(x, y, y_pred, sample_weight) -> scalar``: the loss to differentiate for (a part of) a replica's batch,
#: already scaled so that the parts of every replica add up to the step's loss; it also updates the loss tracker and
#: the metrics. Call it right after the forward pass of that part: it reads ``model.losses`` of the latest call.
Objective = Callable[[Any, Any, Any, Any], tf.Tensor]


class Backend(abc.ABC):
    """Base class of paraml's backends; one subclass per strategy name, registered in :mod:`.registry`.

    Subclasses set ``name``, list the keyword options they accept in ``option_names`` and implement the abstract
    methods. ``forward`` and ``gradients`` have data-parallel defaults (the whole model on each replica); a backend
    that splits the model across devices overrides them.
    """

    #: The strategy name users pass to ``Parallel``.
    name: ClassVar[str] = ""
    #: Keyword options this backend accepts (anything else is rejected before training starts).
    option_names: ClassVar[tuple[str, ...]] = ()
    #: Whether a replica that a short final batch leaves without rows skips the forward pass (inside a ``tf.cond``);
    #: a backend whose forward pass holds a sync point (``merge_call``) cannot, as TF refuses one inside a ``cond``.
    skips_empty_replicas: ClassVar[bool] = True
    #: Whether a model without weights at build (a subclassed model built lazily) may get them at the first batch.
    builds_on_first_batch: ClassVar[bool] = True
    #: Whether ``devices=None`` means "every local device" (True) or "the first device" (False).
    uses_all_devices: ClassVar[bool] = True

    def __init__(self, devices: DeviceSpec = None, **options: Any) -> None:
        self.options: Mapping[str, Any] = dict(options)
        self.devices: tuple[str, ...] = self.resolve_devices(devices)

    def resolve_devices(self, devices: DeviceSpec) -> tuple[str, ...]:
        """This process's devices for the ``devices=`` argument (see :func:`paraml.devices.resolve_devices`)."""
        if devices is None and not self.uses_all_devices:
            devices = 1
        return resolve_devices(devices)

    # -- who am I (multi-worker backends override these) --------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        """How many copies of the model compute on a global batch at once (over all workers)."""
        return len(self.devices)

    @property
    def num_workers(self) -> int:
        """How many processes take part in training."""
        return 1

    @property
    def worker_index(self) -> int:
        """This process's index among the workers (0 is the chief)."""
        return 0

    @property
    def is_chief(self) -> bool:
        """True in the one process that writes files that must exist once (checkpoints, logs)."""
        return self.worker_index == 0

    # -- placement -----------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def scope(self) -> AbstractContextManager[Any]:
        """The context under which the model, its optimizer and metrics create their variables."""

    def metrics_scope(self) -> AbstractContextManager[Any]:
        """The context under which metric variables (summed across replicas) are created; default :meth:`scope`."""
        return self.scope()

    def build_model(self, model_fn: Callable[[], keras.Model], optimizer: Any = None) -> keras.Model:
        """Call ``model_fn`` so that the model's variables live where this backend wants them.

        ``optimizer`` (what the user passed to ``build``) lets a backend that plans placement by memory count the
        optimizer's slots; data-parallel backends ignore it.
        """
        with self.scope():
            return model_fn()

    # -- data and execution --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def distribute(self, dataset: tf.data.Dataset) -> Iterable[Any]:
        """Turn a dataset of global batches into what :meth:`run` takes, one element per step."""

    @abc.abstractmethod
    def run(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        """Run ``fn(*args)`` once per replica on that replica's part of the batch (inside ``tf.function``)."""

    @abc.abstractmethod
    def all_reduce_sum(self, value: tf.Tensor) -> tf.Tensor:
        """Sum ``value`` over all replicas; called inside ``fn`` of :meth:`run` (replica context)."""

    @abc.abstractmethod
    def gather(self, value: Any) -> tf.Tensor:
        """Concatenate the per-replica ``value`` returned by :meth:`run` along axis 0, in replica order."""

    # -- computation (data-parallel defaults) ---------------------------------------------------------------------
    def forward(self, model: keras.Model, x: Any, training: bool) -> Any:
        """The model's output for ``x`` on this replica."""
        return model(x, training=training)

    def gradients(
        self, model: keras.Model, x: Any, y: Any, sample_weight: tf.Tensor, objective: Objective
    ) -> tuple[list[tf.Tensor], Any]:
        """Gradients of ``objective`` with respect to the trainable variables, and the model's output."""
        with tf.GradientTape() as tape:
            y_pred = self.forward(model, x, training=True)
            loss = objective(x, y, y_pred, sample_weight)
        return tape.gradient(loss, model.trainable_variables), y_pred

    def check_optimizer(self, optimizer: keras.optimizers.Optimizer) -> None:
        """Raise ``ValueError`` (at build) for an optimizer this backend cannot step; the default takes any."""
        del optimizer

    def xla_problem(self) -> str | None:
        """Why this backend cannot compile the replicas' step with XLA, or None when it can."""
        return None

    def any_worker(self, flag: tf.Tensor) -> tf.Tensor:
        """``flag`` (a float scalar) summed over the workers, in cross-replica context: > 0 when any worker set it.

        A single process returns it as is; under ``multi_worker`` it is a collective (every worker must call it).
        """
        return flag

    def check_same_on_every_worker(self, value: int, what: str) -> None:
        """Raise unless every worker passes the same ``value``; a no-op for a single process."""
        del value, what  # one process agrees with itself

    def describe(self) -> str:
        """A one-line human description of the backend and its devices."""
        return f"{self.name} on {len(self.devices)} device(s): {', '.join(self.devices)}"
