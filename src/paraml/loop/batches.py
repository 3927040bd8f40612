"""Input: arrays, a ``tf.data.Dataset``, a Python generator or a ``keras.utils.PyDataset`` -> global batches.

Every element the training loop sees is ``(x, y, sample_weight)`` for one *global* batch. ``y`` and
``sample_weight`` may be nested like the model's outputs. Without user weights, ``sample_weight`` is a ones vector of
shape ``(batch,)`` (ones change nothing in Keras' compiled loss). Backends may split a final, short batch unevenly
across replicas (some get fewer samples or none); the loop divides by the all-reduced number of samples of the global
batch (Keras' rule: weights scale samples, they do not change the divisor), so that batch is neither dropped nor
counted twice.

The rules follow Keras' data adapters (``keras/src/trainers/data_adapters``) and its ``EpochIterator``:

- arrays: batches of ``batch_size`` (default 32, or ``ceil(n / steps)`` when only ``steps`` is given), floats other
  than ``keras.config.floatx()`` cast to it; ``sample_weight=`` and ``class_weight=`` are accepted;
- a ``tf.data.Dataset``, a generator (or any iterator) or a ``PyDataset`` yields whole batches: ``x``, ``(x,)``,
  ``(x, y)`` or ``(x, y, sample_weight)``; ``class_weight=`` works with datasets and ``PyDataset``, not generators;
- ``steps`` (``steps_per_epoch``, evaluate's ``steps``, ``validation_steps``) bounds an epoch; when it is given the
  loop keeps one iterator across epochs (:attr:`GlobalBatches.continues`), as ``EpochIterator`` does.
"""

from __future__ import annotations

import itertools
import math
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from paraml.checks import check_int

__all__ = ["GlobalBatches", "global_batches", "input_kind", "split_validation", "zeros_like_spec"]

#: How many leading batches of a generator or PyDataset fix its ``output_signature`` (Keras peeks 2 as well):
#: a dimension that differs between them (a short last batch, a variable sequence length) becomes ``None``.
PEEK_BATCHES = 2


@dataclass(frozen=True)
class GlobalBatches:
    """A source of global batches for one call of fit/evaluate/predict, with what Keras' ``EpochIterator`` needs.

    ``dataset(epoch)`` gives one pass over the data (arrays: several epochs at once). For arrays, a pass's order is a
    stateless shuffle seeded by ``(seed, epoch)`` alone: a resumed run, another backend or another worker sees the same
    order, whatever TensorFlow's global seed is (``Dataset.shuffle`` would mix it in). A ``PyDataset``'s batch order
    is shuffled the same way (by ``(seed, pass)``) when ``shuffle`` is true and its length is known.
    """

    kind: str
    """What the user passed: "arrays", "dataset" (``tf.data``), "generator" (or iterator) or "py_dataset"."""
    steps: int | None
    """Batches per epoch: the caller's ``steps`` when given, else :attr:`num_batches` (None: until the data ends)."""
    num_batches: int | None
    """Batches in one pass over the data when known (arrays, a finite dataset, a ``PyDataset``), else None (a
    generator, a dataset of unknown cardinality; with ``steps`` also an infinite dataset or ``PyDataset``)."""
    continues: bool
    """Whether the caller gave ``steps``. In ``fit``'s training epochs Keras then keeps the iterator across epochs (an
    epoch takes ``steps`` batches from where the previous one stopped) and starts a new pass, ``dataset(pass_index)``,
    only once the data is exhausted; an epoch that reaches the end of the data stops there. Without ``steps``, every
    epoch is one pass. Keras' ``evaluate`` (validation in ``fit`` included) resets its iterator at every call, so each
    evaluation starts a new pass of at most ``steps`` batches whatever this says (measured with Keras 3.15)."""
    num_samples: int | None
    """Samples in one pass (arrays only)."""
    shuffle: bool
    seed: int
    batch_size: int | None
    """The global batch size (arrays only; a dataset, generator or PyDataset makes its own batches)."""
    arrays: Any = None
    py_dataset: keras.utils.PyDataset | None = None
    """The user's ``PyDataset``, whose ``on_epoch_begin``/``on_epoch_end`` :meth:`on_epoch_begin` and
    :meth:`on_epoch_end` call."""
    weighted: bool = False
    """Whether the user gave sample weights (``sample_weight``, ``class_weight`` or ``(x, y, w)`` elements); without
    them the loop passes no weights to Keras (ones of shape ``(batch,)`` would not broadcast to a sequence loss)."""
    targeted: bool = True
    """Whether the user gave targets (without them ``y`` is a placeholder; a model's own step gets no ``y``)."""
    _make_pass: Callable[[int], tf.data.Dataset] | None = field(default=None, repr=False)

    def dataset(self, epoch: int = 0, stop: int | None = None, skip: int = 0) -> tf.data.Dataset:
        """``(x, y, sample_weight)`` global batches of pass ``epoch`` (for arrays, of epochs ``epoch`` to ``stop - 1``;
        default: one), without the first ``skip`` batches.

        For arrays, several epochs make one dataset, so a ``fit`` creates one distributed iterator, not one per epoch
        (that costs ~0.1 s an epoch, measured). Any other input gives one pass per call (``stop`` is ignored): a
        ``tf.data`` dataset iterates again (reshuffling itself if it shuffles), a ``PyDataset`` reads its batches
        again, and a generator yields its first batches again and then continues where the previous pass stopped (a
        generator runs once; Keras' rule, see :func:`_from_generator`). Creating the dataset reads nothing.
        """
        if self.arrays is not None:
            n, seed, shuffle, arrays = int(self.num_samples or 0), self.seed, self.shuffle, self.arrays
            batch_size = int(self.batch_size or 1)
            stop = epoch + 1 if stop is None else stop
            if shuffle:

                def epoch_batches(e: tf.Tensor) -> tf.data.Dataset:  # stateless: the order depends on (seed, epoch)
                    order = tf.random.experimental.stateless_shuffle(
                        tf.range(n, dtype=tf.int64), seed=tf.stack([tf.constant(seed, tf.int64), e])
                    )
                    return tf.data.Dataset.from_tensor_slices(order).batch(batch_size)

                ds = tf.data.Dataset.range(epoch, stop).flat_map(epoch_batches)
                ds = ds.skip(skip).map(lambda index: tf.nest.map_structure(lambda t: tf.gather(t, index), arrays))
            else:  # every pass is the arrays in order: no function to trace (~40 ms less per call, measured)
                ds = tf.data.Dataset.from_tensor_slices(arrays).batch(batch_size).repeat(stop - epoch).skip(skip)
        else:
            assert self._make_pass is not None
            ds = self._make_pass(epoch)
            ds = ds.skip(skip) if skip else ds
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        return ds.with_options(options).prefetch(tf.data.AUTOTUNE)

    @property
    def spans_epochs(self) -> bool:
        """Whether :meth:`dataset` can give several epochs at once (arrays can; any other input cannot)."""
        return self.arrays is not None

    def reset(self) -> None:
        """Call once before a fit/evaluate/predict starts iterating, as Keras' ``EpochIterator.reset()`` does: a
        ``PyDataset`` hears ``on_epoch_end()`` (so its state is that of a finished epoch); any other input ignores it.
        """
        self.on_epoch_end()

    def on_epoch_begin(self) -> None:
        """Call at the start of every epoch (and of an evaluate/predict), as Keras' ``EpochIterator`` does: a
        ``PyDataset`` hears ``on_epoch_begin()``; any other input ignores it."""
        if self.py_dataset is not None:
            self.py_dataset.on_epoch_begin()

    def on_epoch_end(self) -> None:
        """Call at the end of every epoch (and of an evaluate/predict), as Keras' ``EpochIterator`` does: a
        ``PyDataset`` hears ``on_epoch_end()`` (where it may reshuffle or change its data); any other input ignores
        it. Call it after the epoch's last batch was read and before the next epoch's iterator is created."""
        if self.py_dataset is not None:
            self.py_dataset.on_epoch_end()


# -- what the input is -------------------------------------------------------------------------------------------------
def input_kind(x: Any) -> str:
    """ "dataset", "py_dataset", "generator" (a generator or any other iterator) or "arrays".

    >>> input_kind(np.zeros(3)), input_kind(iter([])), input_kind({"a": np.zeros(3)})
    ('arrays', 'generator', 'arrays')
    """
    if isinstance(x, tf.data.Dataset):
        return "dataset"
    if isinstance(x, keras.utils.PyDataset):
        return "py_dataset"
    if isinstance(x, (types.GeneratorType, Iterator)) and not isinstance(x, (np.ndarray, tf.Tensor, Mapping)):
        return "generator"
    return "arrays"


_NAMES = {"dataset": "a tf.data.Dataset", "py_dataset": "a keras.utils.PyDataset", "generator": "a generator"}


# -- arrays ------------------------------------------------------------------------------------------------------------
def _is_leaf_array(value: Any) -> bool:
    return isinstance(value, (np.ndarray, tf.Tensor)) or hasattr(value, "__array__")


def _is_structure(value: Any) -> bool:
    """A dict, or a list/tuple holding arrays or structures (``[[1, 2], [3, 4]]`` is one array, not two inputs)."""
    if isinstance(value, Mapping):
        return True
    return isinstance(value, (list, tuple)) and any(_is_leaf_array(v) or _is_structure(v) for v in value)


def _to_floatx(array: np.ndarray) -> np.ndarray:
    """Floats other than ``keras.config.floatx()`` become floatx, as Keras' array adapter does."""
    floatx = np.dtype(keras.config.floatx())
    return array.astype(floatx) if np.issubdtype(array.dtype, np.floating) and array.dtype != floatx else array


def _as_arrays(value: Any) -> Any:
    """numpy (or nested dicts/lists/tuples of them, lists made tuples) with floats cast to floatx, as Keras does."""
    if isinstance(value, Mapping):
        return {k: _as_arrays(v) for k, v in value.items()}
    if _is_structure(value):
        return tuple(_as_arrays(v) for v in value)  # a tuple: tf.data would stack a list into one tensor
    return _to_floatx(np.asarray(value))


def _num_rows(value: Any, what: str) -> int:
    flat = tf.nest.flatten(value)
    if any(np.ndim(v) == 0 for v in flat):
        raise ValueError(f"{what} holds a scalar: every array needs a first (sample) dimension")
    lengths = {len(v) for v in flat}
    if len(lengths) != 1:
        raise ValueError(f"the arrays in {what} have different lengths: {sorted(lengths)}")
    return lengths.pop()


def _sample_weights(sample_weight: Any, y: Any, n: int) -> Any:
    """The user's sample weights as arrays shaped like ``y`` (one array for every output, as Keras replicates it)."""
    weights = _as_arrays(sample_weight)
    nested_y, nested_w = tf.nest.is_nested(y), tf.nest.is_nested(weights)
    if nested_w:
        if not nested_y:
            raise ValueError("sample_weight is a list/dict but y is one array: pass one sample_weight array")
        try:
            tf.nest.assert_same_structure(y, weights)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"pass one sample_weight array per output in y, in the same structure; y is "
                f"{tf.nest.map_structure(lambda a: 'array', y)}, sample_weight is "
                f"{tf.nest.map_structure(lambda a: 'array', weights)}"
            ) from error
    elif nested_y:
        if not (weights.ndim == 1 or (weights.ndim == 2 and weights.shape[1] == 1)):
            raise ValueError(
                f"for a model with several outputs, one sample_weight array must have one weight per sample (shape "
                f"({n},)), got shape {weights.shape}; for other shapes pass one array per output"
            )
        weights = tf.nest.map_structure(lambda _: weights, y)
    for w in tf.nest.flatten(weights):
        if w.dtype.kind not in "biuf":
            raise ValueError(f"sample_weight must be numeric, got dtype {w.dtype}")
    nw = _num_rows(weights, "sample_weight")
    if nw != n:
        raise ValueError(f"sample_weight has {nw} weights for {n} samples: give one per sample")
    return tf.nest.map_structure(lambda w: w.astype(np.float32), weights)


def _check_class_weight(class_weight: Any) -> dict[int, float]:
    if not isinstance(class_weight, Mapping) or not class_weight:
        raise ValueError(f"class_weight must be a non-empty dict {{class index: weight}}, got {class_weight!r}")
    checked: dict[int, float] = {}
    for key, value in class_weight.items():
        if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)) or key < 0:
            raise ValueError(
                f"class_weight keys must be class indices (ints >= 0), got {key!r}; e.g. {{0: 1.0, 1: 5.0}}"
            )
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real) or not math.isfinite(value):
            raise ValueError(f"class_weight[{key}] must be a finite number, got {value!r}")
        checked[int(key)] = float(value)
    return checked


def _class_of(y: np.ndarray) -> np.ndarray:
    """Keras' rule: one-hot (last dimension > 1) -> argmax, else the rounded value."""
    if y.ndim > 1:
        y = np.argmax(y, axis=-1) if y.shape[-1] != 1 else np.squeeze(y, axis=-1)
    return np.round(y).astype(np.int64)


def _class_weights_for(y: Any, class_weight: dict[int, float]) -> np.ndarray:
    """The sample weights ``class_weight`` gives the targets ``y``: Keras' ``class_weight_to_sample_weights``."""
    if tf.nest.is_nested(y):
        raise ValueError("class_weight is only supported for models with a single output (y is a list/dict)")
    if y.dtype.kind not in "biuf":
        raise ValueError(f"class_weight needs integer class indices or one-hot targets, got y of dtype {y.dtype}")
    if y.ndim <= 1 or y.shape[-1] == 1:
        flat = np.reshape(y, (-1,))
        bad = flat[np.round(flat) != flat]
        if bad.size:
            raise ValueError(
                f"class_weight needs integer class indices or one-hot targets; y holds {bad[0].item()!r}, not a class "
                "index"
            )
    classes = _class_of(y)
    if np.ndim(classes) != 1:
        raise ValueError(f"class_weight needs one class per sample; y of shape {y.shape} gives {classes.shape}")
    table = np.ones(max(max(class_weight), int(classes.max(initial=0))) + 1, np.float32)
    for c, w in class_weight.items():
        table[c] = w
    return table[np.clip(classes, 0, None)] * (classes >= 0) + (classes < 0)


def _from_arrays(
    x: Any,
    y: Any,
    sample_weight: Any,
    class_weight: dict[int, float] | None,
    batch_size: int | None,
    num_replicas: int,
    shuffle: bool,
    seed: int,
    need_targets: bool,
    steps: int | None,
) -> GlobalBatches:
    if x is None:
        raise ValueError(
            "x is None: pass the inputs as a numpy array, a list/dict of arrays, a tf.data.Dataset, a generator or a "
            "keras.utils.PyDataset"
        )
    x = _as_arrays(x)
    n = _num_rows(x, "x")
    targeted = y is not None
    if y is None:
        if need_targets:
            raise ValueError(
                "y is None: pass the targets, or x as a tf.data.Dataset, a generator or a keras.utils.PyDataset of "
                "(x, y) batches"
            )
        if sample_weight is not None or class_weight is not None:
            raise ValueError("sample_weight and class_weight need the targets y")
        y = np.zeros((n,), np.float32)  # a placeholder so every element has the same structure
    else:
        y = _as_arrays(y)
        ny = _num_rows(y, "y")
        if ny != n:
            raise ValueError(f"x and y have different lengths: x has {n} samples, y has {ny}")
    if n == 0:
        raise ValueError("x is empty: there is nothing to train on")
    if batch_size is None:
        batch_size = -(-n // steps) if steps else 32  # Keras' default
    if batch_size < num_replicas:
        raise ValueError(
            f"batch_size={batch_size} is smaller than the number of replicas ({num_replicas}): batch_size is the "
            f"global batch, split across replicas; use at least {num_replicas}"
        )
    if sample_weight is not None:
        weights = _sample_weights(sample_weight, y, n)
    elif class_weight is not None:
        weights = _class_weights_for(y, class_weight)
    else:
        weights = np.ones((n,), np.float32)
    with tf.device("/device:CPU:0"):  # the host holds the data; batches are gathered from it
        arrays = tf.nest.map_structure(tf.convert_to_tensor, (x, y, weights))
    num_batches = -(-n // batch_size)
    return GlobalBatches(
        "arrays",
        steps or num_batches,
        num_batches,
        steps is not None,
        n,
        shuffle,
        seed,
        batch_size,
        arrays,
        weighted=sample_weight is not None or class_weight is not None,
        targeted=targeted,
    )


# -- datasets, generators, PyDataset ---------------------------------------------------------------------------------
def _arity(spec_or_element: Any) -> int:
    return len(spec_or_element) if isinstance(spec_or_element, tuple) else 1


def _complete(class_weight: dict[int, float] | None) -> Callable[..., tuple[Any, Any, Any]]:
    """A ``Dataset.map`` function: an element ``x``, ``(x,)``, ``(x, y)`` or ``(x, y, w)`` -> ``(x, y, w)``, with a
    placeholder ``y``, ones for ``w`` or the weights of ``class_weight`` (Keras' ``make_class_weight_map_fn``)."""
    table = None
    if class_weight is not None:
        table = tf.constant([class_weight.get(c, 1.0) for c in range(max(class_weight) + 1)], tf.float32)

    def complete(*element: Any) -> tuple[Any, Any, Any]:
        x = element[0]
        n = tf.shape(tf.nest.flatten(x)[0])[0]
        y = element[1] if len(element) > 1 else tf.zeros((n,), tf.float32)
        if len(element) > 2:
            w = tf.nest.map_structure(lambda t: tf.cast(t, tf.float32), element[2])
        elif table is not None:
            if y.shape.rank is not None and y.shape.rank >= 2 and y.shape[-1] != 1:
                classes = tf.argmax(y, axis=-1, output_type=tf.int32)
            else:
                classes = tf.cast(tf.round(tf.reshape(tf.cast(y, tf.float32), [n])), tf.int32)
            inside = (classes >= 0) & (classes < tf.shape(table)[0])
            w = tf.where(inside, tf.gather(table, tf.clip_by_value(classes, 0, tf.shape(table)[0] - 1)), 1.0)
        else:
            w = tf.ones((n,), tf.float32)
        return x, y, w

    return complete


def _check_element_arity(arity: int, what: str, need_targets: bool, class_weight: Any, y_spec: Any = None) -> None:
    if arity > 3:
        raise ValueError(f"{what} yields {arity}-tuples: each element must be x, (x,), (x, y) or (x, y, sample_weight)")
    if need_targets and arity < 2:
        raise ValueError(f"{what} yields no targets: each element must be (x, y) or (x, y, sample_weight)")
    if class_weight is not None:
        if arity == 3:
            raise ValueError(f"{what} yields sample weights: class_weight cannot be used with them (pass one of them)")
        if arity < 2:
            raise ValueError(f"class_weight needs targets, but {what} yields only x")
        if tf.nest.is_nested(y_spec):
            raise ValueError("class_weight is only supported for models with a single output (y is a list/dict)")


def _lists_to_tuples(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _lists_to_tuples(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_lists_to_tuples(v) for v in value)
    return value


def _standardize(batch: Any, what: str) -> Any:
    """A batch as ``(x,)``, ``(x, y)`` or ``(x, y, w)`` of numpy arrays (floats as floatx, lists made tuples)."""
    if isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, tuple):
        batch = (batch,)
    if not 1 <= len(batch) <= 3:
        raise ValueError(
            f"{what} yielded a {len(batch)}-tuple: each batch must be x, (x,), (x, y) or (x, y, sample_weight)"
        )
    if any(part is None for part in batch):
        raise ValueError(f"{what} yielded None in a batch: each batch must be x, (x,), (x, y) or (x, y, sample_weight)")
    return tf.nest.map_structure(lambda a: _to_floatx(np.asarray(a)), _lists_to_tuples(batch))


def _signature(batches: list[Any], what: str) -> Any:
    """The ``output_signature`` of ``batches``: the batch dimension and any dimension that differs become None."""
    try:
        for other in batches[1:]:
            tf.nest.assert_same_structure(batches[0], other)
    except (ValueError, TypeError) as error:
        raise ValueError(f"the first batches of {what} have different structures: {error}") from None

    def spec(*arrays: np.ndarray) -> tf.TensorSpec:
        first = arrays[0]
        if first.ndim == 0:
            raise ValueError(f"{what} yielded a scalar: every part of a batch needs a first (batch) dimension")
        if any(a.ndim != first.ndim for a in arrays):
            raise ValueError(f"{what} yielded arrays of different ranks for the same part of a batch")
        dims = [None] + [d if all(a.shape[i] == d for a in arrays) else None for i, d in enumerate(first.shape)][1:]
        dtype = tf.string if first.dtype.kind in "USO" else tf.as_dtype(first.dtype)
        return tf.TensorSpec(dims, dtype)

    return tf.nest.map_structure(spec, *batches)


def _conform(batch: Any, signature: Any, what: str) -> Any:
    """``batch`` cast to the dtypes of ``signature``, with a clear error for a shape that does not fit it."""

    def one(array: np.ndarray, spec: tf.TensorSpec) -> np.ndarray:
        if not spec.shape.is_compatible_with(array.shape):
            raise ValueError(
                f"{what} yielded a batch part of shape {array.shape} where {spec.shape} was expected (the shape of "
                f"the first {PEEK_BATCHES} batches): only dimensions that differ among those may vary"
            )
        return array if spec.dtype == tf.string else array.astype(spec.dtype.as_numpy_dtype, copy=False)

    try:
        return tf.nest.map_structure(one, batch, signature)
    except (ValueError, TypeError) as error:
        if "yielded a batch part" in str(error):
            raise
        raise ValueError(f"{what} yielded a batch whose structure differs from its first batches': {error}") from None


def _from_batches(
    kind: str,
    make_pass: Callable[[int], tf.data.Dataset],
    spec: Any,
    num_batches: int | None,
    infinite: bool,
    steps: int | None,
    class_weight: dict[int, float] | None,
    need_targets: bool,
    py_dataset: keras.utils.PyDataset | None = None,
    shuffle: bool = False,
    seed: int = 0,
) -> GlobalBatches:
    """Global batches from ``make_pass(index)``, a dataset of one pass whose elements have the structure ``spec``."""
    what = _NAMES[kind]
    arity = _arity(spec)
    _check_element_arity(arity, f"the {what[2:]}", need_targets, class_weight, spec[1] if arity > 1 else None)
    if infinite and steps is None:
        raise ValueError(
            f"x is an infinite {what[2:]}: an epoch would never end; pass steps (steps_per_epoch, validation_steps, "
            "evaluate/predict's steps) or a finite one (e.g. ds.take(n))"
        )
    complete = _complete(class_weight)
    mapper = complete if arity > 1 else (lambda x: complete(x))

    def one_pass(index: int) -> tf.data.Dataset:
        return make_pass(index).map(mapper)

    return GlobalBatches(
        kind,
        steps if steps is not None else num_batches,
        num_batches,
        steps is not None,
        None,
        shuffle,
        seed,
        None,
        py_dataset=py_dataset,
        weighted=arity > 2 or class_weight is not None,
        targeted=arity > 1,
        _make_pass=one_pass,
    )


def _from_dataset(
    ds: tf.data.Dataset, steps: int | None, class_weight: dict[int, float] | None, need_targets: bool
) -> GlobalBatches:
    spec = ds.element_spec
    cardinality = int(ds.cardinality())
    return _from_batches(
        "dataset",
        lambda _: ds,
        spec,
        cardinality if cardinality >= 0 else None,
        cardinality == tf.data.INFINITE_CARDINALITY,
        steps,
        class_weight,
        need_targets,
    )


def _from_generator(generator: Iterator[Any], steps: int | None, need_targets: bool) -> GlobalBatches:
    """A generator (or iterator) of batches, by Keras' ``GeneratorDataAdapter`` (``peek_and_restore``): its first
    :data:`PEEK_BATCHES` batches, read to find the signature, start every pass, and then the generator continues where
    the previous pass left it (a generator runs once). So a second pass over a finite generator that has ended gives
    those first batches again, and a validation generator with ``validation_steps <= 2`` is validated on the same
    batches every epoch, as in ``model.fit``."""
    what = "the generator"
    first = list(itertools.islice(generator, PEEK_BATCHES))
    if not first:
        raise ValueError("the generator yielded nothing: it must yield at least one batch")
    first = [_standardize(b, what) for b in first]
    signature = _signature(first, what)
    lock = threading.Lock()

    def batches() -> Iterator[Any]:
        yield from first
        while True:
            with lock:  # two iterators (e.g. an abandoned one still prefetching) must not run the generator at once
                try:
                    batch = _standardize(next(generator), what)
                except StopIteration:
                    return
            yield _conform(batch, signature, what)

    def make_pass(_: int) -> tf.data.Dataset:
        return tf.data.Dataset.from_generator(batches, output_signature=signature)

    return _from_batches("generator", make_pass, signature, None, False, steps, None, need_targets)


def _from_py_dataset(
    py_dataset: keras.utils.PyDataset,
    steps: int | None,
    class_weight: dict[int, float] | None,
    shuffle: bool,
    seed: int,
    need_targets: bool,
) -> GlobalBatches:
    """A ``PyDataset``: ``len()`` batches read by index (``None``: infinite), the order shuffled per pass when asked.

    Its ``workers``/``use_multiprocessing`` are not used: tf.data reads the batches on its own thread, ahead of the
    loop. Keras shuffles with Python's global ``random``; here the order depends on ``(seed, pass)`` only."""
    what = "the PyDataset"
    try:
        num_batches = py_dataset.num_batches
    except NotImplementedError:
        raise ValueError(
            "the PyDataset has neither __len__ nor num_batches: define one (None means infinite)"
        ) from None
    if num_batches is not None:
        num_batches = check_int("the PyDataset's length (or num_batches)", num_batches, low=0)
        if num_batches == 0:
            raise ValueError("the PyDataset is empty (its length is 0): there is nothing to train on")
    peek = PEEK_BATCHES if num_batches is None else min(PEEK_BATCHES, num_batches)
    first = [_standardize(py_dataset[i], what) for i in range(peek)]
    signature = _signature(first, what)

    def batches(index: int) -> Iterator[Any]:
        if num_batches is None:
            order: Any = itertools.count()
        elif shuffle:
            order = np.random.default_rng([seed, index]).permutation(num_batches)
        else:
            order = range(num_batches)
        for i in order:
            yield _conform(_standardize(py_dataset[int(i)], what), signature, what)

    def make_pass(index: int) -> tf.data.Dataset:
        return tf.data.Dataset.from_generator(batches, args=(index,), output_signature=signature)

    return _from_batches(
        "py_dataset",
        make_pass,
        signature,
        num_batches,
        num_batches is None,
        steps,
        class_weight,
        need_targets,
        py_dataset=py_dataset,
        shuffle=bool(shuffle) and num_batches is not None,
        seed=seed,
    )


# -- the entry points -----------------------------------------------------------------------------------------------
def global_batches(
    x: Any,
    y: Any = None,
    *,
    sample_weight: Any = None,
    class_weight: Mapping[int, float] | None = None,
    batch_size: int | None,
    num_replicas: int,
    shuffle: bool | str = False,
    seed: int = 0,
    need_targets: bool = True,
    steps: int | None = None,
) -> GlobalBatches:
    """Validate the user's input and wrap it as :class:`GlobalBatches`.

    ``x`` is arrays (numpy, or a list/tuple/dict of them; ``y`` and ``sample_weight`` likewise, shaped like the
    model's outputs), a ``tf.data.Dataset``, a generator/iterator or a ``keras.utils.PyDataset`` of batches (``x``,
    ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``). ``batch_size`` (arrays only; None: Keras' default, 32 or
    ``ceil(n / steps)``) is the global batch. ``shuffle`` reorders arrays' samples and a PyDataset's batches each
    pass (Keras' ``"batch"``, a shuffle inside each batch, changes no number and is taken as False); a dataset or
    generator is expected to shuffle itself. ``steps`` is the number of batches of an epoch when the caller gives it.
    With ``need_targets=False`` (predict) a missing ``y`` becomes a placeholder.

    Raises ``ValueError`` (before any training) for: a batch size that is not an int or is smaller than the number
    of replicas; x, y and sample_weight of different lengths; empty input; a missing y; y or sample_weight given
    with a dataset, generator or PyDataset; a bad class_weight (or one with several outputs, with sample weights,
    with a generator, or with targets that are not class indices); steps that is not a positive int; an infinite
    dataset or PyDataset without steps.
    """
    check_int("batch_size", batch_size, none_ok=True)
    steps = check_int("steps", steps, none_ok=True)
    if shuffle not in (True, False, "batch"):
        raise ValueError(f"shuffle must be True, False or 'batch', got {shuffle!r}")
    shuffle = shuffle is True
    checked_weights = None if class_weight is None else _check_class_weight(class_weight)
    kind = input_kind(x)
    if kind != "arrays":
        name = _NAMES[kind]
        if y is not None:
            raise ValueError(f"y must be None when x is {name} (it yields (x, y) batches)")
        if sample_weight is not None:
            raise ValueError(
                f"sample_weight must be None when x is {name}: yield (x, y, sample_weight) batches instead "
                "(sample_weight= is for numpy input)"
            )
    if kind == "dataset":
        return _from_dataset(x, steps, checked_weights, need_targets)
    if kind == "generator":
        if checked_weights is not None:
            raise ValueError(
                "class_weight is not supported with a generator (as in Keras): yield (x, y, sample_weight) batches, "
                "or pass a tf.data.Dataset or keras.utils.PyDataset"
            )
        return _from_generator(x, steps, need_targets)
    if kind == "py_dataset":
        return _from_py_dataset(x, steps, checked_weights, shuffle, seed, need_targets)
    if sample_weight is not None and checked_weights is not None:
        raise ValueError("class_weight and sample_weight cannot be used together (as in Keras): pass one of them")
    return _from_arrays(
        x, y, sample_weight, checked_weights, batch_size, num_replicas, shuffle, seed, need_targets, steps
    )


def split_validation(
    x: Any, y: Any, sample_weight: Any, fraction: float
) -> tuple[tuple[Any, Any, Any], tuple[Any, Any, Any]]:
    """Keras' ``validation_split``: the last ``fraction`` of the samples (before any shuffling) for validation.

    Returns ``((x, y, sample_weight), (x_val, y_val, sample_weight_val))`` as numpy (``None`` stays ``None``), the
    split at ``floor(n * (1 - fraction))`` as in Keras' ``train_validation_split``. Raises ``ValueError`` for a
    fraction outside (0, 1), for input that is not arrays (a dataset, generator or PyDataset: pass
    ``validation_data``), for arrays of different lengths, and when either part would be empty.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, Real) or not 0 < fraction < 1:
        raise ValueError(f"validation_split must be a number strictly between 0 and 1, got {fraction!r}")
    kind = input_kind(x)
    if kind != "arrays":
        raise ValueError(
            f"validation_split is only supported for numpy arrays, and x is {_NAMES[kind]}: pass validation_data"
        )
    if x is None:
        raise ValueError("x is None: nothing to split for validation_split")
    parts = [None if v is None else _as_arrays(v) for v in (x, y, sample_weight)]
    lengths = {name: _num_rows(v, name) for name, v in zip(("x", "y", "sample_weight"), parts) if v is not None}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"x, y and sample_weight have different lengths: {lengths}")
    n = lengths["x"]
    split_at = int(math.floor(n * (1.0 - fraction)))
    if split_at in (0, n):
        raise ValueError(
            f"validation_split={fraction} of {n} samples leaves an empty training or validation set: give more data "
            "or another fraction"
        )

    def cut(start: int, end: int) -> tuple[Any, Any, Any]:
        x_part, y_part, w_part = (
            None if v is None else tf.nest.map_structure(lambda a: a[start:end], v) for v in parts
        )
        return x_part, y_part, w_part

    return cut(0, split_at), cut(split_at, n)


def zeros_like_spec(spec: Any, rows: int = 1) -> Any:
    """A batch of ``rows`` samples shaped like ``spec`` (a structure of ``tf.TensorSpec``), other unknown
    dimensions as 1.

    It builds a lazily built model, Keras' compiled metrics and the output dtypes before the first real step; with
    the user's batch size as ``rows``, a shape error Keras raises there shows the user's batch.
    """

    def zeros(s: tf.TensorSpec) -> tf.Tensor:
        shape = [1 if d is None else d for d in s.shape.as_list()] if s.shape.rank is not None else [1]
        shape[:1] = [rows]
        return tf.fill(shape, "") if s.dtype == tf.string else tf.zeros(shape, s.dtype)

    return tf.nest.map_structure(zeros, spec)
