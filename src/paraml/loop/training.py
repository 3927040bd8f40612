"""The one training loop: epochs, callbacks, History and Progbar; evaluate and predict; for every backend.

Keras 3's ``model.fit`` breaks under ``MultiWorkerMirroredStrategy`` (keras-team/keras#20585), so paraml runs its
own loop: each execution is a ``tf.function`` of :class:`paraml.loop.steps.ReplicaStep` that runs
``backend.run(replica_step, batch)``; :class:`paraml.loop.epochs.EpochIterator` says which batches an epoch takes. This
module only drives them and Keras' callbacks.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from paraml.backends.base import Backend
from paraml.loop.batches import GlobalBatches
from paraml.loop.compiling import changed_trainable, trainable_state
from paraml.loop.epochs import EpochIterator
from paraml.loop.steps import ReplicaStep, callers_level

__all__ = ["ProgressHook", "Trainer", "should_validate"]

#: What ``on_progress(epoch, steps_done, event)`` hears: "step" after each execution, "epoch_end" when an epoch
#: completed, "stopped" when training stopped in the middle of one (checkpoints hook in here).
ProgressHook = Callable[[int, int, str], None]


def should_validate(epoch: int, validation_freq: int | Sequence[int]) -> bool:
    """Keras' ``validation_freq`` rule: every N epochs (an int), or in the listed 1-based epochs (a container).

    >>> [should_validate(e, 2) for e in range(4)], should_validate(2, [1, 3])
    ([False, True, False, True], True)
    """
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq


class _ProgressCallback(keras.callbacks.Callback):
    """Reports each finished execution to ``on_progress(epoch, steps_done, "step")`` (checkpoints every N steps)."""

    def __init__(self, on_progress: ProgressHook) -> None:
        super().__init__()
        self.on_progress, self.epoch = on_progress, 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.on_progress(self.epoch, batch + 1, "step")


def _to_numpy(value: Any) -> Any:
    return tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else np.asarray(t), value)


def _never() -> bool:
    return False


class Trainer:
    """Runs fit/evaluate/predict of one compiled model on one backend. Built by :meth:`paraml.Parallel.build`."""

    def __init__(
        self,
        backend: Backend,
        model: keras.Model,
        steps_per_execution: int = 1,
        accumulation_steps: int | None = None,
        jit_compile: bool = False,
    ) -> None:
        self.backend = backend
        self.model = model
        self.optimizer: keras.optimizers.Optimizer = model.optimizer
        self.steps_per_execution = steps_per_execution
        self.step = ReplicaStep(backend, model, accumulation_steps, jit_compile)
        self._compiled_trainable = trainable_state(model)  # what this compile trains, for the warning below

    def warn_if_trainable_changed(self) -> None:
        """Warn, once per change, that a layer's ``trainable`` changed since the compile: as in Keras, what trains
        stays what the compile saw until the model is compiled again."""
        changed = changed_trainable(self.model, self._compiled_trainable)
        if not changed:
            return
        self._compiled_trainable = trainable_state(self.model)
        names = ", ".join(repr(name) for name in changed[:3]) + (f" and {len(changed) - 3} more" if changed[3:] else "")
        warnings.warn(
            f"the trainable flag of layer {names} changed since the model was compiled: it takes effect at the next "
            "compile, as in Keras (the optimizer and the step still train the variables the compile saw); call "
            "par.compile(...) or par.model.compile(...) again before fit",
            stacklevel=callers_level(),
        )

    def _run_epoch(
        self,
        kind: str,
        epoch_iterator: EpochIterator,
        callbacks: keras.callbacks.CallbackList | None = None,
        stop_requested: Callable[[], bool] = _never,
    ) -> tuple[dict[str, float], str]:
        """One epoch from where ``epoch_iterator`` stands: the logs and how it ended: "done" (its steps ran or the
        data ended), "stopped" (a callback set ``model.stop_training``) or "preempted" (``stop_requested()``, agreed
        by every worker). ``callbacks`` get the batch hooks of ``kind`` ("train" or "test")."""
        self.model.reset_metrics()
        logs: dict[str, float] = {}
        ended = "done"
        weighted = epoch_iterator.source.weighted
        while steps := epoch_iterator.next_size():
            requested = kind == "train" and stop_requested()
            if requested and self.backend.topology.num_workers == 1:  # nobody to agree with: stop before this step
                ended = "preempted"
                break
            if callbacks is not None:
                getattr(callbacks, f"on_{kind}_batch_begin")(epoch_iterator.step)
            function = self.step.function(kind, steps, weighted, epoch_iterator.source.targeted)
            stop = tf.constant(float(requested))
            result = epoch_iterator.run(steps, lambda iterator, f=function, s=stop: f(iterator, s))
            if result is None:
                break  # the data has ended
            values, agreed = result
            logs = {name: float(v) for name, v in values.items()}
            if kind == "train":
                self.step.executed(steps)
            if callbacks is not None:
                getattr(callbacks, f"on_{kind}_batch_end")(epoch_iterator.step - 1, logs)
            if kind == "train" and float(agreed) > 0:
                ended = "preempted"
                break
            if kind == "train" and self.model.stop_training:
                left = epoch_iterator.remaining()
                ended = "stopped" if left is None or left > 0 else "done"
                break
        if not logs:
            if epoch_iterator.step == 0 and ended == "done":
                raise ValueError("the input is empty: there is no batch to run")
            logs = {name: float(v) for name, v in self.model.get_metrics_result().items()}
        return logs, ended

    def _validate(self, validation: EpochIterator, callbacks: keras.callbacks.CallbackList) -> dict[str, float]:
        """One pass over the validation data from its first batch, as in Keras; its logs with the ``val_`` prefix."""
        validation.start(0)
        callbacks.on_test_begin()
        validation.source.on_epoch_begin()
        logs, _ = self._run_epoch("test", validation, callbacks)
        validation.source.on_epoch_end()
        callbacks.on_test_end(logs)
        return {f"val_{name}": value for name, value in logs.items()}

    # -- public operations --------------------------------------------------------------------------------------------
    def fit(
        self,
        source: GlobalBatches,
        *,
        epochs: int,
        initial_epoch: int = 0,
        validation: GlobalBatches | None = None,
        validation_freq: int | Sequence[int] = 1,
        callbacks: Sequence[keras.callbacks.Callback] | None = None,
        verbose: int = 0,
        start_step: int = 0,
        resumed: bool = False,
        on_progress: ProgressHook | None = None,
        stop_requested: Callable[[], bool] | None = None,
    ) -> tuple[keras.callbacks.History, bool]:
        """Train for ``epochs - initial_epoch`` epochs; return the History (as ``model.fit`` does) and whether a stop
        request (a signal, through ``stop_requested``) ended training early.

        ``start_step`` skips that many batches of the first epoch; ``resumed`` says the run was restored from a
        checkpoint (see :meth:`EpochIterator.start`); ``on_progress`` hears the progress (see :data:`ProgressHook`).
        """
        model = self.model
        self.warn_if_trainable_changed()
        self.step.build_metrics(source)
        if validation is not None:
            self.step.build_metrics(validation)
        callback_list = keras.callbacks.CallbackList(
            list(callbacks or ()),
            add_history=True,
            add_progbar=verbose != 0,
            model=model,
            verbose=verbose,
            epochs=epochs,
            steps=source.steps,
        )
        history = next(c for c in callback_list.callbacks if isinstance(c, keras.callbacks.History))
        train_callbacks = callback_list
        if on_progress is not None:  # run after the user's callbacks, sharing the model
            extra = _ProgressCallback(on_progress)
            train_callbacks = keras.callbacks.CallbackList([*callback_list.callbacks, extra], model=model)
        model.stop_training = False
        callback_list.on_train_begin()
        logs: dict[str, float] = {}
        source.reset()  # a PyDataset hears on_epoch_end first, as in Keras
        batches = EpochIterator(self.backend, source, self.steps_per_execution)
        batches.start(initial_epoch, epochs, start_step, resumed)
        validation_batches = None
        if validation is not None:
            validation.reset()
            validation_batches = EpochIterator(self.backend, validation, self.steps_per_execution)
        preempted = False
        for epoch in range(initial_epoch, epochs):
            train_callbacks.on_epoch_begin(epoch)
            if epoch != initial_epoch:
                batches.next_epoch(epoch)
            source.on_epoch_begin()
            logs, ended = self._run_epoch("train", batches, train_callbacks, stop_requested or _never)
            preempted = ended == "preempted"
            source.on_epoch_end()
            if validation_batches is not None and not preempted and should_validate(epoch, validation_freq):
                logs.update(self._validate(validation_batches, callback_list))
            callback_list.on_epoch_end(epoch, logs)
            if on_progress is not None:
                on_progress(epoch, batches.step, "epoch_end" if ended == "done" else "stopped")
            if model.stop_training or preempted:
                break
        callback_list.on_train_end(logs)
        return history, preempted

    def evaluate(self, source: GlobalBatches, *, verbose: int = 0) -> dict[str, float]:
        """Loss and metrics over every sample of ``source`` (or its first ``steps`` batches)."""
        self.warn_if_trainable_changed()
        self.step.build_metrics(source)
        callbacks = keras.callbacks.CallbackList(
            add_progbar=bool(verbose), model=self.model, verbose=verbose, epochs=1, steps=source.steps
        )
        source.reset()
        batches = EpochIterator(self.backend, source, self.steps_per_execution)
        batches.start(0)
        callbacks.on_test_begin()
        source.on_epoch_begin()
        logs, _ = self._run_epoch("test", batches, callbacks)
        source.on_epoch_end()
        callbacks.on_test_end(logs)
        return logs

    def predict(self, source: GlobalBatches, *, verbose: int = 0) -> Any:
        """The model's outputs for every sample of ``source``, in input order, as numpy (the model's structure)."""
        self.step.output_dtypes(source)
        source.reset()
        source.on_epoch_begin()
        batches = EpochIterator(self.backend, source)
        batches.start(0)
        progbar = keras.utils.Progbar(source.steps) if verbose else None
        function = self.step.function("predict", 1, False, False)
        no_stop = tf.constant(0.0)
        outputs: list[Any] = []
        while batches.next_size():
            result = batches.run(1, lambda iterator: function(iterator, no_stop))
            if result is None:
                break
            outputs.append(_to_numpy(result))
            if progbar is not None:
                progbar.update(batches.step)
        source.on_epoch_end()
        if not outputs:
            raise ValueError("predict got no data: the input is empty")
        return tf.nest.map_structure(lambda *parts: np.concatenate(parts, axis=0), *outputs)
