"""Model state sharded over the replicas (ZeRO stages 1 to 3): ``shard_optimizer=True``, ``shard_gradients=True``
and ``shard_parameters=True`` under ``mirrored`` and ``multi_worker``.

Under data parallelism every device holds a copy of every variable, of every gradient and of every optimizer slot
(Adam's two moments: 8 of the 16 bytes per fp32 parameter). Here each trainable variable gets one **owner** replica
(owners balanced by bytes, largest variables first, :func:`paraml.planning.footprint.owners`; the replicas of every
worker, worker after worker), and each stage keeps one more thing on the owner only:

1. **optimizer state** (``shard_optimizer``): the variable's slots live only on its owner, and only the owner runs
   the optimizer's update for it. The new values then reach every replica: on one machine an assignment to the
   mirrored variable (a broadcast); across workers one all-gather of the values each replica updated. Gradients are
   all-reduced as before: with the broadcast or all-gather, 1.5 times plain data parallelism's traffic.
2. **gradients** (``shard_gradients``): each gradient is reduced to its owner only, by an all-to-all (TensorFlow's
   reduce-scatter has no CPU kernel; :func:`paraml.internals.all_to_all`): each replica sends each owner its share,
   the owner sums what it receives, so no replica receives the sums of the others' gradients. Rounds of one variable
   per owner bound what is in flight. A sparse gradient (an Embedding's ``IndexedSlices``, the rows a batch touched)
   is gathered as before. Traffic: the all-to-all sends (N-1)/N of the gradients, the all-gather as much again.
3. **parameters** (``shard_parameters``): the variable itself lives only on its owner (created there by
   :func:`owned_variables`), each replica reads it where it computes with it, and the units recompute in their
   backward pass (``remat``) so that a replica's copy lives only while its unit runs, in the forward and again in
   the backward pass, and each unit's forward pass waits for the unit before it (:class:`ReadAhead`), so its
   weights are read one unit ahead instead of all at the step's start. The owner's update is the only copy: nothing
   is broadcast. (DeepSpeed frees a layer's gathered
   weights after its forward pass without recomputing; a TensorFlow gradient holds the weights its layer read.)
   Across workers a replica cannot read another process's variable: a worker holds its replicas' variables and an
   empty placeholder for each of the others, and each unit gathers its weights from their owners by collective where
   it runs (:class:`GatheredWeights`); the collective's gradient brings each owner its variables' gradients summed,
   so the update reduces nothing. The model then computes inside a step (or on every
   worker together in the strategy's scope).

The optimizer is the user's Keras optimizer class, subclassed at run time (:func:`sharded_optimizer`) where a slot is
created (on its owner, as a plain variable; on another worker, as an empty placeholder that keeps the slots'
positions), where Keras' TensorFlow optimizer all-reduces the gradients (stage 2 and 3 leave the dense ones to the
owners), where it hands each variable to the strategy for its update, and (stage 3) where AdamW decays the weights.
Under stage 3 an average of the weights (``use_ema=True``) is a slot like the others: the owner steps it right after
the variable's update, and writes it over the variable every ``ema_overwrite_frequency`` steps (Keras' own step runs
on every replica, its overwrite is a ``merge_call`` inside a ``cond``; both do nothing then). Under stages 1 and 2
the averages stay a copy per replica, as Keras makes and steps them. Everything else is Keras' own code: the update
rule (Adam, AdamW's weight decay, momentum, Nesterov...), the
learning-rate schedule, clipping, a ``LossScaleOptimizer`` around it, sparse gradients. So the weights equal
unsharded training.

Gradient accumulation keeps its running sums on the owners too from stage 2 on (:class:`OwnedSums`). The gradients'
all-reduce, the all-to-all's rounds and the return of the updated values move ``bucket_bytes`` at a time, one bucket
in flight (:mod:`paraml.parallelism.buckets`).

Checkpoints hold every slot and variable whole, by position, as for any optimizer. Across workers each worker writes
its own slots (and, under ZeRO-3, its own weights) into its shard of the checkpoint (:mod:`paraml.loop.shards`;
:func:`restorable_state` says which it holds), and a restore fills only those; :func:`whole_state` gathers the other
workers' slots only for a single-file save. So a sharded run restores on any backend, device count or sharding, and
the other way round. (Keras' own ``model.save_weights`` on one worker would write its placeholders: under ZeRO-3
across workers, save with ``par.save``.)

Importing this module is cheap; TensorFlow is imported when an optimizer is sharded.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paraml.internals import (
    ALL_REDUCE_GRADIENTS,
    DISTRIBUTED_UPDATE_STEP,
    EMA_OVERWRITE,
    EMA_UPDATE,
    WEIGHT_DECAY,
    all_to_all,
    copy_weight_decay_exclusions,
    distributed_update_step,
    has_distributed_update_step,
    optimizer_strategy,
    resource_variable,
)
from paraml.parallelism.buckets import (
    DEFAULT_BUCKET_BYTES,
    all_gather_in_buckets,
    all_reduce_in_buckets,
    publish_in_buckets,
)
from paraml.planning.footprint import owners
from paraml.planning.plan import zero_option

if TYPE_CHECKING:  # pragma: no cover
    import keras

__all__ = [
    "GatheredWeights",
    "OwnedSums",
    "ReadAhead",
    "ShardedSlots",
    "decay_weight",
    "owned_variables",
    "restorable_state",
    "sharded_optimizer",
    "whole_state",
]


@dataclass(frozen=True)
class _Slot:
    """A sharded slot's or variable's whole shape and dtype, the replica that owns it (global index), and whether this
    worker holds it (else it is an empty placeholder)."""

    shape: tuple[int, ...]
    dtype: str
    owner: int
    here: bool


class ShardedSlots:
    """Which variables are sharded (an optimizer's slots; under ZeRO-3 the trainable variables themselves), and where
    each lives (kept by the applied plan and the backend, not as attributes on the variables). Entries hold the
    variables they are keyed by."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Any, _Slot]] = {}

    def record(self, slot: Any, where: _Slot) -> None:
        self._by_id[id(slot)] = (slot, where)

    def where(self, variable: Any) -> _Slot | None:
        """Where ``variable`` (a TensorFlow variable) lives, or None when it was not recorded."""
        entry = self._by_id.get(id(variable))
        return entry[1] if entry is not None and entry[0] is variable else None

    def of(self, optimizer: Any) -> list[_Slot | None]:
        """Where each of ``optimizer.variables`` lives; None for a variable that is not a sharded slot."""
        return [self.where(v) for v in optimizer.variables]


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
    """Every replica's tensors, whole on every replica, by key, one tensor of each replica a round
    (:func:`paraml.parallelism.buckets.all_gather_in_buckets`)."""
    whole: dict[int, Any] = {}
    all_gather_in_buckets(strategy, parts, read, dtype, 0, whole.__setitem__)
    return whole


@contextmanager
def owned_variables(
    devices: Sequence[str], placed: ShardedSlots, num_workers: int = 1, worker_index: int = 0
) -> Iterator[None]:
    """While the block runs (inside the strategy's scope), each trainable variable created gets one owner among the
    replicas of every worker (the least loaded by bytes so far: a replica holds at most its share plus the largest
    variable) and is one plain variable on the owner's device, recorded in ``placed``; on the other workers it is a
    zero-size placeholder (its place among the model's weights; :class:`GatheredWeights` brings the value). Every
    other variable (BatchNorm's statistics, seeds, step counters, metrics) is made by the strategy, a copy per
    replica. ``devices`` are this worker's replicas; each of the ``num_workers`` has as many."""
    import tensorflow as tf

    first = worker_index * len(devices)
    load = [0] * (num_workers * len(devices))  # bytes per replica, global; the same on every worker

    def create(next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        if kwargs.get("trainable") is False:
            return next_creator(**kwargs)
        if callable(kwargs.get("initial_value")):  # run the initializer once, here, to know the size
            kwargs["initial_value"] = kwargs["initial_value"]()
        value = tf.convert_to_tensor(kwargs["initial_value"], dtype=kwargs.get("dtype"))
        owner = load.index(min(load))
        load[owner] += int(value.shape.num_elements()) * value.dtype.size
        here = first <= owner < first + len(devices)
        if not here:
            kwargs["initial_value"] = tf.zeros([0], value.dtype)
            kwargs.pop("shape", None)
        variable = _plain_variable_on(devices[owner - first if here else 0])(next_creator, **kwargs)
        placed.record(variable, _Slot(tuple(value.shape), value.dtype.name, owner, here))
        return variable

    with tf.variable_creator_scope(create):
        yield


class GatheredWeights:
    """ZeRO-3 across workers: a worker holds the variables its replicas own, and a zero-size placeholder for each of
    the others; each unit's ``call`` computes with its weights gathered from their owners just before, in the
    forward pass and again in the recomputed backward pass.

    One all-reduce per variable: the owner sends its value, every other replica zeros (another worker's variable is
    never read). One per variable, not one of the unit's variables joined: a slice's gradient is as large as what it
    was sliced from, and joining them (measured on 12 Dense layers of 1024 across 2 workers) put 35 MiB more on each
    worker's step peak. The gathered values stand in for the variables through ``keras.StatelessScope``; what the
    unit assigns there (Dropout's seed state, BatchNorm's statistics) is assigned to the variables afterwards, and the
    losses it adds are added to the unit. The gradient of an all-reduce is an all-reduce of the gradients: the owner
    receives its variable's gradient summed over the replicas, and the update needs no reduction.

    Every replica reads each variable of the unit (the owner all of it, the others none of it, ``[:0]``), so each
    replica's gradient reaches the collective and every replica runs the backward collective, in the same order.
    """

    def __init__(self, placed: ShardedSlots) -> None:
        self.placed = placed

    def attach(self, model: Any, units: Sequence[tuple[str, Any]]) -> None:
        """Make each of ``units`` (name, layer) of ``model`` gather its weights when called.

        Raises:
            ValueError: naming a trainable variable of the model that no unit holds, or one with a regularizer or a
                constraint (each would be read, as a placeholder, outside any unit).
        """
        held = {id(v) for _, layer in units for v in layer.trainable_variables}
        outside = [v.path for v in model.trainable_variables if id(v) not in held]
        if outside:
            raise ValueError(
                f"shard_parameters=True under 'multi_worker' gathers each unit's weights where the unit runs, but "
                f"{outside[:3]} belong to no unit (a layer that is not a keras.Model holding them): use "
                "shard_gradients=True, or hold those weights in a layer"
            )
        read_outside = [
            v.path
            for v in model.trainable_variables
            if getattr(v, "regularizer", None) is not None or getattr(v, "constraint", None) is not None
        ]
        if read_outside:
            raise ValueError(
                f"shard_parameters=True under 'multi_worker' cannot train {read_outside[:3]}: a weight's regularizer "
                "or constraint reads it outside its unit, where another worker holds it; use shard_gradients=True, "
                "or drop the kernel_regularizer/kernel_constraint"
            )
        for name, layer in units:
            layer.call = self._gathering(name, layer, layer.call)

    def _gathering(self, name: str, layer: Any, original: Callable[..., Any]) -> Callable[..., Any]:
        import keras
        import tensorflow as tf

        weights = [(v, self.placed.where(v.value)) for v in layer.trainable_variables]
        weights = [(v, where) for v, where in weights if where is not None]
        state = [v for v in layer.variables if not v.trainable]  # seed states, moving statistics

        def call(*args: Any, **kwargs: Any) -> Any:
            if not weights:
                return original(*args, **kwargs)
            if any(isinstance(t, keras.KerasTensor) for t in tf.nest.flatten((args, kwargs))):
                return original(*args, **kwargs)  # Keras' shape inference: no value is read
            if not tf.distribute.has_strategy():
                raise RuntimeError(
                    f"unit {name!r} holds weights of other workers (shard_parameters=True under 'multi_worker'): call "
                    "the model through par.fit, par.evaluate or par.predict, or on every worker together inside "
                    "par.backend.strategy.scope(), where the workers gather them"
                )
            if tf.distribute.in_cross_replica_context():  # in the scope, outside a step: a collective as well
                mapping = _gather_across(tf.distribute.get_strategy(), weights)
            else:
                mapping = _gather_from_owners(tf.distribute.get_replica_context(), weights)
            with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
                outputs = original(*args, **kwargs)
            for variable in state:  # what the unit assigned in the scope
                value = scope.get_current_value(variable)
                if value is not None:
                    variable.assign(value)
            for loss in scope.losses:
                layer.add_loss(loss)
            return outputs

        return call


def _gather_across(strategy: Any, weights: Sequence[tuple[Any, _Slot]]) -> list[tuple[Any, Any]]:
    """``(variable, its whole value)`` for ``weights`` (Keras variables, and where each lives), gathered from their
    owners in cross-replica context (every worker calls it together): one :func:`_all_gather` per dtype."""
    replicas = int(strategy.num_replicas_in_sync)
    whole: dict[int, Any] = {}
    for dtype in sorted({where.dtype for _, where in weights}):
        parts = [
            [(i, where.shape) for i, (_, where) in enumerate(weights) if where.owner == r and where.dtype == dtype]
            for r in range(replicas)
        ]
        whole.update(_all_gather(strategy, parts, lambda r, i: weights[i][0].value, dtype))
    return [(variable, whole[i]) for i, (variable, _) in enumerate(weights)]


def _gather_from_owners(context: Any, weights: Sequence[tuple[Any, _Slot]]) -> list[tuple[Any, Any]]:
    """``(variable, its whole value)`` for ``weights`` (Keras variables, and where each lives), each
    summed over the replicas in ``context`` from its owner's value and the others' zeros (an all-reduce per variable:
    no joined buffer, whose slices' gradients would each be as large as the whole)."""
    import tensorflow as tf

    replica = current_replica()
    gathered = []
    for variable, where in weights:
        n = int(tf.TensorShape(where.shape).num_elements())
        mine = n if where.owner == replica else 0
        with tf.device(variable.value.device):  # a placeholder or another replica's variable: nothing is sent
            piece = tf.reshape(variable.value, [-1])[:mine]
        whole = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.pad(piece, [[0, n - mine]]))
        gathered.append((variable, tf.reshape(whole, where.shape)))
    return gathered


class ReadAhead:
    """ZeRO-3's reads of the weights, one unit ahead of the computation: each unit's ``call`` (its forward pass)
    waits for the inputs of the unit called before it, so a replica reads (on GPUs: receives) a unit's weights from
    their owners once the unit before it can start, not all units' at the start of the step.

    Why: a variable read has no input but the variable, so TensorFlow's executor runs every read as soon as the step
    starts (measured with :func:`paraml.bench.trace.trace_step`: every owner sent all its weights in the step's first
    0.2 ms), and each replica would hold every unit's weights at once. The recomputed backward pass reads again
    after its output gradient, which ``tf.recompute_grad`` already waits for. What each replica traces is kept per
    graph (so a trace never reaches into another one's tensors) and per replica.
    """

    def __init__(self) -> None:
        self._started: weakref.WeakKeyDictionary[Any, dict[int, list[Any]]] = weakref.WeakKeyDictionary()

    def attach(self, layers: Sequence[Any]) -> None:
        """Make each of ``layers`` (units, in any order) wait for the previous unit's inputs when called."""
        for layer in layers:
            layer.call = self._waiting(layer.call)

    def _waiting(self, original: Callable[..., Any]) -> Callable[..., Any]:
        import tensorflow as tf

        def call(*args: Any, **kwargs: Any) -> Any:
            graph = tf.compat.v1.get_default_graph()
            if tf.executing_eagerly():  # an eager call reads its variables where it runs them: nothing to order
                return original(*args, **kwargs)
            started = self._started.setdefault(graph, {})
            replica = current_replica()
            previous = started.get(replica, [])
            started[replica] = [t for t in tf.nest.flatten((args, kwargs)) if isinstance(t, tf.Tensor)]
            with tf.control_dependencies(previous):
                return original(*args, **kwargs)

        return call


def decay_weight(optimizer: Any, variable: Any) -> None:
    """Decay ``variable`` (a TensorFlow variable on one device) by the optimizer's ``weight_decay`` times its learning
    rate, where it lives, as Keras' ``_apply_weight_decay`` does through a strategy's per-copy update (which runs
    under the replica's device and takes distributed variables only); nothing when it has no decay or excludes
    the variable."""
    import tensorflow as tf

    if optimizer.weight_decay is None or not getattr(optimizer, WEIGHT_DECAY[1])(variable):
        return
    with tf.device(variable.device):
        rate = tf.cast(optimizer.learning_rate, variable.dtype)
        decay = tf.cast(optimizer.weight_decay, variable.dtype)
        variable.assign_sub(variable * decay * rate)  # Keras' order of the products: the same rounding


def current_replica() -> int:
    """The index of the replica being traced, in its sync group (0 outside a replica context)."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    replica = tf.get_static_value(context.replica_id_in_sync_group) if context is not None else 0
    return int(replica or 0)


def _is_copied(variable: Any) -> bool:
    """Whether ``variable`` (a TensorFlow variable) has a copy per replica (a strategy's distributed variable)."""
    return hasattr(variable, "values")


def _variable_owners(
    variables: Sequence[Any], devices: Sequence[str], first: int, replicas: int, placed: ShardedSlots | None
) -> dict[int, int]:
    """``id(variable.value)`` -> its owner replica (global index): a plain variable's (ZeRO-3) is the one
    :func:`owned_variables` recorded in ``placed``, else the replica whose device holds it; the copied ones are
    balanced by bytes."""
    from paraml.devices import canonical_device

    local = [canonical_device(d) for d in devices]
    copied = [v for v in variables if _is_copied(v.value)]
    sizes = [int(v.value.shape.num_elements()) * v.value.dtype.size for v in copied]
    found = {id(v.value): r for v, r in zip(copied, owners(sizes, replicas))}
    for v in variables:
        if not _is_copied(v.value):
            where = placed.where(v.value) if placed is not None else None
            found[id(v.value)] = where.owner if where else first + local.index(canonical_device(v.value.device))
    return found


def _reduced_in_backward(variables: Sequence[Any], num_workers: int) -> set[int]:
    """``id(variable.value)`` of those whose gradient reaches their owner already summed over the replicas: under
    ZeRO-3 across workers, each plain variable (:class:`GatheredWeights`: the backward pass of its gather)."""
    return {id(v.value) for v in variables if not _is_copied(v.value)} if num_workers > 1 else set()


#: The most elements one gradient sends to its owner in one all-to-all round (a larger one goes in several chunks),
#: and fewer where a bucket (``bucket_bytes``) is smaller than the replicas x this: a round holds twice the replicas x
#: a chunk on each device, sent and received.
CHUNK = 2**20


def _reduce_to_owners(
    strategy: Any,
    devices: Sequence[str],
    first: int,
    replicas: int,
    grads: Sequence[tuple[Any, Any, int]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> dict[int, Any]:
    """Each of ``grads`` (a replica-local gradient of every replica, its variable, and the owner replica, global)
    summed over the replicas onto its owner, by all-to-all: ``{index in grads: sum}`` for those this worker's
    replicas own.

    One all-to-all per round and dtype: round k sends each owner its k-th chunk (at most :data:`CHUNK` elements of
    one gradient, the replicas' chunks together at most ``bucket_bytes``, flattened, padded to the round's longest),
    the last variables' first (the backward pass makes their gradients first); a round waits for the one before, so
    one round is in flight beyond the gradients.
    """
    import tensorflow as tf

    local = [strategy.experimental_local_results(grad) for grad, _, _ in grads]
    shapes = [tf.TensorShape(var.shape) for _, var, _ in grads]  # a gradient's own may be unknown in the graph
    size = [int(shape.num_elements()) for shape in shapes]
    pieces: dict[int, list[Any]] = {}
    previous: list[Any] = []
    for dtype in sorted({values[0].dtype for values in local}, key=str):
        chunk = max(1, min(CHUNK, bucket_bytes // (replicas * dtype.size)))
        chunks = [  # (gradient, start, length) per owner, in the order they are sent
            [
                (i, start, min(chunk, size[i] - start))
                for i in reversed(range(len(grads)))
                if grads[i][2] == r and local[i][0].dtype == dtype
                for start in range(0, max(size[i], 1), chunk)
            ]
            for r in range(replicas)
        ]
        for k in range(max(len(part) for part in chunks)):
            held = [part[k] if k < len(part) else None for part in chunks]
            longest = max(c[2] if c is not None else 0 for c in held)
            finished = []
            for replica, device in enumerate(devices):
                with tf.device(device), tf.control_dependencies(previous):
                    rows = []
                    for chunk in held:
                        if chunk is None:
                            rows.append(tf.zeros([longest], dtype))
                            continue
                        i, start, n = chunk
                        rows.append(tf.pad(tf.reshape(local[i][replica], [-1])[start : start + n], [[0, longest - n]]))
                    got = all_to_all(strategy, replica, tf.stack(rows))  # row s: replica s's share of mine
                    mine = held[first + replica]
                    if mine is not None:
                        piece = tf.reduce_sum(got, axis=0)[: mine[2]]
                        pieces.setdefault(mine[0], []).append(piece)
                        finished.append(piece)
                    else:
                        finished.append(got)
            previous = finished
    reduced = {}
    for i, parts in pieces.items():
        with tf.device(parts[0].device):
            reduced[i] = tf.reshape(parts[0] if len(parts) == 1 else tf.concat(parts, 0), shapes[i])
    return reduced


def _average_and_overwrite(optimizer: Any, average: Any, variable: Any) -> None:
    """Keras' step of the average of the weights (``use_ema=True``) for one variable, where both live: ``average``
    moves towards the variable's new value, and every ``ema_overwrite_frequency`` steps the variable takes the
    average (the same arithmetic as Keras' ``_update_model_variables_moving_average`` and
    ``_overwrite_model_variables_with_average_value``, so the weights equal unsharded training)."""
    import tensorflow as tf

    momentum = tf.cast(tf.not_equal(optimizer.iterations, 0), variable.dtype) * optimizer.ema_momentum
    average.assign(momentum * average + (1 - momentum) * variable)
    frequency = optimizer.ema_overwrite_frequency
    if frequency:

        def overwrite() -> None:
            variable.assign(average)

        tf.cond((optimizer.iterations + 1) % frequency == 0, overwrite, lambda: None)


def sharded_optimizer(
    optimizer: keras.optimizers.Optimizer,
    variables: Sequence[Any],
    devices: Sequence[str],
    slots: ShardedSlots,
    *,
    stage: int = 1,
    num_workers: int = 1,
    worker_index: int = 0,
    placed: ShardedSlots | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> keras.optimizers.Optimizer:
    """A copy of ``optimizer`` (created in the strategy's scope, like the original) whose slots for ``variables``
    live on their owners among the replicas, and whose updates run there; each slot it makes is recorded in
    ``slots``. ``stage`` 2 and 3 reduce each dense gradient to its owner only; under 3, ``variables`` that live on
    one device (:func:`owned_variables`) are updated there, in place, and the average of the weights of such a
    variable (``use_ema=True``) is a slot like the others: the owner steps it after the variable, and overwrites the
    variable with it every ``ema_overwrite_frequency`` steps.

    ``devices`` are this worker's replicas (the strategy's, in its order); each of the ``num_workers`` workers has as
    many, and this one is ``worker_index``. ``placed``: where :func:`owned_variables` put the ZeRO-3 variables (across
    workers their gradients arrive summed on the owners, :class:`GatheredWeights`). ``bucket_bytes``: the most each
    collective of the step moves at once, as the plan resolved it (``ParallelPlan.bucket_bytes``,
    :mod:`paraml.parallelism.buckets`).

    Raises:
        ValueError: for an optimizer Keras' TensorFlow backend does not step through its strategy (it has no
            per-variable update to place), or one that clips the gradients of variables gathered across workers (it
            clips before the reduction, which their gradients have had already).
    """
    import tensorflow as tf

    base = type(optimizer)
    if not has_distributed_update_step(base):
        raise ValueError(
            f"{zero_option(stage)}=True cannot shard {base.__name__}: it does not update its variables one by one "
            f"through the strategy as Keras' TensorFlow optimizers do; use {zero_option(stage)}=False"
        )
    local = len(devices)
    first = worker_index * local  # this worker's first replica, globally
    replicas = num_workers * local
    owner_of = _variable_owners(variables, devices, first, replicas, placed)
    in_place = {id(v.value) for v in variables if not _is_copied(v.value)}  # ZeRO-3: one copy, on its owner
    summed_already = _reduced_in_backward(variables, num_workers)
    clipping = {k: getattr(optimizer, k, None) for k in ("clipnorm", "clipvalue", "global_clipnorm")}
    if summed_already and any(v is not None for v in clipping.values()):
        raise ValueError(
            f"shard_parameters=True under 'multi_worker' cannot clip the gradients ({base.__name__} with "
            f"{ {k: v for k, v in clipping.items() if v is not None} }): Keras clips each replica's gradient before "
            "the reduction, which a gathered weight's gradient has had in the backward pass; use shard_gradients=True "
            "or no clipping"
        )
    averages: dict[int, Any] = {}  # id(variable on one device) -> its average of the weights (use_ema), on its owner

    def add_variable_from_reference(self: Any, reference_variable: Any, *args: Any, **kwargs: Any) -> Any:
        key = id(getattr(reference_variable, "value", reference_variable))
        owner, name = owner_of.get(key), kwargs.get("name", args[0] if args else None)
        # The average of the weights (use_ema) of a copied variable is a copy per replica, as Keras makes it: Keras
        # steps it on every replica, and Keras' SwapEMAWeights swaps it through the strategy, copy by copy.
        if owner is None or (name == "average" and key not in in_place):
            return base.add_variable_from_reference(self, reference_variable, *args, **kwargs)
        slot = owned_slot(self, reference_variable, key, owner, name, args, kwargs)
        if name == "average":
            averages[key] = slot
        return slot

    def owned_slot(self: Any, reference_variable: Any, key: int, owner: int, name: Any, args: Any, kwargs: Any) -> Any:
        here = first <= owner < first + local
        with tf.variable_creator_scope(_plain_variable_on(devices[owner - first if here else 0])):
            if here and key in in_place:
                # Keras' TensorFlow optimizer colocates a slot with a variable only the strategy made: Keras' own
                # slot (its shape, dtype, initializer and name) made here instead
                initializer = kwargs.get("initializer", args[1] if len(args) > 1 else "zeros")
                path = getattr(reference_variable, "path", reference_variable.name).replace("/", "_")
                slot = self.add_variable(
                    reference_variable.shape, initializer, reference_variable.dtype, name=f"{path}_{name or 'var'}"
                )
            elif here:
                slot = base.add_variable_from_reference(self, reference_variable, *args, **kwargs)
            else:  # another worker's: nothing but a place in the optimizer's list
                slot = self.add_variable((0,), dtype=reference_variable.dtype, name=name)
        slots.record(slot, _Slot(tuple(reference_variable.shape), reference_variable.dtype, owner, here))
        return slot

    def reduced_later(grad: Any, var: Any) -> bool:
        # stage 2 and 3: a dense gradient of an owned variable is reduced to its owner, in the update step
        return stage >= 2 and grad is not None and id(var) in owner_of and not isinstance(grad, tf.IndexedSlices)

    def _all_reduce_sum_gradients(self: Any, grads_and_vars: Any) -> list[Any]:
        # the dense gradients not reduced later in buckets, the sparse ones (IndexedSlices) by Keras
        grads_and_vars = list(grads_and_vars)
        context = tf.distribute.get_replica_context()
        later = [reduced_later(g, v) for g, v in grads_and_vars]
        dense = [
            not k and context is not None and g is not None and not isinstance(g, tf.IndexedSlices)
            for (g, _), k in zip(grads_and_vars, later)
        ]
        rest = [gv for gv, k, d in zip(grads_and_vars, later, dense) if not k and not d]
        now = iter(getattr(base, ALL_REDUCE_GRADIENTS)(self, rest))
        bucketed = [g for (g, _), d in zip(grads_and_vars, dense) if d]
        summed = iter(all_reduce_in_buckets(context, bucketed, bucket_bytes))
        picked = zip(grads_and_vars, later, dense)
        return [gv if k else (next(summed), gv[1]) if d else next(now) for gv, k, d in picked]

    def _apply_weight_decay(self: Any, variables: Any) -> None:
        # a variable on one device is decayed in the update step: the strategy's per-copy update takes copies only
        copied = [v for v in variables if id(getattr(v, "value", v)) not in in_place]
        getattr(base, WEIGHT_DECAY[0])(self, copied)

    def _distributed_tf_update_step(self: Any, distribution: Any, grads_and_vars: Any, learning_rate: Any) -> None:
        owned = []  # (gradient, variable, owner)
        for grad, var in grads_and_vars:
            if id(var) in owner_of:
                owned.append((grad, var, owner_of[id(var)]))
                continue
            distributed_update_step(base)(self, distribution, [(grad, var)], learning_rate)
        dense = [
            i
            for i, (g, v, _) in enumerate(owned)
            if g is not None and reduced_later(_one(distribution, g), v) and id(v) not in summed_already
        ]
        to_owners = _reduce_to_owners(distribution, devices, first, replicas, [owned[i] for i in dense], bucket_bytes)
        reduced = {dense[j]: value for j, value in to_owners.items()}
        updated = []  # (copied variable, owner)
        for i, (grad, var, owner) in enumerate(owned):
            if first <= owner < first + local:
                here = owner - first
                with tf.device(devices[here]):
                    gradient = reduced[i] if i in reduced else distribution.experimental_local_results(grad)[here]
                    target = var.values[here] if _is_copied(var) else var
                    if not _is_copied(var):
                        decay_weight(self, var)  # before the update, as Keras' own decay
                    self.update_step(gradient, target, learning_rate)
                    if id(var) in averages:
                        _average_and_overwrite(self, averages[id(var)], var)
            if _is_copied(var):
                updated.append((var, owner))
        publish_in_buckets(distribution, devices, first, replicas, num_workers, updated, bucket_bytes)

    def finalize_variable_values(self: Any, var_list: Any) -> None:
        # Keras' end of training with use_ema: each variable on one device takes its average, on its owner
        if not self.use_ema:
            return
        for var in (getattr(v, "value", v) for v in var_list):
            owner = owner_of.get(id(var))
            if id(var) in averages and owner is not None and first <= owner < first + local:
                with tf.device(devices[owner - first]):
                    var.assign(averages[id(var)])

    def stepped_in_the_update(self: Any, trainable_variables: Any) -> None:
        del self, trainable_variables  # the owners step the averages, and overwrite, in the update step

    methods: dict[str, Any] = {
        "add_variable_from_reference": add_variable_from_reference,
        ALL_REDUCE_GRADIENTS: _all_reduce_sum_gradients,
        WEIGHT_DECAY[0]: _apply_weight_decay,
        DISTRIBUTED_UPDATE_STEP: _distributed_tf_update_step,
        "__module__": base.__module__,  # saved models name the user's class
        "__doc__": base.__doc__,
    }
    if in_place:  # ZeRO-3: every trained variable on one device, its average on its owner
        methods.update(
            {
                EMA_UPDATE: stepped_in_the_update,
                EMA_OVERWRITE: stepped_in_the_update,
                "finalize_variable_values": finalize_variable_values,
            }
        )
    sharded = type(base.__name__, (base,), methods)
    made = sharded.from_config(optimizer.get_config())
    copy_weight_decay_exclusions(optimizer, made)  # not in the config
    return made


class OwnedSums:
    """Gradient accumulation under ZeRO-2 and 3: each trained variable's running sum lives on its owner replica only
    (a sum per replica would be one more whole copy of the gradients on every device).

    An accumulating step reduces each gradient to its owner, as the update does (:func:`_reduce_to_owners`), and adds
    it there; the updating step adds the sum to the owner replica's gradient only, so the update's reduction brings
    (the sum + this step's gradients) / steps to the owner, as replicated sums would. A gradient that arrives summed
    (ZeRO-3 across workers) is added as it is. Made in the strategy's scope; the owners are the sharded optimizer's
    (:func:`_variable_owners` of the same variables and ``placed``).
    """

    def __init__(
        self,
        variables: Sequence[Any],
        devices: Sequence[str],
        num_workers: int,
        worker_index: int,
        placed: ShardedSlots | None = None,
    ) -> None:
        import tensorflow as tf

        self.devices = list(devices)
        self.first = worker_index * len(devices)
        self.replicas = num_workers * len(devices)
        owner_of = _variable_owners(variables, devices, self.first, self.replicas, placed)
        self.values = [v.value for v in variables]
        self.owners = [owner_of[id(value)] for value in self.values]
        summed = _reduced_in_backward(variables, num_workers)
        self.summed = [id(value) in summed for value in self.values]  # arrives summed on its owner
        #: index of a variable this worker's replicas own -> its running sum, a plain variable on the owner's device
        self.sums: dict[int, Any] = {}
        for i, (value, owner) in enumerate(zip(self.values, self.owners)):
            if self.first <= owner < self.first + len(devices):
                with tf.variable_creator_scope(_plain_variable_on(self.devices[owner - self.first])):
                    name = "accumulated_" + value.name.split(":")[0].replace("/", "_")
                    self.sums[i] = tf.Variable(tf.zeros(value.shape, value.dtype), trainable=False, name=name)

    def accumulate(self, grads: list[Any]) -> None:
        """Add a step's gradients (this replica's) to their owners' sums: one reduction to the owners, across the
        replicas."""
        import tensorflow as tf

        replica = current_replica()
        for i, g in enumerate(grads):
            if self.summed[i] and self.owners[i] == replica:
                self.sums[i].assign_add(g)
        reduced = [i for i, summed in enumerate(self.summed) if not summed]
        if not reduced:
            return

        def add(strategy: Any, grads: list[Any]) -> None:
            owned = [(grads[j], self.values[i], self.owners[i]) for j, i in enumerate(reduced)]
            for j, total in _reduce_to_owners(strategy, self.devices, self.first, self.replicas, owned).items():
                self.sums[reduced[j]].assign_add(total)

        tf.distribute.get_replica_context().merge_call(add, args=([grads[i] for i in reduced],))

    def with_sums(self, grads: list[Any], steps: float) -> list[Any]:
        """This replica's gradients over ``steps``, each with its sum added on the replica that owns it."""
        replica = current_replica()
        return [
            (g + self.sums[i]) / steps if self.owners[i] == replica and i in self.sums else g / steps
            for i, g in enumerate(grads)
        ]

    def reset(self) -> None:
        """Empty the sums this replica owns."""
        import tensorflow as tf

        replica = current_replica()
        for i, total in self.sums.items():
            if self.owners[i] == replica:
                total.assign(tf.zeros_like(total))


def _one(distribution: Any, value: Any) -> Any:
    """One replica's part of a value handed to the update step (to see its kind: dense or ``IndexedSlices``)."""
    return distribution.experimental_local_results(value)[0]


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
