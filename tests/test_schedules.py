"""Pipeline schedules: the printed timeline (pure), and ``schedule="1f1b"`` training like ``"gpipe"``."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from paraml import Parallel  # noqa: E402
from paraml.planning.schedules import SCHEDULES, Schedule  # noqa: E402


def test_one_f_one_b_bounds_the_micro_batches_in_flight_and_gpipe_does_not():
    assert Schedule("1f1b", 4, 16).most_in_flight() == [4, 3, 2, 1]  # K - s on stage s
    assert Schedule("gpipe", 4, 16).most_in_flight() == [16] * 4
    assert sum(Schedule("1f1b", 4, 16).most_in_flight()) == 10  # the 10 stage-micro-batches, not 64
    for kind in SCHEDULES:  # every pass runs once, each stage one pass per step
        cells = [cell for row in Schedule(kind, 3, 5).timeline() for cell in row if cell]
        assert sorted(cells) == sorted(f"{p}{i}" for p in "FB" for i in range(5) for _ in range(3))


def test_the_rule_the_stages_follow():
    schedule = Schedule("1f1b", stages=2, micro_batches=8)
    assert [schedule.waits_for(0, i) for i in range(4)] == [None, None, 0, 1]
    assert [schedule.waits_for(1, i) for i in range(3)] == [None, 0, 1]
    assert Schedule("gpipe", 2, 8).waits_for(1, 5) is None
    text = str(schedule)
    assert text.splitlines()[0] == "1f1b, 2 stages x 8 micro-batches (F: forward, B: backward)"
    assert text.endswith("most micro-batches in flight per stage: 2, 1\nbubble (idle fraction): 0.111")


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("stages, micro_batches", [(4, 8), (2, 3), (4, 16), (3, 1)])
def test_the_bubble_is_read_from_the_timeline(kind, stages, micro_batches):
    """The idle fraction of the drawn timeline: (K - 1) / (M + K - 1) for GPipe and 1F1B (3/11 at K=4, M=8)."""
    rows = Schedule(kind, stages, micro_batches).timeline()
    assert len(rows) == 2 * (micro_batches + stages - 1)  # each stage runs its 2M passes in 2(M + K - 1) steps
    bubble = Schedule(kind, stages, micro_batches).bubble
    assert bubble == pytest.approx((stages - 1) / (micro_batches + stages - 1), abs=1e-12)


def test_bad_schedules_are_refused_before_training():
    with pytest.raises(ValueError, match=r"schedule must be one of 'gpipe', '1f1b', got '1F1B'"):
        Parallel("model_parallel", devices=2, micro_batches=2, schedule="1F1B")
    with pytest.raises(ValueError, match=r"unknown option 'schedule' for strategy 'mirrored'"):
        Parallel("mirrored", devices=2, schedule="1f1b")
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
        Schedule("gpipe", 2, 0)


def tagger_and_classifier() -> keras.Model:
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(50, 8)(tokens)  # a sparse gradient, summed over micro-batches
    h = keras.layers.GlobalAveragePooling1D()(h)
    h = keras.layers.Dense(32, activation="gelu")(h)
    h = keras.layers.Dropout(0.2)(h)  # each micro-batch's mask drawn as under gpipe
    h = keras.layers.Dense(32, activation="gelu")(h)
    return keras.Model(tokens, keras.layers.Dense(3)(h))


@pytest.mark.slow
def test_one_f_one_b_trains_like_gpipe():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (104, 6)).astype("int32")  # batches of 32 and a last one of 8: micro-batches of 1
    y = rng.integers(0, 3, 104)
    results = {}
    for kind in SCHEDULES:
        par = Parallel("model_parallel", devices=2, micro_batches=8, schedule=kind, seed=4)
        par.build(tagger_and_classifier, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(True))
        history = par.fit(x, y, batch_size=32, epochs=2, verbose=0)
        evaluated = par.evaluate(x, y, verbose=0)
        results[kind] = (history.history["loss"], par.model.get_weights(), keras.tree.flatten(evaluated))
    np.testing.assert_allclose(results["1f1b"][0], results["gpipe"][0], rtol=1e-5)
    for got, want in zip(results["1f1b"][1], results["gpipe"][1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results["1f1b"][2], results["gpipe"][2], rtol=1e-5)
    assert "schedule='1f1b'" in par.describe() and "most micro-batches in flight per stage: 2, 1" in par.describe()


def test_one_f_one_b_refuses_a_loss_over_masked_tokens():
    tokens = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(20, 4, mask_zero=True)(tokens)
    model_fn = lambda: keras.Model(tokens, keras.layers.Dense(3)(keras.layers.LSTM(4, return_sequences=True)(h)))  # noqa: E731
    par = Parallel("model_parallel", devices=2, micro_batches=2, schedule="1f1b")
    par.build(model_fn, optimizer="sgd", loss="sparse_categorical_crossentropy")
    x = np.array([[1, 2, 0, 0, 0]] * 8, "int32")
    with pytest.raises(ValueError, match="masked tokens .* use schedule='gpipe'"):
        par.fit(x, np.zeros((8, 5), "int32"), batch_size=4, epochs=1, verbose=0)


def test_one_f_one_b_refuses_a_last_batch_that_leaves_a_micro_batch_empty_for_batch_statistics():
    model_fn = lambda: keras.Sequential(  # noqa: E731
        [keras.Input((4,)), keras.layers.Dense(8), keras.layers.BatchNormalization(), keras.layers.Dense(1)]
    )
    par = Parallel("model_parallel", devices=2, micro_batches=4, schedule="1f1b")
    par.build(model_fn, optimizer="sgd", loss="mse")
    x = np.ones((34, 4), "float32")
    with pytest.raises(ValueError, match=r"with schedule='1f1b': the last batch has 2 sample\(s\) for 4"):
        par.fit(x, np.ones((34, 1), "float32"), batch_size=16, epochs=1, verbose=0)
