"""One byte formula per device: what ``estimate_memory``, the ``model_parallel`` placement and ``auto`` count for a
split or sharded model agrees with where the built model's variables actually live."""

import keras
import numpy as np

import paraml
from paraml import Parallel
from paraml.memory import memory_by_device, variable_bytes_by_device
from paraml.planning.footprint import held_bytes, largest_owner_share, part_bytes


def uneven_block() -> keras.Model:
    """Widths that do not divide by 2 or 3 (the parts differ), a layer left whole, and an embedding."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(31, 10)(tokens)
    x = keras.layers.Dense(33, activation="gelu")(x)
    x = keras.layers.Dense(10)(x)
    x = keras.layers.LayerNormalization()(x)
    return keras.Model(tokens, keras.layers.Dense(7)(x))


def test_part_bytes_is_the_largest_part_the_placement_makes() -> None:
    from paraml.parallelism.tensor_parallel import part_sizes

    for length in (1, 7, 33, 64):
        for parts in (1, 2, 3, 4):
            if parts > length:
                continue
            largest = max(part_sizes(length, parts))
            assert part_bytes(4 * length, length, parts) == 4 * largest, (length, parts)
    assert held_bytes([np.zeros((3, 5), "float32")] * 2) == 60  # a variable listed twice counts once
    assert largest_owner_share([400, 100, 300, 200], 2) == 0.5
    assert largest_owner_share([900, 100], 2) == 0.9 and largest_owner_share([1], 1) == 1.0


def test_estimate_placement_and_the_built_model_agree_on_a_split_device() -> None:
    par = Parallel("model_parallel", devices=2, tensor_parallel=2)  # one stage over two tensor shards
    par.build(uneven_block, optimizer="adam", loss="mse")
    measured = memory_by_device(par.model)  # from where the variables live
    largest = max(entry["parameters"] for entry in measured.values())
    smallest = min(entry["parameters"] for entry in measured.values())
    assert smallest < largest  # the whole layers and the longer parts are on the first device

    estimated = paraml.estimate_memory(uneven_block(), tensor_parallel=2, optimizer="adam")
    (stage,) = par.plan.stages
    assert estimated.parameters == largest, (estimated.parameters, measured)
    assert stage.param_bytes == largest, (stage.param_bytes, measured)
    # the gradients are those of the trainable parameters the device holds (every weight here is trainable)
    assert estimated.gradients == largest


def test_estimated_sharded_slots_are_the_most_loaded_devices_slots() -> None:
    par = Parallel("mirrored", devices=2, shard_optimizer=True)
    model = par.build(uneven_block, optimizer="adam", loss="mse")
    x = np.random.default_rng(0).integers(0, 31, (8, 6)).astype("int32")
    par.fit(x, np.zeros((8, 6, 7), "float32"), batch_size=8, epochs=1, verbose=0)  # the slots are made
    optimizer = model.optimizer
    scalars = {id(v) for v in optimizer.variables if len(v.shape) == 0}  # iteration, learning rate: on every device
    slots = variable_bytes_by_device([v for v in optimizer.variables if id(v) not in scalars])
    most = max(slots.values())

    estimated = paraml.estimate_memory(uneven_block(), optimizer="adam", optimizer_shards=2)
    assert estimated.optimizer_slots == most, (estimated.optimizer_slots, slots)
