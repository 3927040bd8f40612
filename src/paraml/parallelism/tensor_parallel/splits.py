"""Which layers of a model are split over ``tensor_parallel=T`` devices, and how: :func:`plan_splits` makes a
:class:`TensorPlan` (the ``splits`` of :class:`paraml.planning.plan.ParallelPlan`).

Columns for a ``Dense`` (or an ``EinsumDense`` computing as one), rows for the ``Dense`` a columns-split one feeds,
heads for attention, vocabulary rows for an embedding; what fits none stays whole, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paraml.internals import attention_projections, direct_sublayers, flatten_layers, own_trainable_variables
from paraml.parallelism.experts import check_experts, expert_banks
from paraml.planning.plan import Layout

__all__ = ["ATTENTION_CLASSES", "KINDS", "LayerSplit", "TensorPlan", "plan_splits"]

#: The ways a layer is split, what each means in :func:`plan_splits` and ``describe()``.
KINDS = {
    "columns": "output columns (each device computes its slice of the output)",
    "rows": "input rows (partial products added once)",
    "heads": "attention heads (partial outputs added once)",
    "vocab": "vocabulary rows (lookups added once)",
    "experts": "experts (each device holds and computes its experts; their outputs joined)",
}


@dataclass(frozen=True)
class LayerSplit:
    """How one layer is split: its path, the kind (a key of :data:`KINDS`) and its split variables' shapes."""

    layer: str
    kind: str
    shapes: tuple[tuple[int, ...], ...]

    def __str__(self) -> str:
        shapes = ", ".join("x".join(map(str, s)) for s in self.shapes)
        return f"{self.layer}: by {KINDS[self.kind]} [{shapes}]"


@dataclass
class TensorPlan:
    """Which layers of a model are split over ``tensor`` devices, and how (:func:`plan_splits`).

    Attributes:
        tensor: Devices each split layer spans (a stage's shards: tensor_parallel, or expert_parallel).
        splits: The split layers, in the model's layer order.
        axes: ``id(variable)`` of each split variable (of the model planned) -> the axis it is split on.
        kinds: ``id(layer)`` of each split layer -> its kind.
        whole: Layers with weights left whole, each with the reason.
    """

    tensor: int
    experts: int = 1
    """``expert_parallel``: devices each expert bank's experts are split over (1: none split)."""
    tensor_parallel: int | None = None
    """The ``tensor_parallel`` the plan was made for (None: ``tensor``)."""
    splits: list[LayerSplit] = field(default_factory=list)
    axes: dict[int, int] = field(default_factory=dict)
    kinds: dict[int, str] = field(default_factory=dict)
    whole: list[str] = field(default_factory=list)

    def saved_bytes(self, layer: Any) -> int:
        """Bytes of ``layer``'s variables (its sublayers' included) the split takes off the device holding most: each
        split variable's whole bytes less its largest part (:func:`paraml.planning.footprint.held_bytes`)."""
        from paraml.planning.footprint import held_bytes

        return held_bytes(layer.variables) - held_bytes(layer.variables, self.axes, self.tensor)

    def moved_to(self, source: Any, target: Any) -> TensorPlan:
        """This plan (made for model ``source``) for ``target``, a second build of the same model: layers and
        variables matched by position, named as ``target`` names them."""
        pairs = list(zip(_leaf_layers(source), _leaf_layers(target)))
        moved = TensorPlan(self.tensor, self.experts, self.tensor_parallel, whole=list(self.whole))
        path = {_path(source, s): _path(target, t) for s, t in pairs}
        moved.splits = [LayerSplit(path.get(s.layer, s.layer), s.kind, s.shapes) for s in self.splits]
        for s, t in pairs:
            if id(s) in self.kinds:
                moved.kinds[id(t)] = self.kinds[id(s)]
        for s, t in zip(source.weights, target.weights):
            if id(s) in self.axes:
                moved.axes[id(t)] = self.axes[id(s)]
        return moved

    def describe(self) -> str:
        tensor = self.tensor if self.tensor_parallel is None else self.tensor_parallel
        degrees = [f"tensor_parallel={tensor}"] if tensor > 1 or self.experts == 1 else []
        degree = ", ".join(degrees + ([f"expert_parallel={self.experts}"] if self.experts > 1 else []))
        lines = [f"{degree}: {len(self.splits)} layer(s) split"]
        lines += [f"  {s}" for s in self.splits]
        lines += [f"  whole: {w}" for w in self.whole]
        return "\n".join(lines)


def _leaf_layers(model: Any) -> list[Any]:
    """Every layer of ``model``, nested ones included, each once, in tracking order."""
    seen: set[int] = set()
    found = []
    for layer in flatten_layers(model):
        if id(layer) not in seen:
            seen.add(id(layer))
            found.append(layer)
    return found


def _plain(layer: Any) -> bool:
    """Whether a layer computes as its class says: no LoRA, no quantization (whose calls are other code)."""
    return not getattr(layer, "lora_enabled", False) and not getattr(layer, "quantization_mode", None)


#: Attention layers besides ``keras.layers.MultiHeadAttention`` (and its subclasses) whose call computes each head
#: from its own slice of the projections, reading the number of heads from the tensors only (checked against the
#: unsplit layer by tests/test_tensor_parallel.py).
ATTENTION_CLASSES = ("keras_hub.src.models.llama.llama_attention.LlamaAttention",)


def _is_attention(layer: Any) -> bool:
    import keras

    kind = type(layer)
    return isinstance(layer, keras.layers.MultiHeadAttention) or f"{kind.__module__}.{kind.__qualname__}" in (
        ATTENTION_CLASSES
    )


def _attention_projections(layer: Any, tensor: int) -> list[tuple[Any, int, str]] | None:
    """An attention layer's projections as (EinsumDense, kernel axis of the heads, 'in' or 'out'), or None when
    their kernels are not laid out as Keras lays them out (heads on kernel axis 1 in, axis 0 out) or their heads do
    not split over ``tensor`` devices. Fewer key/value heads than query heads (grouped-query attention) need both
    counts divisible by ``tensor``, so that each device's query heads have their key/value heads."""
    projections = attention_projections(layer)  # query, key, value (and gate), output
    if projections is None:
        return None
    out = projections.pop("output")
    found = []
    for dense in projections.values():
        if not _plain(dense) or len(dense.kernel.shape) != 3:
            return None
        found.append((dense, 1, "in"))
    if not _plain(out) or len(out.kernel.shape) != 3:
        return None
    found.append((out, 0, "out"))
    heads = {int(dense.kernel.shape[axis]) for dense, axis, _ in found}
    query = int(found[0][0].kernel.shape[1])
    if min(heads) < tensor or int(out.kernel.shape[0]) != query:
        return None
    if len(heads) > 1 and any(h % tensor for h in heads):
        return None
    return found


def _dense_like(layer: Any) -> bool:
    """A ``Dense``, or an ``EinsumDense`` that computes as one (``...c,cd->...d``, bias on ``d`` or none): a product
    over the input's last axis with a 2-D kernel, which splits by columns or rows."""
    import keras

    if not _plain(layer) or not layer.built:
        return False
    if type(layer) is keras.layers.Dense:
        return True
    if type(layer) is not keras.layers.EinsumDense or len(layer.kernel.shape) != 2:
        return False
    inputs, rest = layer.equation.replace("...", "").split(",")
    kernel, output = rest.split("->")
    c, d = kernel
    return (
        inputs[-1:] == c
        and output[-1:] == d
        and c not in output
        and d not in inputs
        and inputs[:-1] == output[:-1]
        and (layer.bias_axes or d) == d
    )


def _units(layer: Any) -> int:
    """Output columns of a :func:`_dense_like` layer."""
    return int(layer.kernel.shape[-1])


def _dense_edges(model: Any, dense: list[Any], sample: Any) -> list[tuple[int, int]]:
    """Pairs (i, j) of ``dense`` layers where layer j's input is layer i's output, in the order of one traced call."""
    import tensorflow as tf

    from paraml.planning.observe import probe_inputs

    produced: dict[int, tuple[Any, int]] = {}
    edges: list[tuple[int, int]] = []
    originals = {}

    def wrap(index: int, layer: Any) -> None:
        original = layer.call
        originals[index] = vars(layer).get("call")  # an instance's own call (a wrapper) is put back after

        def call(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            source = produced.get(id(inputs))
            if source is not None and source[0] is inputs:
                edges.append((source[1], index))
            output = original(inputs, *args, **kwargs)
            produced[id(output)] = (output, index)
            return output

        layer.call = call

    for index, layer in enumerate(dense):
        wrap(index, layer)
    try:
        x = probe_inputs(model)[0] if sample is None else tf.nest.map_structure(lambda a: a[:2], sample)
        tf.function(lambda x: model(x, training=True), autograph=False).get_concrete_function(
            tf.nest.map_structure(lambda a: tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)), x)
        )
    finally:
        for index, layer in enumerate(dense):
            if originals[index] is None:
                del layer.call  # the class's call again
            else:
                layer.call = originals[index]
    return edges


def plan_splits(model: Any, tensor: int, sample: Any = None, experts: int = 1) -> TensorPlan:
    """Decide which layers of ``model`` (built) are split over ``tensor`` devices and how (see the module's notes),
    and, with ``experts`` > 1, which expert banks are split by experts (:mod:`paraml.parallelism.experts`; with
    ``tensor`` 1 nothing else is split, else ``experts`` equals ``tensor``).

    A ``MultiHeadAttention`` with at least ``tensor`` heads is split by heads; an ``Embedding`` with at least
    ``tensor`` rows by vocabulary; ``Dense`` layers by columns, except one whose input is a columns-split ``Dense``'s
    output (one traced call of the model on ``sample`` or a probe batch tells), which is split by rows. A dimension
    that does not divide by ``tensor`` is shared unevenly (:func:`part_sizes`).

    Example:
        >>> import keras
        >>> mlp = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu", name="up"),
        ...                         keras.layers.Dense(8, name="down"), keras.layers.LayerNormalization(name="ln")])
        >>> print(plan_splits(mlp, 2).describe())
        tensor_parallel=2: 2 layer(s) split
          up: by output columns (each device computes its slice of the output) [8x32, 32]
          down: by input rows (partial products added once) [32x8]
          whole: ln (LayerNormalization: no split for this kind of layer)
    """
    import keras

    from paraml.checks import check_int

    # the two degrees checked as a stage's layout checks them: each 1, or equal
    shards = Layout(tensor=check_int("tensor_parallel", tensor), experts=check_int("expert_parallel", experts)).shards
    plan = TensorPlan(shards, experts, tensor_parallel=tensor)
    layers = _leaf_layers(model)
    claimed: set[int] = set()
    chosen: dict[int, tuple[str, list[tuple[Any, int]]]] = {}  # id(layer) -> (kind, [(variable, axis)])
    if experts > 1:
        banks = expert_banks(layers)
        check_experts(banks, experts, model.name)
        for bank in banks:
            chosen[id(bank)] = ("experts", [(v, 0) for v in bank.weights])
            claimed.add(id(bank))
    if tensor == 1:  # expert parallelism alone: the other layers stay whole, as they are
        layers = [layer for layer in layers if id(layer) in claimed]

    for layer in layers:
        if _is_attention(layer):
            projections = _attention_projections(layer, tensor)
            if projections is None:
                continue
            split = []
            for dense, axis, side in projections:
                claimed.add(id(dense))
                split.append((dense.kernel, axis))
                if dense.bias is not None and side == "in":
                    split.append((dense.bias, 0))  # (heads, size per head)
            chosen[id(layer)] = ("heads", split)
            claimed.add(id(layer))

    dense = [layer for layer in layers if id(layer) not in claimed and _dense_like(layer)]
    rows: set[int] = set()
    columns: set[int] = set()
    if len(dense) > 1:
        for i, j in _dense_edges(model, dense, sample):
            a, b = dense[i], dense[j]
            if id(a) in rows or id(a) in columns or id(b) in rows or id(b) in columns or _units(a) < tensor:
                continue
            columns.add(id(a))
            rows.add(id(b))
    for layer in dense:
        if id(layer) in rows:
            chosen[id(layer)] = ("rows", [(layer.kernel, 0)])
        elif _units(layer) >= tensor:
            chosen[id(layer)] = ("columns", [(layer.kernel, 1)] + ([(layer.bias, 0)] if layer.bias is not None else []))

    for layer in layers:
        if isinstance(layer, keras.layers.Embedding) and _plain(layer) and layer.input_dim >= tensor:
            split = [(layer.embeddings, 0)]
            reverse = getattr(layer, "reverse_embeddings", None)
            if reverse is not None and not getattr(layer, "tie_weights", True):
                split.append((reverse, 1))
            chosen[id(layer)] = ("vocab", split)
            claimed.add(id(layer))

    for layer in layers:
        entry = chosen.get(id(layer))
        if entry is not None:
            kind, split = entry
            plan.kinds[id(layer)] = kind
            plan.splits.append(LayerSplit(_path(model, layer), kind, tuple(tuple(v.shape) for v, _ in split)))
            plan.axes.update({id(v): axis for v, axis in split})
        elif own_trainable_variables(layer) and id(layer) not in claimed and not direct_sublayers(layer):
            plan.whole.append(f"{_path(model, layer)} ({_why_whole(layer, tensor)})")
    return plan


def _path(model: Any, layer: Any) -> str:
    """``layer``'s path inside ``model`` (Keras' path without the model's own name)."""
    path = layer.path or layer.name
    return path.split(model.name + "/", 1)[-1]  # Keras' name scopes above the model (if any) left out too


def _why_whole(layer: Any, tensor: int) -> str:
    import keras

    kind = type(layer).__name__
    if not _plain(layer):
        return f"{kind} with LoRA or quantization"
    if _dense_like(layer):
        return f"{kind} with {_units(layer)} unit(s), fewer than tensor_parallel={tensor}"
    if isinstance(layer, keras.layers.EinsumDense):
        return (
            f"EinsumDense {layer.equation!r}: split only when it computes as a Dense (...c,cd->...d) or as a "
            "projection of a known attention layer"
        )
    if _is_attention(layer):
        return f"{kind} whose heads do not split over {tensor} devices"
    if isinstance(layer, keras.layers.Embedding):
        return f"{kind} with {layer.input_dim} row(s), fewer than tensor_parallel={tensor}"
    return f"{kind}: no split for this kind of layer"
