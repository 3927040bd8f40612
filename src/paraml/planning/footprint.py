"""The one byte formula: what one device holds of a model's state under a plan's splits and sharding.

Every place that decides from bytes per device counts them here: :func:`paraml.memory.estimate_memory` (the
parameters, gradients and optimizer slots of the device holding most), the ``model_parallel`` placement (each unit's
parameters on a stage's device, checked against the device's memory) and ``auto`` (which layout fits). So the three
agree by construction:

- a variable **split** over ``parts`` devices along an axis of ``length`` rows is made as parts of
  :func:`part_sizes` rows (the placement makes them so), and the device holding most keeps the largest
  (:func:`part_bytes`);
- a variable's optimizer slots **sharded** over ``shards`` replicas (ZeRO-1): each variable's slots live on one
  owner, owners balanced by bytes, largest first (:func:`owners`); the device holding most keeps its owner's load
  (:func:`largest_owner_share`).

Plain Python: importing it loads no TensorFlow.

Example:
    >>> part_bytes(nbytes=40, length=10, parts=4)  # 10 rows of 4 bytes over 4 devices: parts of 3, 3, 2, 2 rows
    12
    >>> owners([400, 100, 300, 200], 2), largest_owner_share([400, 100, 300, 200], 2)
    ([0, 0, 1, 1], 0.5)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from paraml.planning.sizes import nbytes

__all__ = ["held_bytes", "largest_owner_share", "owners", "part_bytes", "part_sizes"]


def part_sizes(size: int, parts: int) -> list[int]:
    """``size`` rows shared by ``parts`` devices, the first ``size % parts`` taking one more.

    >>> part_sizes(10, 4)
    [3, 3, 2, 2]
    """
    return [size // parts + (1 if k < size % parts else 0) for k in range(parts)]


def part_bytes(nbytes: int, length: int, parts: int) -> int:
    """Bytes of the largest of ``parts`` parts of a variable of ``nbytes`` bytes split along an axis of ``length``."""
    if parts <= 1 or length <= 0:
        return nbytes
    return nbytes * part_sizes(length, parts)[0] // length


def held_bytes(variables: Iterable[Any], axes: Mapping[int, int] | None = None, parts: int = 1) -> int:
    """Bytes the device holding most keeps of ``variables`` (each distinct one once): a variable whose ``id`` is in
    ``axes`` is split on that axis over ``parts`` devices (:func:`part_bytes`), the others are whole.

    Example:
        >>> import numpy as np
        >>> kernel, bias = np.zeros((8, 6), "float32"), np.zeros((6,), "float32")
        >>> held_bytes([kernel, bias]), held_bytes([kernel, bias], {id(kernel): 1}, parts=4)  # 6 columns: 2+2+1+1
        (216, 88)
    """
    seen: set[int] = set()
    total = 0
    for v in variables:
        if id(v) in seen:
            continue
        seen.add(id(v))
        axis = (axes or {}).get(id(v))
        size = nbytes(v)
        total += size if axis is None else part_bytes(size, int(v.shape[axis]), parts)
    return total


def owners(sizes: Sequence[int], num_devices: int) -> list[int]:
    """The owner device (an index) of each variable of ``sizes`` bytes: largest first, to the least loaded device.

    Example:
        >>> owners([400, 100, 300, 200], 2)
        [0, 0, 1, 1]
    """
    load = [0] * num_devices
    found = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        device = load.index(min(load))
        found[i] = device
        load[device] += sizes[i]
    return found


def largest_owner_share(sizes: Sequence[int], shards: int) -> float:
    """The share of ``sum(sizes)`` the most loaded of ``shards`` owners holds when each variable goes to one owner
    (:func:`owners`): the part of the optimizer slots the device holding most keeps under ZeRO-1. 1.0 for one
    shard or nothing to share."""
    total = sum(sizes)
    if shards <= 1 or total <= 0:
        return 1.0
    load = [0] * shards
    for size, device in zip(sizes, owners(sizes, shards)):
        load[device] += size
    return max(load) / total
