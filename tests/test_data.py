"""The input side: every input kind -> (x, y, sample_weight) global batches, by Keras' data-adapter rules.

Real TensorFlow on the simulated CPUs; Keras' own functions are the reference where it has one.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import logits_loss, small_mlp
from keras.src.trainers.data_adapters import array_slicing, data_adapter_utils, tf_dataset_adapter

from paraml import Parallel
from paraml.loop.batches import GlobalBatches, global_batches, input_kind, split_validation


def batches(source: GlobalBatches, *args, **kwargs) -> list:
    return list(source.dataset(*args, **kwargs).as_numpy_iterator())


def arrays(n=10, features=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, features)), rng.integers(0, 3, size=(n,))


def make(x, y=None, **kwargs):
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("num_replicas", 2)
    return global_batches(x, y, **kwargs)


class Batches(keras.utils.PyDataset):
    """``len(x) / batch`` batches of (x, y); counts its epoch hooks."""

    def __init__(self, x, y, batch, infinite=False, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch, self.infinite = x, y, batch, infinite
        self.begun = self.ended = 0

    def __len__(self):
        return -(-len(self.x) // self.batch)

    @property
    def num_batches(self):
        return None if self.infinite else len(self)

    def __getitem__(self, i):
        i = i % len(self)
        return self.x[i * self.batch : (i + 1) * self.batch], self.y[i * self.batch : (i + 1) * self.batch]

    def on_epoch_begin(self):
        self.begun += 1

    def on_epoch_end(self):
        self.ended += 1


# -- arrays ---------------------------------------------------------------------------------------------------------
def test_arrays_give_batches_with_ones_weights_and_float32():
    x, y = arrays(10)
    source = make(x, y)
    got = batches(source)
    assert (source.kind, source.steps, source.num_batches, source.continues) == ("arrays", 3, 3, False)
    assert [len(b[0]) for b in got] == [4, 4, 2]
    assert got[0][0].dtype == np.float32  # float64 -> floatx, as Keras does
    np.testing.assert_allclose(np.concatenate([b[0] for b in got]), x.astype(np.float32))
    np.testing.assert_array_equal(np.concatenate([b[1] for b in got]), y)
    np.testing.assert_array_equal(np.concatenate([b[2] for b in got]), np.ones(10, np.float32))
    assert source.spans_epochs and len(batches(source, 0, 3)) == 9


def test_arrays_shuffle_depends_on_seed_and_epoch_only():
    x, y = np.arange(20.0)[:, None], np.arange(20)
    source = make(x, y, shuffle=True, seed=3)
    two_epochs = batches(source, 0, 2)
    first, second = (np.concatenate([b[1] for b in two_epochs[i : i + 5]]) for i in (0, 5))
    assert sorted(first) == list(range(20)) and not np.array_equal(first, second)
    again = np.concatenate([b[1] for b in batches(make(x, y, shuffle=True, seed=3), 1)])
    np.testing.assert_array_equal(again, second)
    assert not np.array_equal(np.concatenate([b[1] for b in batches(make(x, y, shuffle=True, seed=4))]), first)
    np.testing.assert_array_equal(np.concatenate([b[1] for b in batches(source, 0, skip=2)]), first[8:])


def test_unshuffled_arrays_span_epochs_in_order_with_the_same_element_spec():
    # Unshuffled arrays are batched as they are (no gather): every pass the same, a short last batch in each pass
    # (not merged with the next), a skip counted from the first pass, the same element spec as the shuffled path.
    x, y = arrays(10)
    source = make(x, y)
    got = batches(source, 1, 4, skip=2)
    assert [len(b[0]) for b in got] == [2, 4, 4, 2, 4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([b[1] for b in got]), np.concatenate([y[8:], y, y]))
    assert source.dataset().element_spec == make(x, y, shuffle=True).dataset().element_spec


def test_arrays_with_steps_continue_and_keras_default_batch_size():
    x, y = arrays(10)
    source = make(x, y, batch_size=None, steps=4)
    assert (source.batch_size, source.steps, source.num_batches, source.continues) == (3, 4, 4, True)  # ceil(10/4)
    assert make(x, y, batch_size=None).batch_size == 32


def test_lists_and_dicts_of_arrays_and_nested_targets_and_weights():
    x, y = arrays(6)
    source = make([x, x[:, :1]], {"a": y, "b": x}, sample_weight={"a": np.arange(6.0), "b": np.ones(6)})
    (bx, by, bw), *_ = batches(source)
    assert isinstance(bx, tuple) and bx[1].shape == (4, 1)
    assert set(by) == {"a", "b"} and set(bw) == {"a", "b"}
    np.testing.assert_array_equal(bw["a"], [0, 1, 2, 3])
    # one weight array for several outputs is given to every output, as Keras does
    (_, _, bw), *_ = batches(make(x, {"a": y, "b": x}, sample_weight=np.arange(6.0)))
    np.testing.assert_array_equal(bw["a"], bw["b"])
    assert make([[1.0, 2.0], [3.0, 4.0]], [0, 1], batch_size=2).num_samples == 2  # a nested list of numbers: one array


def test_sample_weight_arrays_reach_the_batches():
    x, y = arrays(10)
    w = np.linspace(0, 1, 10)
    got = batches(make(x, y, sample_weight=w))
    np.testing.assert_allclose(np.concatenate([b[2] for b in got]), w.astype(np.float32))


@pytest.mark.parametrize("encoding", ["sparse", "column", "one_hot"])
def test_class_weight_equals_keras_conversion(encoding):
    y = np.array([0, 1, 2, 2, 1, 0, 3, 1])
    target = {"sparse": y, "column": y[:, None].astype(np.float32), "one_hot": np.eye(4)[y]}[encoding]
    class_weight = {0: 0.5, 1: 2.0, 2: 3.0}  # class 3 absent: weight 1
    want = data_adapter_utils.class_weight_to_sample_weights(target, class_weight)
    got = np.concatenate([b[2] for b in batches(make(np.zeros((8, 2)), target, class_weight=class_weight))])
    np.testing.assert_allclose(got, want)


def test_validation_split_equals_keras():
    x, y = arrays(10)
    w = np.arange(10.0)
    for given, fraction in [((x, y, w), 0.3), (({"a": x, "b": x}, [y, y], None), 0.25), ((x, None, None), 0.5)]:
        want_train, want_val = array_slicing.train_validation_split(given, validation_split=fraction)
        got_train, got_val = split_validation(*given, fraction)
        for got, want in [(got_train, want_train), (got_val, want_val)]:
            flat_got, flat_want = tf.nest.flatten(got), tf.nest.flatten(want)
            assert len(flat_got) == len(flat_want)
            for a, b in zip(flat_got, flat_want):
                assert (a is None) == (b is None)
                if a is not None:
                    np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6)
    assert split_validation(x, y, None, 0.3)[1][2] is None


# -- tf.data --------------------------------------------------------------------------------------------------------
def test_dataset_elements_of_every_arity():
    x, y = arrays(10)
    w = np.arange(10.0)
    for element, need in [((x,), False), ((x, y), True), ((x, y, w), True)]:
        ds = tf.data.Dataset.from_tensor_slices(element).batch(4)
        source = make(ds, need_targets=need)
        got = batches(source)
        assert (source.kind, source.steps, source.num_batches, source.continues) == ("dataset", 3, 3, False)
        assert [len(b[0]) for b in got] == [4, 4, 2]
        want_w = w if len(element) == 3 else np.ones(10)
        np.testing.assert_allclose(np.concatenate([b[2] for b in got]), want_w)
    (bx, by, _), *_ = batches(make(tf.data.Dataset.from_tensor_slices(x).batch(4), need_targets=False))
    assert by.shape == (4,) and bx.shape == (4, 3)  # x alone: a placeholder y


def test_dataset_class_weight_equals_keras_map():
    y = np.array([0, 1, 2, 2, 1, 0, 1, 1])
    ds = tf.data.Dataset.from_tensor_slices((np.zeros((8, 2)), y)).batch(3)
    class_weight = {0: 0.5, 1: 2.0, 2: 3.0}
    want = np.concatenate([w for _, _, w in ds.map(tf_dataset_adapter.make_class_weight_map_fn(class_weight))])
    got = np.concatenate([b[2] for b in batches(make(ds, class_weight=class_weight))])
    np.testing.assert_allclose(got, want)


def test_infinite_dataset_needs_steps():
    x, y = arrays(8)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()
    with pytest.raises(ValueError, match="infinite.*pass steps"):
        make(ds)
    source = make(ds, steps=3)
    assert (source.steps, source.num_batches, source.continues) == (3, None, True)
    assert len(list(source.dataset().take(5))) == 5
    finite = make(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), steps=1)
    assert (finite.steps, finite.num_batches, finite.continues) == (1, 2, True)


# -- generators -----------------------------------------------------------------------------------------------------
def generator(x, y, batch, weights=None):
    for i in range(0, len(x), batch):
        if weights is None:
            yield x[i : i + batch], y[i : i + batch]
        else:
            yield x[i : i + batch], y[i : i + batch], weights[i : i + batch]


def test_generator_without_steps_runs_until_it_ends_and_replays_its_first_batches():
    x, y = arrays(10)
    source = make(generator(x, y, 4))
    assert (source.kind, source.steps, source.num_batches, source.continues) == ("generator", None, None, False)
    got = batches(source)
    assert [len(b[0]) for b in got] == [4, 4, 2]  # the batches read for the signature are not lost
    assert got[0][0].dtype == np.float32 and got[2][0].shape == (2, 3)
    np.testing.assert_allclose(np.concatenate([b[0] for b in got]), x.astype(np.float32))
    np.testing.assert_array_equal(np.concatenate([b[2] for b in got]), np.ones(10))
    again = batches(source)  # a generator runs once; its first batches start every pass (Keras' peek_and_restore)
    assert len(again) == 2 and np.array_equal(again[1][0], got[1][0])


def test_generator_with_steps_and_weights_and_x_only():
    x, y = arrays(12)

    def endless():
        while True:
            yield from generator(x, y, 4, weights=np.arange(12.0))

    source = make(endless(), steps=2)
    assert (source.steps, source.num_batches, source.continues) == (2, None, True)
    got = list(source.dataset().take(5).as_numpy_iterator())
    np.testing.assert_allclose(got[3][2], [0, 1, 2, 3])  # it continues through the generator
    plain = (b for b in [x[:4], x[4:]])  # bare arrays: x only
    (bx, by, bw), _ = batches(make(plain, need_targets=False))
    assert bx.shape == (4, 3) and by.shape == (4,) and bw.shape == (4,)


def test_generator_shape_change_is_a_clear_error():
    def changing():
        yield np.zeros((2, 3)), np.zeros(2)
        yield np.zeros((2, 3)), np.zeros(2)
        yield np.zeros((2, 5)), np.zeros(2)

    with pytest.raises(tf.errors.OpError, match=r"shape \(2, 5\) where \(None, 3\) was expected"):
        batches(make(changing()))


# -- PyDataset ------------------------------------------------------------------------------------------------------
def test_py_dataset_batches_hooks_and_shuffled_order():
    x, y = np.arange(20.0)[:, None], np.arange(20)
    data = Batches(x, y, 4)
    source = make(data)
    assert (source.kind, source.steps, source.num_batches, source.continues) == ("py_dataset", 5, 5, False)
    got = batches(source)
    np.testing.assert_array_equal(np.concatenate([b[1] for b in got]), y)
    np.testing.assert_array_equal(np.concatenate([b[2] for b in got]), np.ones(20))
    source.on_epoch_begin()
    source.on_epoch_end()
    assert (data.begun, data.ended) == (1, 1)
    shuffled = make(Batches(x, y, 4), shuffle=True, seed=1)
    first, second = (np.concatenate([b[1] for b in batches(shuffled, p)]) for p in (0, 1))
    assert sorted(first) == list(range(20)) and not np.array_equal(first, second)  # batch order, per (seed, pass)
    np.testing.assert_array_equal(first[:4], np.sort(first[:4]))  # batches stay whole
    again = np.concatenate([b[1] for b in batches(make(Batches(x, y, 4), shuffle=True, seed=1), 1)])
    np.testing.assert_array_equal(again, second)


def test_py_dataset_class_weight_and_infinite():
    x, y = np.zeros((8, 2)), np.array([0, 1, 2, 2, 1, 0, 1, 1])
    got = np.concatenate([b[2] for b in batches(make(Batches(x, y, 3), class_weight={1: 2.0}))])
    np.testing.assert_allclose(got, data_adapter_utils.class_weight_to_sample_weights(y, {1: 2.0}))
    with pytest.raises(ValueError, match="infinite.*pass steps"):
        make(Batches(x, y, 3, infinite=True))
    source = make(Batches(x, y, 3, infinite=True), steps=4)
    assert (source.steps, source.num_batches, source.continues) == (4, None, True)
    assert len(list(source.dataset().take(7))) == 7


# -- errors ---------------------------------------------------------------------------------------------------------
class Empty(keras.utils.PyDataset):
    def __len__(self):
        return 0

    def __getitem__(self, i):
        raise IndexError(i)


def bad_inputs():
    x, y = arrays(10)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    one_output = {"batch_size": 4, "num_replicas": 2}
    return [
        ((x, y), {"batch_size": 1}, "batch_size=1 is smaller than the number of replicas"),
        ((x, y), {"batch_size": 0}, "batch_size must be an int >= 1 or None, got 0"),
        ((x, y[:5]), {}, "x and y have different lengths: x has 10 samples, y has 5"),
        (([x, x[:3]], y), {}, r"different lengths: \[3, 10\]"),
        ((x[:0], y[:0]), {}, "x is empty"),
        ((x,), {}, "y is None"),
        ((None, y), {}, "x is None"),
        ((ds, y), {}, "y must be None when x is a tf.data.Dataset"),
        ((ds,), {"sample_weight": np.ones(10)}, "sample_weight must be None when x is a tf.data.Dataset"),
        ((iter([(x, y)]),), {"sample_weight": np.ones(10)}, "sample_weight must be None when x is a generator"),
        ((Batches(x, y, 4),), {"sample_weight": np.ones(10)}, "when x is a keras.utils.PyDataset"),
        ((x, y), {"sample_weight": np.ones(9)}, "sample_weight has 9 weights for 10 samples"),
        ((x, {"a": y, "b": y}), {"sample_weight": [np.ones(10)] * 2}, "one sample_weight array per output"),
        ((x, y), {"class_weight": {"cat": 1.0}}, "class_weight keys must be class indices.*'cat'"),
        ((x, y), {"class_weight": {0: "high"}}, r"class_weight\[0\] must be a finite number, got 'high'"),
        ((x, y), {"class_weight": [1.0, 2.0]}, "class_weight must be a non-empty dict"),
        ((x, y), {"class_weight": {0: 1.0}, "sample_weight": np.ones(10)}, "cannot be used together"),
        ((x, {"a": y, "b": y}), {"class_weight": {0: 2.0}}, "only supported for models with a single output"),
        ((x, y + 0.5), {"class_weight": {0: 2.0}}, "integer class indices or one-hot targets; y holds 2.5"),
        ((iter([(x, y)]),), {"class_weight": {0: 2.0}}, "class_weight is not supported with a generator"),
        ((ds.map(lambda a, b: (a, b, b)),), {"class_weight": {0: 2.0}}, "yields sample weights: class_weight"),
        ((ds.map(lambda a, b: (a, b, b, b)),), {}, "yields 4-tuples"),
        ((ds.map(lambda a, b: a),), {}, "yields no targets"),
        ((x, y), {"steps": 0}, "steps must be an int >= 1 or None, got 0"),
        ((x, y), {"shuffle": "yes"}, "shuffle must be True, False or 'batch'"),
        ((iter([]),), {}, "the generator yielded nothing"),
        ((iter([(x, y, y, y)]),), {}, "yielded a 4-tuple"),
        ((Empty(),), one_output, "the PyDataset is empty"),
    ]


@pytest.mark.parametrize("args, kwargs, message", bad_inputs(), ids=lambda v: str(v)[:40] if isinstance(v, str) else "")
def test_bad_input_is_a_clear_error(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(*args, **kwargs)


@pytest.mark.parametrize(
    "x, fraction, message",
    [
        (np.zeros((10, 2)), 0.0, "strictly between 0 and 1, got 0.0"),
        (np.zeros((10, 2)), 1.5, "strictly between 0 and 1, got 1.5"),
        (np.zeros((10, 2)), True, "strictly between 0 and 1"),
        (np.zeros((1, 2)), 0.5, "leaves an empty training or validation set"),
        (tf.data.Dataset.range(3), 0.2, "x is a tf.data.Dataset: pass validation_data"),
        (iter([1]), 0.2, "x is a generator"),
        (Empty(), 0.2, "x is a keras.utils.PyDataset"),
    ],
)
def test_bad_validation_split_is_a_clear_error(x, fraction, message):
    with pytest.raises(ValueError, match=message):
        split_validation(x, np.zeros(len(x)) if isinstance(x, np.ndarray) else None, None, fraction)


def test_input_kind():
    assert input_kind(tf.data.Dataset.range(2)) == "dataset"
    assert input_kind(Empty()) == "py_dataset"
    assert input_kind(x for x in []) == "generator"
    assert input_kind([np.zeros(2)]) == input_kind({"a": np.zeros(2)}) == "arrays"


# -- end to end: paraml "single" against plain Keras fit ------------------------------------------------------------
@pytest.fixture(scope="module")
def train_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 8)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")


def compare_with_keras(make_input, make_eval=None, **fit_args):
    """Train plain Keras and paraml "single" from the same weights on inputs from ``make_input()`` (then evaluate
    on ``make_eval()``); the weights, the History and the evaluation agree."""
    keras.utils.set_random_seed(0)
    model = small_mlp()
    initial = model.get_weights()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=logits_loss(), metrics=["accuracy"])

    def args():  # a fresh validation generator for each run
        return {k: v() if k == "validation_data" and callable(v) else v for k, v in fit_args.items()}

    want = model.fit(make_input(), shuffle=False, verbose=0, **args()).history
    par = Parallel("single", seed=0)
    ours = par.build(small_mlp, optimizer=keras.optimizers.SGD(0.1), loss=logits_loss(), metrics=["accuracy"])
    ours.set_weights(initial)
    got = par.fit(make_input(), shuffle=False, verbose=0, **args()).history
    for a, b in zip(ours.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6, err_msg=key)
    if make_eval is not None:
        want_eval = model.evaluate(make_eval(), verbose=0, return_dict=True)
        got_eval = par.evaluate(make_eval())
        for key in want_eval:
            np.testing.assert_allclose(got_eval[key], want_eval[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_generator_fit_equals_keras(train_data):
    x, y = train_data

    def endless():
        while True:
            yield from generator(x, y, 16)

    compare_with_keras(endless, epochs=3, steps_per_epoch=3)  # the generator continues across epochs


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
def test_finite_generator_fit_with_generator_validation_equals_keras(train_data):
    x, y = train_data
    weights = np.linspace(0.5, 1.5, len(x)).astype("float32")
    compare_with_keras(
        lambda: generator(x, y, 16, weights),
        lambda: generator(x, y, 25),
        epochs=2,  # the second epoch: the generator has ended; its two first batches start the pass again
        validation_data=lambda: generator(x[:30], y[:30], 8),
    )


def test_py_dataset_fit_equals_keras(train_data):
    x, y = train_data
    compare_with_keras(lambda: Batches(x, y, 16), lambda: Batches(x, y, 25), epochs=2)


def test_py_dataset_class_weight_and_validation_equal_keras(train_data):
    x, y = train_data
    compare_with_keras(
        lambda: Batches(x, y, 16),
        epochs=2,
        class_weight={0: 0.5, 2: 3.0},
        validation_data=Batches(x, y, 10),
    )
