"""Expert parallelism: a mixture-of-experts layer's experts split over ``expert_parallel=E`` devices.

keras_hub's mixture-of-experts blocks (Mixtral's, Qwen-MoE's, Qwen3-MoE's) route each token to its ``top_k``
experts with a router ``Dense`` and keep every expert's weights in one expert bank: a few stacked kernels with the
experts on axis 0 (``(experts, hidden, intermediate)``). The bank computes every expert on every token; the block
weighs each expert's output by the token's routing weight (zero for an expert the token was not routed to), adds them
up, and adds the auxiliary load-balancing loss. There is no capacity and no dropped token.

Split over E devices (the :class:`paraml.planning.plan.Layout`'s ``experts``, a stage's shards), each bank kernel is
split on its experts axis (each device holds ``num_experts / E`` experts, and the optimizer their slots), and the
bank's ``call`` runs each device's experts there: the tokens go to every device of the stage, each computes its
experts' outputs with the bank's own code (a bank of the same class over the device's parts of the kernels,
:func:`bank_of_parts`), and the outputs come back joined on the experts axis. The router, the routing weights, the
weighted sum and the auxiliary loss stay the block's own, on the stage's device (with ``tensor_parallel`` also set,
the router is a ``Dense`` split as any other): the numbers are the unsplit model's, and what keras_hub changes in
routing reaches paraml unchanged.

Which layers are expert banks (:func:`is_expert_bank`, :data:`EXPERT_BANKS`) and how one computes on its parts
live here; :mod:`paraml.parallelism.tensor_parallel` places the parts and saves them whole, as it does every split
weight (a checkpoint moves between any E and ``single``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["EXPERT_BANKS", "bank_of_parts", "check_experts", "expert_banks", "is_expert_bank"]

#: keras_hub's expert banks: layers whose variables are every expert's kernels stacked on axis 0, built by
#: ``cls(num_experts=, hidden_dim=, intermediate_dim=, activation_fn=, kernel_initializer=, dtype=)``, computing each
#: expert from its own slice of every kernel (checked against the unsplit bank by tests/test_experts.py).
EXPERT_BANKS = (
    "keras_hub.src.models.mixtral.mixtral_decoder.MixtralMoeExperts",
    "keras_hub.src.models.qwen_moe.qwen_moe_decoder.QwenMoeExperts",
    "keras_hub.src.models.qwen3_moe.qwen3_moe_decoder.Qwen3MoeExperts",
)


def is_expert_bank(layer: Any) -> bool:
    """Whether ``layer`` is one of keras_hub's expert banks (:data:`EXPERT_BANKS`), built."""
    kind = type(layer)
    return f"{kind.__module__}.{kind.__qualname__}" in EXPERT_BANKS and bool(getattr(layer, "built", False))


def expert_banks(layers: Sequence[Any]) -> list[Any]:
    """The expert banks among ``layers``, in their order."""
    return [layer for layer in layers if is_expert_bank(layer)]


def check_experts(banks: Sequence[Any], experts: int, model_name: str) -> None:
    """Refuse ``expert_parallel=experts`` for a model without expert banks, or with a bank whose number of experts
    ``experts`` does not divide (each device holds the same number of whole experts)."""
    if not banks:
        raise ValueError(
            f"expert_parallel={experts}, but model {model_name!r} has no mixture-of-experts layer (keras_hub's "
            "Mixtral, Qwen-MoE and Qwen3-MoE expert banks are split): use expert_parallel=1, or tensor_parallel "
            "to split its other layers"
        )
    for bank in banks:
        if bank.num_experts % experts:
            divisors = [d for d in range(2, bank.num_experts + 1) if bank.num_experts % d == 0]
            raise ValueError(
                f"expert_parallel={experts} does not divide the {bank.num_experts} experts of {bank.path!r}: each "
                f"device holds the same number of whole experts; use one of {divisors}"
            )


def bank_of_parts(bank: Any, variables: Sequence[Any], name: str) -> Any:
    """A bank of ``bank``'s class over ``variables`` (TensorFlow variables, one part of each of ``bank``'s kernels,
    in ``bank.weights`` order, the experts on axis 0): it computes those experts with the bank's own ``call``.

    Made under a variable creator that hands the bank's ``add_weight`` calls the existing parts, so it holds no
    variable of its own; it is tracked by no model (it lives in the split computation's closure).
    """
    import tensorflow as tf

    remaining = iter(variables)

    def existing(next_creator: Any, **kwargs: Any) -> Any:
        del next_creator, kwargs
        return next(remaining)

    experts = int(variables[0].shape[0])
    part = type(bank)(
        num_experts=experts,
        hidden_dim=bank.hidden_dim,
        intermediate_dim=bank.intermediate_dim,
        activation_fn=bank.activation,
        kernel_initializer="zeros",  # never used: the creator hands over the parts
        dtype=bank.dtype_policy,
        name=name,
    )
    with tf.variable_creator_scope(existing):
        part.build(None)
    if next(remaining, None) is not None or len(part.weights) != len(variables):
        raise ValueError(f"{bank.path}: a bank of its class made {len(part.weights)} variables, not {len(variables)}")
    return part
