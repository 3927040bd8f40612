"""``paraml.bench.explain``: one traced step split into its parts, the biggest avoidable one named."""

import argparse
import importlib.util
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from paraml import Parallel
from paraml.bench import command
from paraml.bench.explain import PARTS, explain_step


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def tiny() -> keras.Model:
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])


def deep() -> keras.Model:
    layers = [keras.layers.Dense(256, activation="relu") for _ in range(8)]
    return keras.Sequential([keras.Input((256,)), *layers, keras.layers.Dense(3)])


def rows(n: int, width: int = 8):
    rng = np.random.default_rng(0)
    return rng.random((n, width), dtype=np.float32), rng.integers(0, 3, n).astype("int32")


def assert_adds_up(explanation) -> None:
    assert list(explanation.parts) == list(PARTS)
    assert all(ms >= 0 for ms in explanation.parts.values())
    total = sum(explanation.parts.values())
    assert abs(total - explanation.step_ms) <= 0.1 * explanation.step_ms, (total, explanation.step_ms)
    # each device's span is given out once: its parts inside the span add up to the span
    inside = sum(ms for part, ms in explanation.parts.items() if part != "host")
    assert inside >= explanation.trace.span * 1e3 * 0.999


def test_a_slow_input_pipeline_is_named_the_biggest_part():
    x, y = rows(64)

    def slow(batch):
        time.sleep(0.02)  # a map that reads from a slow disk
        return batch

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    dataset = dataset.map(lambda a, b: (tf.ensure_shape(tf.numpy_function(slow, [a], tf.float32), [None, 8]), b))
    par = Parallel("single", seed=0)
    par.build(tiny, optimizer="adam", loss=loss())
    explanation = explain_step(par, dataset)
    assert_adds_up(explanation)
    assert explanation.biggest == "input" and explanation.shares()["input"] > 0.5
    assert "num_parallel_calls=tf.data.AUTOTUNE" in explanation.advice
    assert set(explanation.timeline()[0]) <= set("crtoi.") and "i" in explanation.timeline()[0]


def test_a_tiny_model_on_four_replicas_is_held_by_the_reduction_or_the_host():
    x, y = rows(64)
    par = Parallel("mirrored", devices=4, seed=0)
    par.build(tiny, optimizer="adam", loss=loss())
    explanation = explain_step(par, x, y)
    assert_adds_up(explanation)
    assert explanation.biggest in ("reduction", "host"), str(explanation)
    assert explanation.parts["reduction"] > 0  # the replicas' all-reduce is in the trace
    assert "sent per replica (all-reduce of" in explanation.predicted["reduction"]
    assert len(explanation.compute_by_device) == 4 and "waiting" in str(explanation)


def test_a_four_stage_gpipe_pipeline_is_held_by_its_bubble():
    x, y = rows(256, 256)
    par = Parallel("model_parallel", devices=4, micro_batches=4, seed=0)
    par.build(deep, optimizer="adam", loss=loss())
    explanation = explain_step(par, x, y)
    assert_adds_up(explanation)
    assert explanation.pipelined and explanation.biggest == "bubble", str(explanation)
    assert explanation.predicted["bubble"].startswith("43% of each device's time")  # (4 - 1) / (4 + 4 - 1)
    assert "micro_batches=8" in explanation.advice


def test_paraml_bench_explain_prints_the_parts_and_plots_them(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    plot = tmp_path / "step.png"
    ns = parser.parse_args(["--explain", "--strategy", "mirrored", "--devices", "4", "--batch-size", "64"])
    ns.plot = str(plot)
    assert command.run_from_args(ns) == 0
    out, err = capsys.readouterr()
    assert "one step of mirrored on 4 device(s)" in out and "host overhead" in out
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in err and not plot.exists()
    else:
        assert plot.stat().st_size > 0


def test_a_parallel_that_trained_before_is_refused_with_what_to_do():
    x, y = rows(32)
    par = Parallel("single", seed=0)
    par.build(tiny, optimizer="adam", loss=loss())
    par.fit(x, y, batch_size=32, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="build a new Parallel and trace its first steps"):
        explain_step(par, x, y)
