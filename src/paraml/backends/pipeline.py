"""A replica's batch pipelined through the stages in micro-batches, in the schedule's order.

All micro-batches of a step are in one ``tf.function``. TensorFlow's dataflow executor starts each op when its inputs
are ready, which yields the GPipe schedule without a hand-written scheduler. For the other schedules (1F1B,
interleaved, zero-bubble) each micro-batch's gradient is taken as soon as its loss exists, and each stage's forward
pass waits (a control dependency, :meth:`Pipeline.gate`) for the backward passes
:meth:`paraml.planning.schedules.Schedule.waits_for` names; the replica's tape sees the summed gradients through a
surrogate term, so the loop and the backend contract stay as they are.

A stage's backward pass is the group of its gradient ops: under zero-bubble, ``B`` is its inputs' gradients (what the
stage before it waits for) and ``W`` its weights' gradients, which then no forward pass waits for unless the
schedule says so; under the others ``B`` is its weights' gradients, the end of its whole backward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from paraml.backends.base import Objective
from paraml.internals import concat_with_masks, keras_masks
from paraml.planning.schedules import Schedule

__all__ = ["Pipeline"]


class Pipeline:
    """Runs a replica's batch as ``schedule.micro_batches`` parts through the stages (forward pass, loss parts).

    ``skips_empty()`` says whether an empty micro-batch (a short last batch) may be skipped in a ``tf.cond``;
    ``trained_variables(model)`` gives what 1F1B differentiates (a split weight's parts). :attr:`variable_stage` maps
    ``id`` of a trained variable's value to its stage (set once the model is placed).
    """

    def __init__(
        self,
        schedule: Schedule,
        skips_empty: Callable[[], bool],
        trained_variables: Callable[[keras.Model], list[Any]],
    ) -> None:
        self.schedule = schedule
        self.micro_batches = schedule.micro_batches
        self.skips_empty = skips_empty
        self.trained_variables = trained_variables
        #: id of a trained variable's value -> the stage it lives on (its gradients are that stage's backward pass).
        self.variable_stage: dict[int, int] = {}
        # A pass ("B" or "W", stage, micro-batch) -> its ops, and the micro-batch being traced: a stage's forward pass
        # waits for the passes the schedule names. Under zero-bubble, the inputs of each stage's units in the
        # micro-batch being traced: their gradients are the stage's B pass.
        self._backward_done: dict[tuple[str, int, int], Any] = {}
        self._tracing: int | None = None
        self._inputs: dict[int, list[tf.Tensor]] = {}

    def gate(self, stage: int, inputs: Sequence[Any] = ()) -> list[Any]:
        """What ``stage``'s forward pass of the micro-batch being traced waits for (the backward passes its schedule
        runs before it on that device), or nothing; under zero-bubble ``inputs`` (a unit's) are kept, to take the
        stage's input gradients apart from its weight gradients."""
        if self._tracing is None:
            return []
        if self.schedule.kind == "zero_bubble":
            self._inputs.setdefault(stage, []).extend(t for t in inputs if _differentiable(t))
        done = (self._backward_done.get(earlier) for earlier in self.schedule.waits_for(stage, self._tracing))
        return [d for d in done if d is not None]

    def _split(self, value: Any, rows: tf.Tensor) -> list[Any]:
        """``value`` (a structure of batch-major tensors, or None) as ``micro_batches`` parts of ``rows`` in all."""
        m = self.micro_batches
        sizes = rows // m + tf.cast(tf.range(m) < rows % m, rows.dtype)
        leaves = tf.nest.flatten(value)
        parts = [[None] * m if t is None else tf.split(t, sizes, num=m) for t in leaves]
        return [tf.nest.pack_sequence_as(value, [p[i] for p in parts]) for i in range(m)]

    def _parts(self, *values: Any) -> list[tuple[Any, ...]]:
        if self.micro_batches == 1:
            return [values]
        first = next(t for t in tf.nest.flatten(values) if t is not None)
        rows = tf.shape(first, out_type=tf.int32)[0]
        return list(zip(*(self._split(v, rows) for v in values)))

    def _run(
        self, model: keras.Model, parts: list[tuple[Any, ...]], training: bool, objective: Objective | None
    ) -> Any:
        """Each part through the model (and ``objective``); returns (the joined outputs, the summed loss parts).

        A part after the first is empty when the batch has fewer rows than ``micro_batches`` (a short last batch).
        A model with batch statistics (BatchNormalization: float state that is not trained) would turn it into NaN,
        so there it is skipped, in a ``tf.cond`` when its size is known only at run time. Any other model runs it, as
        1F1B does: the gradient of a ``tf.cond`` runs on the default device, not on each stage's (measured with
        :func:`paraml.bench.trace.trace_step`). The joined outputs keep the parts' Keras masks.
        """
        batch_statistics = any(w.dtype.startswith("float") for w in model.non_trainable_weights)
        outputs, masks, losses = [], [], []
        for i, (x_part, *rest) in enumerate(parts):

            def step(x_part: Any = x_part, rest: list[Any] = rest) -> tuple[Any, list[tf.Tensor], tf.Tensor]:
                y_pred = model(x_part, training=training)
                loss = tf.zeros(()) if objective is None else objective(x_part, rest[0], y_pred, rest[1])
                return y_pred, [m for m in keras_masks(y_pred) if m is not None], loss

            if i == 0:
                y_pred, mask, loss = step()
                present = [m is not None for m in keras_masks(y_pred)]
            else:
                first = next(t for t in tf.nest.flatten(x_part) if t is not None)
                static = first.shape[0]
                if static == 0:
                    continue
                if static is None and batch_statistics and self.skips_empty():
                    empty = tf.nest.map_structure(lambda t: t[:0], (outputs[0], masks[0]))
                    y_pred, mask, loss = tf.cond(
                        tf.shape(first)[0] > 0, step, lambda empty=empty: (*empty, tf.zeros_like(losses[0]))
                    )
                else:
                    y_pred, mask, loss = step()
            outputs.append(y_pred)
            masks.append(mask)
            losses.append(loss)
        if len(outputs) == 1:
            return outputs[0], losses[0]
        # A tf.cond's outputs carry no mask: the parts' masks travel beside them, in the order of the outputs.
        full = [[next(given) if has else None for has in present] for given in map(iter, masks)]
        return concat_with_masks(outputs, full), tf.add_n(losses)

    def forward(self, model: keras.Model, x: Any, training: bool) -> Any:
        return self._run(model, self._parts(x, None, None), training, None)[0]

    def loss(
        self, model: keras.Model, x: Any, y: Any, sample_weight: Any, objective: Objective, training: bool
    ) -> tuple[tf.Tensor, Any]:
        parts = self._parts(x, y, sample_weight)
        if training and self.schedule.kind != "gpipe" and len(parts) > 1:
            return self._one_forward_one_backward(model, parts, objective)
        y_pred, total = self._run(model, parts, training, objective)
        return total, y_pred

    @tf.autograph.experimental.do_not_convert  # a Python loop over the micro-batches, traced as written
    def _one_forward_one_backward(
        self, model: keras.Model, parts: list[tuple[Any, ...]], objective: Objective
    ) -> tuple[tf.Tensor, Any]:
        """The loss parts of a training batch whose micro-batches each run forward and then backward, in the
        schedule's order (:mod:`paraml.planning.schedules`): each micro-batch's gradient is taken as soon as its loss
        exists, and each stage's forward pass of micro-batch ``i`` waits (a control dependency) for the backward
        passes the schedule names. The caller's tape sees one op whose gradient is the sum of the micro-batches'
        gradients, scaled by what flows back into the loss (the replica's division by the global batch, a loss
        scale)."""
        variables = self.trained_variables(model)
        y_preds: list[Any] = []
        masks: list[list[Any]] = []

        totals, summed = [], None
        for i, (x_part, y_part, w_part) in enumerate(parts):
            if tf.nest.flatten(x_part)[0].shape[0] == 0:
                continue
            self._tracing, self._inputs = i, {}
            try:
                y_pred = model(x_part, training=True)
                part = objective(x_part, y_part, y_pred, w_part)
            finally:
                self._tracing = None
            mask = keras_masks(y_pred)
            if any(m is not None for m in mask):
                raise ValueError(
                    f"schedule={self.schedule.kind!r} takes each micro-batch's gradient before the next one's loss "
                    "exists, but a loss over masked tokens is a mean over the whole batch's tokens; use "
                    "schedule='gpipe'"
                )
            summed = self._backward(part[0], variables, i, given=tf.nest.flatten(x_part), summed=summed)
            totals.append(part)
            y_preds.append(y_pred)
            masks.append(mask)
        self._backward_done.clear()
        self._inputs = {}
        # The caller's tape differentiates this: the loss parts' value, with the summed gradients as their gradient
        # (a sum of each variable times its gradient, held constant), so what flows back into the loss (the replica's
        # division by the global batch, a loss scale) scales them.
        total = tf.stop_gradient(tf.add_n(totals))
        surrogate = tf.add_n([_dot(g, v) for g, v in zip(summed or [], variables) if g is not None] or [tf.zeros(())])
        total += tf.stack([surrogate - tf.stop_gradient(surrogate), 0.0, 0.0])
        return total, concat_with_masks(y_preds, masks)

    def _backward(
        self, loss: tf.Tensor, variables: list[Any], micro_batch: int, given: list[Any], summed: list[Any] | None
    ) -> list[Any]:
        """``summed`` (the earlier micro-batches' gradients, or None) plus ``loss``'s gradients for ``variables``,
        each added on its variable's device; each stage's backward pass of ``micro_batch`` is kept as the passes the
        gates wait for (zero-bubble: the gradients of its units' inputs as ``B``, the sums of its weights' gradients
        as ``W``). ``given`` are the micro-batch's own inputs, whose gradients nobody needs.

        A weight pass ends with its gradients added into the running sums, and the next forward pass on the stage
        waits for those sums: then each micro-batch's gradient is freed once added. Without a control dependency on
        them, Grappler's arithmetic optimizer rewrites the chain of adds into one ``AddN`` of every micro-batch's
        gradient, which holds all of them until the last one exists (measured: one more gradient buffer per
        micro-batch, ``tests/test_stage_memory.py``)."""
        inputs = [
            (stage, t) for stage, tensors in self._inputs.items() for t in tensors if not any(t is g for g in given)
        ]
        # tf.gradients places each gradient op on its forward op's device (a tape's go to the default device)
        grads = tf.gradients(loss, variables + [t for _, t in inputs])
        if summed is not None:
            added = []
            for a, g, v in zip(summed, grads, variables):
                with tf.device(getattr(v, "value", v).device):
                    added.append(a if g is None else g if a is None else _add(a, g))
            grads[: len(variables)] = added
        weights: dict[int, list[Any]] = {}
        for g, v in zip(grads, variables):
            stage = self.variable_stage.get(id(v.value))
            if g is not None and stage is not None:
                weights.setdefault(stage, []).append(_values(g))
        split = self.schedule.kind == "zero_bubble"
        for stage, done in weights.items():
            self._backward_done[("W" if split else "B", stage, micro_batch)] = tf.group(*done)
        if split:
            found: dict[int, list[Any]] = {}
            for (stage, _), g in zip(inputs, grads[len(variables) :]):
                if g is not None:
                    found.setdefault(stage, []).append(_values(g))
            for stage in weights.keys() | found.keys():  # no input gradient seen (remat hides them): the whole pass
                done = found.get(stage) or weights[stage]
                self._backward_done[("B", stage, micro_batch)] = tf.group(*done)
        return grads[: len(variables)]


def _differentiable(value: Any) -> bool:
    """Whether ``value`` is a traced floating-point tensor (a unit's input whose gradient a backward pass computes)."""
    return isinstance(value, tf.Tensor) and value.dtype.is_floating


def _values(gradient: Any) -> Any:
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _add(a: Any, b: Any) -> Any:
    """Two gradients of one variable summed; two sparse ones (an Embedding's) stay sparse, as TensorFlow adds them."""
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0), a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def _dot(gradient: Any, variable: Any) -> tf.Tensor:
    """``sum(gradient * variable)`` with the gradient held constant: its gradient w.r.t. ``variable`` is ``gradient``
    (sparse for a sparse one: only the rows it names are read)."""
    # The gradient of this term is the gradient itself: kept on the variable's device, where it was made.
    with tf.device(getattr(variable, "value", variable).device):
        if isinstance(gradient, tf.IndexedSlices):
            rows = tf.gather(variable, gradient.indices)
            return tf.reduce_sum(
                tf.cast(tf.stop_gradient(gradient.values) * tf.cast(rows, gradient.values.dtype), "float32")
            )
        return tf.reduce_sum(tf.cast(tf.stop_gradient(gradient) * tf.cast(variable, gradient.dtype), "float32"))
