"""Keras masks on tensors: read, and carried over when paraml joins micro-batches' outputs.

Keras keeps a layer output's mask (``Embedding(mask_zero=True)``, ``Masking``) on the tensor itself, and its losses
and metrics read it from ``y_pred``. A tensor made by ``tf.concat`` or returned by a ``tf.cond`` has none, so a
backend that joins micro-batches' outputs sets the joined mask again.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["concat_with_masks", "keras_mask", "keras_masks"]

#: The attribute Keras' TensorFlow backend keeps a tensor's mask in (``keras.src.backend.get_keras_mask``).
_ATTRIBUTE = "_keras_mask"


def keras_mask(tensor: Any) -> tf.Tensor | None:
    """The Keras mask of ``tensor``, or None."""
    return getattr(tensor, _ATTRIBUTE, None)


def keras_masks(outputs: Any) -> list[tf.Tensor | None]:
    """The Keras masks of ``outputs`` (a structure of tensors), flat, None where a tensor has none."""
    return [keras_mask(t) for t in tf.nest.flatten(outputs)]


def concat_with_masks(parts: list[Any], masks: list[list[tf.Tensor | None]]) -> Any:
    """``parts`` (structures of tensors) joined along the batch axis; a joined tensor gets the joined mask when every
    part's tensor had one (``masks``: each part's :func:`keras_masks`)."""
    flat_parts = [tf.nest.flatten(part) for part in parts]
    joined = []
    for i in range(len(flat_parts[0])):
        tensor = tf.concat([flat[i] for flat in flat_parts], axis=0)
        pieces = [part_masks[i] for part_masks in masks]
        if all(piece is not None for piece in pieces):
            setattr(tensor, _ATTRIBUTE, tf.concat(pieces, axis=0))
        joined.append(tensor)
    return tf.nest.pack_sequence_as(parts[0], joined)
