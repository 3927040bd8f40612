"""The one door to Keras' and TensorFlow's internals: every private attribute, method, module or protocol paraml
relies on is read here, and only here.

Each access is one small named function (or constant) whose docstring says what it reads and why no public API
serves. tests/test_internals.py pins each one against the installed Keras and TensorFlow, so that a release that
changes one fails there, with a message naming the function to update, instead of somewhere inside a training
step. docs/tensorflow-notes.md ("Versions and internals") lists them with the versions tested.

Tested with TensorFlow 2.21 and Keras 3.15 (keras-hub 0.32 in the tests).

Importing this module is cheap: Keras and TensorFlow are imported inside the functions that need them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple, cast

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = [
    "ALLOCATOR_STATS",
    "ALL_REDUCE_GRADIENTS",
    "DISTRIBUTED_UPDATE_STEP",
    "WEIGHT_DECAY",
    "WEIGHT_DECAY_EXCLUSIONS",
    "EMA_OVERWRITE",
    "EMA_UPDATE",
    "SAVEABLE_METHODS",
    "VARIABLE_VALUE_KEY",
    "all_to_all",
    "copy_weight_decay_exclusions",
    "replace_weight_decay",
    "AllocatorEvent",
    "allocator_events",
    "attention_projections",
    "autocast",
    "autocast_dtype",
    "concat_with_masks",
    "direct_sublayers",
    "distributed_update_step",
    "flatten_layers",
    "has_distributed_update_step",
    "keras_mask",
    "keras_masks",
    "optimizer_strategy",
    "optimizer_variable_list",
    "own_trainable_variables",
    "read_xspace",
    "resource_variable",
    "shift_collective_keys",
    "start_graph_collection",
    "state_unlocked",
    "stop_graph_collection",
    "tensor_list_element_dtype",
    "trackable_base",
    "untracked",
    "uses_gate",
    "while_body_graph",
]


# -- Keras masks on tensors --------------------------------------------------------------------------------------------
# Keras keeps a layer output's mask (``Embedding(mask_zero=True)``, ``Masking``) on the tensor itself, and its losses
# and metrics read it from ``y_pred``. A tensor made by ``tf.concat`` or returned by a ``tf.cond`` has none, so a
# backend that joins micro-batches' outputs sets the joined mask again.

#: The attribute Keras' TensorFlow backend keeps a tensor's mask in (``keras.src.backend.get_keras_mask``; Keras has
#: no public function to read or set it).
_ATTRIBUTE = "_keras_mask"


def keras_mask(tensor: Any) -> tf.Tensor | None:
    """The Keras mask of ``tensor``, or None.

    Reads the tensor's ``_keras_mask`` attribute: Keras' ``get_keras_mask`` lives in ``keras.src`` only.
    """
    return getattr(tensor, _ATTRIBUTE, None)


def keras_masks(outputs: Any) -> list[tf.Tensor | None]:
    """The Keras masks of ``outputs`` (a structure of tensors), flat, None where a tensor has none."""
    import tensorflow as tf

    return [keras_mask(t) for t in tf.nest.flatten(outputs)]


def concat_with_masks(parts: list[Any], masks: list[list[tf.Tensor | None]]) -> Any:
    """``parts`` (structures of tensors) joined along the batch axis; a joined tensor gets the joined mask when every
    part's tensor had one (``masks``: each part's :func:`keras_masks`).

    Sets the joined tensor's ``_keras_mask``: Keras' ``set_keras_mask`` lives in ``keras.src`` only.
    """
    import tensorflow as tf

    flat_parts = [tf.nest.flatten(part) for part in parts]
    joined = []
    for i in range(len(flat_parts[0])):
        tensor = tf.concat([flat[i] for flat in flat_parts], axis=0)
        pieces = [part_masks[i] for part_masks in masks]
        if all(piece is not None for piece in pieces):
            setattr(tensor, _ATTRIBUTE, tf.concat(pieces, axis=0))
        joined.append(tensor)
    return tf.nest.pack_sequence_as(parts[0], joined)


# -- tf.distribute -----------------------------------------------------------------------------------------------------
def shift_collective_keys(strategy_class: type, by: int) -> bool:
    """Make the next instances of ``strategy_class`` (``tf.distribute.MirroredStrategy``) number their collective
    groups ``by`` further on; False (and nothing changed) when this TensorFlow has no such setting.

    Writes the class attribute ``_collective_key_base``, which each new strategy's ``extended`` copies and adds to
    its group keys. Every MirroredStrategy otherwise starts from the same key, so a second one over other devices in
    the same process joins the first one's groups; TensorFlow offers no public way to choose the keys (its own test
    combinations shift this attribute for the same reason).
    """
    if not hasattr(strategy_class, "_collective_key_base"):
        return False
    strategy_class._collective_key_base += by
    return True


def resource_variable(**kwargs: Any) -> tf.Variable:
    """A plain TensorFlow resource variable made from ``kwargs`` (``tf.Variable``'s), past every variable creator:
    inside a strategy's scope it is neither mirrored nor placed by the strategy (``tf.device`` places it).

    Constructs ``tensorflow.python.ops.resource_variable_ops.ResourceVariable`` directly: a variable creator that
    makes its own variable cannot call ``tf.Variable(...)`` (that enters the creator stack again, the strategy's
    creator and itself included), and TensorFlow exports no public class that skips the stack.
    """
    from tensorflow.python.ops.resource_variable_ops import ResourceVariable

    return ResourceVariable(**kwargs)


# -- Keras optimizers on TensorFlow ------------------------------------------------------------------------------------
#: The method through which Keras' TensorFlow optimizer (``keras.src.backend.tensorflow.optimizer.TFOptimizer``) hands
#: each (gradient, variable) to the strategy for its update, in cross-replica context: ``(self, distribution,
#: grads_and_vars, learning_rate)``. A subclass overrides it under this name to place the updates; Keras has no public
#: hook between the all-reduce and the per-variable updates.
DISTRIBUTED_UPDATE_STEP = "_distributed_tf_update_step"


def has_distributed_update_step(optimizer_class: type) -> bool:
    """Whether ``optimizer_class`` updates its variables one by one through the strategy in
    :data:`DISTRIBUTED_UPDATE_STEP` (every Keras optimizer on the TensorFlow backend)."""
    return hasattr(optimizer_class, DISTRIBUTED_UPDATE_STEP)


def distributed_update_step(optimizer_class: type) -> Callable[..., Any]:
    """``optimizer_class``'s own :data:`DISTRIBUTED_UPDATE_STEP` (unbound), for an override to call for the variables
    it leaves to Keras: ``distributed_update_step(base)(self, distribution, grads_and_vars, learning_rate)``."""
    return getattr(optimizer_class, DISTRIBUTED_UPDATE_STEP)


#: The method of Keras' TensorFlow optimizer that all-reduces the gradients in replica context before
#: :data:`DISTRIBUTED_UPDATE_STEP` receives them: ``(self, grads_and_vars) -> grads_and_vars``. A subclass overrides it
#: under this name to leave a gradient unreduced (ZeRO-2 reduces it to its owner only); Keras has no public hook there.
ALL_REDUCE_GRADIENTS = "_all_reduce_sum_gradients"

#: The method of Keras' TensorFlow optimizer that decays the weights (AdamW's ``weight_decay``) through the
#: strategy's per-copy update, before the gradient step: ``(self, variables)``; and the predicate that says whether a
#: variable is decayed, ``_use_weight_decay(variable)`` (``exclude_from_weight_decay``). The strategy's update takes
#: distributed variables only, so a subclass decays a variable that lives on one device itself.
WEIGHT_DECAY = ("_apply_weight_decay", "_use_weight_decay")

#: Where ``Optimizer.exclude_from_weight_decay(var_list, var_names)`` keeps what it excludes: the variables' keys and
#: the names' pattern. The optimizer's config does not hold them, so an optimizer re-created from its config (paraml
#: makes one in the strategy's scope) would decay what the user excluded: :func:`copy_weight_decay_exclusions`.
WEIGHT_DECAY_EXCLUSIONS = ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern")


def replace_weight_decay(optimizer: Any, apply: Callable[[Any], None]) -> Callable[[Any], None]:
    """Make ``optimizer`` (this instance) decay its weights with ``apply(variables)`` in place of Keras'
    ``_apply_weight_decay`` (:data:`WEIGHT_DECAY`), which runs every decay under the replica's one device; returns
    Keras' own, bound, for the variables ``apply`` leaves to it."""
    keras_decay = getattr(optimizer, WEIGHT_DECAY[0])
    setattr(optimizer, WEIGHT_DECAY[0], apply)
    return cast(Callable[[Any], None], keras_decay)


def copy_weight_decay_exclusions(source: Any, target: Any) -> None:
    """Give the unbuilt optimizer ``target`` what ``source`` excludes from weight decay (see
    :data:`WEIGHT_DECAY_EXCLUSIONS`); nothing when ``source`` excludes nothing."""
    for name in WEIGHT_DECAY_EXCLUSIONS:
        if getattr(source, name, None):
            setattr(target, name, getattr(source, name))


#: The method of Keras' optimizer that updates the average of the weights (``use_ema=True``) after the update step,
#: in replica context, on every replica: ``(self, trainable_variables)``. A sharded optimizer's owners update the
#: averages in the update step instead (an average lives once, on its variable's owner).
EMA_UPDATE = "_update_model_variables_moving_average"
#: The method of Keras' optimizer that overwrites the variables with their averages (every
#: ``ema_overwrite_frequency`` steps) inside a ``cond`` in replica context: ``(self, trainable_variables)``. Keras'
#: TensorFlow version calls ``strategy.extended.update`` there, a ``merge_call`` a ``cond`` cannot hold; a sharded
#: optimizer's owners overwrite in the update step instead.
EMA_OVERWRITE = "_overwrite_model_variables_with_average_value"


def optimizer_strategy(optimizer: Any) -> tf.distribute.Strategy:
    """The strategy a Keras optimizer was created under (it runs its updates through it).

    Reads ``optimizer._distribution_strategy``, which Keras' TensorFlow optimizer sets in ``__init__`` from
    ``tf.distribute.get_strategy()``; Keras exposes no public attribute for it, and the current strategy where the
    optimizer is used may be another one.
    """
    return optimizer._distribution_strategy


def optimizer_variable_list(optimizer: Any) -> Any:
    """A Keras optimizer's own list of its variables (a TensorFlow trackable list), or None when it has none.

    Reads ``optimizer._variables``. The public ``optimizer.variables`` is a copy (a plain list): a TensorFlow
    checkpoint given the optimizer's own list restores each variable, by position, when the optimizer creates it
    later (at its first update); given the copy, it sees only the variables that exist at restore time.
    """
    return getattr(optimizer, "_variables", None)


# -- TensorFlow collectives -------------------------------------------------------------------------------------------
def all_to_all(strategy: tf.distribute.Strategy, replica: int, tensor: tf.Tensor) -> tf.Tensor:
    """Row ``j`` of ``tensor`` (shape ``[replicas, ...]``) sent to the strategy's replica ``j`` (global index); the
    result has one row per replica, row ``j`` what replica ``j`` sent to this one. Called in a traced function, in
    cross-replica context, once for each of this worker's replicas (``replica`` is the local index), in the same order
    on every worker.

    TensorFlow exports no all-to-all through its strategies (its reduce-scatter has no CPU kernel); this issues
    ``CollectiveAllToAllV2`` with the group and instance keys and the ordering token of the strategy's own collective
    launcher for that replica (``strategy.extended._cross_device_ops._launchers[replica]``, a
    ``CollectiveReplicaLauncher``), so that it is ordered with the strategy's all-reduces and keyed like them.
    """
    import tensorflow as tf
    from tensorflow.python.ops import collective_ops

    launcher = strategy.extended._cross_device_ops._launchers[replica]
    options = launcher._options
    instance_key = launcher._next_instance_key()
    with tf.device(launcher._device):
        return collective_ops.all_to_all_v2(
            tensor,
            launcher._group_size,
            launcher._group_key,
            instance_key,
            communication_hint=options.implementation.value,
            timeout=options.timeout_seconds,
            ordering_token=launcher._get_ordering_token(),
        )


# -- TensorFlow checkpoints: the saveable protocol ---------------------------------------------------------------------
def trackable_base() -> type:
    """The base class an object needs to be saved by a TensorFlow checkpoint with tensors of its own
    (``tf.__internal__.tracking.Trackable``).

    ``tf.Module`` (public) is an auto-trackable: it would save the variables it holds as dependencies too, each
    under its own key, where a checkpoint should see one tensor.
    """
    import tensorflow as tf

    return tf.__internal__.tracking.Trackable


#: The methods of :func:`trackable_base` a subclass overrides to save and restore its own tensors (TensorFlow's
#: "saveable" protocol, private): ``_serialize_to_tensors(self) -> {key: tensor}`` and
#: ``_restore_from_tensors(self, restored_tensors)``.
SAVEABLE_METHODS = ("_serialize_to_tensors", "_restore_from_tensors")

#: The key under which a plain TensorFlow variable saves its value in :data:`SAVEABLE_METHODS` (TensorFlow's
#: ``trackable.constants.VARIABLE_VALUE_KEY``): an object that saves its tensor under it restores into a variable,
#: and the other way round.
VARIABLE_VALUE_KEY = "VARIABLE_VALUE"


# -- Keras layers ------------------------------------------------------------------------------------------------------
def flatten_layers(layer: Any) -> list[Any]:
    """Every layer nested in ``layer`` (not itself), at any depth, each once, in Keras' tracking order.

    Calls ``layer._flatten_layers(include_self=False, recursive=True)``: ``Model.layers`` lists one level only, and
    a plain ``Layer`` (a keras_hub block) has no public list of its sublayers.
    """
    return list(layer._flatten_layers(include_self=False, recursive=True))


def own_trainable_variables(layer: Any) -> list[Any]:
    """The trainable variables ``layer`` created itself, without its sublayers'.

    Reads ``layer._trainable_variables``: the public ``trainable_variables`` includes every sublayer's.
    """
    return layer._trainable_variables


def direct_sublayers(layer: Any) -> list[Any]:
    """The layers ``layer`` tracks directly (its attributes and lists of layers, one level).

    Reads ``layer._layers``: a plain ``Layer`` has no public ``layers``.
    """
    return layer._layers


def uses_gate(layer: Any) -> bool:
    """Whether an attention layer has a gate projection (``MultiHeadAttention(use_gate=True)``).

    Reads ``layer._use_gate``: keras_hub's attention classes keep no ``use_gate`` in their config.
    """
    return bool(getattr(layer, "_use_gate", False))


def attention_projections(layer: Any) -> dict[str, Any] | None:
    """An attention layer's projections (``EinsumDense`` layers) by role: ``query``, ``key``, ``value``, ``gate``
    (when :func:`uses_gate`) and ``output``, in that order; None when one is missing (not an attention layer laid out
    as Keras' ``MultiHeadAttention``, or not built).

    Reads ``layer._query_dense``, ``_key_dense``, ``_value_dense``, ``_gate_dense`` and ``_output_dense``, the names
    ``keras.layers.MultiHeadAttention`` and keras_hub's attention classes (Llama's) give their projections; no
    public attribute exposes them.
    """
    roles = ["query", "key", "value", *(["gate"] if uses_gate(layer) else []), "output"]
    found = {role: getattr(layer, f"_{role}_dense", None) for role in roles}
    return None if any(dense is None for dense in found.values()) else found


# -- Keras mixed precision ---------------------------------------------------------------------------------------------
def autocast_dtype() -> str | None:
    """The dtype Keras casts float variables to where they are read now (``Layer.__call__`` of a ``mixed_float16``
    layer enters such a scope around ``call``), or None outside one.

    Reads ``keras.src.backend.common.variables.get_autocast_scope()``: Keras exports no way to ask; code that runs a
    layer's ``call`` again later (a recomputed unit's backward pass) must cast as the first run did.
    """
    from keras.src.backend.common.variables import get_autocast_scope

    scope = get_autocast_scope()
    return None if scope is None else scope.dtype


def autocast(dtype: str | None) -> AbstractContextManager[Any]:
    """A new scope in which Keras casts float variables to ``dtype`` where they are read (``AutocastScope``, not
    exported by Keras); nothing when ``dtype`` is None."""
    from contextlib import nullcontext

    from keras.src.backend.common.variables import AutocastScope

    return nullcontext() if dtype is None else AutocastScope(dtype)


# -- Keras' attribute tracking ----------------------------------------------------------------------------------------
# Keras tracks the state a layer's attributes hold (variables, sub-layers, metrics, seed generators) and locks a
# subclassed layer's tracker once it is built. A model's own ``compile`` may create state (the Keras GAN example's
# loss trackers): in Keras it runs before ``fit`` builds the model, in paraml after the model has its weights.
@contextmanager
def state_unlocked(layer: Any) -> Iterator[None]:
    """While the block runs, ``layer`` takes new state (metrics, sub-layers, variables) as it did before it was built;
    it is locked again afterwards if it was.

    Unlocks ``layer._tracker`` (Keras' ``Tracker.unlock``/``lock``, which ``Layer._lock_state`` locks at build): no
    public API lets a built layer take new state, and Keras' own ``compile`` escapes the lock the same way (by
    not tracking, :func:`untracked`).
    """
    tracker = getattr(layer, "_tracker", None)
    if tracker is None or not tracker.locked:
        yield
        return
    tracker.unlock()
    try:
        yield
    finally:
        tracker.lock()  # keeps Keras' message


def untracked() -> AbstractContextManager[Any]:
    """While the block runs, attributes set on any Keras layer are not tracked as its state (and a built layer does
    not refuse them).

    Returns ``keras.src.utils.tracking.DotNotTrackScope()``, the scope Keras' own ``Model.compile`` runs under
    (``no_automatic_dependency_tracking``); it is not exported.
    """
    from keras.src.utils.tracking import DotNotTrackScope

    return DotNotTrackScope()


# -- TensorFlow graphs -------------------------------------------------------------------------------------------------
def while_body_graph(op: Any) -> Any:
    """The body's graph of a ``While`` op made by ``tf.while_loop`` (while_v2), or None for any other op.

    Reads ``op._body_graph``, which while_v2 sets on the op it builds; a graph's ops expose only the function's
    name, not its Python graph.
    """
    return getattr(op, "_body_graph", None)


def tensor_list_element_dtype(handle: Any) -> tf.DType:
    """The element dtype of the TensorList ``handle`` (a graph tensor of dtype variant), from the handle data
    TensorFlow's shape inference attached to it. Raises when it has none.

    Calls ``tensorflow.python.ops.handle_data_util.get_resource_handle_data``: the handle data has no public API.
    """
    import tensorflow as tf
    from tensorflow.python.ops import handle_data_util

    return tf.as_dtype(handle_data_util.get_resource_handle_data(handle).shape_and_type[0].dtype)


# -- TensorFlow's record of a step: which device ran each op, and when -------------------------------------------------
# TF 2.21 leaves the step stats of a function's run empty (``RunMetadata.step_stats`` has no ``dev_stats``), so the
# times come from the public profiler (``tf.profiler.experimental.start``/``stop``), whose op events name the node but
# not its device; the device of each node comes from the partition graphs TensorFlow records for a function when it
# instantiates it (its first call, and only then).
def start_graph_collection() -> None:
    """From now on, TensorFlow records the partition graphs (one per device, each node with its device) of every
    function it instantiates, until :func:`stop_graph_collection`.

    Calls ``context.context().enable_graph_collection()`` (``tensorflow.python.eager.context``): TensorFlow 2 fills a
    ``RunMetadata`` only through the eager context, and has no public switch for it.
    """
    from tensorflow.python.eager import context

    context.context().enable_graph_collection()


def stop_graph_collection() -> list[Any]:
    """The partition graphs (``tf.compat.v1.GraphDef`` protos) recorded since :func:`start_graph_collection`, of every
    function instantiated meanwhile; recording stops.

    Calls ``context.context().export_run_metadata()`` (which hands over the record and clears it) and
    ``disable_graph_collection()``; the graphs are in ``RunMetadata.function_graphs[*].partition_graphs``.
    """
    from tensorflow.python.eager import context

    eager = context.context()
    recorded = eager.export_run_metadata()
    eager.disable_graph_collection()
    if recorded is None:
        return []
    return [graph for function in recorded.function_graphs for graph in function.partition_graphs]


def read_xspace(data: bytes) -> Any:
    """The profile in ``data`` (the bytes of a ``*.xplane.pb`` file that ``tf.profiler.experimental.stop`` wrote) as
    an ``XSpace`` proto: ``planes[*].lines[*].events[*]``, each event's name in ``plane.event_metadata``.

    Parses with ``tensorflow.tsl.profiler.protobuf.xplane_pb2``: the profile's format (TSL's ``xplane.proto``) has no
    public reader in TensorFlow (tensorboard-plugin-profile's converters would be a dependency for one parse).
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(data)
    return space


# -- TensorFlow's allocators in a profile: each allocation and deallocation of a step ---------------------------------
# An allocator's own peak (``tf.config.experimental.get_memory_info``) says how much, not whose: logical CPUs share one
# allocator. While the profiler runs, TensorFlow's BFC allocators also record each allocation and deallocation in the
# profile, as events of the host plane named ``MemoryAllocation`` / ``MemoryDeallocation`` whose stats (TSL's
# ``MemoryProfile`` annotations, not a public format) name the op that allocated and the allocator's bytes in use after.

#: The stats of an allocator's memory events that :func:`allocator_events` reads: the allocator, its bytes in use
#: after the event, the buffer's bytes and address, and the op (node name) that allocated it.
ALLOCATOR_STATS = ("allocator_name", "bytes_allocated", "allocation_bytes", "addr", "tf_op")


class AllocatorEvent(NamedTuple):
    """One allocation (``freed`` False) or deallocation (``freed`` True) of ``nbytes`` at ``address`` by the
    allocator named ``allocator``, at ``time_ps`` picoseconds since the epoch; ``in_use`` is the allocator's bytes in
    use after it; ``op`` is the node that allocated (``""`` when the event names none: deallocations often do not)."""

    time_ps: int
    allocator: str
    freed: bool
    nbytes: int
    address: int
    op: str
    in_use: int


def allocator_events(space: Any) -> list[AllocatorEvent]:
    """Every allocator memory event in the profile ``space`` (from :func:`read_xspace`), in time order.

    Reads the events named ``MemoryAllocation`` and ``MemoryDeallocation`` of every plane and their stats named in
    :data:`ALLOCATOR_STATS` (a string stat is a reference to the plane's ``stat_metadata``). Events at the same
    picosecond keep the profile's order.
    """
    kinds = {"MemoryAllocation": False, "MemoryDeallocation": True}
    events = []
    for plane in space.planes:
        names = {key: meta.name for key, meta in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                freed = kinds.get(plane.event_metadata[event.metadata_id].name)
                if freed is None:
                    continue
                stats: dict[str, Any] = {}
                for stat in event.stats:
                    kind = stat.WhichOneof("value")
                    value = getattr(stat, kind)
                    stats[names.get(stat.metadata_id, "")] = names.get(value, "") if kind == "ref_value" else value
                events.append(
                    AllocatorEvent(
                        time_ps=line.timestamp_ns * 1000 + event.offset_ps,
                        allocator=str(stats.get("allocator_name", "")),
                        freed=freed,
                        nbytes=int(stats.get("allocation_bytes", 0)),
                        address=int(stats.get("addr", 0)),
                        op=str(stats.get("tf_op", "")),
                        in_use=int(stats.get("bytes_allocated", 0)),
                    )
                )
    return sorted(events, key=lambda e: e.time_ps)
