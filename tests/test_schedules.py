"""Pipeline schedules: the printed timeline and the rule (pure), and every schedule training like ``"gpipe"``."""

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


@pytest.mark.parametrize("kind", SCHEDULES)
def test_every_pass_runs_once_each_device_one_pass_per_step(kind):
    schedule = Schedule(kind, 3, 6)
    passes = "FBW" if kind == "zero_bubble" else "FB"
    chunks = [f".{v}" for v in range(2)] if kind == "interleaved" else [""]
    cells = [cell for row in schedule.timeline() for cell in row if cell]
    assert sorted(cells) == sorted(f"{p}{i}{c}" for p in passes for i in range(6) for c in chunks for _ in range(3))
    orders = schedule.orders()
    assert [len(order) for order in orders] == [len(passes) * 6 * len(chunks)] * 3
    for device, order in enumerate(orders):  # chunk c runs on device c % stages
        assert {schedule.device_of(chunk) for _, chunk, _ in order} == {device}


def test_the_rule_the_stages_follow():
    schedule = Schedule("1f1b", stages=2, micro_batches=8)
    assert [schedule.waits_for(0, i) for i in range(4)] == [(), (), (("B", 0, 0),), (("B", 0, 1),)]
    assert [schedule.waits_for(1, i) for i in range(3)] == [(), (("B", 1, 0),), (("B", 1, 1),)]
    assert Schedule("gpipe", 2, 8).waits_for(1, 5) == ()
    text = str(schedule)
    assert text.splitlines()[0] == "1f1b, 2 stages x 8 micro-batches (F: forward, B: backward)"
    assert text.endswith("most micro-batches in flight per stage: 2, 1\nbubble (idle fraction): 0.111")
    # Megatron-LM's interleaved order: device 0 warms up with (K - 1) * 2 + (v - 1) * K = 4 forward passes of its
    # two chunks (0 and 2), micro-batches in groups of K = 2, then one forward and one backward pass in turn
    interleaved = Schedule("interleaved", stages=2, micro_batches=4, virtual_stages=2)
    assert interleaved.orders()[0][:6] == [
        ("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1), ("F", 0, 2), ("B", 2, 0)
    ]  # fmt: skip
    assert interleaved.waits_for(0, 3) == (("B", 2, 0),)
    # zero-bubble: a forward pass waits for the last input-gradient (B) and weight-gradient (W) passes before it
    zero_bubble = Schedule("zero_bubble", stages=2, micro_batches=4)
    assert zero_bubble.waits_for(0, 3) == (("B", 0, 1), ("W", 0, 0))
    assert "F: forward, B: input gradient, W: weight gradient" in str(zero_bubble)


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("stages, micro_batches", [(4, 8), (2, 4), (4, 16), (2, 2)])
def test_the_bubble_is_read_from_the_timeline(kind, stages, micro_batches):
    """The idle fraction of the drawn timeline: (K - 1) / (M + K - 1) for GPipe and 1F1B (3/11 at K=4, M=8), v times
    smaller in passes of 1/v of a stage when interleaved, and (K - 1) / (3M + K - 1) for zero-bubble (F, B, W)."""
    schedule = Schedule(kind, stages, micro_batches)
    passes = {"interleaved": 2 * 2 * micro_batches, "zero_bubble": 3 * micro_batches}.get(kind, 2 * micro_batches)
    idle = 2 * (stages - 1) if kind != "zero_bubble" else stages - 1
    assert len(schedule.timeline()) == passes + idle  # each device runs all its passes, idle only at the ends
    assert schedule.bubble == pytest.approx(idle / (passes + idle), abs=1e-12)


def test_interleaved_and_zero_bubble_shrink_one_f_one_b_bubble():
    """The issue's figures: 1F1B at K=4, M=8 within 0.05 of 3/11; interleaved (v=2) below 0.75x of it, zero-bubble
    below 0.5x; each waits only for passes of earlier micro-batches (the order the pipeline traces them in)."""
    one_f_one_b = Schedule("1f1b", stages=4, micro_batches=8).bubble
    assert abs(one_f_one_b - 3 / 11) < 0.05
    assert Schedule("interleaved", stages=4, micro_batches=8, virtual_stages=2).bubble < 0.75 * one_f_one_b
    assert Schedule("zero_bubble", stages=4, micro_batches=8).bubble < 0.5 * one_f_one_b
    for kind, v in [("1f1b", None), ("interleaved", 2), ("interleaved", 3), ("zero_bubble", None)]:
        for stages, micro_batches in [(2, 4), (3, 6), (4, 8), (4, 12)]:
            schedule = Schedule(kind, stages, micro_batches, v)
            for chunk in range(schedule.chunks):
                for i in range(micro_batches):
                    assert all(j < i for _, _, j in schedule.waits_for(chunk, i)), (kind, v, chunk, i)
    # what each holds: 1F1B K - s; interleaved per chunk; zero-bubble keeps a micro-batch until its W
    assert Schedule("interleaved", 2, 4).most_in_flight() == [4, 3, 2, 1]
    assert Schedule("zero_bubble", 4, 8).most_in_flight() == [7, 6, 5, 4]


def test_bad_schedules_are_refused_before_training():
    with pytest.raises(
        ValueError, match=r"schedule must be one of 'gpipe', '1f1b', 'interleaved', 'zero_bubble', got '1F1B'"
    ):
        Parallel("model_parallel", devices=2, micro_batches=2, schedule="1F1B")
    with pytest.raises(ValueError, match=r"unknown option 'schedule' for strategy 'mirrored'"):
        Parallel("mirrored", devices=2, schedule="1f1b")
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
        Schedule("gpipe", 2, 0)
    with pytest.raises(ValueError, match=r"virtual_stages=2 cuts .* only schedule='interleaved' runs"):
        Parallel("model_parallel", devices=2, micro_batches=4, schedule="1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match=r"micro_batches=3 must be a multiple of 2; use micro_batches=4"):
        Parallel("model_parallel", devices=2, micro_batches=3, schedule="interleaved")
    with pytest.raises(
        ValueError, match=r"virtual_stages >= 2 .* got 1; with one chunk per device use schedule='1f1b'"
    ):
        Schedule("interleaved", 2, 4, virtual_stages=1)
    with pytest.raises(ValueError, match=r"Parallel\('auto'\) sizes pipelines of one stage per device"):
        Parallel("auto", devices=2, schedule="interleaved")
    with pytest.raises(ValueError, match=r"virtual_stages must be an int >= 1, got 'two'"):
        Parallel("model_parallel", devices=2, micro_batches=4, schedule="interleaved", virtual_stages="two")


def tagger_and_classifier() -> keras.Model:
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(50, 8)(tokens)  # a sparse gradient, summed over micro-batches
    h = keras.layers.GlobalAveragePooling1D()(h)
    h = keras.layers.Dense(32, activation="gelu")(h)
    h = keras.layers.Dropout(0.2)(h)  # each micro-batch's mask drawn as under gpipe
    h = keras.layers.Dense(32, activation="gelu")(h)
    return keras.Model(tokens, keras.layers.Dense(3)(h))


@pytest.mark.slow
def test_every_schedule_trains_like_gpipe():
    """1F1B, interleaved (v=2: 4 chunks on 2 devices) and zero-bubble: the same weights, losses and metrics as GPipe
    (Adam, 2 epochs, rtol 1e-5), 2 devices, 4 micro-batches (a last batch of 8 rows: micro-batches of 2)."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (104, 6)).astype("int32")
    y = rng.integers(0, 3, 104)
    results, described = {}, {}
    for kind in SCHEDULES:
        par = Parallel("model_parallel", devices=2, micro_batches=4, schedule=kind, seed=4)
        par.build(tagger_and_classifier, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(True))
        history = par.fit(x, y, batch_size=32, epochs=2, verbose=0)
        evaluated = par.evaluate(x, y, verbose=0)
        results[kind] = (history.history["loss"], par.model.get_weights(), keras.tree.flatten(evaluated))
        described[kind] = par.describe()
    for kind in SCHEDULES[1:]:
        np.testing.assert_allclose(results[kind][0], results["gpipe"][0], rtol=1e-5)
        for got, want in zip(results[kind][1], results["gpipe"][1]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(results[kind][2], results["gpipe"][2], rtol=1e-5)
        assert f"schedule={kind!r}" in described[kind] and str(Schedule(kind, 2, 4)) in described[kind]
    assert "most micro-batches in flight per stage: 2, 1" in described["1f1b"]
    # interleaved: 4 stages (chunks), chunk c on device c % 2
    devices = [
        line.split()[1] for line in described["interleaved"].splitlines() if line[:2] in ("0 ", "1 ", "2 ", "3 ")
    ]
    assert devices[:4] == [devices[0], devices[1], devices[0], devices[1]] and devices[0] != devices[1]


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


def gelu_stack() -> keras.Model:
    """Dense pairs (column then row splits under tensor_parallel) and a dropout: 9 units for up to 8 chunks."""
    layers = [keras.layers.Dense(24 if i % 2 == 0 else 12, activation="gelu") for i in range(8)]
    return keras.Sequential([keras.Input((12,)), *layers, keras.layers.Dropout(0.1), keras.layers.Dense(3)])


@pytest.mark.slow
def test_the_schedules_compose_with_copies_splits_remat_and_checkpoints(tmp_path):
    """Interleaved with 2 copies of the pipeline and remat, and zero-bubble with each stage's layers split over 2
    devices, train to GPipe's weights under the same layout (Adam, 2 epochs, rtol 1e-5); a checkpoint written under
    interleaved resumes under zero-bubble as if uninterrupted; each stage's figures hold what the timeline keeps."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(96, 12)).astype("float32")
    y = rng.integers(0, 3, 96)
    loss = keras.losses.SparseCategoricalCrossentropy(True)

    def trained(kind: str, **options: object) -> Parallel:
        par = Parallel("model_parallel", devices=4, micro_batches=4, schedule=kind, seed=2, **options)
        par.build(gelu_stack, optimizer="adam", loss=loss)
        par.fit(x, y, batch_size=32, epochs=2, verbose=0)
        return par

    def assert_same(got: Parallel, want: Parallel) -> None:
        for a, b in zip(got.model.get_weights(), want.model.get_weights(), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    copies = {"data_parallel": 2, "remat": True}
    interleaved = trained("interleaved", **copies)
    assert_same(interleaved, trained("gpipe", **copies))
    # 2 copies x 2 devices: 4 chunks each, chunk c on device c % 2 of its copy; each chunk holds what the timeline keeps
    assert [s.in_flight for s in interleaved.plan.stages] == Schedule("interleaved", 2, 4).most_in_flight()
    assert "schedule='interleaved'" in interleaved.describe()

    split = {"tensor_parallel": 2}
    zero_bubble = trained("zero_bubble", **split)
    assert_same(zero_bubble, trained("gpipe", **split))
    # activations until each micro-batch's B (its W is taken with it): fewer than the schedule's in flight
    assert [s.in_flight for s in zero_bubble.plan.stages] == Schedule("zero_bubble", 2, 4).held(32) == [3, 1]
    assert Schedule("zero_bubble", 2, 4).most_in_flight() == [3, 2]

    first = Parallel("model_parallel", devices=2, micro_batches=4, schedule="interleaved", seed=2)
    first.build(gelu_stack, optimizer="adam", loss=loss)
    first.fit(x, y, batch_size=32, epochs=1, verbose=0, checkpoint_dir=tmp_path)
    second = Parallel("model_parallel", devices=2, micro_batches=4, schedule="zero_bubble", seed=2)
    second.build(gelu_stack, optimizer="adam", loss=loss)
    assert second.fit(x, y, batch_size=32, epochs=2, verbose=0, checkpoint_dir=tmp_path).epoch == [1]
    straight = Parallel("model_parallel", devices=2, micro_batches=4, schedule="gpipe", seed=2)
    straight.build(gelu_stack, optimizer="adam", loss=loss)
    straight.fit(x, y, batch_size=32, epochs=2, verbose=0)
    assert_same(second, straight)
