"""``paraml.bench.memory_trace``: each device's peak in one step, from the allocator's own events, on real steps.

Every buffer here is 256 KiB or more (the CPU allocator records no smaller one: docs/tensorflow-notes.md, note 29):
256 features of float32 at 512 rows, 256 x 256 kernels.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conftest import logits_loss  # noqa: E402

from paraml import Parallel  # noqa: E402
from paraml.bench.memory_trace import DeviceMemory, device_memory_peaks, replay  # noqa: E402
from paraml.internals import AllocatorEvent  # noqa: E402

ROWS = 512
WIDTH = 256


def mlp() -> keras.Model:
    layers = [keras.layers.Dense(WIDTH, activation="gelu", name=f"d{i}") for i in range(4)]
    return keras.Sequential([keras.Input((WIDTH,)), *layers, keras.layers.Dense(10, name="head")])


def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(ROWS, WIDTH)).astype("float32"), rng.integers(0, 10, ROWS)


def measured(strategy: str, **options: object) -> tuple[Parallel, DeviceMemory]:
    par = Parallel(strategy, seed=0, **options)
    par.build(mlp, optimizer="adam", loss=logits_loss())
    return par, device_memory_peaks(par, *batch())


@pytest.fixture(scope="module")
def one_f_one_b() -> tuple[Parallel, DeviceMemory]:
    return measured("model_parallel", devices=2, schedule="1f1b", micro_batches=2, batch_size=ROWS)


@pytest.fixture(scope="module")
def single() -> tuple[Parallel, DeviceMemory]:
    return measured("single")


def test_replaying_the_events_gives_the_allocators_own_peak(
    one_f_one_b: tuple[Parallel, DeviceMemory], single: tuple[Parallel, DeviceMemory]
) -> None:
    for par, memory in (one_f_one_b, single):
        assert memory.events > 0
        assert set(memory.allocator_peak_bytes) == set(par.devices)
        for allocator_peak in memory.allocator_peak_bytes.values():  # logical CPUs: each is the process's
            assert memory.process_peak_bytes == allocator_peak, str(memory)
        assert memory.process_peak_bytes > memory.held_before_bytes


def test_each_stages_variables_count_on_its_own_device(one_f_one_b: tuple[Parallel, DeviceMemory]) -> None:
    par, memory = one_f_one_b
    assert memory.device_names == par.devices
    assert par.plan is not None
    for stage, device in zip(par.plan.stages, memory.devices, strict=True):
        weights = sum(w.numpy().nbytes for w in par.model.weights if w.path.split("/")[-2] in stage.layers)
        assert weights == stage.param_bytes > 0
        # the parameters and Adam's two slots of the stage's layers; Adam's step and rate (a few bytes) on one device
        assert 3 * weights <= device.state_bytes <= 3 * weights + 64, (stage, device)
        assert device.buffer_peak_bytes > 0  # each stage's ops allocated buffers on its device


def test_the_devices_account_for_the_process_peak(
    one_f_one_b: tuple[Parallel, DeviceMemory], single: tuple[Parallel, DeviceMemory]
) -> None:
    for _, memory in (one_f_one_b, single):
        total = sum(device.peak_bytes for device in memory.devices)
        assert total >= memory.process_peak_bytes - memory.unattributed_bytes, str(memory)
    # One device alone: its peak and what no device accounts for are the process's peak, up to the variables too
    # small for the allocator to record (biases of 1 KiB), which the device's state counts.
    _, memory = single
    (device,) = memory.devices
    assert device.peak_bytes + memory.unattributed_bytes == pytest.approx(memory.process_peak_bytes, rel=0.01)


def test_the_table_names_each_device_and_what_is_unattributed(one_f_one_b: tuple[Parallel, DeviceMemory]) -> None:
    par, memory = one_f_one_b
    text = str(memory)
    assert all(device in text for device in par.devices)
    assert "unattributed" in text and "process peak" in text
    with pytest.raises(ValueError, match=r"'/device:GPU:7' is not one of the measured devices: /device:CPU:0"):
        memory.device("/device:GPU:7")


def test_a_parallel_that_trained_untraced_is_refused() -> None:
    par = Parallel("single", seed=0)
    par.build(mlp, optimizer="sgd", loss=logits_loss())
    par.fit(*batch(), batch_size=ROWS, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="no record of which device runs each op"):
        device_memory_peaks(par, *batch())
    with pytest.raises(ValueError, match="warmup"):
        device_memory_peaks(par, *batch(), warmup=0)


def test_replay_frees_by_address_and_keeps_unknown_nodes_apart() -> None:
    mib = 1 << 20
    allocator = "mklcpu"

    def event(t: int, freed: bool, nbytes: int, address: int, op: str, in_use: int) -> AllocatorEvent:
        return AllocatorEvent(t, allocator, freed, nbytes, address, op, in_use)

    events = [  # 10 MiB held before: 8 of variables, 2 of an earlier batch, freed at t=4
        event(1, False, 3 * mib, 100, "a", 13 * mib),
        event(2, False, 1 * mib, 200, "b", 14 * mib),
        event(3, False, 2 * mib, 300, "GatherV2", 16 * mib),  # a node of no known device
        event(4, True, 2 * mib, 999, "", 14 * mib),  # allocated before the step
        event(5, True, 3 * mib, 100, "", 11 * mib),
        event(6, False, 4 * mib, 400, "b", 15 * mib),
    ]
    memory = replay(events, {"a": "/device:CPU:0", "b": "/device:CPU:1"}, {"/device:CPU:0": 8 * mib}, ["/device:CPU:0"])
    assert memory.device_names == ("/device:CPU:0", "/device:CPU:1")
    assert [(d.state_bytes, d.buffer_peak_bytes) for d in memory.devices] == [(8 * mib, 3 * mib), (0, 5 * mib)]
    assert memory.held_before_bytes == 10 * mib
    assert memory.process_peak_bytes == 16 * mib
    assert memory.unattributed_bytes == 4 * mib  # 2 held before beyond the variables, and GatherV2's 2
    assert replay([], {}, {}).process_peak_bytes == 0


def test_one_f_one_b_stage_figures_match_each_devices_measured_peak() -> None:
    """Issue 32: with 2 stages and 8 micro-batches, each stage's figure within 20% of its device's measured peak
    (micro-batches of 256 rows x 256 features: each activation a buffer the allocator records)."""
    rows = 2048

    def deeper() -> keras.Model:
        layers = [keras.layers.Dense(WIDTH, activation="gelu") for _ in range(8)]
        return keras.Sequential([keras.Input((WIDTH,)), *layers, keras.layers.Dense(10)])

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(rows, WIDTH)).astype("float32"), rng.integers(0, 10, rows)
    par = Parallel("model_parallel", devices=2, seed=0, schedule="1f1b", micro_batches=8, batch_size=rows)
    par.build(deeper, optimizer="adam", loss=logits_loss())
    memory = device_memory_peaks(par, x, y)
    assert par.plan is not None
    for stage, device in zip(par.plan.stages, memory.devices, strict=True):
        assert 0.8 <= stage.peak_bytes / device.peak_bytes <= 1.2, str(memory)
