"""Recompute (``Parallel(..., remat=True)``): a unit's activations are recomputed in the backward pass, not kept.

Each unit of the model (a layer that is not itself a model, :func:`paraml.planning.observe.model_units`; a transformer
block, a
Dense) gets its ``call`` wrapped in ``tf.recompute_grad``: the forward pass keeps the unit's inputs only, and the
backward pass runs the unit again for what its gradient needs. So a step holds the units' inputs plus one unit's
internals at a time, instead of every intermediate tensor of every unit (a transformer block keeps 10-20x its output).

Why this and not Keras' ``RematScope``: that fails on the TensorFlow backend inside ``tf.function``
(keras-team/keras#21207). The wrapper is the same on every backend; under ``model_parallel`` it wraps the unit's
placement on its stage's device, so the recompute runs there too.

A unit's state is put back before it is recomputed: Dropout's random-seed state (the recompute draws the same mask)
and BatchNormalization's moving statistics (they are updated once, not twice). Training with recompute therefore
gives the same weights as without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import keras
import tensorflow as tf

from paraml.internals import autocast, autocast_dtype
from paraml.planning.observe import model_units, nested_layers

__all__ = ["recompute_units", "recomputed_units", "recomputing"]


def recompute_units(model: keras.Model) -> list[str]:
    """Make every unit of ``model`` recompute its activations in the backward pass; the units' names.

    Example:
        >>> import keras
        >>> layers = [keras.layers.Dense(3, name="a"), keras.layers.Dense(2, name="b")]
        >>> model = keras.Sequential([keras.Input((4,)), *layers])
        >>> recompute_units(model)
        ['a', 'b']
    """
    units = recomputed_units(model)
    for _, layer in units:
        layer.call = _recomputed(layer, layer.call)
    return [name for name, _ in units]


def recomputed_units(model: keras.Model) -> list[tuple[str, keras.layers.Layer]]:
    """``(name, layer)`` of the units :func:`recompute_units` recomputes: every unit but those holding an
    ``Embedding``."""
    return [(name, layer) for name, layer in model_units(model) if not _holds_an_embedding(layer)]


@contextmanager
def recomputing(model: keras.Model) -> Iterator[list[str]]:
    """:func:`recompute_units` for the duration of a ``with`` block (to measure what recompute keeps); the units'
    own ``call`` is back afterwards.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a")])
        >>> with recomputing(model) as names:
        ...     names
        ['a']
        >>> "call" in vars(model.layers[0])
        False
    """
    units = recomputed_units(model)
    saved = [(layer, vars(layer).get("call")) for _, layer in units]
    try:
        yield recompute_units(model)
    finally:
        for layer, own in saved:
            if own is None:
                del layer.call
            else:
                layer.call = own


def _holds_an_embedding(layer: keras.layers.Layer) -> bool:
    """Whether ``layer`` is or holds an ``Embedding``: recomputing a lookup saves nothing (its only activation is its
    output, which the next unit keeps), and the recompute's gradient would be dense where Keras' is sparse, which
    changes what Adam does with the rows a batch does not touch."""
    return any(isinstance(inner, keras.layers.Embedding) for inner in nested_layers(layer))


def _recomputed(layer: keras.layers.Layer, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (the unit's ``call``) under ``tf.recompute_grad``: its tensor arguments become positional
    arguments of the recomputed function, everything else (``training``, None, Python values) is bound."""

    def call(*args: Any, **kwargs: Any) -> Any:
        items = tf.nest.flatten((args, kwargs))
        # Float tensors are the recomputed function's arguments (their gradients flow through it); integer tensors
        # (token ids, masks) are bound like other values.
        positions = [i for i, item in enumerate(items) if isinstance(item, tf.Tensor) and item.dtype.is_floating]
        if not positions:  # a symbolic call (Keras' shape inference) or no tensor input: nothing to keep
            return original(*args, **kwargs)
        state = [v for v in layer.variables if not v.trainable]  # seed states, moving statistics
        # the backward pass runs `original` again outside Layer.__call__: it must read the variables in the dtype the
        # forward pass did (mixed precision)
        dtype = autocast_dtype()
        saved = [tf.identity(v.value) for v in state]
        outputs: dict[str, Any] = {}

        def run(*tensors: tf.Tensor) -> list[tf.Tensor]:
            for variable, value in zip(state, saved):  # a no-op the first time; undoes the first run's updates after
                variable.assign(value)
            filled = list(items)
            for position, tensor in zip(positions, tensors):
                filled[position] = tensor
            call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs), filled)
            with autocast(dtype):
                result = original(*call_args, **call_kwargs)
            flat = tf.nest.flatten(result)
            outputs["structure"], outputs["flat"] = result, flat
            return [t for t in flat if isinstance(t, tf.Tensor)]

        computed = iter(tf.recompute_grad(run)(*[items[i] for i in positions]))
        flat = [next(computed) if isinstance(t, tf.Tensor) else t for t in outputs["flat"]]
        return tf.nest.pack_sequence_as(outputs["structure"], flat)

    return call
