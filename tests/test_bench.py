"""paraml bench and its harness: every backend in the table, one JSON record per variant, interleaved windows,
per-window ratios, per-device variable bytes; and benchmarks that use the public API only."""

import argparse
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from paraml import Parallel
from paraml.bench.command import compute_ratios, format_ratios
from paraml.bench.harness import (
    METRICS,
    BenchResult,
    fit_window,
    format_table,
    int_at_least,
    interleave,
    marked_results,
    paired,
    write_json,
)
from paraml.memory import variable_bytes_by_device

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))

FIELDS = {
    "label",
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
    "windows_ms",
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


def run(*command, timeout=300):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.slow
def test_bench_quick_reports_every_backend(tmp_path):
    out = tmp_path / "bench.json"
    done = run(sys.executable, "-m", "paraml", "bench", "--quick", "--steps", "3", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    for name in (
        "single@1",
        "single@1 xla",
        "keras-fit-single@1",
        "mirrored@2",
        "mirrored@2 xla",
        "keras-fit-mirrored@2",
        "handwritten-mirrored@2",
        "central_storage@2",
        "model_parallel@2 mb=4",
        "multi_worker@2",
    ):
        assert name in done.stdout
    for name in RATIOS:
        assert name in done.stdout
    assert "[bench] timed window 2/2" in done.stderr  # the progress lines
    report = json.loads(out.read_text())
    labels = [r["label"] for r in report["results"]]
    assert len(labels) == len(set(labels))
    for record in report["results"]:
        assert FIELDS <= set(record) and record["samples_per_s"] > 0
        assert record["steps_per_call"] == 4 and all(len(record["windows_ms"][m]) == 2 for m in METRICS)
    staged = next(r for r in report["results"] if r["label"] == "model_parallel@2 mb=4")
    assert staged["micro_batches"] == 4  # the value passed to Parallel
    assert RATIOS <= set(report["ratios"]) and RATIOS <= set(report["fit_call_ratios"])
    assert {"best_single_vs_keras_fit_single", "best_mirrored_vs_keras_fit_mirrored"} <= set(report["ratios"])
    assert "target" not in done.stdout and "MISSED" not in done.stdout  # no internal goals in a user's table


def test_bench_rejects_bad_counts():
    done = run(sys.executable, "-m", "paraml", "bench", "--steps", "0", timeout=60)
    assert done.returncode == 2 and "expected an int >= 1, got '0'" in done.stderr


def model():
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(10), keras.layers.Dense(10)])  # 110 params each


def test_variable_bytes_by_device():
    mirrored = Parallel("mirrored", devices=2)
    mirrored.build(model, optimizer="sgd", loss="mse")
    assert variable_bytes_by_device(mirrored.model.weights) == {"/device:CPU:0": 880, "/device:CPU:1": 880}
    staged = Parallel("model_parallel", devices=2, partition="even")
    staged.build(model, optimizer="sgd", loss="mse")
    assert variable_bytes_by_device(staged.model.weights) == {"/device:CPU:0": 440, "/device:CPU:1": 440}


def test_interleave_rotates_the_order_and_records_every_window():
    calls = []

    def variant(name):
        def window():
            calls.append(name)
            return {"value": float(len(calls))}

        return window

    messages = []
    series = interleave({n: variant(n) for n in "ABC"}, 3, progress=messages.append, show="value")
    assert "".join(calls) == "ABCBCACAB"  # no variant always first, none always after the same neighbour
    assert series["A"]["value"] == [1.0, 6.0, 8.0]
    assert all(len(series[n]["wall_s"]) == len(series[n]["cpu_s"]) == 3 for n in "ABC")
    assert messages[0] == "timed window 1/3 of 3 variants, interleaved" and "A 1.00" in messages[1]
    with pytest.raises(ValueError, match="windows must be an int >= 1"):
        interleave({"A": variant("A")}, 0)


def test_paired_is_the_median_of_per_window_ratios():
    assert paired([2.0, 9.0, 3.0], [1.0, 3.0, 1.0]) == 3.0  # ratios 2, 3, 3; the ratio of medians would be 1.5
    with pytest.raises(ValueError):
        paired([1.0, 2.0], [1.0])


def result(label, step, call):
    backend, rest = label.split("@")
    return BenchResult(
        label,
        backend,
        int(rest.split()[0]),
        xla=label.endswith("xla"),
        windows_ms={"step_ms": step, "fit_call_ms": call},
    )


def test_compute_ratios_pairs_windows_and_takes_the_best_variant():
    results = [
        result("single@1", [2.0, 4.0, 6.0], [4.0, 4.0, 4.0]),
        result("single@1 xla", [1.0, 2.0, 3.0], [8.0, 8.0, 8.0]),
        result("keras-fit-single@1", [1.0, 2.0, 3.0], [4.0, 4.0, 4.0]),
    ]
    steady = compute_ratios(results, metric="step_ms")
    assert steady == {
        "single_vs_keras_fit_single": 2.0,
        "single_xla_vs_keras_fit_single": 1.0,
        "xla_vs_no_xla_single@1": 0.5,
        "best_single_vs_keras_fit_single": 1.0,
    }
    call = compute_ratios(results, metric="fit_call_ms")
    assert call["best_single_vs_keras_fit_single"] == 1.0 and call["xla_vs_no_xla_single@1"] == 2.0
    text = format_ratios({"ratios": steady, "fit_call_ratios": call})
    assert "single_vs_keras_fit_single" in text and "2.000" in text


def test_fit_window_times_the_steady_state_and_the_whole_call():
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    net.compile("sgd", "mse")
    x, y = np.zeros((12, 4), "float32"), np.zeros((12, 2), "float32")
    window = fit_window(lambda callbacks: net.fit(x, y, batch_size=3, verbose=0, callbacks=callbacks), 4)
    measured = window()
    assert set(measured) == set(METRICS) and all(value > 0 for value in measured.values())
    short = fit_window(lambda callbacks: net.fit(x[:3], y[:3], batch_size=3, verbose=0, callbacks=callbacks), 2)
    with pytest.raises(RuntimeError, match="needs at least 2"):
        short()
    with pytest.raises(ValueError, match="steps_per_call must be an int >= 2"):
        fit_window(lambda callbacks: None, 1)


def test_format_table_plain_and_markdown():
    rows = [["a", 1.5, None], ["bb", "x", 3]]
    assert format_table(rows, ["name", "v", "w"]).splitlines() == [
        "name     v  w",
        "----  ----  -",
        "a     1.50  -",
        "bb       x  3",
    ]
    assert format_table(rows, ["name", "v", "w"], markdown=True).splitlines()[:3] == [
        "| name | v | w |",
        "|---|---|---|",
        "| a | 1.50 | - |",
    ]


def test_json_is_written_once_and_found_again(tmp_path, capsys):
    record = {"result": BenchResult("single@1", "single", 1, step_ms=2.5)}
    line = write_json(record, tmp_path / "out.json")
    assert json.loads((tmp_path / "out.json").read_text()) == json.loads(line)
    printed = capsys.readouterr().out
    assert marked_results(printed, "JSON ")[0]["result"]["step_ms"] == 2.5


def test_int_at_least():
    assert int_at_least(0)("0") == 0
    for text in ("0", "x", "-3"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected an int >= 1"):
            int_at_least(1)(text)


def test_bench_and_cli_do_not_import_each_other():
    code = (
        "import sys, paraml.bench.command, paraml.bench.loading\n"
        "assert 'paraml.cli' not in sys.modules, 'bench imports cli'\n"
        "assert 'tensorflow' not in sys.modules, 'importing bench loads TensorFlow'\n"
    )
    done = run(sys.executable, "-c", code, timeout=60)
    assert done.returncode == 0, done.stderr


def private_uses(path):
    """What a file reaches for beyond paraml's public API: ``x._name``, ``x.backend``, ``from m import _name``,
    paraml's internal modules (``backends``, ``training``) and ``getattr`` of such names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            if node.attr == "backend" or (node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom):
            if {"backends", "training"} & set((node.module or "").split(".")):
                found.append(f"line {node.lineno}: from {node.module}")
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr"):
            name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else ""
            if name in ("backend", "micro_batches") or name.startswith("_"):
                found.append(f"line {node.lineno}: {node.func.id}(..., {name!r})")
    return found


@pytest.mark.parametrize(
    "path", [*SCRIPTS, ROOT / "src/paraml/bench/command.py", ROOT / "src/paraml/bench/harness.py"], ids=lambda p: p.name
)
def test_benchmarks_measure_through_the_public_api(path):
    assert private_uses(path) == [], f"{path.name} reaches into paraml's internals"


def test_the_public_api_check_finds_private_uses(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from paraml.loop.training import Feed\nfrom paraml.bench.command import _record\npar._trainer.x = 1\n"
        "getattr(par.backend, 'micro_batches', None)\ngetattr(par, 'backend')\n"
    )
    assert len(private_uses(bad)) == 6  # the module, _record, ._trainer, .backend, 'micro_batches', 'backend'


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_scripts_start(path):
    done = run(sys.executable, str(path), "--help", timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:")
