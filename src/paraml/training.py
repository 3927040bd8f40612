"""The one training loop: epochs, steps, callbacks, History and Progbar, evaluate and predict, for every backend.

Keras 3's ``model.fit`` breaks under ``MultiWorkerMirroredStrategy`` (keras-team/keras#20585), so paraml runs its
own loop: each step is ``backend.run(replica_step, batch)`` inside ``tf.function``. The loss is averaged over the
*global* batch: each replica divides its sum by the all-reduced number of samples, which stays right when a final,
short batch is split unevenly (or leaves a replica empty). Keras layers, optimizers, losses, metrics and callbacks
are used as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from .backends.base import Backend
from .data import GlobalBatches

__all__ = ["Trainer", "make_optimizer", "resolve_loss", "resolve_metrics"]

LossFn = Callable[[Any, Any], tf.Tensor]


# -- compile arguments, resolved as Keras' compile does -------------------------------------------------------------
def make_optimizer(identifier: Any) -> keras.optimizers.Optimizer:
    """A fresh optimizer for ``identifier`` (a name, a config dict or an instance).

    Call it inside the backend's scope: a Keras 3 optimizer remembers the strategy it was created under, so an
    instance the user made outside any scope is re-created from its config (its state, if any, is not carried).
    """
    if isinstance(identifier, keras.optimizers.Optimizer):
        return identifier.__class__.from_config(identifier.get_config())
    try:
        return keras.optimizers.get(identifier)
    except (ValueError, TypeError) as error:
        raise ValueError(f"unknown optimizer {identifier!r}: {error}") from None


def resolve_loss(identifier: Any) -> tuple[LossFn, str]:
    """The per-sample loss function for ``identifier`` (as ``compile`` accepts it) and its name."""
    if identifier is None:
        raise ValueError("loss is required, e.g. loss='sparse_categorical_crossentropy'")
    try:
        loss = keras.losses.get(identifier) if not callable(identifier) else identifier
    except (ValueError, TypeError) as error:
        raise ValueError(f"unknown loss {identifier!r}: {error}") from None
    if isinstance(loss, keras.losses.Loss):
        return loss.call, loss.name  # `call` is the unreduced, per-sample loss
    if not callable(loss):
        raise ValueError(f"loss must be a name, a keras.losses.Loss or a function, got {identifier!r}")
    return loss, getattr(loss, "__name__", "loss")


def _accuracy_for(loss_name: str, model: keras.Model) -> keras.metrics.Metric:
    """The accuracy Keras would pick for the string "accuracy", from the loss and the model's output width."""
    name = loss_name.lower()
    if "sparse" in name:
        return keras.metrics.SparseCategoricalAccuracy(name="accuracy")
    if "binary" in name or model.outputs and model.outputs[0].shape[-1] == 1:
        return keras.metrics.BinaryAccuracy(name="accuracy")
    if "categorical" in name:
        return keras.metrics.CategoricalAccuracy(name="accuracy")
    return keras.metrics.SparseCategoricalAccuracy(name="accuracy")


def resolve_metrics(metrics: Sequence[Any] | None, loss_name: str, model: keras.Model) -> list[keras.metrics.Metric]:
    """Metric objects for ``metrics`` (names, classes, functions or instances); call inside the backend's scope."""
    resolved: list[keras.metrics.Metric] = []
    for item in metrics or ():
        if isinstance(item, str) and item in ("accuracy", "acc"):
            resolved.append(_accuracy_for(loss_name, model))
            continue
        if isinstance(item, keras.metrics.Metric):
            try:  # variables must be created under the strategy: rebuild from config where possible
                resolved.append(item.__class__.from_config(item.get_config()))
            except (TypeError, ValueError, NotImplementedError):
                resolved.append(item)
            continue
        try:
            metric = keras.metrics.get(item)
        except (ValueError, TypeError) as error:
            raise ValueError(f"unknown metric {item!r}: {error}") from None
        if isinstance(metric, type):
            metric = metric()
        name = item if isinstance(item, str) else getattr(metric, "name", getattr(metric, "__name__", "metric"))
        if not isinstance(metric, keras.metrics.Metric):
            metric = keras.metrics.MeanMetricWrapper(metric, name=name)
        elif metric.name != name:  # logs use the name the user wrote ("mae"), as compile does
            metric = metric.__class__.from_config({**metric.get_config(), "name": name})
        resolved.append(metric)
    names = [m.name for m in resolved]
    if len(set(names)) != len(names) or "loss" in names:
        raise ValueError(f"metric names must be unique and not 'loss', got {names}")
    return resolved


def _as_float32(value: Any) -> Any:
    return tf.cast(value, tf.float32) if value.dtype.is_floating else value


def _weights_like(w: tf.Tensor, per_sample: tf.Tensor) -> tf.Tensor:
    """Sample weights brought to the rank of the per-sample loss, as Keras does: (n, 1) -> (n,), (n,) -> (n, 1)."""
    while w.shape.rank > per_sample.shape.rank and w.shape[-1] == 1:
        w = tf.squeeze(w, -1)
    while w.shape.rank < per_sample.shape.rank:
        w = tf.expand_dims(w, -1)
    return tf.cast(w, tf.float32)


def _to_numpy(value: Any) -> Any:
    return tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else np.asarray(t), value)


class _ProgressCallback(keras.callbacks.Callback):
    """Reports each finished execution to ``on_progress(epoch, steps_done, "step")`` (checkpoints every N steps)."""

    def __init__(self, on_progress: Callable[[int, int, str], None]) -> None:
        super().__init__()
        self.on_progress, self.epoch = on_progress, 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.on_progress(self.epoch, batch + 1, "step")


def _with(callbacks: keras.callbacks.CallbackList, extra: keras.callbacks.Callback) -> keras.callbacks.CallbackList:
    """``callbacks`` plus ``extra`` (run last), sharing the same model."""
    return keras.callbacks.CallbackList([*callbacks.callbacks, extra], model=callbacks.model)


# -- the loop ---------------------------------------------------------------------------------------------------------
class Trainer:
    """Runs fit/evaluate/predict of one compiled model on one backend. Built by :meth:`paraml.Parallel.build`."""

    def __init__(
        self,
        backend: Backend,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer,
        loss: LossFn,
        metrics: list[keras.metrics.Metric],
        loss_tracker: keras.metrics.Mean,
        steps_per_execution: int = 1,
    ) -> None:
        self.backend = backend
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss
        self.metrics = metrics
        self.loss_tracker = loss_tracker
        self.steps_per_execution = steps_per_execution
        self._functions: dict[tuple[str, int], Callable[[Iterator[Any]], Any]] = {}

    # -- per-replica work ---------------------------------------------------------------------------------------------
    def _objective(self, global_rows: tf.Tensor) -> Callable[[Any, Any, tf.Tensor, bool], tf.Tensor]:
        """The loss to differentiate for (part of) a replica's batch; also updates the loss tracker and metrics."""
        model = self.model

        def objective(y_pred: Any, y: Any, w: tf.Tensor, first: bool) -> tf.Tensor:
            y_pred = tf.nest.map_structure(_as_float32, y_pred)  # mixed precision: the loss in float32
            per_sample = tf.cast(self.loss_fn(y, y_pred), tf.float32)
            if per_sample.shape.rank == 0:  # a loss that already averaged its batch: weigh it by the rows
                per_sample = tf.fill(tf.shape(w)[:1], per_sample)
            per_sample = per_sample * _weights_like(w, per_sample)
            # Keras' "sum over batch size" divides by every element of the loss: global rows x other dims.
            per_row = tf.cast(tf.reduce_prod(tf.shape(per_sample)[1:]), tf.float32)
            loss = tf.nn.compute_average_loss(
                tf.reshape(per_sample, [-1]), global_batch_size=tf.cast(global_rows * per_row, tf.int64)
            )
            # Regularisation counts once per step in the gradient (on the first part) but in every sample's
            # reported loss, as Keras reports it, also when a backend splits the batch into micro-batches.
            regularization = tf.add_n(model.losses) if model.losses else tf.constant(0.0)
            if first and model.losses:
                loss += tf.nn.scale_regularization_loss(regularization)
            self.loss_tracker.update_state(per_sample + regularization)
            for metric in self.metrics:
                metric.update_state(y, y_pred, sample_weight=w)
            return self.optimizer.scale_loss(loss)  # a LossScaleOptimizer scales; others return it as is

        return objective

    def _train_replica(self, x: Any, y: Any, w: tf.Tensor) -> None:
        rows = tf.shape(w)[0]
        global_rows = self.backend.all_reduce_sum(tf.cast(rows, tf.float32))
        variables = self.model.trainable_variables

        def compute() -> list[tf.Tensor]:
            grads, _ = self.backend.gradients(self.model, x, y, w, self._objective(global_rows))
            return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, variables)]

        # A short last batch can leave a replica with no rows: running the model on nothing would feed NaN into
        # layers such as BatchNormalization. That replica contributes zero gradients to the all-reduce instead.
        grads = tf.cond(rows > 0, compute, lambda: [tf.zeros_like(v) for v in variables])
        self.optimizer.apply_gradients(zip(grads, variables))

    def _test_replica(self, x: Any, y: Any, w: tf.Tensor) -> None:
        y_pred = self.backend.forward(self.model, x, training=False)
        self._objective(tf.constant(1.0))(y_pred, y, w, True)

    def _predict_replica(self, x: Any, y: Any, w: tf.Tensor) -> Any:
        del y, w
        return self.backend.forward(self.model, x, training=False)

    # -- compiled multi-step functions --------------------------------------------------------------------------------
    def _logs(self) -> dict[str, tf.Tensor]:
        return {m.name: m.result() for m in [self.loss_tracker, *self.metrics]}

    def _function(self, kind: str, steps: int) -> Callable[[Iterator[Any]], Any]:
        """A ``tf.function`` that runs ``steps`` steps of ``kind`` on the next batches of an iterator."""
        key = (kind, steps)
        if key in self._functions:
            return self._functions[key]
        backend = self.backend
        replica_fn = {"train": self._train_replica, "test": self._test_replica}.get(kind)

        if kind == "predict":

            def run(iterator: Iterator[Any]) -> Any:
                outputs = backend.run(self._predict_replica, next(iterator))
                return tf.nest.map_structure(backend.gather, outputs)

        else:

            def run(iterator: Iterator[Any]) -> Any:
                if steps == 1:  # a graph loop around one step costs 4-7% per step (measured): run it straight
                    backend.run(replica_fn, next(iterator))
                else:
                    for _ in tf.range(steps):
                        backend.run(replica_fn, next(iterator))
                return self._logs()

        self._functions[key] = tf.function(run)
        return self._functions[key]

    def _reset_metrics(self) -> None:
        for metric in [self.loss_tracker, *self.metrics]:
            metric.reset_state()

    def _run_epoch(
        self,
        kind: str,
        source: GlobalBatches,
        epoch: int,
        callbacks: keras.callbacks.CallbackList | None = None,
        start_step: int = 0,
        iterator: Iterator[Any] | None = None,
    ) -> tuple[dict[str, float], int]:
        """One pass over ``source`` from batch ``start_step``; return the logs and the number of the next batch.

        ``callbacks`` get the batch hooks of ``kind`` ("train" or "test"), and training stops early when a callback
        sets ``model.stop_training``. ``iterator`` continues a distributed iterator that spans epochs; without it,
        one is made for this epoch.
        """
        self._reset_metrics()
        if iterator is None:
            iterator = iter(self.backend.distribute(source.dataset(epoch, skip=start_step)))
        logs: dict[str, float] = {}
        step = start_step
        while source.steps is None or step < source.steps:
            k = 1 if source.steps is None else min(self.steps_per_execution, source.steps - step)
            if callbacks is not None:
                getattr(callbacks, f"on_{kind}_batch_begin")(step)
            try:
                logs = {name: float(v) for name, v in self._function(kind, k)(iterator).items()}
            except tf.errors.OutOfRangeError:
                break  # a dataset of unknown length has ended
            step += k
            if callbacks is not None:
                getattr(callbacks, f"on_{kind}_batch_end")(step - 1, logs)
                if kind == "train" and self.model.stop_training:
                    break
        if not logs:
            if start_step == 0:
                raise ValueError("the input is empty: there is no batch to run")
            logs = {name: float(v) for name, v in self._logs().items()}
        return logs, step

    # -- public operations --------------------------------------------------------------------------------------------
    def fit(
        self,
        source: GlobalBatches,
        *,
        epochs: int,
        initial_epoch: int,
        validation: GlobalBatches | None,
        callbacks: Sequence[keras.callbacks.Callback] | None,
        verbose: int,
        start_step: int = 0,
        on_progress: Callable[[int, int, str], None] | None = None,
    ) -> keras.callbacks.History:
        """Train for ``epochs - initial_epoch`` epochs and return the History (as ``model.fit`` does).

        ``start_step`` skips that many batches of the first epoch (a resumed run). ``on_progress(epoch,
        steps_done, event)`` hooks checkpointing in: ``event`` is "step" after each execution, "epoch_end" when an
        epoch completed, "stopped" when a callback stopped training in the middle of one.
        """
        model = self.model
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
        model.stop_training = False
        callback_list.on_train_begin()
        logs: dict[str, float] = {}
        shared = None  # one iterator over every epoch, where the input allows it
        if source.spans_epochs and source.steps is not None:
            shared = iter(self.backend.distribute(source.dataset(initial_epoch, epochs, skip=start_step)))
        progress = _ProgressCallback(on_progress) if on_progress is not None else None
        train_callbacks = callback_list if progress is None else _with(callback_list, progress)
        for epoch in range(initial_epoch, epochs):
            callback_list.on_epoch_begin(epoch)
            if progress is not None:
                progress.epoch = epoch
            first = start_step if epoch == initial_epoch else 0
            logs, steps_done = self._run_epoch("train", source, epoch, train_callbacks, first, shared)
            completed = source.steps is None or steps_done >= source.steps
            if validation is not None and completed:
                callback_list.on_test_begin()
                val_logs, _ = self._run_epoch("test", validation, 0, callback_list)
                callback_list.on_test_end(val_logs)
                logs.update({f"val_{name}": value for name, value in val_logs.items()})
            callback_list.on_epoch_end(epoch, logs)
            if on_progress is not None:
                on_progress(epoch, steps_done, "epoch_end" if completed else "stopped")
            if model.stop_training:
                break
        callback_list.on_train_end(logs)
        return history

    def evaluate(self, source: GlobalBatches, *, verbose: int = 0) -> dict[str, float]:
        """Loss and metrics over every sample of ``source``."""
        callbacks = keras.callbacks.CallbackList(
            add_progbar=bool(verbose), model=self.model, verbose=verbose, steps=source.steps
        )
        callbacks.on_test_begin()
        logs, _ = self._run_epoch("test", source, 0, callbacks)
        callbacks.on_test_end(logs)
        return logs

    def predict(self, source: GlobalBatches, *, verbose: int = 0) -> Any:
        """The model's outputs for every sample of ``source``, in input order, as numpy."""
        iterator = iter(self.backend.distribute(source.dataset(0)))
        progbar = keras.utils.Progbar(source.steps) if verbose else None
        batches: list[Any] = []
        step = 0
        while source.steps is None or step < source.steps:
            try:
                batches.append(_to_numpy(self._function("predict", 1)(iterator)))
            except tf.errors.OutOfRangeError:
                break
            step += 1
            if progbar is not None:
                progbar.update(step)
        if not batches:
            raise ValueError("predict got no data: the input is empty")
        return tf.nest.map_structure(lambda *parts: np.concatenate(parts, axis=0), *batches)
