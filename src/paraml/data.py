"""Input: numpy arrays, dicts of arrays or a ``tf.data.Dataset`` -> a dataset of global batches.

Every element the training loop sees is ``(x, y, sample_weight)`` for one *global* batch. Backends may
split a final, short batch unevenly across replicas (some get fewer samples or none); the loop divides by the
all-reduced number of samples of the global batch (Keras' rule: weights scale samples, they do not change the
divisor), so that batch is neither dropped nor counted twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["GlobalBatches", "global_batches"]


@dataclass(frozen=True)
class GlobalBatches:
    """A source of global batches for one call of fit/evaluate/predict.

    ``dataset(epoch)`` gives the epoch's batches; ``steps`` is the number of batches per epoch when known. For arrays,
    an epoch's order is a stateless shuffle seeded by ``(seed, epoch)`` alone: a resumed run, another backend or
    another worker sees the same order, whatever TensorFlow's global seed is (``Dataset.shuffle`` would mix it in).
    """

    base: tf.data.Dataset | None
    steps: int | None
    num_samples: int | None
    shuffle: bool
    seed: int
    batch_size: int | None
    arrays: Any = None

    def dataset(self, epoch: int = 0, stop: int | None = None, skip: int = 0) -> tf.data.Dataset:
        """``(x, y, sample_weight)`` global batches of epochs ``epoch`` to ``stop - 1`` (default: one epoch), without
        the first ``skip`` batches.

        For arrays, several epochs make one dataset, so a ``fit`` creates one distributed iterator, not one per epoch
        (that costs ~0.1 s an epoch, measured). A user's dataset gives one epoch per call.
        """
        if self.arrays is not None:
            n, seed, shuffle, arrays = int(self.num_samples or 0), self.seed, self.shuffle, self.arrays

            def epoch_batches(e: tf.Tensor) -> tf.data.Dataset:
                order = tf.range(n, dtype=tf.int64)
                if shuffle:  # stateless: the order depends on (seed, epoch) only
                    order = tf.random.experimental.stateless_shuffle(
                        order, seed=tf.stack([tf.constant(seed, tf.int64), e])
                    )
                return tf.data.Dataset.from_tensor_slices(order).batch(self.batch_size)

            ds = tf.data.Dataset.range(epoch, epoch + 1 if stop is None else stop).flat_map(epoch_batches)
            ds = ds.skip(skip).map(lambda index: tf.nest.map_structure(lambda t: tf.gather(t, index), arrays))
        else:
            ds = self.base.skip(skip) if skip else self.base
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        return ds.with_options(options).prefetch(tf.data.AUTOTUNE)

    @property
    def spans_epochs(self) -> bool:
        """Whether :meth:`dataset` can give several epochs at once (arrays can; a user's dataset cannot)."""
        return self.arrays is not None


def _num_rows(value: Any, what: str) -> int:
    lengths = {len(v) for v in tf.nest.flatten(value)}
    if len(lengths) != 1:
        raise ValueError(f"the arrays in {what} have different lengths: {sorted(lengths)}")
    return lengths.pop()


def _as_arrays(value: Any) -> Any:
    """numpy (or nested dicts/lists of them) with float64 turned into float32, as Keras does."""

    def convert(array: Any) -> np.ndarray:
        array = np.asarray(array)
        return array.astype(np.float32) if array.dtype == np.float64 else array

    if isinstance(value, Mapping):
        return {k: _as_arrays(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and value and not np.isscalar(value[0]) and np.ndim(value[0]) > 0:
        return tuple(convert(v) for v in value)  # a tuple: tf.data would stack a list into one tensor
    return convert(value)


def global_batches(
    x: Any,
    y: Any = None,
    *,
    batch_size: int,
    num_replicas: int,
    shuffle: bool = False,
    seed: int = 0,
    need_targets: bool = True,
) -> GlobalBatches:
    """Validate the user's input and wrap it as :class:`GlobalBatches`.

    Raises ``ValueError`` (before any training) for a batch size that is not an int or is smaller than the number
    of replicas, x and y of different lengths, a missing y, or y given with a dataset.
    """
    if isinstance(x, tf.data.Dataset):
        if y is not None:
            raise ValueError("y must be None when x is a tf.data.Dataset (the dataset yields (x, y) batches)")
        return _from_dataset(x, need_targets)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if batch_size < num_replicas:
        raise ValueError(
            f"batch_size={batch_size} is smaller than the number of replicas ({num_replicas}): batch_size is the "
            f"global batch, split across replicas; use at least {num_replicas}"
        )
    if x is None:
        raise ValueError("x is None: pass the inputs as a numpy array, a dict of arrays or a tf.data.Dataset")
    x = _as_arrays(x)
    n = _num_rows(x, "x")
    if y is None:
        if need_targets:
            raise ValueError("y is None: pass the targets, or x as a tf.data.Dataset of (x, y) batches")
        y = np.zeros((n,), np.float32)  # a placeholder so every element has the same structure
    else:
        y = _as_arrays(y)
        ny = _num_rows(y, "y")
        if ny != n:
            raise ValueError(f"x and y have different lengths: x has {n} samples, y has {ny}")
    if n == 0:
        raise ValueError("x is empty: there is nothing to train on")
    with tf.device("/device:CPU:0"):  # the host holds the data; batches are gathered from it
        arrays = tf.nest.map_structure(tf.convert_to_tensor, (x, y, np.ones((n,), np.float32)))
    return GlobalBatches(None, -(-n // batch_size), n, shuffle, seed, batch_size, arrays)


def _from_dataset(ds: tf.data.Dataset, need_targets: bool) -> GlobalBatches:
    """A user's dataset of batches: ``x``, ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)`` per element."""
    spec = ds.element_spec
    arity = len(spec) if isinstance(spec, tuple) else 1
    if need_targets and arity < 2:
        raise ValueError("the dataset yields no targets: each element must be (x, y) or (x, y, sample_weight)")

    def add_weights(*element: Any) -> tuple[Any, Any, tf.Tensor]:
        x = element[0]
        n = tf.shape(tf.nest.flatten(x)[0])[0]
        y = element[1] if len(element) > 1 else tf.zeros((n,), tf.float32)
        w = tf.cast(element[2], tf.float32) if len(element) > 2 else tf.ones((n,), tf.float32)
        return x, y, w

    mapped = ds.map(add_weights if arity > 1 else (lambda x: add_weights(x)))
    cardinality = int(ds.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "the dataset is infinite (it repeats): an epoch would never end; pass a finite one, e.g. ds.take(steps)"
        )
    steps = cardinality if cardinality >= 0 else None
    return GlobalBatches(mapped, steps, None, False, 0, None)
