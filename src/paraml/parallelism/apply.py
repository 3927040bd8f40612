"""Every technique of a plan applied to a model, in one place and one order (torchtitan's ``parallelize``).

:func:`apply_plan` takes a built model and its :class:`paraml.planning.plan.ParallelPlan` and applies, in this
order (each later one wraps the earlier ones, so the order is the meaning):

0. **Variable placement** happened before, while ``model_fn`` created the variables: the backend's variable creator
   put each on its stage's devices (a split weight as parts on the stage's tensor shards; under ZeRO-3 each trainable
   variable once, on its owner replica). Nothing here moves them.
1. **Tensor splits**: each split layer's ``call`` computes on its parts, on its stage's tensor-shard devices. First,
   because it replaces the layer's own computation.
2. **Stage placement**: each unit's ``call`` runs under its stage's device (and, under a schedule other than GPipe,
   after the backward passes the schedule names). It wraps 1, so a split layer's whole-tensor ops run on its stage
   too. Under an interleaved schedule there are more stages (model chunks) than devices: stage ``s`` runs on the
   mesh's stage ``s % stages``. **Gathered weights** (ZeRO-3 across workers): each unit's ``call`` computes with its
   weights gathered from their owners (:class:`paraml.parallelism.zero.GatheredWeights`), inside the recompute of 3,
   so the backward pass gathers them again.
3. **Recompute** (``remat``): each unit's ``call`` under ``tf.recompute_grad``. It wraps 2, so the recompute runs on
   the unit's stage.
4. **Reads one unit ahead** (ZeRO-3): each unit's ``call`` waits for the inputs of the unit called before it, so
   its weights are read from their owners once that unit can start (:class:`paraml.parallelism.zero.ReadAhead`).
5. At compile, through the returned :class:`AppliedPlan`: **sharded model state** (ZeRO-1 to 3) and the slots of a
   split weight's parts; the **cross-entropy of split logits** computed on the slices.

The returned :class:`AppliedPlan` is what the loop reads through the backend (``backend.techniques``): the variables
the step trains, the optimizer and loss as the plan wants them, the optimizer state a checkpoint saves. The loop
imports no technique.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from paraml.internals import replace_weight_decay
from paraml.parallelism import tensor_parallel, zero
from paraml.parallelism.remat import recompute_units
from paraml.parallelism.zero import current_replica
from paraml.planning.observe import model_units, nested_layers
from paraml.planning.plan import ParallelPlan

__all__ = ["AppliedPlan", "apply_plan", "current_replica"]

#: ``gate(stage, inputs)``: what ``stage``'s forward pass of the micro-batch being traced waits for (a pipeline
#: schedule); ``inputs`` are the unit's flattened arguments (the zero-bubble schedule takes their gradients apart).
Gate = Callable[[int, Sequence[Any]], list[Any]]


def apply_plan(
    model: keras.Model, plan: ParallelPlan, gate: Gate | None = None, placed: zero.ShardedSlots | None = None
) -> AppliedPlan:
    """Apply ``plan``'s techniques to ``model`` (built, its variables already placed) in the module's order.

    ``gate`` is the pipeline's wait (:meth:`paraml.backends.pipeline.Pipeline.gate`: the schedule's order).
    ``placed``: under ZeRO-3 across workers, where the backend put each trainable variable (a worker holds its own
    and a placeholder for the others'): each unit then gathers its weights.
    """
    stage_of_unit = plan.stage_of()
    every_unit = model_units(model) if stage_of_unit or plan.zero_stage == 3 else []  # ZeRO-3 gathers, reads by unit
    units = every_unit if stage_of_unit else []

    # 1. tensor splits: a split layer computes on its parts, on its stage's tensor shards of the replica traced
    split = None
    if plan.splits is not None:
        stage_of_layer: dict[int, int] = {}
        for name, layer in units:
            for inner in nested_layers(layer):
                stage_of_layer.setdefault(id(inner), stage_of_unit[name])

        def shard_devices(layer: Any) -> tuple[str, ...]:
            return plan.mesh.stage_group(current_replica(), stage_of_layer[id(layer)])

        split = tensor_parallel.SplitLayers(plan.splits, tensor_parallel.SplitWeights(model), shard_devices)
        split.attach(model)

    # 2. stage placement: each unit's call on its stage's device of the replica traced, after the schedule's wait
    for name, layer in units:
        _run_on_stage(layer, plan, stage_of_unit[name], gate)
    if placed is not None:  # each unit's weights from their owners, where it runs; inside 3's recompute
        zero.GatheredWeights(placed).attach(model, every_unit)

    # 3. recompute: wraps 2, so the recompute runs where the unit does
    recomputed = recompute_units(model) if plan.remat else []

    # 4. ZeRO-3: each unit's forward pass (its weights' reads) after the previous unit's inputs; wraps 3, so the
    # recomputed backward pass keeps waiting on its output gradient only
    if plan.zero_stage == 3:
        zero.ReadAhead().attach([layer for _, layer in every_unit])
    return AppliedPlan(plan, split, recomputed, placed)


def _run_on_stage(layer: keras.layers.Layer, plan: ParallelPlan, stage: int, gate: Gate | None) -> None:
    """Make ``layer``'s ``call`` (the public method, set on this instance) run on ``stage``'s device of the replica
    being traced, after what ``gate(stage)`` returns."""
    original = layer.call

    def call(*args: Any, **kwargs: Any) -> Any:
        device = plan.mesh.stage_group(current_replica(), stage)[0]
        waits = gate(stage, tf.nest.flatten((args, kwargs))) if gate is not None else []
        with tf.device(device), tf.control_dependencies(waits):
            return original(*args, **kwargs)

    layer.call = call


def _update_beside_variables(optimizer: Any) -> None:
    """Make ``optimizer`` (this instance) run each variable's update step on the variable's device.

    Why: a replica's strategy runs the whole update under the replica's one device (``OneDeviceStrategy`` does, for a
    pipeline), so Adam's arithmetic for stage 1's weights ran on stage 0's device and its results were sent back
    (seen in the step's trace). The slots already live beside their variable; the arithmetic now does too.
    """
    original = optimizer.update_step

    def update_step(gradient: Any, variable: Any, learning_rate: Any) -> Any:
        with tf.device(_placed(variable).device):
            return original(gradient, variable, learning_rate)

    optimizer.update_step = update_step  # the public method, on this instance

    def apply_weight_decay(variables: Any) -> None:
        # AdamW's decay goes through the same one-device update: with one replica, each variable is decayed where it
        # lives; copies per replica (data_parallel) are decayed per copy, on its device, by Keras already
        one_replica = tf.distribute.get_strategy().num_replicas_in_sync == 1
        alone = [one_replica and not hasattr(_placed(v), "values") for v in variables]
        keras_decay([v for v, here in zip(variables, alone) if not here])
        for v, here in zip(variables, alone):
            if here:
                zero.decay_weight(optimizer, _placed(v))

    keras_decay = replace_weight_decay(optimizer, apply_weight_decay)


def _placed(variable: Any) -> Any:
    """The TensorFlow variable of a Keras or TensorFlow variable (what has a device)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


class AppliedPlan:
    """A plan's techniques as applied to one model: what the step, the optimizer and checkpoints ask of them
    (the :class:`paraml.backends.base.Techniques` contract).

    Attributes:
        plan: The plan applied.
        split: The split layers' computation (``tensor_parallel``), or None.
        recomputed: The names of the units that recompute their activations (``remat``).
        placed: Under ZeRO-3 across workers, where each trainable variable lives (else None).
    """

    def __init__(
        self,
        plan: ParallelPlan,
        split: tensor_parallel.SplitLayers | None = None,
        recomputed: list[str] | None = None,
        placed: zero.ShardedSlots | None = None,
    ) -> None:
        self.plan = plan
        self.split = split
        self.recomputed: list[str] = list(recomputed or ())
        self.placed = placed
        self.sharded = zero.ShardedSlots()  # the sharded optimizer's slots, where each lives (ZeRO)
        #: What the last compile trains (:meth:`build_optimizer`): the model and its trained variables then.
        self._compiled: tuple[Any, list[Any]] | None = None

    def trained_variables(self, model: keras.Model) -> list[Any]:
        """``model.trainable_variables``, a split weight replaced by its parts (what the gradient is taken for).

        For the compiled model, those of its last compile: as in Keras, a layer's ``trainable`` changed since takes
        effect at the next compile, which builds an optimizer for them (:meth:`build_optimizer`).
        """
        if self._compiled is not None and self._compiled[0] is model:
            return list(self._compiled[1])
        return self._trainable_now(model)

    def variables_of(self, layer: keras.layers.Layer) -> list[Any]:
        """Every variable of ``layer``, trainable or not (a frozen one may be trained after a compile again), a split
        weight replaced by its parts."""
        return list(layer.weights) if self.split is None else self.split.weights.with_parts(layer.weights)

    def _trainable_now(self, model: keras.Model) -> list[Any]:
        if self.split is None:
            return list(model.trainable_variables)
        return self.split.weights.trained_variables(model)

    def prepare_optimizer(self, optimizer: Any, model: keras.Model, topology: Any) -> Any:
        """``optimizer`` with its slots (and, from ZeRO-2 on, its reduced gradients) on owner replicas when the plan
        shards the model's state (ZeRO), and each variable's update beside the variable when a replica spans
        devices (stages, tensor shards)."""
        if self.plan.zero_stage:
            slots = zero.ShardedSlots()  # this optimizer's only (a compile again replaces the previous one's)
            optimizer = zero.sharded_optimizer(
                optimizer,
                model.trainable_variables,
                topology.devices,
                slots,
                stage=self.plan.zero_stage,
                num_workers=topology.num_workers,
                worker_index=topology.worker_index,
                placed=self.placed,
                bucket_bytes=self.plan.bucket_bytes,
            )
            self.sharded = slots  # once it is accepted: a refused one leaves the previous compile's as it was
        if self.plan.stage_of() or self.split is not None:
            _update_beside_variables(getattr(optimizer, "inner_optimizer", optimizer))  # a loss scale's inner one
        return optimizer

    def owned_sums(self, variables: list[Any], topology: Any) -> zero.OwnedSums | None:
        """Gradient accumulation's sums on each variable's owner only when the plan shards the gradients (ZeRO-2 and
        3): a sum per replica would be a whole copy of the gradients on every device."""
        if self.plan.zero_stage < 2:
            return None
        return zero.OwnedSums(variables, topology.devices, topology.num_workers, topology.worker_index, self.placed)

    def build_optimizer(self, optimizer: Any, model: keras.Model) -> None:
        """Create ``optimizer``'s slots for the trained variables (a part's slots on the part's device, saved
        joined)."""
        if self.split is not None:
            self.split.weights.record_slots(optimizer)
        trained = self._trainable_now(model)  # a compile reads the trainable set again, as Keras' does
        optimizer.build(trained)
        self._compiled = (model, trained)

    def prepare_loss(self, loss: Any) -> Any:
        """``loss``, its cross-entropy computed on the slices of split logits when layers are split."""
        return tensor_parallel.split_logits_loss(loss) if self.split is not None else loss

    def optimizer_state(self, optimizer: Any) -> list[Any]:
        """The optimizer's variables as a checkpoint stores them, each slot whole."""
        return zero.whole_state(optimizer, self.sharded, self._saved)

    def restorable_state(self, optimizer: Any) -> list[tuple[Any | None, tuple[int, ...]]]:
        """Each saved optimizer variable as a restore fills it, and its whole shape."""
        return zero.restorable_state(optimizer, self.sharded, self._saved)

    def _saved(self, variables: Any) -> list[Any]:
        """An optimizer's unsharded variables as saved: a split weight's slots joined into one."""
        if self.split is None:
            return [v.value for v in variables]
        return self.split.weights.saved_state(variables)
