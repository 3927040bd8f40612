"""Memory estimates for Keras models: what training a model needs, and the per-unit costs the stage planners take.

Importing this module is cheap: Keras and TensorFlow are imported lazily,
inside the functions that need them.

What :func:`estimate_memory` counts:

* **parameters**: bytes of every distinct model variable, trainable or not
  (number of elements times dtype size);
* **gradients**: bytes of the trainable variables (one gradient each);
* **optimizer slots**: bytes of the slot variables a fresh copy of the
  optimizer creates when built on the model's trainable variables (momenta,
  velocities, factored second moments, EMA copies, gradient accumulators...;
  :func:`paraml.planning.optimizers.slot_bytes`); scalar bookkeeping variables
  (``iteration``, ``learning_rate``, ...) are ignored;
* **activations**: what one training step keeps alive between its forward and
  backward passes, measured, not guessed: one training step of the model is
  traced on two small batches and every tensor its forward pass creates that
  the gradient reads is counted, per unit (:func:`paraml.planning.observe.observe_units`),
  then scaled to ``batch_size`` rows; plus the batch itself and the model's
  outputs (their gradient is as large). The traced step takes the loss of the
  outputs as training does (``loss=``; default: sparse categorical
  cross-entropy from logits for an output with a class axis, mean squared
  error otherwise), and what the loss keeps for its gradient is measured too:
  a cross-entropy keeps a softmax-sized buffer as large as the logits. Those
  buffers live at the end of the forward pass, before any gradient exists, so
  they add what they exceed the gradients by (a large vocabulary: the logits
  outweigh the weights). With ``remat=True``, the units are traced recomputed
  (they keep about their inputs), plus the larger of the outputs with the
  loss's buffers and the largest unit's own activations (the one being
  recomputed; the outputs are freed by then); the backward pass frees each
  unit's inputs as it makes its gradients, so those activations add what they
  exceed the gradients by (:meth:`paraml.planning.observe.Observation.activation_bytes`).

* **collectives**: with ``optimizer_shards`` > 1, what ZeRO's collectives hold beyond the above while they run, in
  buckets of ``bucket_bytes`` (:func:`paraml.parallelism.buckets.in_flight_bytes`: a round of the return of the
  updated values, a round of the all-to-all of the gradients). Within 10% of each worker's allocator peak at every
  stage under ``paraml launch -n 2`` (6x1024 MLP, Adam; tests/test_buckets.py).

The total is the peak of one training step: within 0.85-1.15 of the allocator's
measured peak for an MLP, keras_hub GPT-2 (also with a 32000-token vocabulary)
and BERT, keras.applications MobileNetV2 and ResNet50 and an LSTM, with and
without remat (``benchmarks/bench_memory.py``).

Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")])
    >>> est = estimate_memory(model, batch_size=2, optimizer="sgd")  # loss: cross-entropy of the 3 logits
    >>> est.total  # 60 params + 60 gradients + 32 batch + 24 outputs (the loss's 24 bytes: fewer than the gradients)
    176
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paraml.checks import check_int
from paraml.parallelism.buckets import check_bucket_bytes, in_flight_bytes, stage_bucket_bytes
from paraml.planning.footprint import held_bytes, largest_owner_share
from paraml.planning.observe import Observation, observation_notes, observe_units, unit_costs, variable_bytes
from paraml.planning.optimizers import optimizer_slots_per_param, slot_bytes
from paraml.planning.plan import Layout
from paraml.planning.sizes import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from paraml.planning.partition import LayerCost

__all__ = [
    "MemoryEstimate",
    "estimate_memory",
    "layer_costs",
    "memory_by_device",
    "unmeasurable_reason",
    "variable_bytes_by_device",
]


@dataclass(frozen=True)
class MemoryEstimate:
    """Training-memory estimate of a model, in bytes.

    Attributes:
        parameters: Bytes of all model variables (trainable and not).
        gradients: Bytes of the gradients (one per trainable variable).
        optimizer_slots: Bytes of the optimizer's slot variables.
        activations: Bytes of the forward activations kept for backward.
        batch_size: Batch size the activations were computed for.
        per_layer: ``(layer name, param bytes, activation bytes)`` per layer.
        note: Caveats about the estimate (e.g. activations unknown).
        collectives: Bytes ZeRO's collectives hold while they run (0 without ``optimizer_shards``).

    Example:
        >>> est = MemoryEstimate(60, 60, 120, 384, 32, (("dense", 60, 384),))
        >>> est.total
        624
        >>> "optimizer slots" in str(est)
        True
    """

    parameters: int
    gradients: int
    optimizer_slots: int
    activations: int
    batch_size: int
    per_layer: tuple[tuple[str, int, int], ...] = ()
    note: str = ""
    collectives: int = 0

    @property
    def total(self) -> int:
        """Sum of parameters, gradients, optimizer slots, activations and collectives.

        Example:
            >>> MemoryEstimate(1, 2, 3, 4, batch_size=8).total
            10
        """
        return self.parameters + self.gradients + self.optimizer_slots + self.activations + self.collectives

    def as_dict(self) -> dict[str, Any]:
        """The estimate as a plain dict (``per_layer`` as a list of dicts).

        Example:
            >>> MemoryEstimate(1, 2, 3, 4, batch_size=8).as_dict()["total"]
            10
        """
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_slots": self.optimizer_slots,
            "activations": self.activations,
            "collectives": self.collectives,
            "total": self.total,
            "batch_size": self.batch_size,
            "per_layer": [{"layer": name, "param_bytes": p, "activation_bytes": a} for name, p, a in self.per_layer],
            "note": self.note,
        }

    def __str__(self) -> str:
        rows = [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer slots", self.optimizer_slots),
            ("activations", self.activations),
            *([("collectives", self.collectives)] if self.collectives else []),
            ("total", self.total),
        ]
        w_name = max(len(r[0]) for r in rows)
        w_bytes = max(len(f"{r[1]:,}") for r in rows)
        w_size = max(len(format_bytes(r[1])) for r in rows)
        lines = [f"Estimated training memory (batch size {self.batch_size})"]
        rule = "-" * (w_name + w_bytes + w_size + 4)
        lines.append(f"{'category'.ljust(w_name)}  {'bytes'.rjust(w_bytes)}  {'size'.rjust(w_size)}")
        lines.append(rule)
        for i, (name, value) in enumerate(rows):
            if i == len(rows) - 1:
                lines.append(rule)
            lines.append(f"{name.ljust(w_name)}  {f'{value:,}'.rjust(w_bytes)}  {format_bytes(value).rjust(w_size)}")
        if self.per_layer:
            w_layer = max(len("layer"), *(len(n) for n, _, _ in self.per_layer))
            lines.append("")
            lines.append(f"{'layer'.ljust(w_layer)}  {'parameters':>12}  {'activations':>12}")
            for name, p, a in self.per_layer:
                lines.append(f"{name.ljust(w_layer)}  {format_bytes(p):>12}  {format_bytes(a):>12}")
        if self.note:
            lines.append("")
            lines.append(f"note: {self.note}")
        return "\n".join(lines)


def unmeasurable_reason(model: Any) -> str:
    """Why :func:`estimate_memory` cannot measure the ``keras.Model`` ``model``, with what would let it; ``""`` when
    it can try (a probe batch may still fail: :attr:`paraml.planning.observe.Observation.problem`).

    The memory is measured by tracing one call of the model, so a model without a ``call`` of its own (a GAN whose own
    ``train_step`` calls its parts) cannot be measured whole, and an unbuilt one not yet.

    Example:
        >>> import keras
        >>> unmeasurable_reason(keras.Sequential([keras.layers.Dense(2)], name="lazy")).split(":")[0]
        "model 'lazy' is not built"
        >>> unmeasurable_reason(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
        ''
    """
    import keras

    if type(model).call in (keras.Model.call, keras.layers.Layer.call):  # Keras' own: it raises NotImplementedError
        parts = [name for name, value in vars(model).items() if isinstance(value, keras.Model)]
        measure = ", ".join(f"estimate_memory(model.{name})" for name in parts) or "estimate_memory(part)"
        return (
            f"model {model.name!r} has no call of its own to trace (as a GAN whose own train_step calls its parts); "
            f"its parts can be measured one by one: {measure}"
        )
    if not model.built:
        return (
            f"model {model.name!r} is not built: start it with keras.Input(...), or call model.build(input_shape) or "
            "the model on a batch, before it is measured"
        )
    return ""


def _resolve_model(model: Any) -> Any:
    import keras

    if not isinstance(model, keras.Model) and callable(model):
        model = model()
    if not isinstance(model, keras.Model):
        raise ValueError(f"expected a keras.Model or a zero-argument callable returning one, got {model!r}")
    reason = unmeasurable_reason(model)
    if reason:
        raise ValueError(reason)
    return model


def estimate_memory(
    model: Any | Callable[[], Any],
    *,
    batch_size: int = 32,
    optimizer: Any = "adam",
    exact_slots: bool = True,
    remat: bool = False,
    sample: Any = None,
    optimizer_shards: int = 1,
    zero_stage: int = 1,
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    observation: Observation | None = None,
    loss: Any = None,
    targets: Any = None,
    bucket_bytes: int | None = None,
) -> MemoryEstimate:
    """Estimate the memory needed to train ``model`` (see the module docstring).

    Args:
        model: A built ``keras.Model``, or a zero-argument callable returning one.
        batch_size: Batch size used for the activation estimate.
        optimizer: An optimizer name (``"adam"``), config or instance.  It is
            not modified: a fresh copy is built on the model's variables.
        exact_slots: If true (default), the slot bytes are counted by building
            a fresh optimizer on the model's trainable variables, which
            temporarily allocates those slots.  If false, or if that fails,
            ``trainable bytes * optimizer_slots_per_param(optimizer)`` is used.
        remat: The estimate with recompute (``Parallel(..., remat=True)``, :mod:`paraml.parallelism.remat`).
        sample: A batch of the model's inputs (any number of rows) whose shapes, dtypes and values the measurement
            uses: give one when the model leaves its sequence length or image size unknown.
        optimizer_shards: The optimizer slots split over this many devices as ``shard_optimizer=True`` splits them
            (each variable's slots on one owner, owners balanced by bytes): the slots of the device holding most.
        zero_stage: With ``optimizer_shards`` > 1, what else is sharded (:mod:`paraml.parallelism.zero`): 1 the slots
            only (``shard_optimizer``); 2 also the reduced gradients (``shard_gradients``), counted as 1 (a replica
            computes its whole gradient before it is reduced, and the all-reduce's received copy that ZeRO-2 removes
            is not counted at any stage); 3 also the parameters (``shard_parameters``): the device holding most keeps
            its owner's share of the trainable variables plus the largest unit's, read where that unit runs, and
            the units recompute (as with ``remat=True``).
        tensor_parallel: The model's Dense, attention and Embedding layers split over this many devices as
            ``model_parallel``'s ``tensor_parallel`` splits them
            (:func:`paraml.parallelism.tensor_parallel.plan_splits`): the
            parameters, gradients and slots of the device holding most (the layers left whole and the largest part of
            each split one); the activations are counted whole.
        expert_parallel: The experts of the model's mixture-of-experts layers split over this many devices as
            ``model_parallel``'s ``expert_parallel`` splits them (:mod:`paraml.parallelism.experts`): the first
            device's share, counted as for ``tensor_parallel`` (the two are 1, or equal).
        observation: :func:`paraml.planning.observe.observe_units` of ``model`` to reuse (measured with recompute
            when the estimate is); measured here when None (then ``loss`` and ``targets`` are used).
        loss: The loss the model trains with, as given to ``compile`` (a name, a ``keras.losses.Loss``, a function
            ``(y_true, y_pred)``, or a list or dict of those per output). None (default): sparse categorical
            cross-entropy from logits for an output with a class axis (rank 2 or more, last dimension above 1),
            mean squared error for any other. Its buffers are counted: a cross-entropy keeps one more logits-sized
            tensor for its gradient.
        targets: A batch of targets matching ``sample``; None: zero targets of the loss's kind (the bytes do not
            depend on the values).
        bucket_bytes: With ``optimizer_shards`` > 1, the bucket of ZeRO's collectives as ``Parallel(...,
            bucket_bytes=)`` takes it (None: the default, :mod:`paraml.parallelism.buckets`), for ``collectives``.

    Raises:
        ValueError: for a model it cannot measure (:func:`unmeasurable_reason` says why), a bad batch size, an
            unknown optimizer or a bad ``bucket_bytes``.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        >>> est = estimate_memory(model, batch_size=2, optimizer="adam")
        >>> est.parameters, est.gradients, est.optimizer_slots, est.activations  # batch 32 + outputs 24
        (60, 60, 120, 56)
    """
    batch_size = check_int("batch_size", batch_size)
    model = _resolve_model(model)
    trainable = model.trainable_variables
    parameters = variable_bytes(model.weights)
    gradients = variable_bytes(trainable)
    notes: list[str] = []
    slots = _slot_bytes(optimizer, trainable, exact_slots, check_int("optimizer_shards", optimizer_shards), notes)
    if zero_stage not in (1, 2, 3):
        raise ValueError(
            f"zero_stage must be 1, 2 or 3 (what shard_optimizer, shard_gradients, shard_parameters "
            f"shard), got {zero_stage!r}"
        )
    if not isinstance(remat, bool):
        raise ValueError(f"remat must be True or False, got {remat!r}")
    check_bucket_bytes(bucket_bytes, zero_stage if optimizer_shards > 1 else 0)  # before anything is measured
    owned_parameters = zero_stage == 3 and optimizer_shards > 1
    remat = remat or owned_parameters  # ZeRO-3 reads each unit's weights again in its recomputed backward pass
    tensor_parallel = check_int("tensor_parallel", tensor_parallel)
    shards = Layout(tensor=tensor_parallel, experts=check_int("expert_parallel", expert_parallel)).shards
    if shards > 1:
        from paraml.parallelism.tensor_parallel import plan_splits

        plan = plan_splits(model, tensor_parallel, sample, expert_parallel)
        whole_gradients = gradients
        parameters = held_bytes(model.weights, plan.axes, shards)
        gradients = held_bytes(trainable, plan.axes, shards)
        slots = round(slots * gradients / max(whole_gradients, 1))  # slots in proportion to their variable's bytes
        split = "tensor-parallel" if tensor_parallel > 1 else "expert-parallel"
        notes.append(
            f"parameters, gradients and slots of the first of {shards} {split} devices (its whole "
            "layers and the largest part of each split one); activations counted whole"
        )
    if owned_parameters and shards > 1:
        raise ValueError(
            "zero_stage=3 (shard_parameters) and tensor_parallel or expert_parallel: choose one (no backend does both)"
        )
    if observation is None:
        from paraml.parallelism.remat import recomputing  # TensorFlow: only now

        observation = observe_units(
            model, sample=sample, recompute=recomputing if remat else None, loss=loss, targets=targets
        )
    costs = unit_costs(observation, batch_size, remat=remat)
    notes.extend(observation_notes(observation))
    if owned_parameters:
        share = largest_owner_share([variable_bytes([v]) for v in trainable], optimizer_shards)
        in_flight = max((c.param_bytes for c in costs), default=0)
        parameters += round(gradients * share) + in_flight - gradients
        notes.append(
            f"parameters of the device holding most of {optimizer_shards} owners, plus the largest unit's read where "
            "it runs; gradients whole (a replica computes all of its own before they are reduced)"
        )
    if remat and observation.remat_measured:
        notes.append("with remat, activations count what they exceed the gradients by (freed as those are made)")
    activations = (
        sum(c.activation_bytes for c in costs)
        if observation.problem
        else observation.activation_bytes(batch_size, remat=remat, gradient_bytes=gradients)
    )
    return MemoryEstimate(
        parameters=parameters,
        gradients=gradients,
        optimizer_slots=slots,
        activations=activations,
        batch_size=batch_size,
        per_layer=tuple((c.name, c.param_bytes, c.activation_bytes) for c in costs),
        note="; ".join(notes),
        collectives=_collective_bytes(trainable, optimizer_shards, zero_stage, bucket_bytes),
    )


def _collective_bytes(trainable: list[Any], shards: int, stage: int, bucket_bytes: int | None) -> int:
    """:func:`paraml.parallelism.buckets.in_flight_bytes` of ZeRO ``stage`` over ``shards`` replicas, its bucket as
    the plan resolves it (:func:`paraml.parallelism.buckets.stage_bucket_bytes`); 0 for ``shards`` 1."""
    if shards == 1:
        return 0
    sizes = [variable_bytes([v]) for v in trainable]
    # under shard_parameters no trainable variable is copied: none returns whole (plan_bucket_bytes)
    bucket = stage_bucket_bytes(stage, [] if stage == 3 else sizes, bucket_bytes)
    owned = round(sum(sizes) * largest_owner_share(sizes, shards))
    return in_flight_bytes(stage, shards, bucket, owned, sum(sizes))


def _slot_bytes(optimizer: Any, trainable: list[Any], exact: bool, shards: int, notes: list[str]) -> int:
    """The optimizer's slot bytes for ``trainable`` (see :func:`estimate_memory`); with ``shards`` > 1, those of the
    device holding most when each variable's slots live on one owner. Appends its caveats to ``notes``."""
    if not trainable:
        return 0
    slots: int | None = None
    if exact:
        try:
            slots = slot_bytes(optimizer, trainable)
        except ValueError:
            raise
        except Exception as err:  # e.g. a custom optimizer that cannot be copied
            notes.append(f"optimizer slots estimated from slots per parameter ({type(err).__name__}: {err})")
    if slots is None:
        slots = variable_bytes(trainable) * optimizer_slots_per_param(optimizer)
    if shards > 1:
        share = largest_owner_share([variable_bytes([v]) for v in trainable], shards)
        slots = round(slots * share)  # slots in proportion to their variable's bytes
        notes.append(f"optimizer slots of the device holding most of {shards} shards")
    return slots


def layer_costs(
    model: Any | Callable[[], Any], *, batch_size: int, remat: bool = False, sample: Any = None
) -> list[LayerCost]:
    """Per-unit :class:`paraml.planning.partition.LayerCost`, in the order one call of the model runs its units.

    ``model`` is a built ``keras.Model`` or a zero-argument callable returning one; the costs are
    :func:`paraml.planning.observe.unit_costs` of :func:`paraml.planning.observe.observe_units` (nested models are
    descended into; a layer
    called twice is one unit). ``param_bytes`` counts all of a unit's variables (trainable and not) once;
    ``activation_bytes`` is the bytes of its outputs over all its calls, scaled to ``batch_size`` rows.

    Raises:
        ValueError: for a model it cannot measure (:func:`unmeasurable_reason`) or a bad batch size.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")])
        >>> layer_costs(model, batch_size=2)  # a Dense keeps nothing of its own: its gradient reads its input
        [LayerCost(name='d', param_bytes=60, activation_bytes=0)]
    """
    batch_size = check_int("batch_size", batch_size)
    from paraml.parallelism.remat import recomputing  # TensorFlow: only now

    observed = observe_units(_resolve_model(model), sample=sample, recompute=recomputing if remat else None)
    return unit_costs(observed, batch_size, remat=remat)


def variable_bytes_by_device(variables: Sequence[Any]) -> dict[str, int]:
    """Bytes of ``variables`` on each device, read from where they live: a mirrored variable counts on every device
    holding a copy, a split one (``tensor_parallel``) each part on its device, a variable listed twice once.

    Example:
        >>> import keras
        >>> variable_bytes_by_device([keras.Variable([[1.0, 2.0]])])
        {'/device:CPU:0': 8}
    """
    totals: dict[str, int] = {}
    seen: set[int] = set()
    for variable in variables:
        value = getattr(variable, "value", variable)
        if id(value) in seen:
            continue
        seen.add(id(value))
        for part in getattr(value, "parts", None) or (value,):  # a variable split by tensor_parallel
            for copy in getattr(part, "values", None) or (part,):
                device = "/device:" + copy.device.split("device:")[-1]
                totals[device] = totals.get(device, 0) + int(copy.shape.num_elements()) * copy.dtype.size
    return dict(sorted(totals.items()))


def memory_by_device(model: Any, optimizers: Sequence[Any] = ()) -> dict[str, dict[str, int]]:
    """``{device: {"parameters": bytes, "optimizer": bytes}}``: the model's variables (trainable or not) and the
    optimizers' variables (slots and their scalars) on each device, read from where the variables live.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        >>> optimizer = keras.optimizers.Adam()
        >>> optimizer.build(model.trainable_variables)
        >>> memory_by_device(model, [optimizer])["/device:CPU:0"]["optimizer"]  # 2 slots of 60 bytes, step, rate
        132
    """
    parameters = variable_bytes_by_device(model.weights)
    state = variable_bytes_by_device([v for optimizer in optimizers for v in optimizer.variables])
    devices = sorted(set(parameters) | set(state))
    return {d: {"parameters": parameters.get(d, 0), "optimizer": state.get(d, 0)} for d in devices}
