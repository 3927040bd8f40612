"""The facade: ``Parallel(strategy, devices)`` picks a backend by name, owns the model and runs the one loop."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from . import backends
from .auto import AutoDecision, decide
from .backends.base import Backend
from .checkpoint import CheckpointState, latest_checkpoint, restore_checkpoint, save_checkpoint
from .cluster import parse_tf_config
from .data import GlobalBatches, global_batches
from .devices import device_memory, resolve_devices
from .memory import estimate_memory, parse_size
from .partition import PartitionPlan
from .training import Trainer, make_optimizer, resolve_loss, resolve_metrics

__all__ = ["Parallel"]

#: Options every backend accepts; the backend's own ``option_names`` add to these.
COMMON_OPTIONS = ("seed", "steps_per_execution")

Verbose = int | str | bool

#: Options of ``Parallel("auto")``: its own, and those it passes to ``model_parallel`` if it picks it.
AUTO_OPTIONS = ("device_memory", "batch_size", "partition", "micro_batches")

#: Keras callbacks that write files which must exist once: under multi_worker only the chief runs them.
CHIEF_ONLY_CALLBACKS = (keras.callbacks.ModelCheckpoint, keras.callbacks.CSVLogger, keras.callbacks.TensorBoard)


def _verbosity(verbose: Verbose, default: int) -> int:
    if verbose == "auto":
        return default
    if isinstance(verbose, bool) or verbose in (0, 1, 2):
        return int(verbose)
    raise ValueError(f"verbose must be 'auto', 0, 1 or 2, got {verbose!r}")


class Parallel:
    """Train one Keras model on several devices with one word: the strategy.

    ``strategy`` picks the backend: ``"single"``, ``"mirrored"``, ``"central_storage"``, ``"multi_worker"``,
    ``"model_parallel"``, or ``"auto"`` (decides at :meth:`build` from the cluster, the devices and the model's
    memory; options ``device_memory="16GiB"`` and ``batch_size``; :meth:`explain` says why).

    ``devices=None`` means every local GPU, else the CPU (for data-parallel strategies, every logical CPU); an int
    means the first N devices; a sequence names them (``["GPU:0", "GPU:1"]``).

    Options: ``seed`` (initial weights and shuffling; the same seed gives the same weights on every backend),
    ``steps_per_execution`` (steps run per ``tf.function`` call, for small models), and each backend's own (for
    example ``parameter_device`` for ``central_storage``).

    >>> import numpy as np, keras
    >>> from paraml import Parallel
    >>> par = Parallel("mirrored", devices=2, seed=0)
    >>> def make_model():
    ...     return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    >>> model = par.build(make_model, optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    >>> x, y = np.random.rand(64, 4).astype("float32"), np.random.randint(0, 3, 64)
    >>> history = par.fit(x, y, batch_size=16, epochs=2, verbose=0)
    >>> sorted(par.evaluate(x, y))
    ['accuracy', 'loss']
    >>> par.predict(x).shape
    (64, 3)
    """

    def __init__(
        self,
        strategy: str = "auto",
        devices: None | int | str | Sequence[str] = None,
        *,
        seed: int | None = None,
        steps_per_execution: int = 1,
        **options: Any,
    ) -> None:
        option_names = AUTO_OPTIONS if strategy == "auto" else backends.get_backend(strategy).option_names
        unknown = sorted(set(options) - set(option_names))
        if unknown:
            valid = ", ".join(COMMON_OPTIONS + option_names)
            raise ValueError(f"unknown option {unknown[0]!r} for strategy {strategy!r}; valid options: {valid}")
        if isinstance(steps_per_execution, bool) or not isinstance(steps_per_execution, int) or steps_per_execution < 1:
            raise ValueError(f"steps_per_execution must be a positive int, got {steps_per_execution!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        self.seed = seed
        self.steps_per_execution = steps_per_execution
        self._trainer: Trainer | None = None
        self._epochs_done = 0
        self._backend: Backend | None = None
        self._decision: AutoDecision | None = None
        self._auto: tuple[Any, dict[str, Any]] | None = None
        if strategy != "auto":
            self._backend = backends.get_backend(strategy)(devices, **options)
            return
        if "device_memory" in options and options["device_memory"] is not None:
            options["device_memory"] = parse_size(options["device_memory"])
        cluster = parse_tf_config()
        if cluster is not None and cluster.num_workers > 1:  # decided now: the strategy must exist at program start
            self._decision = decide(num_workers=cluster.num_workers, num_devices=0, estimate=None, device_memory=None)
            self._backend = backends.get_backend("multi_worker")(devices)
        else:
            self._auto = (devices, options)

    # -- what was chosen ----------------------------------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        """The backend doing the work (for ``"auto"``, chosen at :meth:`build`)."""
        if self._backend is None:
            raise RuntimeError(
                "Parallel('auto') chooses its strategy when it sees the model: call par.build(...) first"
            )
        return self._backend

    @property
    def strategy(self) -> str:
        """The resolved strategy name (``"auto"`` until ``build`` has chosen)."""
        return self._backend.name if self._backend is not None else "auto"

    @property
    def devices(self) -> tuple[str, ...]:
        """Canonical names of this process's devices."""
        if self._backend is None and self._auto is not None:
            return resolve_devices(self._auto[0])
        return self.backend.devices

    def explain(self) -> str:
        """Why this strategy: for ``"auto"``, the rule's decision with its numbers; otherwise, that it was asked for."""
        if self._decision is not None:
            return self._decision.explain()
        if self._backend is None:
            return "Parallel('auto') has not chosen yet: it decides at build(), when it sees the model"
        return f"strategy {self.strategy!r} was chosen by the caller"

    def _choose(self, model_fn: Callable[[], keras.Model], optimizer: Any) -> None:
        """Resolve ``"auto"``: measure the model, apply :func:`paraml.auto.decide`, create the chosen backend."""
        assert self._auto is not None
        device_spec, options = self._auto
        devices = resolve_devices(device_spec)
        memory = options.get("device_memory")
        if memory is None:
            memory = device_memory(devices[0])
        estimate = None
        if len(devices) > 1:
            with tf.device("/device:CPU:0"):  # measure on the host: the model may not fit on one accelerator
                estimate = estimate_memory(model_fn, batch_size=options.get("batch_size", 32), optimizer=optimizer)
        self._decision = decide(num_workers=1, num_devices=len(devices), estimate=estimate, device_memory=memory)
        chosen = backends.get_backend(self._decision.strategy)
        passed = {k: v for k, v in options.items() if k in chosen.option_names}
        self._backend = chosen(device_spec if len(devices) > 1 else devices, **passed)
        self._auto = None

    @property
    def num_replicas(self) -> int:
        """How many model replicas compute each global batch (over all workers)."""
        return self.backend.num_replicas

    @property
    def is_chief(self) -> bool:
        """True in the process that writes files that must exist once."""
        return self._backend is None or self._backend.is_chief

    @property
    def worker_index(self) -> int:
        """This process's index among the workers (0 is the chief; always 0 on one machine)."""
        return self.backend.worker_index

    @property
    def num_workers(self) -> int:
        """How many processes train together (1 except under ``multi_worker``)."""
        return self.backend.num_workers

    @property
    def model(self) -> keras.Model:
        """The model built by :meth:`build`."""
        return self._require_trainer("model").model

    @property
    def plan(self) -> PartitionPlan | None:
        """The stage plan of ``model_parallel`` after :meth:`build` (``None`` for data-parallel strategies)."""
        return getattr(self.backend, "plan", None)

    def describe(self) -> str:
        """A readable description of the backend: its devices and, for ``model_parallel``, the stage table."""
        return self.backend.describe()

    def _require_trainer(self, action: str) -> Trainer:
        if self._trainer is None:
            raise RuntimeError(f"{action} needs a model: call par.build(model_fn, optimizer=..., loss=...) first")
        return self._trainer

    def __repr__(self) -> str:
        return f"Parallel({self.strategy!r}, devices={list(self.devices)!r})"

    # -- build --------------------------------------------------------------------------------------------------------
    def build(
        self,
        model_fn: Callable[[], keras.Model],
        optimizer: Any = "rmsprop",
        loss: Any = None,
        metrics: Sequence[Any] | None = None,
    ) -> keras.Model:
        """Create the model with ``model_fn()`` where the backend places it, and compile it.

        ``model_fn`` takes no arguments and returns a built ``keras.Model`` (start it with ``keras.Input``).
        ``optimizer``, ``loss`` and ``metrics`` take what ``keras.Model.compile`` takes.
        """
        if not callable(model_fn) or isinstance(model_fn, keras.layers.Layer):
            raise TypeError(
                f"model_fn must be a zero-argument function that returns a keras.Model, got {model_fn!r}: pass the "
                "function that builds the model (not the model), so its variables are created where the backend "
                "places them"
            )
        if isinstance(metrics, str):
            metrics = [metrics]
        loss_fn, loss_name = resolve_loss(loss)
        if self._backend is None:
            self._choose(model_fn, optimizer)
        if self.seed is not None:
            keras.utils.set_random_seed(self.seed)
        model = self.backend.build_model(model_fn, optimizer)
        if not isinstance(model, keras.Model):
            raise TypeError(f"model_fn must return a keras.Model, it returned {type(model).__name__}")
        if not model.built or not model.weights:
            raise ValueError(
                "model_fn returned a model without weights: give it an input shape (start it with keras.Input(...)) "
                "so its variables are created where the backend places them"
            )
        if len(model.outputs or ()) > 1:
            raise ValueError(
                f"model_fn returned a model with {len(model.outputs)} outputs; paraml trains single-output models: "
                "concatenate the outputs in the model (and split the targets alike), or train each head separately"
            )
        with self.backend.scope():
            model.compile(optimizer=make_optimizer(optimizer), loss=loss)
            opt = model.optimizer  # under a mixed-precision policy, compile wraps it in a LossScaleOptimizer
            opt.build(model.trainable_variables)
        with self.backend.metrics_scope():
            compiled_metrics = resolve_metrics(metrics, loss_name, model)
            loss_tracker = keras.metrics.Mean(name="loss")
        self._trainer = Trainer(
            self.backend, model, opt, loss_fn, compiled_metrics, loss_tracker, self.steps_per_execution
        )
        return model

    # -- train, evaluate, predict -------------------------------------------------------------------------------------
    def _batches(
        self, x: Any, y: Any, batch_size: int, *, shuffle: bool = False, targets: bool = True
    ) -> GlobalBatches:
        return global_batches(
            x,
            y,
            batch_size=batch_size,
            num_replicas=self.num_replicas,
            shuffle=shuffle,
            seed=self.seed or 0,
            need_targets=targets,
        )

    def fit(
        self,
        x: Any,
        y: Any = None,
        *,
        batch_size: int = 32,
        epochs: int = 1,
        validation_data: Any = None,
        callbacks: Sequence[keras.callbacks.Callback] | None = None,
        verbose: Verbose = "auto",
        shuffle: bool = True,
        initial_epoch: int = 0,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        keep: int | None = 3,
    ) -> keras.callbacks.History:
        """Train the model, as ``keras.Model.fit`` does, and return its ``History``.

        ``x``/``y`` are numpy arrays (``x`` may be a dict of arrays for a multi-input model) or ``x`` is a
        ``tf.data.Dataset`` of ``(x, y)`` global batches. ``batch_size`` is the global batch, split across replicas.
        Shuffling depends only on ``seed`` and the epoch. ``verbose=1`` shows the Keras progress bar.

        With ``checkpoint_dir``, a checkpoint is saved at the end of every epoch (and every ``checkpoint_every``
        steps), keeping the newest ``keep``; started again with the same directory, training resumes from the last
        complete checkpoint and ends with the weights of a run that never stopped. (Resuming mid-epoch restores the
        weights and the data position exactly; that epoch's logged averages then cover only the steps after it.)
        """
        trainer = self._require_trainer("fit")
        for name, value, low in (("epochs", epochs, 1), ("initial_epoch", initial_epoch, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        verbosity = _verbosity(verbose, 1)
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a positive int or None, got {keep!r}")
        for callback in callbacks or ():
            if not isinstance(callback, keras.callbacks.Callback):
                raise TypeError(f"callbacks must be keras.callbacks.Callback instances, got {callback!r}")
        if not self.is_chief:  # files that must exist once are the chief's (TF's multi-worker convention)
            callbacks = [c for c in callbacks or () if not isinstance(c, CHIEF_ONLY_CALLBACKS)]
        if checkpoint_every is not None and (
            isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1
        ):
            raise ValueError(f"checkpoint_every must be a positive int (steps) or None, got {checkpoint_every!r}")
        if checkpoint_every is not None and checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir: say where the checkpoints go")
        source = self._batches(x, y, batch_size, shuffle=shuffle)
        validation = None
        if validation_data is not None:
            if isinstance(validation_data, (tuple, list)):
                if len(validation_data) != 2:
                    raise ValueError("validation_data must be (x_val, y_val) or a tf.data.Dataset")
                validation = self._batches(validation_data[0], validation_data[1], batch_size)
            else:
                validation = self._batches(validation_data, None, batch_size)
        start_step, on_progress = 0, None
        if checkpoint_dir is not None:
            state = self.restore(checkpoint_dir) if latest_checkpoint(checkpoint_dir) is not None else None
            # Workers resuming at different points would hang in the collectives: fail instead.
            self.backend.check_same_on_every_worker(
                -1 if state is None else state.epoch * 1_000_000_000 + state.step,
                f"where to resume from {str(checkpoint_dir)!r} (-1: no checkpoint; epoch * 1e9 + step). "
                "checkpoint_dir must be on storage every worker sees (the chief writes it)",
            )
            if state is not None and (state.epoch > initial_epoch or (state.epoch == initial_epoch and state.step)):
                initial_epoch, start_step = state.epoch, state.step
                source = self._batches(x, y, batch_size, shuffle=shuffle)  # the checkpoint's seed decides order
            on_progress = self._checkpointer(checkpoint_dir, checkpoint_every, keep)
        history = trainer.fit(
            source,
            epochs=epochs,
            initial_epoch=initial_epoch,
            validation=validation,
            callbacks=callbacks,
            verbose=verbosity,
            start_step=start_step,
            on_progress=on_progress,
        )
        if history.epoch:
            self._epochs_done = history.epoch[-1] + 1
        return history

    def _checkpointer(
        self, directory: str | os.PathLike[str], every: int | None, keep: int | None
    ) -> Callable[[int, int, str], None]:
        """The hook that saves at each epoch's end, when training stops mid-epoch, and every ``every`` steps."""
        last = {"step": 0}

        def on_progress(epoch: int, steps_done: int, event: str) -> None:
            if event == "epoch_end":
                self.save(directory, keep=keep, progress=(epoch + 1, 0))
                last["step"] = 0
            elif event == "stopped" or (every is not None and steps_done - last["step"] >= every):
                self.save(directory, keep=keep, progress=(epoch, steps_done))
                last["step"] = steps_done

        return on_progress

    # -- checkpoints ---------------------------------------------------------------------------------------------------
    def save(
        self, path: str | os.PathLike[str], *, keep: int | None = None, progress: tuple[int, int] | None = None
    ) -> Path:
        """Save weights, optimizer state, the epoch/step reached and the shuffling seed into the directory ``path``.

        The write is atomic (a crash during ``save`` leaves the previous checkpoint readable), in TensorFlow's
        checkpoint format, and restores under any backend. Under ``multi_worker`` every worker calls it and only
        the chief's copy is kept. Returns the new checkpoint's folder.
        """
        trainer = self._require_trainer("save")
        epoch, step = progress if progress is not None else (self._epochs_done, 0)
        self._epochs_done = epoch
        state = CheckpointState(epoch, step, self.seed or 0)
        return save_checkpoint(path, trainer.model, trainer.optimizer, state, keep=keep, write=self.is_chief)

    def restore(self, path: str | os.PathLike[str]) -> CheckpointState:
        """Load a checkpoint written by :meth:`save` (under any backend) into the built model and its optimizer.

        ``path`` is a checkpoint directory (its newest checkpoint is used) or one checkpoint folder. Returns where
        training stood; its seed becomes this object's seed, so a resumed run sees the same data order.
        """
        trainer = self._require_trainer("restore")
        state = restore_checkpoint(path, trainer.model, trainer.optimizer)
        self.seed, self._epochs_done = state.seed, state.epoch
        return state

    def evaluate(self, x: Any, y: Any = None, *, batch_size: int = 32, verbose: Verbose = 0) -> dict[str, float]:
        """Loss and metrics over every sample of ``x``/``y``: ``{"loss": ..., "accuracy": ...}``."""
        trainer = self._require_trainer("evaluate")
        return trainer.evaluate(self._batches(x, y, batch_size), verbose=_verbosity(verbose, 0))

    def predict(self, x: Any, *, batch_size: int = 32, verbose: Verbose = 0) -> Any:
        """The model's output for every sample of ``x``, in input order, as a numpy array."""
        trainer = self._require_trainer("predict")
        return trainer.predict(self._batches(x, None, batch_size, targets=False), verbose=_verbosity(verbose, 0))
