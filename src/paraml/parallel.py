"""The facade: ``Parallel(strategy, devices)`` picks a backend by name, owns the model and runs the one loop."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from . import backends
from .auto import AutoDecision, decide
from .backends.base import Backend
from .checkpoint import CheckpointState, latest_checkpoint, restore_checkpoint, save_checkpoint
from .cluster import parse_tf_config
from .data import GlobalBatches, global_batches, split_validation
from .devices import device_memory, resolve_devices
from .memory import estimate_memory
from .partition import PartitionPlan
from .preemption import PreemptionGuard
from .sizes import parse_size
from .training import Trainer, check_compile_names, make_optimizer, zeros_like_spec

__all__ = ["Parallel"]

#: Options every backend accepts; the backend's own ``option_names`` add to these.
COMMON_OPTIONS = ("seed", "steps_per_execution", "jit_compile")

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
    ``steps_per_execution`` (steps run per ``tf.function`` call, for small models), ``jit_compile`` (``True``:
    compile each replica's forward pass, loss and gradients with XLA; ``"auto"``: where Keras would, on GPUs, and
    the backend allows it; ``False``, the default: never; :meth:`explain` says what was chosen), and each backend's
    own (for example ``parameter_device`` for ``central_storage``).

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
        jit_compile: bool | str = False,
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
        if jit_compile not in (True, False, "auto"):
            raise ValueError(f"jit_compile must be True, False or 'auto', got {jit_compile!r}")
        self.seed = seed
        self.steps_per_execution = steps_per_execution
        self.jit_compile = jit_compile
        self._xla_reason = "jit_compile=False: no XLA"
        self._trainer: Trainer | None = None
        self._model: keras.Model | None = None
        self._pending_compile: dict[str, Any] | None = None
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
            chosen = self._decision.explain()
        elif self._backend is None:
            return "Parallel('auto') has not chosen yet: it decides at build(), when it sees the model"
        else:
            chosen = f"strategy {self.strategy!r} was chosen by the caller"
        return chosen + "\n" + self._xla_reason

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
        if self._model is None:
            raise RuntimeError("model needs a model: call par.build(model_fn, optimizer=..., loss=...) first")
        return self._model

    @property
    def plan(self) -> PartitionPlan | None:
        """The stage plan of ``model_parallel`` after :meth:`build` (``None`` for data-parallel strategies)."""
        return getattr(self.backend, "plan", None)

    def describe(self) -> str:
        """A readable description of the backend: its devices and, for ``model_parallel``, the stage table."""
        text = self.backend.describe()
        return text if self.jit_compile is False else text + "\n" + self._xla_reason

    def _require_trainer(self, action: str) -> Trainer:
        if self._trainer is None and self._pending_compile is not None:
            raise RuntimeError(
                f"{action} needs the model's weights: this subclassed model gets them at its first batch; call "
                "fit, evaluate or predict first (or build it inside model_fn)"
            )
        if self._trainer is None:
            raise RuntimeError(f"{action} needs a model: call par.build(model_fn, optimizer=..., loss=...) first")
        return self._trainer

    def _require_model(self, action: str) -> None:
        if self._model is None:
            raise RuntimeError(f"{action} needs a model: call par.build(model_fn, optimizer=..., loss=...) first")

    def __repr__(self) -> str:
        return f"Parallel({self.strategy!r}, devices={list(self.devices)!r})"

    # -- build --------------------------------------------------------------------------------------------------------
    def build(
        self,
        model_fn: Callable[[], keras.Model],
        optimizer: Any = "rmsprop",
        loss: Any = None,
        metrics: Any = None,
        *,
        loss_weights: Any = None,
        weighted_metrics: Any = None,
        auto_scale_loss: bool = True,
        **compile_options: Any,
    ) -> keras.Model:
        """Create the model with ``model_fn()`` where the backend places it, and compile it as ``model.compile`` does.

        ``model_fn`` takes no arguments and returns a built ``keras.Model``: Sequential or functional (start it with
        ``keras.Input``), or subclassed (call ``model.build(input_shape)`` or call it on a batch inside
        ``model_fn``). ``optimizer``, ``loss``, ``metrics``, ``loss_weights``, ``weighted_metrics`` and
        ``auto_scale_loss`` take what ``keras.Model.compile`` takes, nested per output for multi-output models.
        ``steps_per_execution`` and ``jit_compile`` are options of :class:`Parallel`; ``run_eagerly`` is not
        supported (paraml's loop is always compiled).
        """
        for name in compile_options:
            if name in ("steps_per_execution", "jit_compile"):
                raise TypeError(f"{name} is an option of Parallel, not of build: Parallel(..., {name}=...)")
            if name == "run_eagerly":
                raise TypeError(
                    "run_eagerly is not supported: paraml's loop runs in tf.function on every backend; to debug a "
                    "model eagerly, use plain keras model.compile(run_eagerly=True).fit(...)"
                )
            raise TypeError(
                f"build() got an unexpected keyword argument {name!r}; valid: optimizer, loss, metrics, "
                "loss_weights, weighted_metrics, auto_scale_loss"
            )
        if not callable(model_fn) or isinstance(model_fn, keras.layers.Layer):
            raise TypeError(
                f"model_fn must be a zero-argument function that returns a keras.Model, got {model_fn!r}: pass the "
                "function that builds the model (not the model), so its variables are created where the backend "
                "places them"
            )
        if loss is None:
            raise ValueError("loss is required, e.g. loss='sparse_categorical_crossentropy' (or one per output)")
        check_compile_names(loss, metrics, weighted_metrics)
        if isinstance(metrics, str):
            metrics = [metrics]
        if isinstance(weighted_metrics, str):
            weighted_metrics = [weighted_metrics]
        if self._backend is None:
            self._choose(model_fn, optimizer)
        if self.seed is not None:
            keras.utils.set_random_seed(self.seed)
        model = self.backend.build_model(model_fn, optimizer)
        if not isinstance(model, keras.Model):
            raise TypeError(f"model_fn must return a keras.Model, it returned {type(model).__name__}")
        compile_args = {
            "optimizer": optimizer,
            "loss": loss,
            "loss_weights": loss_weights,
            "metrics": metrics,
            "weighted_metrics": weighted_metrics,
            "auto_scale_loss": auto_scale_loss,
        }
        self._model, self._trainer = model, None
        if model.weights:
            self._compile(compile_args)
        elif not self.backend.builds_on_first_batch:
            raise ValueError(
                f"model_fn returned a model without weights; strategy {self.strategy!r} places the weights at "
                "build, so it needs them now: start a functional model with keras.Input(...), or call a subclassed "
                "model on a batch inside model_fn"
            )
        else:  # a subclassed model built lazily (as Keras builds it at the first batch of fit)
            self._pending_compile = compile_args
        return model

    def _compile(self, args: dict[str, Any]) -> None:
        """Create the optimizer under the backend's scope and compile the model as ``model.compile`` does."""
        model = self._model
        with self.backend.scope():
            opt = make_optimizer(args["optimizer"])
            # Keras accumulates inside apply_gradients with a cond that breaks under tf.distribute (a merge_call in
            # the cond): paraml's loop accumulates instead, with the same rule, around an optimizer without it.
            accumulation = opt.gradient_accumulation_steps
            if accumulation:
                opt = opt.__class__.from_config({**opt.get_config(), "gradient_accumulation_steps": None})
            if args["auto_scale_loss"] and model.dtype_policy.name == "mixed_float16":
                opt = keras.optimizers.LossScaleOptimizer(opt)  # as compile would, but under the strategy
            self.backend.check_optimizer(opt)
            opt.build(model.trainable_variables)
        with self.backend.metrics_scope():
            model.compile(**{**args, "optimizer": opt})
        use_xla = self._resolve_xla(model)
        self._trainer = Trainer(self.backend, model, self.steps_per_execution, accumulation, use_xla)
        self._pending_compile = None

    def _resolve_xla(self, model: keras.Model) -> bool:
        """Decide ``jit_compile`` for this model and backend; remember why (for :meth:`explain`)."""
        if self.jit_compile is False:
            return False
        problem = self.backend.xla_problem()
        if problem is None:
            blocked = [layer.name for layer in _all_layers(model) if not getattr(layer, "supports_jit", True)]
            if blocked:
                problem = f"layer {blocked[0]!r} does not support XLA (supports_jit=False)"
        if self.jit_compile is True:
            if problem is not None:
                raise ValueError(f"jit_compile=True cannot be used: {problem}; use jit_compile=False or 'auto'")
            self._xla_reason = "jit_compile=True: each replica's forward pass, loss and gradients run under XLA"
            return True
        if problem is None and not all("GPU" in d for d in self.devices):
            problem = "the devices are CPUs (Keras' rule: XLA only on accelerators)"
        self._xla_reason = (
            "jit_compile='auto': XLA on, the model and the backend support it"
            if problem is None
            else f"jit_compile='auto': XLA off, {problem}"
        )
        return problem is None

    def _ready(self, action: str, source: GlobalBatches) -> Trainer:
        """The trainer; a model built lazily gets its weights from a zero batch shaped like ``source``'s first."""
        if self._trainer is None and self._pending_compile is not None:
            x = zeros_like_spec(source.dataset(0).element_spec)[0]
            with self.backend.scope():
                self.backend.forward(self._model, x, training=False)
            if not self._model.weights:
                raise ValueError("the model has no weights even after a call on the first batch: nothing to train")
            self._compile(self._pending_compile)
        return self._require_trainer(action)

    # -- train, evaluate, predict -------------------------------------------------------------------------------------
    def _batches(
        self,
        x: Any,
        y: Any,
        batch_size: int | None,
        *,
        shuffle: bool = False,
        targets: bool = True,
        sample_weight: Any = None,
        class_weight: Any = None,
        steps: int | None = None,
    ) -> GlobalBatches:
        return global_batches(
            x,
            y,
            sample_weight=sample_weight,
            class_weight=class_weight,
            batch_size=batch_size,
            num_replicas=self.num_replicas,
            shuffle=shuffle,
            seed=self.seed or 0,
            need_targets=targets,
            steps=steps,
        )

    def fit(
        self,
        x: Any,
        y: Any = None,
        *,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: Verbose = "auto",
        callbacks: Sequence[keras.callbacks.Callback] | None = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool = True,
        class_weight: Mapping[int, float] | None = None,
        sample_weight: Any = None,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        validation_freq: int | Sequence[int] = 1,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        keep: int | None = 3,
    ) -> keras.callbacks.History:
        """Train the model, as ``keras.Model.fit`` does (the same arguments and meaning), and return its ``History``.

        ``x``/``y`` are numpy arrays (``x`` may be a dict or list of arrays for a multi-input model, ``y`` likewise
        for a multi-output one), or ``x`` is a ``tf.data.Dataset``, a Python generator or a ``keras.utils.PyDataset``
        of ``(x, y)`` or ``(x, y, sample_weight)`` global batches (infinite ones need ``steps_per_epoch``).
        ``batch_size`` (default 32) is the global batch, split across replicas. Shuffling depends only on ``seed``
        and the epoch. ``verbose=1`` shows the Keras progress bar.

        With ``checkpoint_dir``, a checkpoint is saved at the end of every epoch (and every ``checkpoint_every``
        steps), keeping the newest ``keep``; started again with the same directory, training resumes from the last
        complete checkpoint and ends with the weights of a run that never stopped. A SIGTERM or SIGINT during such a
        fit stops at the next step, saves, and exits with :data:`paraml.preemption` 's code (see docs/guide.md).
        """
        self._require_model("fit")
        for name, value, low in (("epochs", epochs, 1), ("initial_epoch", initial_epoch, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        for name, value in (("steps_per_epoch", steps_per_epoch), ("validation_steps", validation_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        _check_validation_freq(validation_freq)
        verbosity = _verbosity(verbose, 1)
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a positive int or None, got {keep!r}")
        for callback in callbacks or ():
            if not isinstance(callback, keras.callbacks.Callback):
                raise TypeError(f"callbacks must be keras.callbacks.Callback instances, got {callback!r}")
            if isinstance(callback, keras.callbacks.BackupAndRestore):
                raise ValueError(
                    "keras.callbacks.BackupAndRestore is not supported: use par.fit(..., checkpoint_dir=DIR), which "
                    "saves every epoch (and every checkpoint_every steps) and resumes exactly where a run stopped"
                )
        if not self.is_chief:  # files that must exist once are the chief's (TF's multi-worker convention)
            callbacks = [c for c in callbacks or () if not isinstance(c, CHIEF_ONLY_CALLBACKS)]
        if checkpoint_every is not None and (
            isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1
        ):
            raise ValueError(f"checkpoint_every must be a positive int (steps) or None, got {checkpoint_every!r}")
        if checkpoint_every is not None and checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir: say where the checkpoints go")
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = split_validation(x, y, sample_weight, validation_split)
        elif validation_split:
            raise ValueError("validation_split and validation_data are exclusive: pass one of them")

        def training_batches() -> GlobalBatches:
            return self._batches(
                x,
                y,
                batch_size,
                shuffle=shuffle,
                sample_weight=sample_weight,
                class_weight=class_weight,
                steps=steps_per_epoch,
            )

        source = training_batches()
        trainer = self._ready("fit", source)
        validation = None
        if validation_data is not None:
            val_size = validation_batch_size or batch_size
            if isinstance(validation_data, (tuple, list)):
                if len(validation_data) not in (2, 3):
                    raise ValueError(
                        "validation_data must be (x_val, y_val), (x_val, y_val, sample_weight_val), a tf.data.Dataset,"
                        " a generator or a keras.utils.PyDataset"
                    )
                val_weight = validation_data[2] if len(validation_data) == 3 else None
                validation = self._batches(
                    validation_data[0], validation_data[1], val_size, sample_weight=val_weight, steps=validation_steps
                )
            else:
                validation = self._batches(validation_data, None, val_size, steps=validation_steps)
        start_step, on_progress, resumed = 0, None, False
        if checkpoint_dir is not None:
            _check_writable(checkpoint_dir)
            state = self.restore(checkpoint_dir) if latest_checkpoint(checkpoint_dir) is not None else None
            # Workers resuming at different points would hang in the collectives: fail instead.
            self.backend.check_same_on_every_worker(
                -1 if state is None else state.epoch * 1_000_000_000 + state.step,
                f"where to resume from {str(checkpoint_dir)!r} (-1: no checkpoint; epoch * 1e9 + step). "
                "checkpoint_dir must be on storage every worker sees (the chief writes it)",
            )
            if state is not None and (state.epoch > initial_epoch or (state.epoch == initial_epoch and state.step)):
                initial_epoch, start_step, resumed = state.epoch, state.step, True
                source = training_batches()  # the checkpoint's seed decides the order
            on_progress = self._checkpointer(checkpoint_dir, checkpoint_every, keep, start_step)
        self._check_no_empty_replica(source)
        # With somewhere to save, SIGTERM/SIGINT stop training at the next step, which saves and exits (143/130).
        guard = PreemptionGuard() if checkpoint_dir is not None else None
        with guard if guard is not None else nullcontext():
            if guard is not None:
                trainer.stop_requested = lambda: guard.requested
            try:
                history, preempted = trainer.fit(
                    source,
                    epochs=epochs,
                    initial_epoch=initial_epoch,
                    validation=validation,
                    validation_freq=validation_freq,
                    callbacks=callbacks,
                    verbose=verbosity,
                    start_step=start_step,
                    on_progress=on_progress,
                    resumed=resumed,
                )
            finally:
                trainer.stop_requested = lambda: False
        if history.epoch:
            self._epochs_done = history.epoch[-1] + 1
        if preempted and guard is not None:
            if not guard.requested:  # another worker was signalled: this one stops with it
                guard.request()
            assert checkpoint_dir is not None
            error = guard.exception(checkpoint=latest_checkpoint(checkpoint_dir), epoch=self._epochs_done)
            print(f"paraml: {error}", file=sys.stderr, flush=True)
            raise error
        return history

    def _check_no_empty_replica(self, source: GlobalBatches) -> None:
        """Under a backend that cannot skip an empty replica, refuse a final batch that would leave one empty when
        the model has state computed from the batch (BatchNormalization would turn it into NaN)."""
        if self.backend.skips_empty_replicas or source.num_samples is None or source.batch_size is None:
            return
        tail = source.num_samples % source.batch_size
        stateful = [w.path for w in self.model.non_trainable_weights if w.dtype.startswith("float")]
        if 0 < tail < self.num_replicas and stateful:
            raise ValueError(
                f"strategy {self.strategy!r}: the last batch has {tail} sample(s) for {self.num_replicas} replicas, so "
                f"a replica would get none and turn batch statistics ({stateful[0]!r}) into NaN; choose a batch_size "
                f"that leaves at least {self.num_replicas} samples in the last batch, or drop those samples"
            )

    def _checkpointer(
        self, directory: str | os.PathLike[str], every: int | None, keep: int | None, start_step: int = 0
    ) -> Callable[[int, int, str], None]:
        """The hook that saves at each epoch's end, when training stops mid-epoch, and every ``every`` steps (on the
        same grid of steps after a resume from ``start_step``)."""
        last = {"step": start_step - start_step % every if every else 0}

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

    def evaluate(
        self,
        x: Any,
        y: Any = None,
        *,
        batch_size: int | None = None,
        verbose: Verbose = 0,
        sample_weight: Any = None,
        steps: int | None = None,
    ) -> dict[str, float]:
        """Loss and metrics over every sample of ``x``/``y`` (or the first ``steps`` batches), with Keras' names:
        ``{"loss": ..., "accuracy": ...}`` (``"<output>_loss"``, ``"<output>_<metric>"`` for multi-output models)."""
        self._require_model("evaluate")
        source = self._batches(x, y, batch_size, sample_weight=sample_weight, steps=steps)
        trainer = self._ready("evaluate", source)
        return trainer.evaluate(source, verbose=_verbosity(verbose, 0))

    def predict(self, x: Any, *, batch_size: int | None = None, verbose: Verbose = 0, steps: int | None = None) -> Any:
        """The model's output for every sample of ``x`` (or the first ``steps`` batches), in input order, as numpy
        in the model's output structure (an array, or a list/dict of arrays)."""
        self._require_model("predict")
        source = self._batches(x, None, batch_size, targets=False, steps=steps)
        trainer = self._ready("predict", source)
        return trainer.predict(source, verbose=_verbosity(verbose, 0))


def _all_layers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """``layer`` and every layer nested in it (through ``layers`` of models and attributes of layers)."""
    found: list[keras.layers.Layer] = []
    stack = [layer]
    while stack:
        current = stack.pop()
        if any(current is seen for seen in found):
            continue
        found.append(current)
        children = list(getattr(current, "layers", []) or [])
        children += [v for v in vars(current).values() if isinstance(v, keras.layers.Layer)]
        stack.extend(children)
    return found


def _check_validation_freq(validation_freq: Any) -> None:
    if isinstance(validation_freq, bool) or not (
        (isinstance(validation_freq, int) and validation_freq >= 1)
        or (isinstance(validation_freq, (list, tuple, set, range)) and all(isinstance(e, int) for e in validation_freq))
    ):
        raise ValueError(
            f"validation_freq must be a positive int or a list of epochs (1-based), got {validation_freq!r}"
        )


def _check_writable(directory: str | os.PathLike[str]) -> None:
    """Fail before training when the checkpoint directory cannot be written (nothing in it is touched)."""
    path = Path(directory)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and (not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK)):
        raise PermissionError(f"checkpoint_dir {str(path)!r} is not writable (checked {str(existing)!r})")
