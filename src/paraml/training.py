"""The one training loop: epochs, steps, callbacks, History and Progbar, evaluate and predict, for every backend.

Keras 3's ``model.fit`` breaks under ``MultiWorkerMirroredStrategy`` (keras-team/keras#20585), so paraml runs its
own loop: each step is ``backend.run(replica_step, batch)`` inside ``tf.function``. Losses and metrics are Keras'
own: the model is compiled as usual and each replica calls ``model.compute_loss`` / ``model.compute_metrics``, so
multi-output models, ``loss_weights``, ``weighted_metrics`` and a model's own ``compute_loss`` work as in
``model.fit`` and the logs carry Keras' names.

The loss is averaged over the *global* batch. Keras divides a replica's loss by the replica's rows and by the number
of replicas, which is right only when every replica has the same number of rows. paraml multiplies each replica's
loss by ``rows * replicas / global_rows`` (the global rows are all-reduced), which makes the sum over replicas the
mean over the global batch, regularisation included, also when a final, short batch is split unevenly or leaves a
replica empty, and also for the micro-batches of ``model_parallel``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from .backends.base import Backend
from .data import GlobalBatches

__all__ = ["Feed", "Trainer", "check_compile_names", "make_optimizer", "should_validate", "zeros_like_spec"]

#: What ``on_progress(epoch, steps_done, event)`` hears: "step", "epoch_end", "stopped".
ProgressHook = Callable[[int, int, str], None]


# -- compile arguments, checked before anything is built -------------------------------------------------------------
def make_optimizer(identifier: Any) -> keras.optimizers.Optimizer:
    """A fresh optimizer for ``identifier`` (a name, a config dict or an instance).

    Call it inside the backend's scope: a Keras 3 optimizer remembers the strategy it was created under, so an
    instance the user made outside any scope is re-created from its config (its state, if any, is not carried).

    >>> make_optimizer("adam").__class__.__name__
    'Adam'
    """
    if isinstance(identifier, keras.optimizers.Optimizer):
        return identifier.__class__.from_config(identifier.get_config())
    try:
        return keras.optimizers.get(identifier)
    except (ValueError, TypeError) as error:
        raise ValueError(f"unknown optimizer {identifier!r}: {error}") from None


#: Metric names Keras resolves from the loss and the output (not through ``keras.metrics.get``).
_KERAS_SPECIAL_METRICS = ("accuracy", "acc", "crossentropy", "ce")


def check_compile_names(loss: Any, metrics: Any, weighted_metrics: Any) -> None:
    """Raise ``ValueError`` for a loss or metric name Keras does not know (Keras itself only notices at the first step).

    ``loss`` and the metrics may be nested as ``compile`` takes them (lists per output, dicts by output name).

    >>> check_compile_names("mse", ["mae"], None)
    >>> check_compile_names("mse", ["acuracy"], None)
    Traceback (most recent call last):
    ...
    ValueError: unknown metric 'acuracy': Could not interpret metric identifier: acuracy
    """
    for item in tf.nest.flatten(loss):
        if isinstance(item, str):
            try:
                keras.losses.get(item)
            except (ValueError, TypeError) as error:
                raise ValueError(f"unknown loss {item!r}: {error}") from None
    for item in tf.nest.flatten([metrics, weighted_metrics]):
        if isinstance(item, str) and item not in _KERAS_SPECIAL_METRICS:
            try:
                keras.metrics.get(item)
            except (ValueError, TypeError) as error:
                raise ValueError(f"unknown metric {item!r}: {error}") from None


# -- small helpers -----------------------------------------------------------------------------------------------------
def _rows(x: Any) -> tf.Tensor:
    """The number of samples in a (nested) batch, from its first tensor, as Keras counts them."""
    return tf.shape(tf.nest.flatten(x)[0])[0]


def _to_numpy(value: Any) -> Any:
    return tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else np.asarray(t), value)


def zeros_like_spec(spec: Any) -> Any:
    """A batch of one sample shaped like ``spec`` (a structure of ``tf.TensorSpec``), unknown dimensions as 1."""

    def zeros(s: tf.TensorSpec) -> tf.Tensor:
        shape = [1 if d is None else d for d in s.shape.as_list()] if s.shape.rank is not None else [1]
        shape[:1] = [1]
        return tf.fill(shape, "") if s.dtype == tf.string else tf.zeros(shape, s.dtype)

    return tf.nest.map_structure(zeros, spec)


def _returns_a_scalar(loss: Any, y: Any, y_pred: Any) -> bool:
    """Whether a plain loss function among ``loss`` (as compiled) returns one value for a whole batch."""
    functions = [f for f in tf.nest.flatten(loss) if callable(f) and not isinstance(f, keras.losses.Loss)]
    pairs = list(zip(tf.nest.flatten(y), tf.nest.flatten(y_pred)))
    for function in functions:
        for y_true, y_out in pairs:
            try:
                if tf.convert_to_tensor(function(y_true, y_out)).shape.rank == 0:
                    return True
            except Exception:  # not this output's loss: Keras checks the real pairing
                continue
    return False


class _ProgressCallback(keras.callbacks.Callback):
    """Reports each finished execution to ``on_progress(epoch, steps_done, "step")`` (checkpoints every N steps)."""

    def __init__(self, on_progress: ProgressHook) -> None:
        super().__init__()
        self.on_progress, self.epoch = on_progress, 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.on_progress(self.epoch, batch + 1, "step")


def _with(callbacks: keras.callbacks.CallbackList, extra: keras.callbacks.Callback) -> keras.callbacks.CallbackList:
    """``callbacks`` plus ``extra`` (run last), sharing the same model."""
    return keras.callbacks.CallbackList([*callbacks.callbacks, extra], model=callbacks.model)


def should_validate(epoch: int, validation_freq: int | Sequence[int]) -> bool:
    """Keras' ``validation_freq`` rule: every N epochs (an int), or in the listed 1-based epochs (a container).

    >>> [should_validate(e, 2) for e in range(4)], should_validate(2, [1, 3])
    ([False, True, False, True], True)
    """
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq


# -- where the batches come from ---------------------------------------------------------------------------------------
@dataclass
class Feed:
    """The distributed iterators of one ``fit`` (or evaluate/predict) over a :class:`GlobalBatches`, by Keras' rules.

    - An epoch is ``source.steps`` batches when that is known (``steps_per_epoch`` or the data's length), else it ends
      with the data.
    - When the caller gave ``steps_per_epoch`` (``source.continues``), one iterator runs on across epochs and a new
      pass over the data starts only when the old one is exhausted (an epoch that reaches the end of the data stops
      there, as in ``model.fit``); otherwise every epoch is one pass.
    - Arrays without ``steps_per_epoch`` make one iterator for all epochs (a distributed iterator costs ~0.1 s).
    """

    backend: Backend
    source: GlobalBatches
    iterator: Iterator[Any] | None = None
    pass_index: int = 0  # which pass over the data the iterator is in
    seen: int = 0  # batches taken from the current pass

    @property
    def budget(self) -> int | None:
        """How many batches one epoch runs at most (None: until the data ends)."""
        return self.source.steps

    def start(self, epoch: int, stop_epoch: int, skip: int, resumed: bool = False) -> None:
        """Open the iterator for ``epoch`` after ``skip`` batches of it.

        ``resumed``: a run restored from a checkpoint. A user's dataset that makes a new pass every epoch reshuffles
        at every new iterator (``shuffle(reshuffle_each_iteration=True)``): the run that was stopped had made
        ``epoch`` iterators before this one, so as many are made (and dropped, unread) first.
        """
        source = self.source
        if resumed and source.kind == "dataset" and not source.continues:  # (a generator would be read)
            for _ in range(epoch):
                iter(source.dataset(epoch))
        if source.continues:
            self.pass_index, self.seen = self.position(epoch, skip)
            self.iterator = iter(self.backend.distribute(source.dataset(self.pass_index, skip=self.seen)))
        elif source.spans_epochs:
            self.iterator = iter(self.backend.distribute(source.dataset(epoch, stop_epoch, skip=skip)))
        else:
            self.iterator = iter(self.backend.distribute(source.dataset(epoch, skip=skip)))

    def position(self, epoch: int, step: int) -> tuple[int, int]:
        """Where batch ``step`` of ``epoch`` falls among the passes over the data: (pass, batches into it).

        Keras' rule when ``steps_per_epoch`` is given: an epoch takes ``steps`` batches, or fewer if the pass ends
        first; a new pass starts at the next epoch. Data of unknown length is one pass.
        """
        steps, length = self.source.steps or 0, self.source.num_batches
        if length is None:
            return 0, epoch * steps + step
        passes, seen = 0, 0
        for _ in range(epoch):
            seen += min(steps, length - seen)
            if seen >= length:
                passes, seen = passes + 1, 0
        return passes, seen + step

    def next_epoch(self, epoch: int) -> None:
        """Prepare the iterator for ``epoch`` (after the previous one ended)."""
        source = self.source
        if source.continues:
            if self.iterator is None or (source.num_batches is not None and self.seen >= source.num_batches):
                self.pass_index, self.seen = self.pass_index + 1, 0
                self.iterator = iter(self.backend.distribute(source.dataset(self.pass_index)))
        elif not source.spans_epochs:
            self.iterator = iter(self.backend.distribute(source.dataset(epoch)))

    def batches_left(self, step: int) -> int | None:
        """How many batches the epoch may still take at ``step`` (None: unbounded)."""
        left = None if self.budget is None else self.budget - step
        if self.source.continues and self.source.num_batches is not None:
            in_pass = self.source.num_batches - self.seen
            left = in_pass if left is None else min(left, in_pass)
        return left

    def exhausted(self) -> None:
        """The iterator ran out of data: the next epoch starts a new pass."""
        if self.source.continues:
            self.iterator = None


# -- the loop ---------------------------------------------------------------------------------------------------------
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
        # Keras' own tracker (``model.fit`` updates it); a model whose ``metrics`` leaves it out keeps its own.
        self.loss_tracker = next(
            (m for m in model.metrics if m.name == "loss" and isinstance(m, keras.metrics.Mean)), None
        )
        self._functions: dict[tuple[str, int, tuple[bool, ...], bool], Callable[..., Any]] = {}
        self._weighted = False  # whether the function being traced passes the user's sample weights to Keras
        self._scalar_loss = False  # whether a compiled loss function returns one value for the batch
        #: Keras' ``gradient_accumulation_steps``, run by this loop (see :meth:`_train_replica`), and its state.
        self.accumulation_steps: int | None = accumulation_steps
        self.micro_steps = 0
        self.accumulators: list[tf.Variable] | None = None
        if accumulation_steps:
            with backend.scope():
                self.accumulators = [
                    tf.Variable(
                        tf.zeros(v.shape, v.dtype),
                        trainable=False,
                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,  # the same on every replica
                        name="accumulated_" + v.name,
                    )
                    for v in model.trainable_variables
                ]
        self._metrics_built = False
        self._output_dtypes: Any = None  # the model's output dtypes, seen when predict is traced
        #: XLA for the replicas' forward pass, loss and gradients. The optimizer update stays outside: under
        #: tf.distribute it is a sync point (merge_call), which TF refuses inside a nested compiled function.
        self.jit_compile = jit_compile
        self._xla_gradients = tf.function(self._replica_gradients, jit_compile=True)
        #: Called once per execution; returns True when training should stop at this step boundary (a signal).
        self.stop_requested: Callable[[], bool] = lambda: False

    # -- Keras' compiled loss and metrics ------------------------------------------------------------------------
    def build_metrics(self, source: GlobalBatches) -> None:
        """Build Keras' compiled loss and metrics from the input's structure, outside any replica (as ``fit`` does).

        Keras creates them lazily at the first call, which under a strategy would be inside a replica. Any bad loss
        or metric for this model and data (a wrong output name, a loss that does not fit the targets) fails here,
        before training starts.
        """
        if self._metrics_built:
            return
        x, y, w = zeros_like_spec(source.dataset(0).element_spec)
        with self.backend.metrics_scope():
            y_pred = self.backend.forward(self.model, x, training=False)
            self._scalar_loss = _returns_a_scalar(self.model.loss, y, y_pred)
            w = w if source.weighted or self._scalar_loss else None
            self.model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=w, training=False)
            self.model.compute_metrics(x, y, y_pred, sample_weight=w)
        self.model.reset_metrics()
        self._metrics_built = True

    def _objective(self, global_rows: tf.Tensor, training: bool) -> Callable[[Any, Any, Any, Any], tf.Tensor]:
        """The loss to differentiate for (a part of) a replica's batch; also updates the loss tracker and metrics."""
        model, tracker = self.model, self.loss_tracker

        def objective(x: Any, y: Any, y_pred: Any, w: Any) -> tf.Tensor:
            # No user weights: none for Keras either, as model.fit passes them. A loss function that returns a scalar
            # gets ones, so that Keras spreads it over the rows and scales it like any other (it does not scale a
            # bare scalar by the replicas, which would count it once per replica).
            w = w if self._weighted or self._scalar_loss else None
            loss = tf.cast(model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=w, training=training), "float32")
            replicas = tf.cast(tf.distribute.get_strategy().num_replicas_in_sync, tf.float32)
            rows = tf.cast(_rows(x), tf.float32)
            if tracker is not None:  # Keras logs the replica's unscaled loss, weighted by its rows
                tracker.update_state(loss * replicas, sample_weight=rows)
            model.compute_metrics(x, y, y_pred, sample_weight=w)
            return self.optimizer.scale_loss(loss * (rows * replicas / global_rows))

        return objective

    # -- per-replica work ---------------------------------------------------------------------------------------------
    def _gradients(self, x: Any, y: Any, w: Any, rows: tf.Tensor, global_rows: tf.Tensor) -> list[Any]:
        """This replica's gradients; zeros (of the same kinds) for a replica the last batch left empty."""
        variables = self.model.trainable_variables
        kinds: list[Any] = []

        def compute() -> list[Any]:
            grads = (self._xla_gradients if self.jit_compile else self._replica_gradients)(x, y, w, global_rows)
            kinds[:] = grads
            return grads

        def nothing() -> list[Any]:
            # Sparse gradients (an Embedding's IndexedSlices) stay sparse: the other branch must match their kind.
            return [
                tf.IndexedSlices(
                    tf.zeros([0, *g.values.shape[1:]], g.values.dtype),
                    tf.zeros([0], g.indices.dtype),
                    tf.constant(list(v.shape), g.dense_shape.dtype),
                )
                if isinstance(g, tf.IndexedSlices)
                else tf.zeros_like(v)
                for g, v in zip(kinds, variables)
            ]

        if not self.backend.skips_empty_replicas:  # a sync point in the forward pass (see the backend) forbids cond
            return compute()
        # Running the model on no rows would feed NaN into layers such as BatchNormalization.
        return tf.cond(rows > 0, compute, nothing)

    def _replica_gradients(self, x: Any, y: Any, w: Any, global_rows: tf.Tensor) -> list[Any]:
        """Forward pass, loss and gradients of this replica (what ``jit_compile=True`` compiles with XLA)."""
        grads, _ = self.backend.gradients(self.model, x, y, w, self._objective(global_rows, True))
        return [tf.zeros_like(v) if g is None else g for g, v in zip(grads, self.model.trainable_variables)]

    def _train_replica(self, x: Any, y: Any, w: Any, update: bool = True) -> None:
        """One training step on this replica. With gradient accumulation, ``update`` says whether this step applies
        the accumulated gradients (the host knows which step does, so the graph holds no ``cond`` around the
        optimizer: that ``cond`` is what breaks Keras' own accumulation under tf.distribute)."""
        rows = _rows(x)
        global_rows = self.backend.all_reduce_sum(tf.cast(rows, tf.float32))
        grads = self._gradients(x, y, w, rows, global_rows)
        variables = self.model.trainable_variables
        if self.accumulators is None:
            self.optimizer.apply_gradients(zip(grads, variables))
            return
        # Keras' rule: every n-th step applies (sum of the n steps' gradients) / n; the others only accumulate.
        grads = [tf.convert_to_tensor(g) for g in grads]
        steps = float(self.accumulation_steps)
        if not update:
            for accumulator, g in zip(self.accumulators, self.backend.all_reduce_sum(grads)):
                accumulator.assign_add(g)
            return
        # The optimizer sums the replicas' gradients: each adds its share of what was accumulated (already summed).
        replicas = float(tf.distribute.get_strategy().num_replicas_in_sync)
        total = [(g + a / replicas) / steps for g, a in zip(grads, self.accumulators)]
        self.optimizer.apply_gradients(zip(total, variables))
        for accumulator in self.accumulators:
            accumulator.assign(tf.zeros_like(accumulator))

    def _test_replica(self, x: Any, y: Any, w: Any) -> None:
        y_pred = self.backend.forward(self.model, x, training=False)
        self._objective(tf.constant(1.0), False)(x, y, y_pred, w)

    def _predict_replica(self, x: Any, y: Any, w: Any) -> Any:
        del y, w
        outputs = self.backend.forward(self.model, x, training=False)
        self._output_dtypes = tf.nest.map_structure(lambda t: t.dtype, outputs)
        # TF's collectives refuse bfloat16 (mixed_bfloat16): gathered in float32, cast back after.
        return tf.nest.map_structure(lambda t: tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t, outputs)

    # -- compiled multi-step functions --------------------------------------------------------------------------------
    def _updates(self, steps: int) -> tuple[bool, ...]:
        """Which of the next ``steps`` training steps apply the optimizer (all, without gradient accumulation)."""
        if self.accumulators is None:
            return (True,) * steps
        n = self.accumulation_steps
        return tuple((self.micro_steps + i + 1) % n == 0 for i in range(steps))

    def _function(self, kind: str, steps: int, weighted: bool) -> Callable[..., Any]:
        """A ``tf.function`` that runs ``steps`` steps of ``kind`` on the next batches of an iterator (with the user's
        sample weights when ``weighted``)."""
        updates = self._updates(steps) if kind == "train" else ()
        key = (kind, steps, updates, weighted)
        if key in self._functions:
            return self._functions[key]
        backend = self.backend
        replica_fn = {"train": self._train_replica, "test": self._test_replica}.get(kind)

        if kind == "predict":

            def run(iterator: Iterator[Any], stop: tf.Tensor) -> Any:
                del stop
                outputs = backend.run(self._predict_replica, next(iterator))
                gathered = tf.nest.map_structure(backend.gather, outputs)
                return tf.nest.map_structure(tf.cast, gathered, self._output_dtypes)

        else:

            def step(update: bool) -> Callable[..., Any]:
                return functools.partial(replica_fn, update=update) if kind == "train" else replica_fn

            def run(iterator: Iterator[Any], stop: tf.Tensor) -> Any:
                if steps == 1:  # a graph loop around one step costs 4-7% per step (measured): run it straight
                    backend.run(step(not updates or updates[0]), next(iterator))
                elif self.accumulators is not None:  # which steps update is known here: unrolled, no cond
                    for update in updates:
                        backend.run(step(update), next(iterator))
                else:
                    for _ in tf.range(steps):
                        backend.run(step(True), next(iterator))
                # Every worker must stop at the same step: the stop request is agreed over all of them.
                return self.model.get_metrics_result(), backend.any_worker(stop)

        def traced(iterator: Iterator[Any], stop: tf.Tensor) -> Any:
            self._weighted = weighted  # read by the objective while this function is traced
            return run(iterator, stop)

        self._functions[key] = tf.function(traced)
        return self._functions[key]

    def _run_epoch(
        self,
        kind: str,
        feed: Feed,
        callbacks: keras.callbacks.CallbackList | None = None,
        start_step: int = 0,
    ) -> tuple[dict[str, float], int, str]:
        """One epoch from batch ``start_step``: the logs, the number of the next batch, and how it ended: "done"
        (its steps ran or the data ended), "stopped" (a callback set ``model.stop_training``) or "preempted" (a stop
        request, :attr:`stop_requested`, agreed by every worker).

        ``callbacks`` get the batch hooks of ``kind`` ("train" or "test").
        """
        self.model.reset_metrics()
        logs: dict[str, float] = {}
        step, ended = start_step, "done"
        while True:
            left = feed.batches_left(step)
            if left is not None and left <= 0:
                break
            k = 1 if left is None else min(self.steps_per_execution, left)
            requested = kind == "train" and self.stop_requested()
            if requested and self.backend.num_workers == 1:  # nobody to agree with: stop before this step
                ended = "preempted"
                break
            if callbacks is not None:
                getattr(callbacks, f"on_{kind}_batch_begin")(step)
            stop = tf.constant(float(requested))
            try:
                values, agreed = self._function(kind, k, feed.source.weighted)(feed.iterator, stop)
            except tf.errors.OutOfRangeError:
                feed.exhausted()
                break  # the data has ended
            logs = {name: float(v) for name, v in values.items()}
            if kind == "train":
                self.micro_steps += k
            step += k
            feed.seen += k
            if callbacks is not None:
                getattr(callbacks, f"on_{kind}_batch_end")(step - 1, logs)
            if kind == "train" and float(agreed) > 0:
                ended = "preempted"
                break
            if kind == "train" and self.model.stop_training:
                ended = "stopped" if left is None or left > k else "done"
                break
        if not logs:
            if step == 0 and ended == "done":
                raise ValueError("the input is empty: there is no batch to run")
            logs = {name: float(v) for name, v in self.model.get_metrics_result().items()}
        return logs, step, ended

    # -- public operations --------------------------------------------------------------------------------------------
    def fit(
        self,
        source: GlobalBatches,
        *,
        epochs: int,
        initial_epoch: int,
        validation: GlobalBatches | None,
        validation_freq: int | Sequence[int] = 1,
        callbacks: Sequence[keras.callbacks.Callback] | None,
        verbose: int,
        start_step: int = 0,
        on_progress: ProgressHook | None = None,
        resumed: bool = False,
    ) -> tuple[keras.callbacks.History, bool]:
        """Train for ``epochs - initial_epoch`` epochs; return the History (as ``model.fit`` does) and whether a stop
        request (a signal) ended training early.

        ``start_step`` skips that many batches of the first epoch; ``resumed`` says the run was restored from a
        checkpoint (see :meth:`Feed.start`). ``on_progress(epoch,
        steps_done, event)`` hooks checkpointing in: ``event`` is "step" after each execution, "epoch_end" when an
        epoch completed, "stopped" when training stopped in the middle of one.
        """
        model = self.model
        self.build_metrics(source)
        if validation is not None:
            self.build_metrics(validation)
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
        source.reset()  # a PyDataset hears on_epoch_end first, as in Keras
        if validation is not None:
            validation.reset()
        feed = Feed(self.backend, source)
        feed.start(initial_epoch, epochs, start_step, resumed)
        validation_feed = Feed(self.backend, validation) if validation is not None else None
        progress = _ProgressCallback(on_progress) if on_progress is not None else None
        train_callbacks = callback_list if progress is None else _with(callback_list, progress)
        preempted = False
        for epoch in range(initial_epoch, epochs):
            callback_list.on_epoch_begin(epoch)
            if progress is not None:
                progress.epoch = epoch
            first = start_step if epoch == initial_epoch else 0
            if epoch != initial_epoch:
                feed.next_epoch(epoch)
            source.on_epoch_begin()
            logs, steps_done, ended = self._run_epoch("train", feed, train_callbacks, first)
            preempted = ended == "preempted"
            source.on_epoch_end()
            if validation_feed is not None and not preempted and should_validate(epoch, validation_freq):
                validation_feed.start(0, 1, 0)  # every validation starts at the first batch, as in Keras
                callback_list.on_test_begin()
                validation_feed.source.on_epoch_begin()
                val_logs, _, _ = self._run_epoch("test", validation_feed, callback_list)
                validation_feed.source.on_epoch_end()
                callback_list.on_test_end(val_logs)
                logs.update({f"val_{name}": value for name, value in val_logs.items()})
            callback_list.on_epoch_end(epoch, logs)
            if on_progress is not None:
                on_progress(epoch, steps_done, "epoch_end" if ended == "done" else "stopped")
            if model.stop_training or preempted:
                break
        callback_list.on_train_end(logs)
        return history, preempted

    def evaluate(self, source: GlobalBatches, *, verbose: int = 0) -> dict[str, float]:
        """Loss and metrics over every sample of ``source`` (or its first ``steps`` batches)."""
        self.build_metrics(source)
        callbacks = keras.callbacks.CallbackList(
            add_progbar=bool(verbose), model=self.model, verbose=verbose, steps=source.steps
        )
        source.reset()
        feed = Feed(self.backend, source)
        feed.start(0, 1, 0)
        callbacks.on_test_begin()
        source.on_epoch_begin()
        logs, _, _ = self._run_epoch("test", feed, callbacks)
        source.on_epoch_end()
        callbacks.on_test_end(logs)
        return logs

    def predict(self, source: GlobalBatches, *, verbose: int = 0) -> Any:
        """The model's outputs for every sample of ``source``, in input order, as numpy (the model's structure)."""
        source.reset()
        source.on_epoch_begin()
        feed = Feed(self.backend, source)
        feed.start(0, 1, 0)
        progbar = keras.utils.Progbar(source.steps) if verbose else None
        batches: list[Any] = []
        step = 0
        no_stop = tf.constant(0.0)
        while (left := feed.batches_left(step)) is None or left > 0:
            try:
                batches.append(_to_numpy(self._function("predict", 1, False)(feed.iterator, no_stop)))
            except tf.errors.OutOfRangeError:
                break
            step += 1
            feed.seen += 1
            if progbar is not None:
                progbar.update(step)
        source.on_epoch_end()
        if not batches:
            raise ValueError("predict got no data: the input is empty")
        return tf.nest.map_structure(lambda *parts: np.concatenate(parts, axis=0), *batches)
