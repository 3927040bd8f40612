"""Sharded checkpoints: in a cluster, each worker writes the tensors it owns; a small index says where each one is.

Layout of a sharded checkpoint folder (beside the single-file ``ckpt.*`` of one process)::

    ckpt-000003/index.json            where training stood, the optimizer, the layout, and per tensor: its shard,
                                      shape and dtype (written by the chief once every shard is complete)
    ckpt-000003/shard-00000/ckpt.*    worker 0's tensors, in TensorFlow's checkpoint format
    ckpt-000003/shard-00001/ckpt.*    worker 1's ...

Who writes what (:func:`owners`): a tensor only one worker holds (its ZeRO slot) is written by that worker, so no
worker gathers another's state; a tensor every worker holds (a replicated weight) by one of them, largest first to
the least loaded, so each writes about 1/W of the bytes. A worker marks its shard complete with a small file listing
its tensors, after flushing them; the chief waits for every worker's mark (reading files, not a collective, so it may
wait in a background thread), writes the index and renames the folder into place. A restore reads the index, then
from each shard only the tensors this worker holds.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["INDEX", "ShardIndex", "Workers", "owners", "read_index", "shard_folder", "wait_for_shards", "write_mark"]

#: The index file of a sharded checkpoint.
INDEX = "index.json"

#: How long the chief waits for the other workers' shards before it gives up (seconds).
SHARD_TIMEOUT = 600.0

_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"


@dataclass(frozen=True)
class Workers:
    """The workers of a run, as a checkpoint needs them: this one's ``index``, their ``count``, and ``gather``, the
    backend's ``across_workers`` (every worker's value of a host tensor, one row per worker: a collective)."""

    index: int
    count: int
    gather: Callable[[tf.Tensor], tf.Tensor]


def owners(held: np.ndarray, sizes: Sequence[int]) -> list[int]:
    """The worker that writes each tensor: ``held[w, i]`` says whether worker ``w`` holds tensor ``i`` (of ``sizes[i]``
    bytes). The only holder writes a tensor one worker holds; the others go, largest first, to the least loaded of
    their holders.

    Example:
        >>> owners(np.array([[1, 1, 1, 0], [1, 1, 0, 1]], bool), [400, 300, 100, 100])
        [0, 1, 0, 1]
    """
    workers, count = held.shape
    load = [0] * workers
    found = [-1] * count
    for i in range(count):
        holders = np.flatnonzero(held[:, i])
        if len(holders) == 1:
            found[i] = int(holders[0])
            load[found[i]] += sizes[i]
    for i in sorted(range(count), key=lambda i: (-sizes[i], i)):
        holders = np.flatnonzero(held[:, i])
        if found[i] < 0 and len(holders):
            found[i] = int(min(holders, key=lambda w: (load[w], w)))
            load[found[i]] += sizes[i]
    return found


def shard_folder(folder: Path, worker: int) -> Path:
    """The folder of worker ``worker``'s shard in the checkpoint (or staging) folder ``folder``."""
    return folder / f"shard-{worker:05d}"


def _mark(folder: Path, worker: int) -> Path:
    return folder / f"shard-{worker:05d}.json"


def write_mark(folder: Path, worker: int, tensors: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """Flush worker ``worker``'s shard in ``folder`` and mark it complete: a file listing its tensors (shape, dtype),
    written under a temporary name and renamed."""
    for file in shard_folder(folder, worker).iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    mark = _mark(folder, worker)
    temporary = mark.with_suffix(".tmp")
    with open(temporary, "w") as handle:
        json.dump({key: [list(shape), dtype] for key, (shape, dtype) in tensors.items()}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, mark)


def wait_for_shards(folder: Path, count: int, metadata: dict[str, Any], timeout: float = SHARD_TIMEOUT) -> None:
    """Wait until all ``count`` workers marked their shards in ``folder``, then write the index: ``metadata`` and,
    per tensor, its shard, shape and dtype.

    Raises:
        TimeoutError: naming the workers whose shards did not arrive in ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    missing = list(range(count))
    while missing:
        missing = [w for w in missing if not _mark(folder, w).is_file()]
        if missing and time.monotonic() > deadline:
            raise TimeoutError(
                f"worker(s) {missing} did not write their shard of the checkpoint in {folder} within {timeout:.0f} s "
                "(a worker stopped, or checkpoint_dir is not on storage every worker sees)"
            )
        if missing:
            time.sleep(0.05)
    tensors = {}
    for worker in range(count):
        for key, (shape, dtype) in json.loads(_mark(folder, worker).read_text()).items():
            tensors[key] = {"shard": worker, "shape": shape, "dtype": dtype}
    index = folder / INDEX
    with open(index, "w") as handle:
        json.dump({**metadata, "shards": count, "tensors": tensors}, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    for worker in range(count):  # the index says it all now
        _mark(folder, worker).unlink()


@dataclass(frozen=True)
class ShardIndex:
    """A sharded checkpoint's index: ``metadata`` (``progress``, ``optimizer_class``, ``layout``) and per tensor key
    its ``(shard, shape, dtype)``."""

    folder: Path
    metadata: dict[str, Any]
    tensors: dict[str, tuple[int, tuple[int, ...], str]]

    def reader(self, shard: int) -> Any:
        """TensorFlow's reader of shard ``shard`` (``tf.train.load_checkpoint``)."""
        return tf.train.load_checkpoint(str(shard_folder(self.folder, shard) / "ckpt"))

    def read(self, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """The stored values of ``keys``, each read from its shard only (a reader per shard read from)."""
        readers: dict[int, Any] = {}
        values = {}
        for key in keys:
            shard = self.tensors[key][0]
            if shard not in readers:
                readers[shard] = self.reader(shard)
            values[key] = readers[shard].get_tensor(key + _SUFFIX)
        return values


def read_index(folder: Path) -> ShardIndex | None:
    """The index of the sharded checkpoint in ``folder``, or None when ``folder`` holds a single-file checkpoint.

    Raises:
        ValueError: for an index that cannot be read.
    """
    path = folder / INDEX
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        tensors = {
            key: (int(entry["shard"]), tuple(int(n) for n in entry["shape"]), str(entry["dtype"]))
            for key, entry in raw.pop("tensors").items()
        }
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"checkpoint {str(folder)!r} is corrupt or truncated: its {INDEX}: {error}") from None
    return ShardIndex(folder, raw, tensors)
