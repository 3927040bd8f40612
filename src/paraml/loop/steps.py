"""What runs inside a replica: the objective, the gradients, gradient accumulation, and the compiled step functions.

Losses and metrics are Keras' own: the model is compiled as usual and each replica calls ``model.compute_loss`` /
``model.compute_metrics``, so multi-output models, ``loss_weights``, ``weighted_metrics`` and a model's own
``compute_loss`` work as in ``model.fit`` and the logs carry Keras' names.

The loss is averaged over the *global* batch. Keras divides a replica's loss by the replica's rows and by the number
of replicas, which is right only when every replica has the same number of rows. paraml turns each part's loss into
sums (the loss times the part's rows; for a masked output, the loss times the part's real tokens, and the tokens) that
add up over micro-batches and replicas, and divides them by the global counts (all-reduced). The sum over replicas is
then the mean over the global batch, regularisation included, also when a final, short batch is split unevenly or
leaves a replica empty, also for the micro-batches of ``model_parallel``, and a masked loss is the mean over the global
batch's real tokens, as on one device (Keras under ``MirroredStrategy`` averages the replicas' token means instead).

A model that overrides ``train_step``, ``test_step`` or ``predict_step`` runs its own, on each replica, as Keras'
``fit`` does under the same strategy; its logs (nested dicts flattened as Keras flattens them) are reduced over the
replicas as Keras reduces them. With more than one replica that is not the one-device step, which a one-time
:class:`OwnStepWarning` says, with how to write a step that is.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from paraml.backends.base import Accumulator, Backend, Objective
from paraml.internals import keras_mask
from paraml.loop.batches import GlobalBatches, zeros_like_spec
from paraml.loop.compiling import STEP_METHODS, extra_optimizers, overrides

__all__ = ["OwnStepWarning", "ReplicaStep"]

#: An objective's loss parts: [loss x rows, a masked output's loss x its real tokens, the real tokens]; each adds up
#: over micro-batches and replicas.
LOSS_PARTS = 3

#: A compiled execution: ``function(iterator, stop) -> (metrics, stop agreed by every worker)`` for train and test,
#: ``function(iterator, stop) -> outputs`` for predict.
StepFunction = Callable[[Iterator[Any], tf.Tensor], Any]


class OwnStepWarning(UserWarning):
    """A model's own ``train_step`` runs per replica, as in Keras under the same strategy, not as on one device."""


def own_step_warning(model_name: str, replicas: int) -> str:
    """What differs from one device when ``model_name``'s own ``train_step`` runs on ``replicas`` replicas, and how to
    write a step that is exact."""
    return (
        f"{model_name}.train_step runs on each of the {replicas} replicas on its share of the batch, as Keras' fit "
        "runs it under a tf.distribute strategy, not as on one device: the optimizer sums the replicas' gradients; "
        f"self.compute_loss and keras.losses divide their mean over the replica's rows by {replicas} (one device's "
        f"gradients when the replicas have as many rows, but a loss logged from them is 1/{replicas} of one device's); "
        f"a loss you average yourself is not divided ({replicas}x one device's gradients). For the one-device step, "
        "make the loss this replica's share of the global batch's mean: global_rows = "
        "tf.distribute.get_replica_context().all_reduce('sum', tf.shape(x)[0]); loss = "
        "tf.nn.compute_average_loss(per_example_loss, global_batch_size=global_rows) (or, for a mean over the "
        "replica's rows you computed, mean_loss * local_rows / global_rows), and log per_example_loss through a "
        "keras.metrics.Mean. See 'Your own train_step' in docs/guide.md; once the step is exact: "
        "warnings.simplefilter('ignore', paraml.OwnStepWarning)."
    )


def callers_level() -> int:
    """The ``stacklevel`` of the first caller outside paraml (a warning then shows the user's line, ``par.fit``)."""
    package = str(Path(__file__).resolve().parents[1])
    frame, level = inspect.currentframe(), 0
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(package):
        frame, level = frame.f_back, level + 1
    return max(level, 1)


def flat_logs(logs: dict[Any, Any]) -> dict[Any, Any]:
    """A step's logs with nested dicts flattened as Keras' callbacks flatten them (``pythonify_logs``): names in
    sorted order, a dict's entries in its place under their own names, a later name replacing an earlier one.

    >>> flat_logs({"loss": 1.0, "compile_metrics": {"mae": 2.0, "more": {"mse": 3.0}}})
    {'mae': 2.0, 'mse': 3.0, 'loss': 1.0}
    """
    flat: dict[Any, Any] = {}
    for name, value in sorted(logs.items()):
        if isinstance(value, dict):
            flat.update(flat_logs(value))
        else:
            flat[name] = value
    return flat


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


class ReplicatedSums:
    """Gradient accumulation's running sums, one copy per replica, each beside its variable (a stage's, a part's) as
    the optimizer's slots are: every accumulating step adds the all-reduced gradients; the updating step adds each
    replica's share of the sums to its own gradients, so the optimizer's reduction brings the whole to every replica.
    """

    def __init__(self, variables: list[Any], backend: Backend) -> None:
        self.all_reduce_sum = backend.all_reduce_sum
        self.replicas = backend.topology.num_replicas
        strategy = tf.distribute.get_strategy()
        self.sums: list[tf.Variable] = []
        for v in variables:
            # a variable the strategy did not make (ZeRO-3's, on its owner) gets the strategy's copy per replica
            beside = strategy.extended.variable_created_in_scope(v.value)
            with strategy.extended.colocate_vars_with(v.value) if beside else contextlib.nullcontext():
                self.sums.append(
                    tf.Variable(
                        tf.zeros(v.shape, v.dtype),
                        trainable=False,
                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,  # the same on every replica
                        name="accumulated_" + v.name,
                    )
                )

    def accumulate(self, grads: list[tf.Tensor]) -> None:
        for total, g in zip(self.sums, self.all_reduce_sum(grads)):
            total.assign_add(g)

    def with_sums(self, grads: list[tf.Tensor], steps: float) -> list[tf.Tensor]:
        return [(g + a / self.replicas) / steps for g, a in zip(grads, self.sums)]

    def reset(self) -> None:
        for total in self.sums:
            total.assign(tf.zeros_like(total))


class ReplicaStep:
    """The per-replica work of one compiled model on one backend, and the cache of ``tf.function`` s that run it.

    ``accumulation_steps``: Keras' ``gradient_accumulation_steps``, run here (the optimizer was re-created without
    it). ``jit_compile``: the replicas' forward pass and loss under XLA (and so their gradients); the optimizer update
    stays outside (under tf.distribute it is a sync point, which TF refuses inside a nested compiled function).
    """

    def __init__(
        self, backend: Backend, model: keras.Model, accumulation_steps: int | None = None, jit_compile: bool = False
    ) -> None:
        self.backend = backend
        self.model = model
        self.optimizer: keras.optimizers.Optimizer = model.optimizer
        self.replicas = backend.topology.num_replicas
        #: The step methods the model overrides ("train_step", ...): those run as the model wrote them.
        self.own_steps = frozenset(name for name in STEP_METHODS if overrides(model, name))
        # Keras' own tracker (``model.fit`` updates it); a model whose ``metrics`` leaves it out keeps its own.
        self.loss_tracker = next(
            (m for m in model.metrics if m.name == "loss" and isinstance(m, keras.metrics.Mean)), None
        )
        self.accumulation_steps = accumulation_steps
        self.updates_done = 0  # training steps run, for the accumulation pattern
        #: The gradients' running sums between updates (None without gradient accumulation): on each variable's
        #: owner only when the plan shards the gradients (ZeRO-2, 3), else a sum per replica.
        self.accumulator: Accumulator | None = None
        if accumulation_steps:
            with backend.scope():
                variables = backend.techniques.trained_variables(model)
                owned = backend.techniques.owned_sums(variables, backend.topology)
                self.accumulator = owned if owned is not None else ReplicatedSums(variables, backend)
        self.jit_compile = jit_compile
        self._colocate = backend.capabilities.colocates_gradients
        self._xla_gradients = tf.function(self._replica_gradients, jit_compile=True)
        self._xla_parts = tf.function(self._parts, jit_compile=True)  # a masked loss: its gradient is taken outside
        self._functions: dict[tuple[str, int, tuple[bool, ...], bool, bool], StepFunction] = {}
        self._scalar_loss = False  # whether a compiled loss function returns one value for the batch
        self._masked = False  # whether the loss is the mean over a masked output's real tokens
        self._metrics_built = False
        self._output_dtypes: Any = None
        self._warned = False  # the own train_step's warning (more than one replica): once per model

    # -- before the first step: Keras' compiled loss and metrics, the output dtypes -----------------------------------
    def build_metrics(self, source: GlobalBatches) -> None:
        """Build Keras' compiled loss and metrics from the input's structure, outside any replica (as ``fit`` does).

        Keras creates them lazily at the first call, which under a strategy would be inside a replica. Any bad loss
        or metric for this model and data (a wrong output name, a loss that does not fit the targets) fails here,
        before training starts. A model with its own ``train_step`` and no compiled loss (a GAN) has nothing to
        build.
        """
        if self._metrics_built:
            return
        self._metrics_built = True
        if "train_step" in self.own_steps:
            self._build_optimizers(source)
            if self.model.loss is None:
                return
        x, y, w = zeros_like_spec(source.dataset(0).element_spec, rows=source.batch_size or 1)
        with self.backend.metrics_scope():
            y_pred = self.backend.forward(self.model, x, training=False)
            self._scalar_loss = _returns_a_scalar(self.model.loss, y, y_pred)
            self._masked = _exact_over_tokens(self.model, y_pred)
            w = w if source.weighted or self._scalar_loss else None
            self.model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=w, training=False)
            self.model.compute_metrics(x, y, y_pred, sample_weight=w)
        self.model.reset_metrics()

    def _build_optimizers(self, source: GlobalBatches) -> None:
        """Build the model's other optimizers (a GAN's) before the first step, on the variables its ``train_step``
        applies them to (found by tracing the step once, with the optimizers' ``apply`` recording instead of
        updating). Built inside a replica at their first update, their variables break ``MirroredStrategy`` (Keras'
        own ``fit`` fails there for the Keras GAN example)."""
        unbuilt = [optimizer for optimizer in extra_optimizers(self.model).values() if not optimizer.built]
        if not unbuilt:
            return
        spec = source.dataset(0).element_spec
        applied: dict[int, list[Any]] = {id(optimizer): [] for optimizer in unbuilt}

        def recorder(optimizer: keras.optimizers.Optimizer) -> Callable[..., None]:
            def apply(grads: Any, trainable_variables: Any = None) -> None:
                del grads
                seen = applied[id(optimizer)]
                seen.extend(v for v in trainable_variables or () if not any(v is s for s in seen))

            return apply

        def step() -> None:
            x, y, w = zeros_like_spec(spec)
            self.backend.run(self.model.train_step, (_keras_data(x, y, w, source.targeted, source.weighted),))

        for optimizer in unbuilt:
            optimizer.apply = recorder(optimizer)  # on the instance, for this trace only
        try:
            with self.backend.scope():
                tf.function(step).get_concrete_function()
        finally:
            for optimizer in unbuilt:
                del optimizer.apply
        with self.backend.scope():
            for optimizer in unbuilt:
                if applied[id(optimizer)]:
                    optimizer.build(applied[id(optimizer)])

    def output_dtypes(self, source: GlobalBatches) -> Any:
        """The dtypes of the model's outputs (one prediction on a one-sample batch shaped like ``source``'s)."""
        if self._output_dtypes is None:
            x = zeros_like_spec(source.dataset(0).element_spec)[0]
            with self.backend.scope():
                outputs = self._outputs(x, None, None, False, False)
            self._output_dtypes = tf.nest.map_structure(lambda t: t.dtype, outputs)
        return self._output_dtypes

    # -- inside a replica ---------------------------------------------------------------------------------------------
    def _objective(self, training: bool, weighted: bool) -> Objective:
        """The loss parts (``LOSS_PARTS``) of (a part of) a replica's batch; also updates the metrics."""
        model, masked = self.model, self._masked
        replicas = float(self.replicas)

        def objective(x: Any, y: Any, y_pred: Any, w: Any) -> tf.Tensor:
            # No user weights: none for Keras either, as model.fit passes them. A loss function that returns a scalar
            # gets ones, so that Keras spreads it over the rows and scales it like any other (it does not scale a
            # bare scalar by the replicas, which would count it once per replica).
            w = w if weighted or self._scalar_loss else None
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=w, training=training)
            loss = tf.cast(loss, "float32") * replicas  # Keras divides every term by the replicas
            rows = tf.cast(_rows(x), tf.float32)
            model.compute_metrics(x, y, y_pred, sample_weight=w)
            mask = keras_mask(y_pred) if masked else None
            if mask is None:
                return tf.stack([loss * rows, 0.0, 0.0])
            # Keras' masked loss is the mean over this part's real tokens: kept apart as (sum, tokens).
            tokens = tf.reduce_sum(tf.cast(mask, tf.float32))
            added = [tf.reduce_sum(tf.cast(a, tf.float32)) for a in model.losses]  # add_loss, regularizers
            other = tf.add_n(added) if added else tf.zeros(())
            return tf.stack([other * rows, (loss - other) * tokens, tokens])

        return objective

    def _combine(self, parts: tf.Tensor, rows: tf.Tensor, global_rows: tf.Tensor) -> tf.Tensor:
        """This replica's share of the global batch's loss from its summed ``parts``; Keras' loss tracker is
        updated with it (as the replica's mean, weighted by its rows, so that the logged loss is the global mean)."""
        loss = tf.math.divide_no_nan(parts[0], global_rows)
        if self._masked:  # every replica takes part in this all-reduce, also one the last batch left empty
            loss += tf.math.divide_no_nan(parts[1], self.backend.all_reduce_sum(parts[2]))
        if self.loss_tracker is not None:
            self.loss_tracker.update_state(tf.math.divide_no_nan(loss * global_rows, rows), sample_weight=rows)
        return loss

    def _parts(self, x: Any, y: Any, w: Any, weighted: bool) -> tf.Tensor:
        """Forward pass and loss parts of this replica."""
        return self.backend.loss(self.model, x, y, w, self._objective(True, weighted), training=True)[0]

    def _replica_gradients(
        self, x: Any, y: Any, w: Any, rows: tf.Tensor, global_rows: tf.Tensor, weighted: bool
    ) -> list[Any]:
        """Forward pass, loss and gradients of this replica (what ``jit_compile=True`` compiles with XLA)."""
        with tf.GradientTape() as tape:
            loss = self._combine(self._parts(x, y, w, weighted), rows, global_rows)
            loss = self.optimizer.scale_loss(loss)
        return _gradients_or_zeros(tape, loss, self.backend.techniques.trained_variables(self.model), self._colocate)

    def _gradients(self, x: Any, y: Any, w: Any, rows: tf.Tensor, global_rows: tf.Tensor, weighted: bool) -> list[Any]:
        """This replica's gradients; zeros (of the same kinds) for a replica the last batch left empty."""
        rows = tf.cast(rows, tf.float32)
        skip_empty = self.backend.capabilities.skips_empty_replicas  # a sync point in the forward pass forbids cond
        if self._masked:
            return self._masked_gradients(x, y, w, rows, global_rows, weighted, skip_empty)
        variables = self.backend.techniques.trained_variables(self.model)
        kinds = list[Any]()  # no annotation: autograph cannot convert an annotated name used in a closure

        def compute() -> list[Any]:
            gradients = self._xla_gradients if self.jit_compile else self._replica_gradients
            grads = gradients(x, y, w, rows, global_rows, weighted)
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

        if not skip_empty:
            return compute()
        # Running the model on no rows would feed NaN into layers such as BatchNormalization.
        return tf.cond(rows > 0, compute, nothing)

    def _masked_gradients(
        self, x: Any, y: Any, w: Any, rows: tf.Tensor, global_rows: tf.Tensor, weighted: bool, skip_empty: bool
    ) -> list[Any]:
        """The gradients of a loss over the global batch's real tokens: their count is all-reduced between the forward
        pass and the gradient, on every replica, so the tape spans the ``cond`` that holds the forward pass only
        (MirroredStrategy refuses a collective inside a ``cond``, and XLA one inside a compiled function)."""
        parts = self._xla_parts if self.jit_compile else self._parts
        with tf.GradientTape() as tape:
            if skip_empty:
                summed = tf.cond(rows > 0, lambda: parts(x, y, w, weighted), lambda: tf.zeros([LOSS_PARTS]))
            else:
                summed = parts(x, y, w, weighted)
            loss = self.optimizer.scale_loss(self._combine(summed, rows, global_rows))
        return _gradients_or_zeros(tape, loss, self.backend.techniques.trained_variables(self.model), self._colocate)

    def _train(self, x: Any, y: Any, w: Any, *, update: bool, weighted: bool) -> None:
        """One training step on this replica. With gradient accumulation, ``update`` says whether this step applies
        the accumulated gradients (the host knows which step does, so the graph holds no ``cond`` around the
        optimizer: that ``cond`` is what breaks Keras' own accumulation under tf.distribute)."""
        rows = _rows(x)
        global_rows = self.backend.all_reduce_sum(tf.cast(rows, tf.float32))
        grads = self._gradients(x, y, w, rows, global_rows, weighted)
        variables = self.backend.techniques.trained_variables(self.model)
        if self.accumulator is None:
            self.optimizer.apply_gradients(zip(grads, variables))
            return
        # Keras' rule: every n-th step applies (sum of the n steps' gradients) / n; the others only accumulate.
        grads = [tf.convert_to_tensor(g) for g in grads]
        if not update:
            self.accumulator.accumulate(grads)
            return
        total = self.accumulator.with_sums(grads, float(self.accumulation_steps or 1))
        self.optimizer.apply_gradients(zip(total, variables))
        self.accumulator.reset()

    def _test(self, x: Any, y: Any, w: Any, *, weighted: bool) -> None:
        objective = self._objective(False, weighted)
        parts, _ = self.backend.loss(self.model, x, y, w, objective, training=False)
        rows = tf.cast(_rows(x), tf.float32)
        self._combine(parts, rows, self.backend.all_reduce_sum(rows))

    def _outputs(self, x: Any, y: Any, w: Any, targeted: bool, weighted: bool) -> Any:
        if "predict_step" in self.own_steps:
            return self.model.predict_step(_keras_data(x, y, w, targeted, weighted))
        return self.backend.forward(self.model, x, training=False)

    def _predict(self, x: Any, y: Any, w: Any, targeted: bool, weighted: bool) -> Any:
        outputs = self._outputs(x, y, w, targeted, weighted)
        # TF's collectives refuse bfloat16 (mixed_bfloat16): gathered in float32, cast back after.
        return tf.nest.map_structure(lambda t: tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t, outputs)

    def _own_step(self, kind: str, targeted: bool, weighted: bool) -> Callable[..., dict[str, tf.Tensor]]:
        """The model's own ``train_step``/``test_step`` on this replica; its logs as rows, for the mean over
        replicas (Keras' reduction of a step's logs under tf.distribute)."""
        method = getattr(self.model, f"{kind}_step")

        where = f"{type(self.model).__name__}.{kind}_step"

        def as_row(name: Any, value: Any) -> tf.Tensor:
            value = tf.convert_to_tensor(value)
            if not (value.dtype.is_floating or value.dtype.is_integer or value.dtype.is_bool):
                raise TypeError(f"{where} logged {name!r} as a {value.dtype.name} tensor: a log must be a number")
            return tf.expand_dims(tf.cast(value, tf.float32), 0)

        def step(x: Any, y: Any, w: Any) -> dict[str, tf.Tensor]:
            logs = method(_keras_data(x, y, w, targeted, weighted))
            if not isinstance(logs, dict):
                raise TypeError(
                    f"{where} returned {type(logs).__name__}: it must return a dict of logs, e.g. "
                    "{m.name: m.result() for m in self.metrics}"
                )
            return {name: as_row(name, value) for name, value in flat_logs(logs).items()}

        return step

    # -- compiled executions ------------------------------------------------------------------------------------------
    def _updates(self, steps: int) -> tuple[bool, ...]:
        """Which of the next ``steps`` training steps apply the optimizer (all, without gradient accumulation)."""
        if self.accumulator is None:
            return (True,) * steps
        n = self.accumulation_steps or 1
        return tuple((self.updates_done + i + 1) % n == 0 for i in range(steps))

    def executed(self, steps: int) -> None:
        """``steps`` training steps ran (the accumulation pattern moves on)."""
        self.updates_done += steps

    def function(self, kind: str, steps: int, weighted: bool, targeted: bool = True) -> StepFunction:
        """A ``tf.function`` that runs ``steps`` steps of ``kind`` ("train", "test", "predict") on the next batches of
        an iterator (with the user's sample weights when ``weighted``; ``targeted``: the user gave targets)."""
        updates = self._updates(steps) if kind == "train" else ()
        key = (kind, steps, updates, weighted, targeted)
        if kind == "train" and "train_step" in self.own_steps and self.replicas > 1 and not self._warned:
            self._warned = True
            warnings.warn(
                own_step_warning(type(self.model).__name__, self.replicas), OwnStepWarning, stacklevel=callers_level()
            )
        if key not in self._functions:
            if f"{kind}_step" in self.own_steps and kind != "predict":
                execution = self._own_execution(kind, steps, targeted, weighted)
            else:
                execution = self._execution(kind, steps, updates, weighted, targeted)
            self._functions[key] = tf.function(execution)
        return self._functions[key]

    def _own_execution(self, kind: str, steps: int, targeted: bool, weighted: bool) -> StepFunction:
        backend, model = self.backend, self.model
        step = self._own_step(kind, targeted, weighted)

        def run(iterator: Iterator[Any], stop: tf.Tensor) -> Any:
            if steps > 1:
                for _ in tf.range(steps - 1):
                    backend.run(step, next(iterator))
            logs = backend.run(step, next(iterator))
            result = model.get_metrics_result()
            if set(logs) != set(result):  # the same names: Keras reads the metrics (over every replica) instead
                result = {name: tf.reduce_mean(backend.gather(value), axis=0) for name, value in logs.items()}
            return result, tf.reduce_sum(backend.across_workers(stop))

        return run

    def _execution(
        self, kind: str, steps: int, updates: tuple[bool, ...], weighted: bool, targeted: bool
    ) -> StepFunction:
        backend = self.backend
        if kind == "predict":
            dtypes = self._output_dtypes  # known before tracing: output_dtypes() ran first

            def predict(iterator: Iterator[Any], stop: tf.Tensor) -> Any:
                del stop
                predict_step = functools.partial(self._predict, targeted=targeted, weighted=weighted)
                outputs = backend.run(predict_step, next(iterator))
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
            elif self.accumulator is not None:  # which steps update is known here: unrolled, no cond
                for update in updates:
                    backend.run(step(update), next(iterator))
            else:
                for _ in tf.range(steps):
                    backend.run(step(True), next(iterator))
            # Every worker must stop at the same step: the stop request is agreed over all of them.
            return self.model.get_metrics_result(), tf.reduce_sum(backend.across_workers(stop))

        return run


def _gradients_or_zeros(tape: tf.GradientTape, loss: tf.Tensor, variables: list[Any], colocate: bool) -> list[Any]:
    """``loss``'s gradients, zeros for a variable it does not reach (the optimizer takes no None).

    With ``colocate`` (in a traced step), each gradient op runs on its forward op's device: ``tf.gradients`` places
    them there, while a ``GradientTape`` leaves them to the default device (every stage's backward pass on the first
    device: tensorflow-notes).
    """
    if colocate and not tf.executing_eagerly():
        grads = tf.gradients(loss, variables)
    else:
        grads = tape.gradient(loss, variables)
    return [tf.zeros_like(v) if g is None else g for g, v in zip(grads, variables)]


def _keras_data(x: Any, y: Any, w: Any, targeted: bool, weighted: bool) -> Any:
    """A batch as Keras hands it to a model's own step: ``x``, ``(x, y)`` or ``(x, y, sample_weight)``."""
    return keras.utils.pack_x_y_sample_weight(x, y if targeted else None, w if targeted and weighted else None)


def _exact_over_tokens(model: keras.Model, y_pred: Any) -> bool:
    """Whether the loss can be made the mean over the global batch's real tokens: one output with a Keras mask, a
    mean-type reduction, and Keras' own ``compute_loss`` (a model's own could weigh the mask in any way)."""
    if tf.nest.is_nested(y_pred) or keras_mask(y_pred) is None or overrides(model, "compute_loss"):
        return False
    loss = model.loss[0] if isinstance(model.loss, (list, tuple)) and len(model.loss) == 1 else model.loss
    return getattr(loss, "reduction", "sum_over_batch_size") in ("sum_over_batch_size", "mean")
