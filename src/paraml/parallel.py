"""The facade: ``Parallel(strategy, devices)`` picks a backend by name, owns the model and runs the one loop.

It tells the story and delegates each chapter: argument checks (:mod:`paraml.checks`), the choice of ``"auto"``
(:mod:`paraml.auto`), compiling (:mod:`paraml.loop.compiling`), the input (:mod:`paraml.loop.batches`),
checkpoints, resume and
preemption (:mod:`paraml.loop.checkpoint`), and the loop (:mod:`paraml.loop.training`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from paraml import backends
from paraml.auto import AUTO_OPTIONS, AutoChoice
from paraml.backends.base import Backend
from paraml.checks import check_int, check_verbose, did_you_mean
from paraml.devices import no_gpu_reason
from paraml.loop.batches import GlobalBatches, global_batches, split_validation, zeros_like_spec
from paraml.loop.checkpoint import Checkpointing, CheckpointState, CheckpointWriter, restore_checkpoint, workers_of
from paraml.loop.compiling import (
    MODEL_DEFAULT,
    NOT_EAGER,
    check_compile_names,
    check_loss,
    compile_again_arguments,
    compile_model,
    extra_optimizers,
    given_arguments,
    overrides,
    route_compile,
)
from paraml.loop.training import Trainer
from paraml.memory import memory_by_device
from paraml.planning.plan import ParallelPlan
from paraml.planning.sizes import format_bytes

__all__ = ["Parallel"]

#: Options every backend accepts; the backend's own ``option_names`` add to these.
COMMON_OPTIONS = ("seed", "steps_per_execution", "jit_compile", "remat")

#: Why an option of one strategy means nothing under the others (said when it is given to them).
_NOT_HERE = {
    "shard_optimizer": " (only 'mirrored' and 'multi_worker' shard optimizer state: they keep a copy per device, "
    "which 'single', 'central_storage' and 'model_parallel' do not)",
    "shard_gradients": " (only 'mirrored' and 'multi_worker' shard gradients: they reduce a copy per device, "
    "which 'single', 'central_storage' and 'model_parallel' do not)",
    "shard_parameters": " (only 'mirrored' and 'multi_worker' shard parameters: they keep a copy per device, which "
    "'single', 'central_storage' and 'model_parallel' do not; 'model_parallel' splits a model too large for one "
    "device)",
    "schedule": " (a pipeline schedule: only 'model_parallel' pipelines)",
    "data_parallel": " (copies of a pipeline: only 'model_parallel' pipelines; the data-parallel strategies make "
    "every device a copy already)",
    "tensor_parallel": " (layers split over devices: only 'model_parallel', e.g. Parallel('model_parallel', "
    "devices=2, tensor_parallel=2))",
    "expert_parallel": " (experts split over devices: only 'model_parallel', e.g. Parallel('model_parallel', "
    "devices=2, expert_parallel=2))",
}

Verbose = int | str | bool


#: Keras callbacks that write files which must exist once: under multi_worker only the chief runs them.
CHIEF_ONLY_CALLBACKS = (keras.callbacks.ModelCheckpoint, keras.callbacks.CSVLogger, keras.callbacks.TensorBoard)


class Parallel:
    """Train one Keras model on several devices with one word: the strategy.

    ``strategy`` picks the backend: ``"single"``, ``"mirrored"``, ``"central_storage"``, ``"multi_worker"``,
    ``"model_parallel"``, or ``"auto"`` (decides at :meth:`build` from the cluster, the devices and the model's
    memory; options ``device_memory="16GiB"``, ``batch_size`` and ``measure=True`` (time the layouts that fit and
    take the fastest); :meth:`explain` says why).

    ``devices=None`` means every local GPU, else the CPU (for data-parallel strategies, every logical CPU); an int
    means the first N devices; a sequence names them (``["GPU:0", "GPU:1"]``).

    Options: ``seed`` (initial weights and shuffling; the same seed gives the same weights on every backend),
    ``steps_per_execution`` (steps run per ``tf.function`` call, for small models), ``jit_compile`` (``True``:
    compile each replica's forward pass, loss and gradients with XLA; ``"auto"``: where Keras would, on GPUs, and
    the backend allows it; ``False``, the default: never; :meth:`explain` says what was chosen), ``remat`` (``True``:
    each unit, a layer that is not a model, recomputes its activations in the backward pass instead of keeping them:
    less memory, one more forward pass, the same weights; :mod:`paraml.parallelism.remat`), and each backend's own (for
    example
    ``parameter_device`` for ``central_storage``).

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
        remat: bool = False,
        **options: Any,
    ) -> None:
        option_names = AUTO_OPTIONS if strategy == "auto" else backends.get_backend(strategy).option_names
        unknown = sorted(set(options) - set(option_names))
        if unknown:
            valid = COMMON_OPTIONS + option_names
            hint = did_you_mean(unknown[0], valid)
            why = _NOT_HERE.get(unknown[0], "")
            raise ValueError(
                f"unknown option {unknown[0]!r}{hint} for strategy {strategy!r}{why}; valid options: {', '.join(valid)}"
            )
        self.steps_per_execution: int = check_int("steps_per_execution", steps_per_execution)
        self.seed: int | None = check_int("seed", seed, low=None, none_ok=True)
        if jit_compile not in (True, False, "auto"):
            raise ValueError(f"jit_compile must be True, False or 'auto', got {jit_compile!r}")
        self.jit_compile = jit_compile
        if not isinstance(remat, bool):
            raise ValueError(f"remat must be True or False, got {remat!r}")
        self.remat = remat
        self._xla_reason = "jit_compile=False: no XLA"
        self._trainer: Trainer | None = None
        self._model: keras.Model | None = None
        self._pending_compile: dict[str, Any] | None = None  # a lazily built model compiles at its first batch
        self._compile_args: dict[str, Any] = {}  # the last compile's arguments (a compile again keeps some)
        self._epochs_done = 0
        #: Writes ``save(..., asynchronous=True)``'s checkpoints in the background; the next save, restore and fit
        #: wait for it.
        self._saves = CheckpointWriter(asynchronous=True)
        self._auto: AutoChoice | None = None
        self._backend: Backend | None = None
        if strategy == "auto":
            self._auto = AutoChoice(devices, options)
            self._backend = self._auto.backend
        else:
            self._backend = backends.get_backend(strategy)(devices, **options)
        if self._backend is not None:
            self._warn_if_alone()

    def _warn_if_alone(self) -> None:
        """Warn when this process trains by itself though ``paraml launch`` started several workers."""
        launched = int(os.environ.get("PARAML_NUM_WORKERS", "1") or 1)
        if launched > 1 and self.backend.topology.num_workers == 1:
            warnings.warn(
                f"paraml launch started {launched} workers, but strategy {self.strategy!r} does not make them one "
                "cluster: each worker trains its own copy of the model. Use Parallel('multi_worker') (or 'auto')",
                stacklevel=3,
            )

    def _one_device_note(self) -> str | None:
        """What to say when a strategy meant for several devices ended up with one."""
        topology = self.backend.topology
        layout = topology.layout
        if self.strategy == "single" or topology.num_workers > 1 or layout.data * layout.devices_per_replica > 1:
            return None
        device = topology.devices[0]
        note = f"strategy {self.strategy!r} has one device ({device}): it trains like 'single', with no speed-up"
        return note + (". " + no_gpu_reason() if "CPU" in device else "")

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
            return self._auto.local_devices()
        return self.backend.topology.devices

    @property
    def num_replicas(self) -> int:
        """How many model replicas compute each global batch (over all workers)."""
        return self.backend.topology.num_replicas

    @property
    def is_chief(self) -> bool:
        """True in the process that writes files that must exist once."""
        return self._backend is None or self._backend.topology.is_chief

    @property
    def worker_index(self) -> int:
        """This process's index among the workers (0 is the chief; always 0 on one machine)."""
        return self.backend.topology.worker_index

    @property
    def num_workers(self) -> int:
        """How many processes train together (1 except under ``multi_worker``)."""
        return self.backend.topology.num_workers

    @property
    def model(self) -> keras.Model:
        """The model built by :meth:`build`."""
        return self._require_model("model")

    @property
    def plan(self) -> ParallelPlan | None:
        """The parallel plan after :meth:`build` (None before): the layout, the stages (``plan.stages``, empty for
        data-parallel strategies), the tensor splits, the schedule, what is recomputed and sharded;
        ``plan.describe()`` prints it."""
        return self.backend.plan

    @property
    def trained_variables(self) -> list[Any]:
        """What the training step differentiates and the optimizer updates, after :meth:`build`: the model's
        trainable variables, a weight split by ``tensor_parallel`` replaced by its parts (each on its device). A
        loop or gradient of one's own takes these, not ``model.trainable_variables``.

        Raises:
            ValueError: before :meth:`build`.
        """
        if self._model is None:
            raise ValueError("trained_variables exist after build(): call par.build(model_fn, ...) first")
        return self.backend.techniques.trained_variables(self._model)

    def explain(self) -> str:
        """Why this strategy: for ``"auto"``, the rule's decision with its numbers; otherwise, that it was asked for."""
        if self._auto is not None and self._auto.decision is not None:
            chosen = self._auto.decision.explain()
        elif self._backend is None:
            return "Parallel('auto') has not chosen yet: it decides at build(), when it sees the model"
        else:
            chosen = f"strategy {self.strategy!r} was chosen by the caller"
        note = self._one_device_note()
        text = chosen + ("\n" + note if note else "") + "\n" + self._xla_reason
        recomputed = self.backend.techniques.recomputed if self._model is not None else []
        if recomputed:
            text += f"\nremat=True: {len(recomputed)} units recompute their activations in the backward pass"
        return text

    def describe(self) -> str:
        """A readable description of the backend (for ``"auto"``, first why it was chosen): its devices and, for
        ``model_parallel``, the stage table; after :meth:`build`, the bytes of parameters and optimizer state on each
        device (:meth:`memory_by_device`)."""
        text = self.backend.describe()
        if self._auto is not None and self._auto.decision is not None:  # why auto chose this backend
            text = f"auto: {self._auto.decision.explain()}\n{text}"
        if self._model is not None and self._trainer is not None:
            rows = [
                (device, format_bytes(b["parameters"]), format_bytes(b["optimizer"]))
                for device, b in self.memory_by_device().items()
            ]
            width = max(len("device"), *(len(r[0]) for r in rows))
            text += f"\n{'device'.ljust(width)}  {'parameters':>12}  {'optimizer':>12}"
            text += "".join(f"\n{d.ljust(width)}  {p:>12}  {o:>12}" for d, p, o in rows)
        return text if self.jit_compile is False else text + "\n" + self._xla_reason

    def memory_by_device(self) -> dict[str, dict[str, int]]:
        """``{device: {"parameters": bytes, "optimizer": bytes}}`` after :meth:`build`, read from where the variables
        live: replicated under data parallelism, split by stage under ``model_parallel``, one copy on the parameter
        device under ``central_storage``. Optimizer bytes count every optimizer the model holds (its slots and
        their scalars)."""
        model = self._require_model("memory_by_device()")
        optimizers = [model.optimizer, *extra_optimizers(model).values()] if model.optimizer is not None else []
        return memory_by_device(model, optimizers)

    def __repr__(self) -> str:
        return f"Parallel({self.strategy!r}, devices={list(self.devices)!r})"

    # -- build --------------------------------------------------------------------------------------------------------
    def build(
        self,
        model_fn: Callable[[], keras.Model],
        optimizer: Any = MODEL_DEFAULT,
        loss: Any = MODEL_DEFAULT,
        metrics: Any = MODEL_DEFAULT,
        *,
        loss_weights: Any = MODEL_DEFAULT,
        weighted_metrics: Any = MODEL_DEFAULT,
        auto_scale_loss: Any = MODEL_DEFAULT,
        **compile_options: Any,
    ) -> keras.Model:
        """Create the model with ``model_fn()`` where the backend places it, and compile it as ``model.compile`` does.

        ``model_fn`` takes no arguments and returns a built ``keras.Model``: Sequential or functional (start it with
        ``keras.Input``), or subclassed (call ``model.build(input_shape)`` or call it on a batch inside
        ``model_fn``). ``optimizer``, ``loss``, ``metrics``, ``loss_weights``, ``weighted_metrics`` and
        ``auto_scale_loss`` take what ``keras.Model.compile`` takes, nested per output for multi-output models.
        Only the arguments given reach the model's ``compile``: it keeps its own defaults for the others, as
        ``model.compile(...)`` does (Keras' ``"rmsprop"`` optimizer; a keras_hub task's default optimizer, loss and
        metrics or ``weighted_metrics``).
        ``steps_per_execution`` and ``jit_compile`` are options of :class:`Parallel`; ``run_eagerly`` is not
        supported (paraml's loop is always compiled).

        A model's own ``compile`` gets what it takes: further keyword arguments go to it (a GAN's
        ``d_optimizer=..., g_optimizer=..., loss_fn=...``), every optimizer among them re-created under the backend.
        Its own ``compile`` may create state (a GAN's loss trackers), as in Keras. A model with its own
        ``train_step`` needs no ``loss``; its ``train_step``, ``test_step`` and
        ``predict_step`` run on each replica, as in Keras' ``fit`` under the same strategy.
        """
        _check_build_arguments(model_fn, loss, metrics, weighted_metrics, compile_options)
        # What the planners count optimizer slots for: Keras' default when none is given (a model whose compile
        # picks another, a keras_hub task's Adam, is counted with it when it is given).
        planned_optimizer = "rmsprop" if optimizer is MODEL_DEFAULT else optimizer
        host_model = None
        if self._backend is None:
            assert self._auto is not None
            self._seed_globals()  # auto's host build is the first build model_parallel would keep: seeded like it
            # what measure=True compiles each candidate with (metrics cost the same under every layout)
            timed_with = given_arguments(
                optimizer=optimizer, loss=loss, loss_weights=loss_weights, auto_scale_loss=auto_scale_loss
            )
            self._backend, host_model = self._auto.choose(
                model_fn, planned_optimizer, self.remat, compile_args=timed_with, jit_compile=self.jit_compile
            )
            assert self._auto.decision is not None
            self.remat = self.remat or self._auto.decision.remat  # auto recomputes when only that makes it fit
            self._warn_if_alone()
        note = self._one_device_note()
        if note is not None and self._model is None:  # once per Parallel
            warnings.warn(note, stacklevel=2)
        self._seed_globals()  # again: measure=True built and trained candidates since, which drew random numbers
        model = self.backend.build_model(model_fn, planned_optimizer, host_model, self.remat)
        if not isinstance(model, keras.Model):
            raise TypeError(f"model_fn must return a keras.Model, it returned {type(model).__name__}")
        if model.weights and not model.built and getattr(self.backend, "techniques", None) is None:
            raise ValueError(
                f"strategy {self.strategy!r} plans from a call of the model, and model {model.name!r} is not built: "
                "build it inside model_fn (keras.Input, or call it on a batch); a model without its own call (a GAN "
                "whose train_step calls its parts) trains under 'single', 'mirrored', 'central_storage' or "
                "'multi_worker'"
            )
        if model.weights and getattr(self.backend, "techniques", None) is None:
            raise TypeError(
                f"backend {type(self.backend).__name__}.build_model did not apply a plan: a build_model of one's own "
                "ends with self.apply_plan(model, plan) (see Backend.build_model), so that the loop can read "
                "backend.techniques"
            )
        compile_args = given_arguments(  # only these override the model's own compile defaults
            optimizer=optimizer,
            loss=loss,
            loss_weights=loss_weights,
            metrics=metrics,
            weighted_metrics=weighted_metrics,
            auto_scale_loss=auto_scale_loss,
            **compile_options,  # the arguments of the model's own compile
        )
        check_loss(model, compile_args)
        self._model, self._trainer = model, None
        route_compile(model, self._compile_again)  # par.model.compile(...) compiles again here, as par.compile does
        if model.weights:
            self._compile(compile_args)
        elif not self.backend.capabilities.builds_on_first_batch:
            raise ValueError(
                f"model_fn returned a model without weights; strategy {self.strategy!r} places the weights at "
                "build, so it needs them now: start a functional model with keras.Input(...), or call a subclassed "
                "model on a batch inside model_fn"
            )
        else:  # a subclassed model built lazily (as Keras builds it at the first batch of fit)
            self._pending_compile = self._compile_args = compile_args
        return model

    def _seed_globals(self) -> None:
        """Seed Python, NumPy, TensorFlow and Keras, so that a build gives the same weights on every backend."""
        if self.seed is not None:
            keras.utils.set_random_seed(self.seed)

    def compile(
        self,
        optimizer: Any = MODEL_DEFAULT,
        loss: Any = MODEL_DEFAULT,
        metrics: Any = MODEL_DEFAULT,
        *,
        loss_weights: Any = MODEL_DEFAULT,
        weighted_metrics: Any = MODEL_DEFAULT,
        auto_scale_loss: Any = MODEL_DEFAULT,
        steps_per_execution: int | None = None,
        jit_compile: bool | str | None = None,
        **compile_options: Any,
    ) -> None:
        """Compile the built model again, as ``model.compile`` does in Keras (``par.model.compile(...)`` does the
        same): the way to fine-tune (``base.trainable = True``, then compile with a lower learning rate, then fit).

        The new optimizer is created where the layout puts it (replicated, sharded by the ZeRO stage, beside each
        stage or tensor shard) for the variables trainable now; the step is traced again once. As in Keras, a loss
        not given keeps the previous one, metrics not given keep the previous ones, and a ``trainable`` changed
        without compiling again changes nothing (``fit`` warns). ``steps_per_execution`` and ``jit_compile``, when
        given, replace the :class:`Parallel` options. The arguments are checked as :meth:`build` checks them, before
        anything trains.
        """
        given = given_arguments(
            optimizer=optimizer,
            loss=loss,
            metrics=metrics,
            loss_weights=loss_weights,
            weighted_metrics=weighted_metrics,
            auto_scale_loss=auto_scale_loss,
            **compile_options,
        )
        options = {"steps_per_execution": steps_per_execution, "jit_compile": jit_compile}
        self._compile_again({**given, **{k: v for k, v in options.items() if v is not None}})

    def _compile_again(self, arguments: dict[str, Any]) -> None:
        """A second compile (:meth:`compile`, or ``model.compile(**arguments)`` routed here)."""
        model = self._require_model("compile")
        given, steps, jit_compile = compile_again_arguments(
            model, self._compile_args, arguments, self.steps_per_execution, self.jit_compile
        )
        self._saves.wait()  # a background save reads the optimizer this compile replaces
        if self._trainer is None and self._pending_compile is not None:  # a lazily built model: at its first batch
            self._pending_compile = self._compile_args = given
        else:
            self._compile(given, steps, jit_compile)  # a refused compile leaves the previous one in place
        self.steps_per_execution, self.jit_compile = steps, jit_compile

    def _compile(self, compile_args: dict[str, Any], steps: int | None = None, jit_compile: Any = None) -> None:
        steps = self.steps_per_execution if steps is None else steps
        jit_compile = self.jit_compile if jit_compile is None else jit_compile
        compiled = compile_model(self.backend, self.model, compile_args, jit_compile)
        self._xla_reason = compiled.xla_reason
        self._trainer = Trainer(self.backend, self.model, steps, compiled.accumulation_steps, compiled.xla)
        self._pending_compile, self._compile_args = None, compile_args

    def _require_model(self, action: str) -> keras.Model:
        if self._model is None:
            raise RuntimeError(f"{action} needs a model: call par.build(model_fn, optimizer=..., loss=...) first")
        return self._model

    def _ready(self, action: str, source: GlobalBatches | None = None) -> Trainer:
        """The trainer; a model built lazily gets its weights from a zero batch shaped like ``source``'s first."""
        model = self._require_model(action)
        if self._trainer is None and self._pending_compile is not None:
            if source is None:
                raise RuntimeError(
                    f"{action} needs the model's weights: this subclassed model gets them at its first batch; call "
                    "fit, evaluate or predict first (or build it inside model_fn)"
                )
            x = zeros_like_spec(source.dataset(0).element_spec)[0]
            with self.backend.scope():
                self.backend.forward(model, x, training=False)
            if not model.weights:
                raise ValueError("the model has no weights even after a call on the first batch: nothing to train")
            self._compile(self._pending_compile)
        assert self._trainer is not None
        return self._trainer

    # -- train, evaluate, predict -------------------------------------------------------------------------------------
    def _batches(self, x: Any, y: Any, batch_size: int | None, step: str = "test_step", **kwargs: Any) -> GlobalBatches:
        """Global batches for the model's ``step``; targets are required unless the model wrote that step itself."""
        kwargs.setdefault("seed", self.seed or 0)
        kwargs.setdefault("need_targets", self._model is None or not overrides(self._model, step))
        return global_batches(x, y, batch_size=batch_size, num_replicas=self.num_replicas, **kwargs)

    def _validation_batches(self, data: Any, batch_size: int | None, steps: int | None) -> GlobalBatches | None:
        if data is None:
            return None
        if not isinstance(data, (tuple, list)):
            return self._batches(data, None, batch_size, steps=steps)
        if len(data) not in (2, 3):
            raise ValueError(
                "validation_data must be (x_val, y_val), (x_val, y_val, sample_weight_val), a tf.data.Dataset,"
                " a generator or a keras.utils.PyDataset"
            )
        weights = data[2] if len(data) == 3 else None
        return self._batches(data[0], data[1], batch_size, sample_weight=weights, steps=steps)

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
        async_checkpoint: bool = False,
    ) -> keras.callbacks.History:
        """Train the model, as ``keras.Model.fit`` does (the same arguments and meaning), and return its ``History``.

        ``x``/``y`` are numpy arrays (``x`` may be a dict or list of arrays for a multi-input model, ``y`` likewise
        for a multi-output one), or ``x`` is a ``tf.data.Dataset``, a Python generator or a ``keras.utils.PyDataset``
        of ``(x, y)`` or ``(x, y, sample_weight)`` global batches (infinite ones need ``steps_per_epoch``).
        ``batch_size`` (default 32) is the global batch, split across replicas. Shuffling depends only on ``seed``
        and the epoch. ``verbose=1`` shows the Keras progress bar (``"auto"``: on the chief, so one bar per job).

        With ``checkpoint_dir``, a checkpoint is saved at the end of every epoch (and every ``checkpoint_every``
        steps), keeping the newest ``keep``; started again with the same directory, training resumes from the last
        complete checkpoint and ends with the weights of a run that never stopped. A SIGTERM or SIGINT during such a
        fit stops at the next step, saves, and exits with :data:`paraml.loop.preemption` 's code (see docs/guide.md).
        ``async_checkpoint=True`` writes those checkpoints in the background while training goes on (the state is
        copied to host memory first; the next save waits for the previous one; the save where training stops, and
        the end of ``fit``, wait for the write), each as atomic as a synchronous one.
        """
        self._require_model("fit")
        _check_fit_arguments(epochs, initial_epoch, steps_per_epoch, validation_steps, validation_freq)
        _check_checkpoint_arguments(checkpoint_dir, checkpoint_every, keep, async_checkpoint)
        self._saves.wait()  # a background par.save is complete before training changes the variables again
        verbosity = check_verbose(verbose, 1 if self.is_chief else 0)  # progress bars: the chief's by default
        callbacks = self._callbacks(callbacks)
        if validation_split and validation_data is not None:
            raise ValueError("validation_split and validation_data are exclusive: pass one of them")
        if validation_split:
            (x, y, sample_weight), validation_data = split_validation(x, y, sample_weight, validation_split)
        arguments = {"shuffle": shuffle, "sample_weight": sample_weight, "class_weight": class_weight}
        source = self._batches(x, y, batch_size, "train_step", steps=steps_per_epoch, **arguments)
        trainer = self._ready("fit", source)
        validation = self._validation_batches(validation_data, validation_batch_size or batch_size, validation_steps)
        start = CheckpointState(initial_epoch, 0, self.seed or 0)
        checkpoints = None
        if checkpoint_dir is not None:
            checkpoints = Checkpointing(
                checkpoint_dir,
                every=checkpoint_every,
                keep=keep,
                trainer=trainer,
                seed=start.seed,
                asynchronous=async_checkpoint,
                steps_per_epoch=source.steps,
            )
            start = checkpoints.resume(initial_epoch, epochs) or start
            if start.seed != (self.seed or 0):  # the checkpoint's seed decides the order
                source = self._batches(
                    x, y, batch_size, "train_step", steps=steps_per_epoch, seed=start.seed, **arguments
                )
        self._check_no_empty_replica(source)
        with (
            checkpoints.stop_on_signal() if checkpoints is not None else nullcontext() as stop_requested,
            checkpoints.writer if checkpoints is not None else nullcontext(),  # fit returns with its writes done
        ):
            history, preempted = trainer.fit(
                source,
                epochs=epochs,
                initial_epoch=start.epoch,
                validation=validation,
                validation_freq=validation_freq,
                callbacks=callbacks,
                verbose=verbosity,
                start_step=start.step,
                resumed=(start.epoch, start.step) != (initial_epoch, 0),
                on_progress=checkpoints,
                stop_requested=stop_requested,
            )
        if history.epoch:
            self._epochs_done = history.epoch[-1] + 1
        if preempted and checkpoints is not None:
            raise checkpoints.preempted(self._epochs_done)
        return history

    def _callbacks(self, callbacks: Sequence[keras.callbacks.Callback] | None) -> list[keras.callbacks.Callback]:
        """The user's callbacks, checked; under ``multi_worker``, those that write files are the chief's alone."""
        for callback in callbacks or ():
            if not isinstance(callback, keras.callbacks.Callback):
                raise TypeError(f"callbacks must be keras.callbacks.Callback instances, got {callback!r}")
            if isinstance(callback, keras.callbacks.BackupAndRestore):
                raise ValueError(
                    "keras.callbacks.BackupAndRestore is not supported: use par.fit(..., checkpoint_dir=DIR), which "
                    "saves every epoch (and every checkpoint_every steps) and resumes exactly where a run stopped"
                )
            if isinstance(callback, keras.callbacks.SwapEMAWeights) and self.plan and self.plan.zero_stage == 3:
                raise ValueError(
                    "keras.callbacks.SwapEMAWeights swaps each weight with its copy per replica of the average, and "
                    "under shard_parameters=True both live once, on the variable's owner; use shard_gradients=True "
                    "(it keeps the averages a copy per replica), or leave the callback out and call "
                    "par.model.optimizer.finalize_variable_values(par.model.trainable_variables) after training"
                )
        if self.is_chief:
            return list(callbacks or ())
        return [c for c in callbacks or () if not isinstance(c, CHIEF_ONLY_CALLBACKS)]

    def _check_no_empty_replica(self, source: GlobalBatches) -> None:
        """Under a backend that cannot skip an empty replica, refuse a final batch that would leave one empty when
        the model has state computed from the batch (BatchNormalization would turn it into NaN)."""
        if self.backend.capabilities.skips_empty_replicas or source.num_samples is None or source.batch_size is None:
            return
        tail = source.num_samples % source.batch_size
        stateful = [w.path for w in self.model.non_trainable_weights if w.dtype.startswith("float")]
        plan = self.backend.plan
        parts, why = self.num_replicas, ["remat=True"] if self.remat else []
        if plan is not None and plan.micro_batches > 1:
            parts *= plan.micro_batches
            kind = plan.schedule.kind if plan.schedule is not None else "gpipe"
            why += [f"schedule={kind!r}"] if kind != "gpipe" else []
        if 0 < tail < parts and stateful:
            raise ValueError(
                f"strategy {self.strategy!r}{' with ' + ' and '.join(why) if why else ''}: the last batch has {tail} "
                f"sample(s) for {parts} replicas or micro-batches, so one would get none and turn batch statistics "
                f"({stateful[0]!r}) into NaN; choose a batch_size that leaves at least {parts} samples in the last "
                "batch, or drop those samples"
            )

    def evaluate(
        self,
        x: Any,
        y: Any = None,
        *,
        sample_weight: Any = None,
        batch_size: int | None = None,
        steps: int | None = None,
        verbose: Verbose = 0,
    ) -> dict[str, float]:
        """Loss and metrics over every sample of ``x``/``y`` (or the first ``steps`` batches), with Keras' names:
        ``{"loss": ..., "accuracy": ...}`` (``"<output>_loss"``, ``"<output>_<metric>"`` for multi-output models)."""
        self._require_model("evaluate")
        source = self._batches(x, y, batch_size, sample_weight=sample_weight, steps=steps)
        return self._ready("evaluate", source).evaluate(source, verbose=check_verbose(verbose, 0))

    def predict(self, x: Any, *, batch_size: int | None = None, verbose: Verbose = 0, steps: int | None = None) -> Any:
        """The model's output for every sample of ``x`` (or the first ``steps`` batches), in input order, as numpy
        in the model's output structure (an array, or a list/dict of arrays)."""
        self._require_model("predict")
        source = self._batches(x, None, batch_size, need_targets=False, steps=steps)
        return self._ready("predict", source).predict(source, verbose=check_verbose(verbose, 0))

    # -- checkpoints ---------------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], *, keep: int | None = None, asynchronous: bool = False) -> Path:
        """Save weights, optimizer state, the epochs done and the shuffling seed into the directory ``path``.

        The write is atomic (a crash during ``save`` leaves the previous checkpoint readable), in TensorFlow's
        checkpoint format, and restores under any backend. In a cluster (``multi_worker``) every worker calls it and
        writes its own shard of the checkpoint (the tensors it owns, its optimizer slots as they are: no worker gathers
        the whole state), and every worker returns once it is complete. Returns the new checkpoint's folder.

        ``asynchronous=True`` returns once the state is copied to host memory and writes it in the background
        (TensorFlow's asynchronous checkpoint), made visible atomically as a synchronous save is; the next ``save``,
        ``restore`` and ``fit`` wait for it and raise what it raised, and so does the program's end.
        """
        if not isinstance(asynchronous, bool):
            raise ValueError(f"asynchronous must be True or False, got {asynchronous!r}")
        trainer = self._ready("save")
        state = CheckpointState(self._epochs_done, 0, self.seed or 0)
        folder = self._saves.save(
            path,
            trainer.model,
            trainer.optimizer,
            state,
            keep=keep,
            write=self.is_chief,
            techniques=self.backend.techniques,
            asynchronous=asynchronous,
            workers=workers_of(trainer.backend),
        )
        if self.num_workers > 1 and not asynchronous:  # the others wait for the chief (they may restore it next)
            trainer.backend.across_workers(tf.constant(0))
        return folder

    def restore(self, path: str | os.PathLike[str]) -> CheckpointState:
        """Load a checkpoint written by :meth:`save` (under any backend) into the built model and its optimizer.

        ``path`` is a checkpoint directory (its newest checkpoint is used) or one checkpoint folder. Returns where
        training stood: epochs done, steps into the next epoch, and the seed its data order came from.
        """
        trainer = self._ready("restore")
        self._saves.wait()  # a background save of this Parallel's is complete before anything is read
        state = restore_checkpoint(path, trainer.model, trainer.optimizer, self.backend.techniques)
        self._epochs_done = state.epoch
        return state


def _check_build_arguments(
    model_fn: Any, loss: Any, metrics: Any, weighted_metrics: Any, compile_options: Mapping[str, Any]
) -> None:
    for name in compile_options:
        if name in ("steps_per_execution", "jit_compile"):
            raise TypeError(f"{name} is an option of Parallel, not of build: Parallel(..., {name}=...)")
        if name == "run_eagerly":
            raise TypeError(NOT_EAGER)
    if not callable(model_fn) or isinstance(model_fn, keras.layers.Layer):
        raise TypeError(
            f"model_fn must be a zero-argument function that returns a keras.Model, got {model_fn!r}: pass the "
            "function that builds the model (not the model), so its variables are created where the backend "
            "places them"
        )
    check_compile_names(loss, metrics, weighted_metrics)


def _check_checkpoint_arguments(directory: Any, every: Any, keep: Any, asynchronous: Any = False) -> None:
    check_int("checkpoint_every", every, none_ok=True)
    check_int("keep", keep, none_ok=True)
    if not isinstance(asynchronous, bool):
        raise ValueError(f"async_checkpoint must be True or False, got {asynchronous!r}")
    for given, name in ((every is not None, "checkpoint_every"), (asynchronous, "async_checkpoint")):
        if given and directory is None:
            raise ValueError(f"{name} needs checkpoint_dir: say where the checkpoints go")


def _check_fit_arguments(
    epochs: Any, initial_epoch: Any, steps_per_epoch: Any, validation_steps: Any, validation_freq: Any
) -> None:
    check_int("epochs", epochs)
    check_int("initial_epoch", initial_epoch, low=0)
    check_int("steps_per_epoch", steps_per_epoch, none_ok=True)
    check_int("validation_steps", validation_steps, none_ok=True)
    if isinstance(validation_freq, bool) or not (
        (isinstance(validation_freq, int) and validation_freq >= 1)
        or (isinstance(validation_freq, (list, tuple, set, range)) and all(isinstance(e, int) for e in validation_freq))
    ):
        raise ValueError(
            f"validation_freq must be a positive int or a list of epochs (1-based), got {validation_freq!r}"
        )
