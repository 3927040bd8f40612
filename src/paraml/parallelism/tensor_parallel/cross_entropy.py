"""The cross-entropy of split logits (vocabulary-parallel, as Megatron-LM's ``cross_entropy.py``): computed on the
slices a split layer left, so neither the whole logits nor their gradient is made on one device."""

from __future__ import annotations

from typing import Any

from paraml.parallelism.tensor_parallel.layers import slices_of

__all__ = ["sparse_categorical_crossentropy", "split_logits_loss"]


def sparse_categorical_crossentropy(
    y_true: Any, y_pred: Any, from_logits: bool = False, ignore_class: int | None = None, axis: int = -1
) -> Any:
    """Keras' ``sparse_categorical_crossentropy``; on logits a split layer left in slices along the class axis (the
    tied LM head or a columns-split last ``Dense`` under ``tensor_parallel``), computed on the slices
    (vocabulary-parallel, as Megatron-LM does): each device takes the maximum, the sum of exponentials and the target
    logit of its slice, and only those (one value per token) are combined. Neither the whole logits nor their gradient
    is made on one device. Slices in a 16-bit float dtype are computed in float32 (the maximum, the sums of
    exponentials and the target logits), the loss returned in the logits' dtype as Keras returns it. Elsewhere (other
    tensors, probabilities, ``ignore_class``) it is Keras' own.

    :func:`split_logits_loss` puts it into a ``keras.losses.SparseCategoricalCrossentropy``; a loss function of one's
    own can call it in place of Keras'.
    """
    import keras
    import tensorflow as tf

    pieces = slices_of(y_pred, axis) if from_logits and ignore_class is None else None
    if pieces is None or tf.executing_eagerly():
        return keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=from_logits, ignore_class=ignore_class, axis=axis
        )
    labels = tf.convert_to_tensor(y_true)
    if labels.shape.rank == y_pred.shape.rank and labels.shape[-1] == 1:
        labels = tf.squeeze(labels, -1)
    labels = tf.cast(labels, "int32")
    dtype = pieces[0].dtype
    if dtype in (tf.bfloat16, tf.float16):  # each slice cast on its device (exact); only per-token values move
        wide = []
        for piece in pieces:
            with tf.device(piece.device):
                wide.append(tf.cast(piece, tf.float32))
        pieces = wide
    highest, sums, targets = [], [], []
    for piece in pieces:
        with tf.device(piece.device):
            highest.append(tf.reduce_max(tf.stop_gradient(piece), axis=-1))
    shift = tf.reduce_max(tf.stack(highest), axis=0)  # one value per token; the loss does not depend on it
    start = 0
    for piece in pieces:
        size = int(piece.shape[-1])
        with tf.device(piece.device):
            sums.append(tf.reduce_sum(tf.exp(piece - shift[..., None]), axis=-1))
            local = labels - start
            inside = tf.logical_and(local >= 0, local < size)
            picked = tf.gather(piece, tf.where(inside, local, 0), axis=-1, batch_dims=labels.shape.rank)
            targets.append(tf.where(inside, picked, tf.zeros_like(picked)))
        start += size
    return tf.cast(tf.math.log(tf.add_n(sums)) + shift - tf.add_n(targets), dtype)


def split_logits_loss(loss: Any) -> Any:
    """``loss`` with its cross-entropy computed on split logits (:func:`sparse_categorical_crossentropy`) when it is a
    ``keras.losses.SparseCategoricalCrossentropy`` on logits (a copy; its configuration, and so a saved model's, is
    Keras' own); any other loss as it is. A structure of losses (one per output) is mapped."""
    import keras

    if isinstance(loss, (list, tuple)):
        return type(loss)(split_logits_loss(item) for item in loss)
    if isinstance(loss, dict):
        return {key: split_logits_loss(item) for key, item in loss.items()}
    if type(loss) is keras.losses.SparseCategoricalCrossentropy and loss.from_logits and loss.ignore_class is None:
        copy = keras.losses.SparseCategoricalCrossentropy.from_config(loss.get_config())
        copy.fn = sparse_categorical_crossentropy
        return copy
    return loss
