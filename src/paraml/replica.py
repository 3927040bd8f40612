"""What runs inside a replica: the objective, the gradients, gradient accumulation, and the compiled step functions.

Losses and metrics are Keras' own: the model is compiled as usual and each replica calls ``model.compute_loss`` /
``model.compute_metrics``, so multi-output models, ``loss_weights``, ``weighted_metrics`` and a model's own
``compute_loss`` work as in ``model.fit`` and the logs carry Keras' names.

The loss is averaged over the *global* batch. Keras divides a replica's loss by the replica's rows and by the number
of replicas, which is right only when every replica has the same number of rows. paraml multiplies each replica's
loss by ``rows * replicas / global_rows`` (the global rows are all-reduced), which makes the sum over replicas the
mean over the global batch, regularisation included, also when a final, short batch is split unevenly or leaves a
replica empty, and also for the micro-batches of ``model_parallel``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from .backends.base import Backend, Objective
from .data import GlobalBatches, zeros_like_spec

__all__ = ["ReplicaStep"]

#: A compiled execution: ``function(iterator, stop) -> (metrics, stop agreed by every worker)`` for train and test,
#: ``function(iterator, stop) -> outputs`` for predict.
StepFunction = Callable[[Iterator[Any], tf.Tensor], Any]


def _rows(x: Any) -> tf.Tensor:
    """The number of samples in a (nested) batch, from its first tensor, as Keras counts them."""
    return tf.shape(tf.nest.flatten(x)[0])[0]


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


class ReplicaStep:
    """The per-replica work of one compiled model on one backend, and the cache of ``tf.function`` s that run it.

    ``accumulation_steps``: Keras' ``gradient_accumulation_steps``, run here (the optimizer was re-created without
    it). ``jit_compile``: the replicas' forward pass, loss and gradients under XLA; the optimizer update stays
    outside (under tf.distribute it is a sync point, which TF refuses inside a nested compiled function).
    """

    def __init__(
        self, backend: Backend, model: keras.Model, accumulation_steps: int | None = None, jit_compile: bool = False
    ) -> None:
        self.backend = backend
        self.model = model
        self.optimizer: keras.optimizers.Optimizer = model.optimizer
        self.replicas = backend.topology.num_replicas
        # Keras' own tracker (``model.fit`` updates it); a model whose ``metrics`` leaves it out keeps its own.
        self.loss_tracker = next(
            (m for m in model.metrics if m.name == "loss" and isinstance(m, keras.metrics.Mean)), None
        )
        self.accumulation_steps = accumulation_steps
        self.updates_done = 0  # training steps run, for the accumulation pattern
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
        self.jit_compile = jit_compile
        self._xla_gradients = tf.function(self._replica_gradients, jit_compile=True)
        self._functions: dict[tuple[str, int, tuple[bool, ...], bool], StepFunction] = {}
        self._scalar_loss = False  # whether a compiled loss function returns one value for the batch
        self._metrics_built = False
        self._output_dtypes: Any = None

    # -- before the first step: Keras' compiled loss and metrics, the output dtypes -----------------------------------
    def build_metrics(self, source: GlobalBatches) -> None:
        """Build Keras' compiled loss and metrics from the input's structure, outside any replica (as ``fit`` does).

        Keras creates them lazily at the first call, which under a strategy would be inside a replica. Any bad loss
        or metric for this model and data (a wrong output name, a loss that does not fit the targets) fails here,
        before training starts.
        """
        if self._metrics_built:
            return
        x, y, w = zeros_like_spec(source.dataset(0).element_spec, rows=source.batch_size or 1)
        with self.backend.metrics_scope():
            y_pred = self.backend.forward(self.model, x, training=False)
            self._scalar_loss = _returns_a_scalar(self.model.loss, y, y_pred)
            w = w if source.weighted or self._scalar_loss else None
            self.model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=w, training=False)
            self.model.compute_metrics(x, y, y_pred, sample_weight=w)
        self.model.reset_metrics()
        self._metrics_built = True

    def output_dtypes(self, source: GlobalBatches) -> Any:
        """The dtypes of the model's outputs (one forward pass on a one-sample batch shaped like ``source``'s)."""
        if self._output_dtypes is None:
            x = zeros_like_spec(source.dataset(0).element_spec)[0]
            with self.backend.scope():
                outputs = self.backend.forward(self.model, x, training=False)
            self._output_dtypes = tf.nest.map_structure(lambda t: t.dtype, outputs)
        return self._output_dtypes

    # -- inside a replica ---------------------------------------------------------------------------------------------
    def _objective(self, global_rows: tf.Tensor, training: bool, weighted: bool) -> Objective:
        """The loss to differentiate for (a part of) a replica's batch; also updates the loss tracker and metrics."""
        model, tracker = self.model, self.loss_tracker
        replicas = float(self.replicas)

        def objective(x: Any, y: Any, y_pred: Any, w: Any) -> tf.Tensor:
            # No user weights: none for Keras either, as model.fit passes them. A loss function that returns a scalar
            # gets ones, so that Keras spreads it over the rows and scales it like any other (it does not scale a
            # bare scalar by the replicas, which would count it once per replica).
            w = w if weighted or self._scalar_loss else None
            loss = tf.cast(model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=w, training=training), "float32")
            rows = tf.cast(_rows(x), tf.float32)
            if tracker is not None:  # Keras logs the replica's unscaled loss, weighted by its rows
                tracker.update_state(loss * replicas, sample_weight=rows)
            model.compute_metrics(x, y, y_pred, sample_weight=w)
            return self.optimizer.scale_loss(loss * (rows * replicas / global_rows))

        return objective

    def _replica_gradients(self, x: Any, y: Any, w: Any, global_rows: tf.Tensor, weighted: bool) -> list[Any]:
        """Forward pass, loss and gradients of this replica (what ``jit_compile=True`` compiles with XLA)."""
        grads, _ = self.backend.gradients(self.model, x, y, w, self._objective(global_rows, True, weighted))
        return [tf.zeros_like(v) if g is None else g for g, v in zip(grads, self.model.trainable_variables)]

    def _gradients(self, x: Any, y: Any, w: Any, rows: tf.Tensor, global_rows: tf.Tensor, weighted: bool) -> list[Any]:
        """This replica's gradients; zeros (of the same kinds) for a replica the last batch left empty."""
        variables = self.model.trainable_variables
        kinds: list[Any] = []

        def compute() -> list[Any]:
            gradients = self._xla_gradients if self.jit_compile else self._replica_gradients
            grads = gradients(x, y, w, global_rows, weighted)
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

        if not self.backend.capabilities.skips_empty_replicas:  # a sync point in the forward pass forbids cond
            return compute()
        # Running the model on no rows would feed NaN into layers such as BatchNormalization.
        return tf.cond(rows > 0, compute, nothing)

    def _train(self, x: Any, y: Any, w: Any, *, update: bool, weighted: bool) -> None:
        """One training step on this replica. With gradient accumulation, ``update`` says whether this step applies
        the accumulated gradients (the host knows which step does, so the graph holds no ``cond`` around the
        optimizer: that ``cond`` is what breaks Keras' own accumulation under tf.distribute)."""
        rows = _rows(x)
        global_rows = self.backend.all_reduce_sum(tf.cast(rows, tf.float32))
        grads = self._gradients(x, y, w, rows, global_rows, weighted)
        variables = self.model.trainable_variables
        if self.accumulators is None:
            self.optimizer.apply_gradients(zip(grads, variables))
            return
        # Keras' rule: every n-th step applies (sum of the n steps' gradients) / n; the others only accumulate.
        grads = [tf.convert_to_tensor(g) for g in grads]
        if not update:
            for accumulator, g in zip(self.accumulators, self.backend.all_reduce_sum(grads)):
                accumulator.assign_add(g)
            return
        # The optimizer sums the replicas' gradients: each adds its share of what was accumulated (already summed).
        steps = float(self.accumulation_steps or 1)
        total = [(g + a / self.replicas) / steps for g, a in zip(grads, self.accumulators)]
        self.optimizer.apply_gradients(zip(total, variables))
        for accumulator in self.accumulators:
            accumulator.assign(tf.zeros_like(accumulator))

    def _test(self, x: Any, y: Any, w: Any, *, weighted: bool) -> None:
        self.backend.loss(self.model, x, y, w, self._objective(tf.constant(1.0), False, weighted), training=False)

    def _predict(self, x: Any, y: Any, w: Any) -> Any:
        del y, w
        outputs = self.backend.forward(self.model, x, training=False)
        # TF's collectives refuse bfloat16 (mixed_bfloat16): gathered in float32, cast back after.
        return tf.nest.map_structure(lambda t: tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t, outputs)

    # -- compiled executions ------------------------------------------------------------------------------------------
    def _updates(self, steps: int) -> tuple[bool, ...]:
        """Which of the next ``steps`` training steps apply the optimizer (all, without gradient accumulation)."""
        if self.accumulators is None:
            return (True,) * steps
        n = self.accumulation_steps or 1
        return tuple((self.updates_done + i + 1) % n == 0 for i in range(steps))

    def executed(self, steps: int) -> None:
        """``steps`` training steps ran (the accumulation pattern moves on)."""
        self.updates_done += steps

    def function(self, kind: str, steps: int, weighted: bool) -> StepFunction:
        """A ``tf.function`` that runs ``steps`` steps of ``kind`` ("train", "test", "predict") on the next batches of
        an iterator (with the user's sample weights when ``weighted``)."""
        updates = self._updates(steps) if kind == "train" else ()
        key = (kind, steps, updates, weighted)
        if key not in self._functions:
            self._functions[key] = tf.function(self._execution(kind, steps, updates, weighted))
        return self._functions[key]

    def _execution(self, kind: str, steps: int, updates: tuple[bool, ...], weighted: bool) -> StepFunction:
        backend = self.backend
        if kind == "predict":
            dtypes = self._output_dtypes  # known before tracing: output_dtypes() ran first

            def predict(iterator: Iterator[Any], stop: tf.Tensor) -> Any:
                del stop
                outputs = backend.run(self._predict, next(iterator))
                gathered = tf.nest.map_structure(backend.gather, outputs)
                return tf.nest.map_structure(tf.cast, gathered, dtypes)

            return predict

        def step(update: bool) -> Callable[..., None]:
            if kind == "train":
                return functools.partial(self._train, update=update, weighted=weighted)
            return functools.partial(self._test, weighted=weighted)

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
            return self.model.get_metrics_result(), tf.reduce_sum(backend.across_workers(stop))

        return run
