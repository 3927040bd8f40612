"""Optimizer state sharded over the replicas (ZeRO stage 1): ``shard_optimizer=True`` under ``mirrored`` and
``multi_worker``.

Under data parallelism every device holds a copy of every variable and of every optimizer slot (Adam's two moments:
8 of the 16 bytes per fp32 parameter). Here each trainable variable gets one **owner** replica (owners balanced by
bytes, largest variables first, :func:`paraml.planning.footprint.owners`; the replicas of every worker, worker after
worker), its slots live only there, and only the owner runs the optimizer's update for it. The new values then reach
every replica: on one machine an assignment to the mirrored variable (a broadcast); across workers one all-gather of
the values each replica updated. Gradients are all-reduced as before, so one machine communicates as plain data
parallelism does, and several workers 1.5 times as much (an all-reduce and an all-gather).

The optimizer is the user's Keras optimizer class, subclassed at run time (:func:`sharded_optimizer`) in two places
only: where a slot is created (on its owner, as a plain variable; on another worker, as an empty placeholder that
keeps the slots' positions) and where Keras' TensorFlow optimizer hands each variable to the strategy for its update.
Everything else is Keras' own code: the update rule (Adam, AdamW's weight decay, momentum, Nesterov...), the
learning-rate schedule, clipping, a ``LossScaleOptimizer`` around it, sparse (``IndexedSlices``) gradients. So the
weights equal unsharded training.

Checkpoints hold every slot whole, by position, as for any optimizer: :func:`whole_state` gathers the other workers'
slots for a save (into every worker's host memory, for the save's duration) and :func:`restorable_state` leaves them
out of a restore, so a sharded run restores on any backend, device count or sharding, and the other way round.

Importing this module is cheap; TensorFlow is imported when an optimizer is sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paraml.internals import (
    DISTRIBUTED_UPDATE_STEP,
    distributed_update_step,
    has_distributed_update_step,
    optimizer_strategy,
    resource_variable,
)
from paraml.planning.footprint import owners

if TYPE_CHECKING:  # pragma: no cover
    import keras

__all__ = ["ShardedSlots", "restorable_state", "sharded_optimizer", "whole_state"]


@dataclass(frozen=True)
class _Slot:
    """A sharded slot's whole shape and dtype, the replica that owns it (global index), and whether this worker
    holds it (else it is an empty placeholder)."""

    shape: tuple[int, ...]
    dtype: str
    owner: int
    here: bool


class ShardedSlots:
    """Which of a sharded optimizer's variables are sharded slots, and where each lives (kept by the applied plan,
    not as attributes on the optimizer's variables). Entries hold the slots they are keyed by."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Any, _Slot]] = {}

    def record(self, slot: Any, where: _Slot) -> None:
        self._by_id[id(slot)] = (slot, where)

    def of(self, optimizer: Any) -> list[_Slot | None]:
        """Where each of ``optimizer.variables`` lives; None for a variable that is not a sharded slot."""
        found: list[_Slot | None] = []
        for v in optimizer.variables:
            entry = self._by_id.get(id(v))
            found.append(entry[1] if entry is not None and entry[0] is v else None)
        return found


def _plain_variable_on(device: str) -> Callable[..., Any]:
    """A variable creator that makes a plain (not mirrored) variable on ``device``, inside a strategy's scope."""
    import tensorflow as tf

    def create(next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        del next_creator
        for mirrored_only in ("colocate_with", "use_resource", "experimental_batch_ndims"):
            kwargs.pop(mirrored_only, None)
        with tf.device(device):
            return resource_variable(**kwargs)  # the strategy's creator bypassed

    return create


def _all_gather(
    strategy: Any,
    parts: Sequence[Sequence[tuple[int, tuple[int, ...]]]],
    read: Callable[[int, int], Any],
    dtype: Any,
) -> dict[int, Any]:
    """Every replica's tensors, whole on every replica, by key. ``parts[r]`` names (key, shape) of what replica ``r``
    (global index) holds; ``read(r, key)`` reads one of this worker's.

    One all-gather per round: round k gathers the k-th largest tensor of each replica, flattened and padded to the
    round's largest, so a round holds at most replicas x one tensor beyond the variables (one gather of everything
    would hold the whole state again).
    """
    import tensorflow as tf

    def size(shape: tuple[int, ...]) -> int:
        return int(tf.TensorShape(shape).num_elements())

    ordered = [sorted(part, key=lambda item: -size(item[1])) for part in parts]
    whole = {}
    for k in range(max(len(part) for part in ordered)):
        held = [part[k] if k < len(part) else None for part in ordered]
        longest = max(size(item[1]) if item else 0 for item in held)

        def padded(context: Any, held: Any = held, longest: int = longest) -> Any:
            item = held[context.replica_id_in_sync_group]
            flat = tf.reshape(read(context.replica_id_in_sync_group, item[0]), [-1]) if item else tf.zeros([0], dtype)
            short = longest - (size(item[1]) if item else 0)
            return tf.pad(flat, [[0, short]]) if short else flat

        gathered = strategy.gather(strategy.experimental_distribute_values_from_function(padded), axis=0)
        for r, item in enumerate(held):
            if item is not None:
                key, shape = item
                whole[key] = tf.reshape(gathered[r * longest : r * longest + size(shape)], shape)
    return whole


def sharded_optimizer(
    optimizer: keras.optimizers.Optimizer,
    variables: Sequence[Any],
    devices: Sequence[str],
    slots: ShardedSlots,
    *,
    num_workers: int = 1,
    worker_index: int = 0,
) -> keras.optimizers.Optimizer:
    """A copy of ``optimizer`` (created in the strategy's scope, like the original) whose slots for ``variables``
    live on their owners among the replicas, and whose updates run there; each slot it makes is recorded in
    ``slots``.

    ``devices`` are this worker's replicas (the strategy's, in its order); each of the ``num_workers`` workers has as
    many, and this one is ``worker_index``.

    Raises:
        ValueError: for an optimizer Keras' TensorFlow backend does not step through its strategy (it has no
            per-variable update to place).
    """
    import tensorflow as tf

    base = type(optimizer)
    if not has_distributed_update_step(base):
        raise ValueError(
            f"shard_optimizer=True cannot shard {base.__name__}: it does not update its variables one by one "
            "through the strategy as Keras' TensorFlow optimizers do; use shard_optimizer=False"
        )
    local = len(devices)
    first = worker_index * local  # this worker's first replica, globally
    replicas = num_workers * local
    sizes = [int(v.value.shape.num_elements()) * v.value.dtype.size for v in variables]
    owner_of = {id(v.value): r for v, r in zip(variables, owners(sizes, replicas))}

    def add_variable_from_reference(self: Any, reference_variable: Any, *args: Any, **kwargs: Any) -> Any:
        owner = owner_of.get(id(getattr(reference_variable, "value", reference_variable)))
        # EMA's averages (`use_ema=True`, named "average") are updated by every replica outside the per-variable
        # update: one copy on its owner would be updated once per replica. They stay as Keras makes them.
        if owner is None or kwargs.get("name", args[0] if args else None) == "average":
            return base.add_variable_from_reference(self, reference_variable, *args, **kwargs)
        here = first <= owner < first + local
        with tf.variable_creator_scope(_plain_variable_on(devices[owner - first if here else 0])):
            if here:
                slot = base.add_variable_from_reference(self, reference_variable, *args, **kwargs)
            else:  # another worker's: nothing but a place in the optimizer's list
                name = kwargs.get("name", args[0] if args else None)
                slot = self.add_variable((0,), dtype=reference_variable.dtype, name=name)
        slots.record(slot, _Slot(tuple(reference_variable.shape), reference_variable.dtype, owner, here))
        return slot

    def _distributed_tf_update_step(self: Any, distribution: Any, grads_and_vars: Any, learning_rate: Any) -> None:
        updated = []  # (mirrored variable, owner)
        for grad, var in grads_and_vars:
            owner = owner_of.get(id(var))
            if owner is None:
                distributed_update_step(base)(self, distribution, [(grad, var)], learning_rate)
                continue
            if first <= owner < first + local:
                with tf.device(devices[owner - first]):
                    grads = distribution.experimental_local_results(grad)
                    self.update_step(grads[owner - first], var.values[owner - first], learning_rate)
            updated.append((var, owner))
        if num_workers == 1:
            for var, owner in updated:  # every replica gets the owner's result
                with tf.device(devices[owner]):
                    value = tf.identity(var.values[owner])
                var.assign(value)
            return
        for dtype in sorted({var.dtype for var, _ in updated}, key=str):
            parts = [
                [(i, tuple(var.shape)) for i, (var, o) in enumerate(updated) if o == r and var.dtype == dtype]
                for r in range(replicas)
            ]
            whole = _all_gather(distribution, parts, lambda r, i: updated[i][0].values[r - first], dtype)
            for i, value in whole.items():
                updated[i][0].assign(value)

    sharded = type(
        base.__name__,
        (base,),
        {
            "add_variable_from_reference": add_variable_from_reference,
            DISTRIBUTED_UPDATE_STEP: _distributed_tf_update_step,
            "__module__": base.__module__,  # saved models name the user's class
            "__doc__": base.__doc__,
        },
    )
    return sharded.from_config(optimizer.get_config())


#: ``saved(variables)``: an optimizer's variables as a checkpoint holds them when none is sharded (a split weight's
#: slots joined, :meth:`paraml.parallelism.tensor_parallel.SplitWeights.saved_state`).
Saved = Callable[[Sequence[Any]], list[Any]]


def whole_state(optimizer: keras.optimizers.Optimizer, sharded: ShardedSlots, saved: Saved) -> list[Any]:
    """``optimizer.variables`` as a checkpoint stores them: each slot whole.

    A slot held by another worker (``multi_worker`` with ``shard_optimizer=True``) is gathered from it into a
    temporary variable on the host: every worker must call this together (it is a collective).
    """
    variables, slots = optimizer.variables, sharded.of(optimizer)
    if all(s is None for s in slots):
        return saved(variables)
    values = [v.value for v in variables]
    strategy = optimizer_strategy(optimizer)
    replicas = int(strategy.num_replicas_in_sync)
    if replicas == len(strategy.extended.worker_devices):
        return values  # one worker holds every slot (the same answer on every worker: no one gathers)
    import tensorflow as tf

    for dtype in sorted({s.dtype for s in slots if s is not None}, key=str):
        parts = [
            [(i, s.shape) for i, s in enumerate(slots) if s is not None and s.owner == r and s.dtype == dtype]
            for r in range(replicas)
        ]
        whole = _all_gather(strategy, parts, lambda r, i: variables[i].value, dtype)
        with tf.device("/device:CPU:0"):
            for i, value in whole.items():
                values[i] = tf.Variable(value, trainable=False)
    return values


def restorable_state(
    optimizer: keras.optimizers.Optimizer, sharded: ShardedSlots, saved: Saved
) -> list[tuple[Any | None, tuple[int, ...]]]:
    """Each of ``optimizer.variables`` as a restore fills it, by position: the variable (None where the slot is
    another worker's) and its whole shape."""
    slots = sharded.of(optimizer)
    if all(s is None for s in slots):
        return [(value, tuple(value.shape)) for value in saved(optimizer.variables)]
    return [
        (v.value, tuple(v.shape)) if s is None else (v.value if s.here else None, s.shape)
        for v, s in zip(optimizer.variables, slots)
    ]
