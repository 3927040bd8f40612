"""Optimizer state sharded over the replicas (ZeRO stage 1): ``Parallel("mirrored", shard_optimizer=True)``.

Under ``MirroredStrategy`` every device holds a copy of every variable and of every optimizer slot (Adam's two
moments: 8 of the 16 bytes per fp32 parameter). Here each trainable variable gets one **owner** device (owners
balanced by bytes, largest variables first, :func:`owners`), its slots live only there, and only the owner runs the
optimizer's update for it; the new value then reaches every replica (an assignment to the mirrored variable: a
broadcast). Gradients are all-reduced as before, so the communication is that of plain data parallelism.

The optimizer is the user's Keras optimizer class, subclassed at run time (:func:`sharded_optimizer`) in two places
only: where a slot is created (on the owner, as a plain variable) and where Keras' TensorFlow optimizer hands each
variable to the strategy for its update (on the owner's copy, then a broadcast). Everything else is Keras' own code:
the update rule (Adam, AdamW's weight decay, momentum, Nesterov...), the learning-rate schedule, clipping, EMA, a
``LossScaleOptimizer`` around it, and sparse (``IndexedSlices``) gradients. So the weights equal unsharded training.

Checkpoints hold the slots by position, as for any optimizer: a sharded run restores on any backend and the other
way round.

Importing this module is cheap (:func:`owners` is plain Python); TensorFlow is imported when an optimizer is sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import keras

__all__ = ["owners", "sharded_optimizer"]


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


def _plain_variable_on(device: str) -> Callable[..., Any]:
    """A variable creator that makes a plain (not mirrored) variable on ``device``, inside a strategy's scope."""
    import tensorflow as tf
    from tensorflow.python.ops.resource_variable_ops import ResourceVariable  # the strategy's creator bypassed

    def create(next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        del next_creator
        for mirrored_only in ("colocate_with", "use_resource", "experimental_batch_ndims"):
            kwargs.pop(mirrored_only, None)
        with tf.device(device):
            return ResourceVariable(**kwargs)

    return create


def sharded_optimizer(
    optimizer: keras.optimizers.Optimizer, variables: Sequence[Any], devices: Sequence[str]
) -> keras.optimizers.Optimizer:
    """A copy of ``optimizer`` (created in the strategy's scope, like the original) whose slots for ``variables``
    live on their owners among ``devices`` (the strategy's, in its order), and whose updates run there.

    Raises:
        ValueError: for an optimizer Keras' TensorFlow backend does not step through its strategy (it has no
            per-variable update to place).
    """
    import tensorflow as tf

    base = type(optimizer)
    if not hasattr(base, "_distributed_tf_update_step"):
        raise ValueError(
            f"shard_optimizer=True cannot shard {base.__name__}: it does not update its variables one by one "
            "through the strategy as Keras' TensorFlow optimizers do; use shard_optimizer=False"
        )
    sizes = [int(v.value.shape.num_elements()) * v.value.dtype.size for v in variables]
    owner_of = {id(v.value): devices[d] for v, d in zip(variables, owners(sizes, len(devices)))}
    index_of = {device: i for i, device in enumerate(devices)}

    def add_variable_from_reference(self: Any, reference_variable: Any, *args: Any, **kwargs: Any) -> Any:
        owner = owner_of.get(id(getattr(reference_variable, "value", reference_variable)))
        if owner is None:  # not a sharded variable: as Keras makes it
            return base.add_variable_from_reference(self, reference_variable, *args, **kwargs)
        with tf.variable_creator_scope(_plain_variable_on(owner)):
            return base.add_variable_from_reference(self, reference_variable, *args, **kwargs)

    def _distributed_tf_update_step(self: Any, distribution: Any, grads_and_vars: Any, learning_rate: Any) -> None:
        for grad, var in grads_and_vars:
            owner = owner_of.get(id(var))
            if owner is None:
                base._distributed_tf_update_step(self, distribution, [(grad, var)], learning_rate)
                continue
            index = index_of[owner]
            copy = var.values[index]  # the owner's copy of the mirrored variable
            with tf.device(owner):
                self.update_step(distribution.experimental_local_results(grad)[index], copy, learning_rate)
                updated = tf.identity(copy)
            var.assign(updated)  # every replica gets the owner's result

    sharded = type(
        base.__name__,
        (base,),
        {
            "add_variable_from_reference": add_variable_from_reference,
            "_distributed_tf_update_step": _distributed_tf_update_step,
            "__module__": base.__module__,  # saved models name the user's class
            "__doc__": base.__doc__,
        },
    )
    return sharded.from_config(optimizer.get_config())
