"""Parallel("auto")'s choices (issue 32, item 5): pipelines with 1F1B or recompute before refusing, every figure it
tried in explain(), and refusals that name the devices it was given.

The model: four GELU layers of 128 (GELU keeps several tensors of its output's size, recomputed it keeps its input),
SGD, a global batch of 64 on 2 devices. Its estimates, which the memories below sit between:

    mirrored (a replica's 32 rows)                                     ~682 KiB
    mirrored with remat=True (and shard_optimizer=True)                ~422 KiB
    mirrored with shard_parameters=True                                ~404 KiB
    2-stage pipeline (64 rows)                                         ~517 KiB
    2-stage pipeline, 1f1b x 4 micro-batches (16 rows a micro-batch)   ~324 KiB

(a recomputing stage's figure includes its largest unit's own activations, live while that unit recomputes).
"""

import re

import keras
import numpy as np
import pytest

from paraml import Parallel

BATCH = 64


def gelu_mlp() -> keras.Model:
    layers = [keras.layers.Dense(128, activation="gelu") for _ in range(4)]
    return keras.Sequential([keras.Input((32,)), *layers, keras.layers.Dense(2)])


def figures(text: str) -> dict[str, tuple[float, str]]:
    """The figures explain() (or a refusal) lists: layout -> (KiB, "fits" or "does not fit")."""
    listed = text.split("vs device memory ")[1].split("): ", 1)[1]
    found = re.findall(r"(?:, )?(.+?) (\d+\.\d\d) KiB \((fits|does not fit)\)", listed)
    return {layout: (float(kib), verdict) for layout, kib, verdict in found}


def train(name: str, devices: int | None = None, **options):
    x = np.random.default_rng(0).normal(size=(128, 32)).astype("float32")
    y = np.random.default_rng(1).normal(size=(128, 2)).astype("float32")
    par = Parallel(name, devices=devices, seed=5, **options)
    par.build(gelu_mlp, optimizer="sgd", loss="mse")
    initial = par.model.get_weights()
    par.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    return par, initial


@pytest.fixture(scope="module")
def reference():
    return train("single")


def assert_trains_like_single(par, initial, reference):
    reference_par, reference_initial = reference
    weights = par.model.get_weights()
    assert any(not np.allclose(a, b) for a, b in zip(initial, weights))  # it trained
    for got, want in zip(initial + weights, reference_initial + reference_par.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_1f1b_pipeline_where_no_replica_and_no_plain_pipeline_fits(reference):
    par, initial = train("auto", 2, device_memory="330KiB", batch_size=BATCH)
    text = par.explain()
    assert par.strategy == "model_parallel" and not par.remat, text
    assert (par.backend.micro_batches, par.backend.schedule.kind) == (4, "1f1b")
    assert par.backend.topology.layout.stages == 2
    tried = figures(text)
    mirrored = [v for k, v in tried.items() if k.startswith("mirrored")]
    assert len(mirrored) == 5 and all(verdict == "does not fit" for _, verdict in mirrored), tried  # and its savings
    assert tried["2-stage pipeline (64 rows a micro-batch)"][1] == "does not fit", tried
    kib, verdict = tried["2-stage pipeline with schedule='1f1b' x 4 micro-batches (16 rows a micro-batch)"]
    assert verdict == "fits" and kib <= 330, tried
    assert ", with schedule='1f1b' and micro_batches=4 (a pipeline as it is does not fit)" in text, text
    # model_parallel planned its stages for the global batch under the schedule: its largest stage is auto's figure
    assert par.backend.batch_size == BATCH
    assert par.plan.partition.largest_stage_bytes / 1024 == pytest.approx(kib, abs=0.005)
    assert_trains_like_single(par, initial, reference)


def test_a_recomputing_1f1b_pipeline_auto_chose_trains_like_single(reference):
    """Between the 1F1B pipeline's figure (~324 KiB) and the recomputing one's (~308 KiB): auto turns remat on in a
    2-stage 1F1B pipeline, and that pipeline trains to single's weights."""
    par, initial = train("auto", 2, device_memory="315KiB", batch_size=BATCH)
    text = par.explain()
    assert par.strategy == "model_parallel" and par.remat, text
    assert (par.backend.micro_batches, par.backend.schedule.kind) == (4, "1f1b")
    assert "with remat=True and schedule='1f1b' and micro_batches=4" in text, text
    assert par.plan.remat and par.plan.partition.largest_stage_bytes <= 315 * 1024
    assert_trains_like_single(par, initial, reference)


def test_micro_batches_1_keeps_auto_from_trying_1f1b():
    with pytest.raises(ValueError, match="found no layout that fits the 2 device") as refused:
        Parallel("auto", devices=2, device_memory="300KiB", batch_size=BATCH, micro_batches=1).build(
            gelu_mlp, optimizer="sgd", loss="mse"
        )
    tried = figures(str(refused.value))
    assert "2-stage pipeline with remat=True (64 rows a micro-batch)" in tried, tried  # remat pipelines are tried
    assert not any("1f1b" in layout for layout in tried), tried  # the user allowed no micro-batches


@pytest.mark.parametrize("devices, memory", [(2, "200KiB"), (4, "100KiB")])
def test_when_nothing_fits_auto_refuses_naming_the_devices_it_was_given(devices, memory):
    par = Parallel("auto", devices=devices, device_memory=memory, batch_size=BATCH)
    with pytest.raises(ValueError) as refused:
        par.build(gelu_mlp, optimizer="sgd", loss="mse")
    text = str(refused.value)
    names = ", ".join(f"/device:CPU:{i}" for i in range(devices))
    assert f"found no layout that fits the {devices} device(s) it was given ({names}), with {memory[:3]}.00 KiB" in text
    assert "give more devices, a larger device_memory" in text and "smaller global batch (now batch_size=64)" in text
    other = {2, 4} - {devices}
    assert not re.search(rf"\b{other.pop()} device", text), text  # no other device count
    tried = figures(text)
    assert tried and all(verdict == "does not fit" for _, verdict in tried.values()), tried
    assert any(layout.startswith("mirrored") for layout in tried) and any("remat=True" in k for k in tried), tried
    assert any("1f1b" in layout and "pipeline" in layout for layout in tried), tried


def test_one_device_too_small_is_refused_and_named():
    par = Parallel("auto", devices=1, device_memory="100KiB", batch_size=BATCH)
    with pytest.raises(ValueError, match=r"the 1 device\(s\) it was given \(/device:CPU:0\), with 100.00 KiB each"):
        par.build(gelu_mlp, optimizer="sgd", loss="mse")


def test_a_model_that_fits_lists_its_one_figure():
    par = Parallel("auto", devices=2, device_memory="1MiB", batch_size=BATCH)
    par.build(gelu_mlp, optimizer="sgd", loss="mse")
    assert par.strategy == "mirrored" and not par.remat
    tried = figures(par.explain())
    assert list(tried) == ["mirrored (a replica's 32 rows)"] and tried["mirrored (a replica's 32 rows)"][1] == "fits"
