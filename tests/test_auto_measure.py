"""Parallel("auto", measure=True): the layouts that fit are timed on the user's model, the fastest is chosen, and the
step times are kept in a cache that a later process reads instead of timing again."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from paraml import Parallel

SEED = 7
#: One candidate in explain(): its estimated bytes, its median step time, and whether it was chosen.
FIGURE = re.compile(r"\(([\d.]+ [KMG]?i?B)\): ([\d.]+) ms( \(the fastest: chosen\))?")


def mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(4),
        ]
    )


def build_measured(devices: int = 4) -> Parallel:
    par = Parallel("auto", devices=devices, measure=True, seed=SEED)
    par.build(mlp, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return par


def figures(text: str) -> list[tuple[float, bool]]:
    """(step time in ms, chosen) of every candidate explain() lists."""
    return [(float(ms), bool(chosen)) for _, ms, chosen in FIGURE.findall(text)]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One measured build on 4 devices with a cache of its own: the Parallel, its initial weights, explain(), the
    cache directory."""
    cache = tmp_path_factory.mktemp("cache")
    before = os.environ.get("PARAML_CACHE_DIR")
    os.environ["PARAML_CACHE_DIR"] = str(cache)
    try:
        par = build_measured()
        yield par, par.model.get_weights(), par.explain(), cache
    finally:
        if before is None:
            os.environ.pop("PARAML_CACHE_DIR", None)
        else:
            os.environ["PARAML_CACHE_DIR"] = before


def test_the_fastest_measured_layout_is_chosen_and_trains(measured):
    par, _, text, cache = measured
    timed = figures(text)
    assert len(timed) >= 2, text
    chosen = [ms for ms, is_chosen in timed if is_chosen]
    assert chosen == [min(ms for ms, _ in timed)], text
    assert text.startswith(f"chose {par.strategy}") and "(measure=True)" in text, text
    assert f"{len(timed)} candidates timed in this process" in text, text
    saved = json.loads((cache / "auto_measure.json").read_text())
    (entry,) = saved.values()
    assert [round(s * 1e3, 3) for s in entry["seconds"]] == [ms for ms, _ in timed]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(256, 32)).astype("float32"), rng.integers(0, 4, 256)
    history = par.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    assert any(not np.array_equal(a, b) for a, b in zip(par.model.get_weights(), measured[1]))


def chosen_options(par: Parallel) -> dict:
    """The options that build the layout ``par`` chose, read from its plan."""
    plan = par.plan
    if par.strategy == "model_parallel":
        return {"data_parallel": plan.layout.data, "micro_batches": plan.micro_batches, "schedule": plan.schedule.kind}
    return {"shard_optimizer": True} if plan.zero_stage == 1 else {}


def test_measuring_starts_from_the_weights_of_the_chosen_strategy_with_the_same_seed(measured):
    par, initial, _, _ = measured
    direct = Parallel(par.strategy, devices=4, seed=SEED, **chosen_options(par))
    direct.build(mlp, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for got, want in zip(initial, direct.model.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


CHILD = """
import sys
import paraml
paraml.simulate_devices(4)
sys.path.insert(0, {tests!r})
from test_auto_measure import build_measured
par = build_measured()
print(par.strategy)
print(par.explain().splitlines()[0])
"""


def test_a_new_process_reads_the_cache_and_times_nothing(measured):
    par, _, text, cache = measured
    env = dict(os.environ, PARAML_CACHE_DIR=str(cache), TF_CPP_MIN_LOG_LEVEL="3")
    child = CHILD.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    strategy, again = done.stdout.splitlines()[-2:]
    assert "no candidate was timed in this process" in again, again
    assert f"read from the cache {cache / 'auto_measure.json'}" in again
    assert figures(again) == figures(text)  # the first run's times, to the microsecond: read, not measured again
    assert strategy == par.strategy


def test_a_bad_measure_value_is_refused_before_building():
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match=rf"measure must be True or False, got {re.escape(repr(bad))}"):
            Parallel("auto", devices=4, measure=bad)


def test_one_device_times_nothing_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("PARAML_CACHE_DIR", str(tmp_path))
    par = Parallel("auto", devices=1, measure=True)
    par.build(mlp, optimizer="sgd", loss="mse")
    assert par.strategy == "single"
    assert "measure=True timed nothing: one device" in par.explain()
    assert not (tmp_path / "auto_measure.json").exists()


def test_a_corrupt_cache_is_ignored_with_a_warning_and_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("PARAML_CACHE_DIR", str(tmp_path))
    path = tmp_path / "auto_measure.json"
    path.write_text('{"half a write')
    with pytest.warns(UserWarning, match="ignoring the auto measure cache .*auto_measure.json: cannot read it"):
        par = build_measured(devices=2)
    text = par.explain()
    assert len(figures(text)) >= 2 and "candidates timed in this process" in text, text
    (entry,) = json.loads(path.read_text()).values()  # rewritten whole
    assert len(entry["seconds"]) == len(figures(text))
