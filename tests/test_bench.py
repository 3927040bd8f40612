"""paraml bench: every backend in the table, one JSON record per (backend, devices), per-device variable bytes."""

import json
import os
import subprocess
import sys

import keras

from paraml import Parallel
from paraml.bench import variable_bytes_per_device

FIELDS = {
    "backend",
    "devices",
    "xla",
    "samples_per_s",
    "step_ms",
    "fit_call_ms",
    "fixed_ms",
    "first_step_s",
    "variable_bytes_per_device",
    "peak_rss_mib",
}
#: One ratio of each kind: paraml single / plain Keras (with and without XLA), mirrored / Keras fit under the same
#: strategy (with and without XLA), XLA / no XLA, and paraml / the hand-written loop.
RATIOS = {
    "single_vs_keras_fit_single",
    "single_xla_vs_keras_fit_single",
    "paraml_vs_keras_fit",
    "mirrored_xla_vs_keras_fit_mirrored",
    "xla_vs_no_xla_single@1",
    "xla_vs_no_xla_mirrored@2",
    "paraml_vs_handwritten",
}


def test_bench_quick_reports_every_backend(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(
        [sys.executable, "-m", "paraml", "bench", "--quick", "--steps", "3", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    for name in (
        "single@1",
        "single@1 xla",
        "keras-fit-single@1",
        "mirrored@2",
        "mirrored@2 xla",
        "keras-fit-mirrored@2",
        "central_storage@2",
        "model_parallel@2 mb=4",
        "multi_worker@2",
    ):
        assert name in done.stdout
    for name in RATIOS:
        assert name in done.stdout
    assert "[bench] timed window" in done.stderr  # the progress line
    report = json.loads(out.read_text())
    labels = [r["label"] for r in report["results"]]
    assert len(labels) == len(set(labels))
    for record in report["results"]:
        assert FIELDS <= set(record) and record["samples_per_s"] > 0
    assert RATIOS <= set(report["ratios"]) and RATIOS <= set(report["fit_call_ratios"])
    assert {"best_single_vs_keras_fit_single", "best_mirrored_vs_keras_fit_mirrored"} <= set(report["targets"])


def model():
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(10), keras.layers.Dense(10)])  # 110 params each


def test_variable_bytes_per_device():
    mirrored = Parallel("mirrored", devices=2)
    mirrored.build(model, optimizer="sgd", loss="mse")
    assert variable_bytes_per_device(mirrored.model.weights) == {"/device:CPU:0": 880, "/device:CPU:1": 880}
    staged = Parallel("model_parallel", devices=2, partition="even")
    staged.build(model, optimizer="sgd", loss="mse")
    assert variable_bytes_per_device(staged.model.weights) == {"/device:CPU:0": 440, "/device:CPU:1": 440}
