"""Tensor parallelism: one layer's weights split over ``tensor_parallel=T`` devices (Megatron-LM's splits).

``model_parallel`` places whole layers on stages; here the large layers of each stage are split over the stage's T
devices, each device holding and computing its slice:

- **columns** (a ``Dense``, or an ``EinsumDense`` computing as one, whose output feeds another, or one that feeds
  nothing splittable): the kernel's output columns and the bias are split; each device computes its slice of the
  output (activation included).
- **rows** (the ``Dense`` a columns-split one feeds): the kernel's input rows are split; each device multiplies the
  slice of the input its partner computed, and the partial products are added once (one reduction), then the bias
  and the activation. A column-then-row pair (a transformer's feed-forward block) exchanges nothing in between.
- **heads** (``keras.layers.MultiHeadAttention`` and subclasses, as keras_hub's GPT-2 and BERT attention, and the
  classes of :data:`ATTENTION_CLASSES`, as Llama's grouped-query attention): query, key, value (and gate)
  projections split by heads, the output projection by heads' rows; each device runs the attention of its
  heads, and the partial outputs are added once, then the output bias.
- **vocab** (``Embedding``, keras_hub's ``ReversibleEmbedding``): the table's rows split; each device looks up the
  ids in its range (zeros elsewhere) and the lookups are added once. A reversible embedding's reverse call (the tied
  LM head) gives each device its slice of the logits.

Layers with weights that fit none of these (normalisations, convolutions, position embeddings) stay whole on the
stage's first device. A split layer's slices of the output are joined (concatenated) where a consumer needs the
whole tensor; a rows-split layer takes its partner's slices without joining them, and so does the cross-entropy of
split logits (:func:`sparse_categorical_crossentropy`, put into Keras' ``SparseCategoricalCrossentropy`` by
:func:`split_logits_loss`): :func:`slices_of` finds the slices of a joined tensor, and a join nothing reads is never
computed.

**The model's public face stays whole.** A split variable is a Keras variable whose value is a
:class:`WholeVariable`: a view over the parts (plain TensorFlow variables on their devices) that reads as their
concatenation, assigns by splitting, saves as one whole tensor in TensorFlow checkpoints and converts to numpy whole.
So ``get_weights``, ``set_weights``, ``predict``, ``model.save``/``load_model`` and paraml's checkpoints see whole
tensors, and a checkpoint moves between any backend and any T. The training step differentiates with respect to the
parts (:func:`trained_variables`), and the optimizer keeps each part's slots on the part's device; a checkpoint joins
them (:func:`saved_state`).

Importing this module is cheap: Keras and TensorFlow are imported inside the functions that need them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from paraml.internals import (
    VARIABLE_VALUE_KEY,
    attention_projections,
    direct_sublayers,
    flatten_layers,
    own_trainable_variables,
    trackable_base,
)

__all__ = [
    "ATTENTION_CLASSES",
    "LayerSplit",
    "SplitLayers",
    "TensorPlan",
    "WholeVariable",
    "part_sizes",
    "plan_splits",
    "is_split",
    "saved_state",
    "slices_of",
    "sparse_categorical_crossentropy",
    "split_logits_loss",
    "tag_slots",
    "trained_variables",
]

#: The ways a layer is split, what each means in :func:`plan_splits` and ``describe()``.
KINDS = {
    "columns": "output columns (each device computes its slice of the output)",
    "rows": "input rows (partial products added once)",
    "heads": "attention heads (partial outputs added once)",
    "vocab": "vocabulary rows (lookups added once)",
}

_PARTS = "_paraml_parts"  # on a split Keras variable: its parts, as Keras variables
_PART = "_paraml_part"  # on a part: (the whole Keras variable, the part's index)
_SLOT_OF = "_paraml_slot_of"  # on an optimizer slot of a part: (the whole Keras variable, the part's index, ordinal)


def part_sizes(size: int, parts: int) -> list[int]:
    """``size`` rows shared by ``parts`` devices, the first ``size % parts`` taking one more.

    >>> part_sizes(10, 4)
    [3, 3, 2, 2]
    """
    return [size // parts + (1 if k < size % parts else 0) for k in range(parts)]


class _Whole:
    """The base :func:`WholeVariable`'s class (made on first use, with TensorFlow) carries, for ``isinstance``."""


_WHOLE_CLASS: list[type] = []


def _whole_class() -> type:
    """:class:`WholeVariable`'s implementation, made (and its tensor conversion registered) on first use."""
    if _WHOLE_CLASS:
        return _WHOLE_CLASS[0]
    import numpy as np
    import tensorflow as tf

    class WholeVariableImpl(trackable_base(), _Whole):
        def __init__(self, parts: Sequence[Any], axis: int, name: str) -> None:
            self.parts = list(parts)
            self.axis = axis
            self._name = name
            shapes = [list(p.shape) for p in self.parts]
            whole = shapes[0][:]
            whole[axis] = sum(s[axis] for s in shapes)
            self._shape = tf.TensorShape(whole)

        dtype = property(lambda self: self.parts[0].dtype)
        shape = property(lambda self: self._shape)
        name = property(lambda self: self._name)
        trainable = property(lambda self: self.parts[0].trainable)
        device = property(lambda self: self.parts[0].device)

        def read_value(self) -> Any:
            return tf.concat([tf.convert_to_tensor(p) for p in self.parts], self.axis)

        def numpy(self) -> Any:
            return self.read_value().numpy()

        def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
            del copy
            return np.asarray(self.numpy(), dtype=dtype)

        def assign(self, value: Any, use_locking: Any = None, name: Any = None, read_value: bool = True) -> Any:
            del use_locking, name, read_value
            value = tf.convert_to_tensor(value, dtype=self.dtype)
            sizes = [int(p.shape[self.axis]) for p in self.parts]
            for part, piece in zip(self.parts, tf.split(value, sizes, axis=self.axis)):
                part.assign(piece)
            return self

        # A TensorFlow checkpoint stores the whole tensor under the key a plain variable uses, so one written here
        # restores into a plain variable, and the other way round.
        def _serialize_to_tensors(self) -> dict[str, Any]:
            return {VARIABLE_VALUE_KEY: self.read_value()}

        def _restore_from_tensors(self, restored_tensors: dict[str, Any]) -> Any:
            return self.assign(restored_tensors[VARIABLE_VALUE_KEY])

        def __repr__(self) -> str:
            shape = tuple(self._shape)
            return f"<WholeVariable {self._name!r} shape={shape} in {len(self.parts)} parts on axis {self.axis}>"

    def convert(value: Any, dtype: Any = None, name: Any = None, as_ref: bool = False) -> Any:
        del name, as_ref
        whole = value.read_value()
        return whole if dtype is None or tf.as_dtype(dtype) == whole.dtype else tf.cast(whole, dtype)

    tf.register_tensor_conversion_function(WholeVariableImpl, convert)
    WholeVariableImpl.__name__ = WholeVariableImpl.__qualname__ = "WholeVariable"
    _WHOLE_CLASS.append(WholeVariableImpl)
    return WholeVariableImpl


def WholeVariable(parts: Sequence[Any], axis: int, name: str) -> Any:  # noqa: N802 (a class made on first use)
    """A variable made of ``parts`` (TensorFlow variables, each on its device) joined along ``axis``: reads as their
    concatenation, ``assign`` splits, a TensorFlow checkpoint stores it whole, numpy converts it whole.

    >>> import tensorflow as tf
    >>> whole = WholeVariable([tf.Variable([[1.0], [2.0]]), tf.Variable([[3.0], [4.0]])], axis=1, name="w")
    >>> whole.numpy().tolist(), tuple(whole.shape)
    ([[1.0, 3.0], [2.0, 4.0]], (2, 2))
    """
    return _whole_class()(parts, axis, name)


def _is_whole(value: Any) -> bool:
    return isinstance(value, _Whole)


# -- planning ----------------------------------------------------------------------------------------------------------
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
        tensor: Devices each split layer spans.
        splits: The split layers, in the model's layer order.
        axes: ``id(variable)`` of each split variable (of the model planned) -> the axis it is split on.
        kinds: ``id(layer)`` of each split layer -> its kind.
        whole: Layers with weights left whole, each with the reason.
    """

    tensor: int
    splits: list[LayerSplit] = field(default_factory=list)
    axes: dict[int, int] = field(default_factory=dict)
    kinds: dict[int, str] = field(default_factory=dict)
    whole: list[str] = field(default_factory=list)

    def split_bytes(self, layer: Any) -> int:
        """Bytes of ``layer``'s variables (its sublayers' included) that are split."""
        from paraml.planning.sizes import nbytes

        return sum(nbytes(v) for v in layer.variables if id(v) in self.axes)

    def moved_to(self, source: Any, target: Any) -> TensorPlan:
        """This plan (made for model ``source``) for ``target``, a second build of the same model: layers and
        variables matched by position, named as ``target`` names them."""
        pairs = list(zip(_leaf_layers(source), _leaf_layers(target)))
        moved = TensorPlan(self.tensor, whole=list(self.whole))
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
        lines = [f"tensor_parallel={self.tensor}: {len(self.splits)} layer(s) split"]
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


def _product(layer: Any, x: Any, kernel: Any) -> Any:
    """``x`` times ``kernel`` (a part of ``layer``'s) as ``layer`` computes it."""
    import keras

    if hasattr(layer, "equation"):
        return keras.ops.einsum(layer.equation, x, kernel)
    return keras.ops.matmul(x, kernel)


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


def plan_splits(model: Any, tensor: int, sample: Any = None) -> TensorPlan:
    """Decide which layers of ``model`` (built) are split over ``tensor`` devices and how (see the module's notes).

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

    check_int("tensor_parallel", tensor)
    plan = TensorPlan(tensor)
    layers = _leaf_layers(model)
    claimed: set[int] = set()
    chosen: dict[int, tuple[str, list[tuple[Any, int]]]] = {}  # id(layer) -> (kind, [(variable, axis)])

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


# -- training and checkpoints -----------------------------------------------------------------------------------------
def trained_variables(model: Any) -> list[Any]:
    """``model.trainable_variables`` with each split variable replaced by its parts: what the gradient is taken with
    respect to and what the optimizer updates (each part's slots on the part's device)."""
    return [p for v in model.trainable_variables for p in getattr(v, _PARTS, (v,))]


def tag_slots(optimizer: Any) -> None:
    """Mark each slot ``optimizer`` creates for a part of a split variable (a Keras optimizer creates a slot from its
    variable), so that :func:`saved_state` joins a variable's slots into one whole slot."""
    for target in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if target is None or "add_variable_from_reference" in vars(target):
            continue
        original = target.add_variable_from_reference
        made: dict[int, int] = {}

        def add_variable_from_reference(
            reference: Any,
            *args: Any,
            original: Callable[..., Any] = original,
            made: dict[int, int] = made,
            **kwargs: Any,
        ) -> Any:
            slot = original(reference, *args, **kwargs)
            part = getattr(reference, _PART, None)
            if part is not None:
                ordinal = made.get(id(reference), 0)
                made[id(reference)] = ordinal + 1
                setattr(slot, _SLOT_OF, (part[0], part[1], ordinal))
            return slot

        target.add_variable_from_reference = add_variable_from_reference


def saved_state(variables: Sequence[Any]) -> list[Any]:
    """``variables`` (an optimizer's, Keras variables) as a checkpoint holds them: each split variable's slots joined
    into one :class:`WholeVariable` at the first part's position, the other parts' slots left out, so the list is the
    one a model whose variables are whole has. Other variables: their value."""
    joined: dict[tuple[int, int], list[Any]] = {}
    for v in variables:
        tag = getattr(v, _SLOT_OF, None)
        if tag is not None:
            joined.setdefault((id(tag[0]), tag[2]), []).append((tag[1], v.value))
    state = []
    for v in variables:
        tag = getattr(v, _SLOT_OF, None)
        if tag is None:
            state.append(v.value)
        elif tag[1] == 0:
            parts = [value for _, value in sorted(joined[(id(tag[0]), tag[2])], key=lambda item: item[0])]
            state.append(WholeVariable(parts, tag[0].value.axis, v.name))
    return state


# -- computation -------------------------------------------------------------------------------------------------------
class SplitLayers:
    """Makes the split layers of a built model compute on their parts: each split layer's ``call`` (the instance
    attribute, the public method) replaced by its split computation.

    ``devices(layer)`` gives the devices of the layer's parts for the replica being traced, in part order.
    """

    def __init__(self, plan: TensorPlan, devices: Callable[[Any], Sequence[str]]) -> None:
        self.plan = plan
        self.devices = devices
        self._shard: int | None = None  # the part being traced inside a heads-split attention layer

    def attach(self, model: Any) -> None:
        """Give each split variable of ``model`` its parts as Keras variables, and wrap the split layers' calls."""
        import keras

        for v in model.weights:
            if _is_whole(v.value) and not hasattr(v, _PARTS):
                parts = [_keras_part(v, k, p) for k, p in enumerate(v.value.parts)]
                setattr(v, _PARTS, parts)
        for layer in _leaf_layers(model):
            kind = self.plan.kinds.get(id(layer))
            if kind == "heads":
                self._heads(layer)
            elif kind == "columns":
                self._columns(layer)
            elif kind == "rows":
                self._rows(layer)
            elif kind == "vocab":
                self._vocab(layer, isinstance(layer, keras.layers.Embedding) and hasattr(layer, "tie_weights"))

    def _split(self, x: Any, sizes: list[int], axis: int) -> list[Any]:
        import tensorflow as tf

        pieces = slices_of(x, axis)
        if pieces is not None and [int(p.shape[axis]) for p in pieces] == sizes:
            return pieces
        return tf.split(x, sizes, axis=axis)

    def _columns(self, layer: Any) -> None:
        import keras

        kernel, bias = _parts(layer.kernel), _parts(layer.bias)

        def call(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            del args, kwargs
            import tensorflow as tf

            pieces = []
            for k, device in enumerate(self.devices(layer)):
                with tf.device(device):
                    y = _product(layer, inputs, kernel[k].value)
                    if bias is not None:
                        y = keras.ops.add(y, bias[k].value)
                    pieces.append(layer.activation(y) if layer.activation is not None else y)
            return _joined(pieces, axis=-1)

        layer.call = call

    def _rows(self, layer: Any) -> None:
        import keras

        kernel = _parts(layer.kernel)
        sizes = [int(p.shape[0]) for p in kernel]

        def call(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            del args, kwargs
            import tensorflow as tf

            pieces = self._split(inputs, sizes, axis=-1)
            partial = []
            for k, device in enumerate(self.devices(layer)):
                with tf.device(device):
                    partial.append(_product(layer, pieces[k], kernel[k].value))
            y = tf.add_n(partial)  # the one reduction
            if layer.bias is not None:
                y = keras.ops.add(y, layer.bias.value)
            return layer.activation(y) if layer.activation is not None else y

        layer.call = call

    def _heads(self, layer: Any) -> None:
        import keras

        projections = _attention_projections(layer, self.plan.tensor)
        assert projections is not None
        original = layer.call
        out = projections[-1][0]

        def call(*args: Any, **kwargs: Any) -> Any:
            import tensorflow as tf

            if kwargs.get("cache") is not None:  # generation with a whole key/value cache: the projections join
                return original(*args, **kwargs)
            results = []
            for k, device in enumerate(self.devices(layer)):
                previous, self._shard = self._shard, k
                try:
                    with tf.device(device):
                        results.append(original(*args, **kwargs))
                finally:
                    self._shard = previous
            first = [r[0] if isinstance(r, tuple) else r for r in results]
            y = tf.add_n(first)  # the one reduction
            if out.bias is not None:
                y = keras.ops.add(y, out.bias.value)
            if out.activation is not None:
                y = out.activation(y)
            if not isinstance(results[0], tuple):
                return y
            # return_attention_scores: (batch, heads, ...) scores, joined by heads
            return (y, *(tf.concat([r[i] for r in results], axis=1) for i in range(1, len(results[0]))))

        layer.call = call
        for dense, _, side in projections:
            self._projection(layer, dense, side)

    def _projection(self, attention: Any, dense: Any, side: str) -> None:
        """An attention layer's projection: in the traced part ``k`` (:meth:`_heads`), its heads' slice; outside one
        (a cached generation step), the whole computation from the parts."""
        import keras
        import tensorflow as tf

        kernel, bias = _parts(dense.kernel), _parts(dense.bias) if side == "in" else None
        inputs_spec, rest = dense.equation.split(",")
        kernel_spec, output_spec = rest.split("->")
        heads = kernel_spec[1] if side == "in" else kernel_spec[0]
        heads_axis = output_spec.index(heads) if side == "in" else inputs_spec.index(heads)
        sizes = [int(p.shape[1 if side == "in" else 0]) for p in kernel]

        def one(inputs: Any, k: int) -> Any:
            y = keras.ops.einsum(dense.equation, inputs, kernel[k].value)
            if side == "in":
                if bias is not None:
                    y = keras.ops.add(y, bias[k].value)
                if dense.activation is not None:
                    y = dense.activation(y)
            return y

        def call(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            del args, kwargs
            if self._shard is not None:
                return one(inputs, self._shard)
            devices = self.devices(attention)
            if side == "in":
                pieces = []
                for k, device in enumerate(devices):
                    with tf.device(device):
                        pieces.append(one(inputs, k))
                return _joined(pieces, axis=heads_axis)
            pieces = self._split(inputs, sizes, axis=heads_axis)
            partial = []
            for k, device in enumerate(devices):
                with tf.device(device):
                    partial.append(one(pieces[k], k))
            y = tf.add_n(partial)
            if dense.bias is not None:
                y = keras.ops.add(y, dense.bias.value)
            return dense.activation(y) if dense.activation is not None else y

        dense.call = call

    def _vocab(self, layer: Any, reversible: bool) -> None:
        import keras
        import tensorflow as tf

        table = _parts(layer.embeddings)
        sizes = [int(p.shape[0]) for p in table]
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        reverse_parts = _parts(getattr(layer, "reverse_embeddings", None)) if reversible else None

        def lookup(inputs: Any) -> Any:
            ids = inputs if inputs.dtype in ("int32", "int64") else keras.ops.cast(inputs, "int32")
            pieces = []
            for k, device in enumerate(self.devices(layer)):
                with tf.device(device):
                    local = ids - tf.cast(starts[k], ids.dtype)
                    inside = tf.logical_and(local >= 0, local < sizes[k])
                    rows = tf.gather(table[k].value, tf.where(inside, local, tf.zeros_like(local)))
                    pieces.append(rows * tf.cast(inside, rows.dtype)[..., None])
            return keras.ops.cast(tf.add_n(pieces), layer.compute_dtype)  # the one reduction

        def logits(inputs: Any) -> Any:
            pieces = []
            for k, device in enumerate(self.devices(layer)):
                with tf.device(device):
                    kernel = keras.ops.transpose(table[k].value) if layer.tie_weights else reverse_parts[k].value
                    x = inputs
                    if layer.reverse_dtype is not None:
                        x, kernel = keras.ops.cast(x, layer.reverse_dtype), keras.ops.cast(kernel, layer.reverse_dtype)
                    y = keras.ops.matmul(x, kernel)
                    if layer.logit_soft_cap is not None:
                        y = keras.ops.multiply(keras.ops.tanh(y / layer.logit_soft_cap), layer.logit_soft_cap)
                    pieces.append(y)
            return _joined(pieces, axis=-1)

        def call(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            reverse = kwargs.get("reverse", args[0] if args else False)
            return logits(inputs) if reversible and reverse else lookup(inputs)

        layer.call = call


#: The attribute of a traced graph holding its joined tensors' slices: ``id(joined) -> (joined, slices, axis)``. A
#: split layer's output is joined for the consumers that need it whole; a rows-split layer or the cross-entropy takes
#: the slices without the join (TensorFlow then never computes the join: nothing reads it). The entries live with the
#: graph they were traced in and go with it; an eager call keeps none (its slices are freed with the call).
GRAPH_SLICES = "paraml_split_slices"


def _joined(pieces: list[Any], axis: int) -> Any:
    """A split layer's slices of its output joined along ``axis``; in a traced graph, the slices kept for
    :func:`slices_of`."""
    import tensorflow as tf

    whole = tf.concat(pieces, axis=axis)
    if not tf.executing_eagerly():
        graph = whole.graph  # a graph has slots, no __dict__: the attribute is set, not found in vars()
        if getattr(graph, GRAPH_SLICES, None) is None:
            setattr(graph, GRAPH_SLICES, {})
        getattr(graph, GRAPH_SLICES)[id(whole)] = (whole, pieces, axis)
    return whole


def slices_of(x: Any, axis: int = -1) -> list[Any] | None:
    """The slices a split layer joined along ``axis`` into ``x`` (or into the tensor ``x`` is a cast of: a loss casts
    its input), each on its device; None for any other tensor, and for any eager one."""
    import tensorflow as tf

    if tf.executing_eagerly():
        return None
    graph = getattr(x, "graph", None)
    entry = (getattr(graph, GRAPH_SLICES, None) or {}).get(id(x))
    rank = getattr(getattr(x, "shape", None), "rank", None)
    if entry is not None and entry[0] is x and rank and entry[2] % rank == axis % rank:
        return entry[1]
    op = getattr(x, "op", None)
    if op is not None and op.type == "Cast" and not tf.executing_eagerly():
        inner = slices_of(op.inputs[0], axis)
        if inner is not None:
            cast = []
            for piece in inner:
                with tf.device(piece.device):
                    cast.append(tf.cast(piece, x.dtype))
            return cast
    return None


def sparse_categorical_crossentropy(
    y_true: Any, y_pred: Any, from_logits: bool = False, ignore_class: int | None = None, axis: int = -1
) -> Any:
    """Keras' ``sparse_categorical_crossentropy``; on logits a split layer left in slices along the class axis (the
    tied LM head or a columns-split last ``Dense`` under ``tensor_parallel``), computed on the slices
    (vocabulary-parallel, as Megatron-LM does): each device takes the maximum, the sum of exponentials and the target
    logit of its slice, and only those (one value per token) are combined. Neither the whole logits nor their gradient
    is made on one device. Elsewhere (other tensors, probabilities, ``ignore_class``) it is Keras' own.

    :func:`split_logits_loss` puts it into a ``keras.losses.SparseCategoricalCrossentropy``; a loss function of one's
    own can call it in place of Keras'.
    """
    import keras
    import tensorflow as tf

    pieces = slices_of(y_pred, axis) if from_logits and ignore_class is None else None
    if pieces is None or tf.executing_eagerly():
        return keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=from_logits, ignore_class=ignore_class, axis=axis
        )
    labels = tf.convert_to_tensor(y_true)
    if labels.shape.rank == y_pred.shape.rank and labels.shape[-1] == 1:
        labels = tf.squeeze(labels, -1)
    labels = tf.cast(labels, "int32")
    highest, sums, targets = [], [], []
    for piece in pieces:
        with tf.device(piece.device):
            highest.append(tf.reduce_max(tf.stop_gradient(piece), axis=-1))
    shift = tf.reduce_max(tf.stack(highest), axis=0)  # one value per token; the loss does not depend on it
    start = 0
    for piece in pieces:
        size = int(piece.shape[-1])
        with tf.device(piece.device):
            sums.append(tf.reduce_sum(tf.exp(piece - shift[..., None]), axis=-1))
            local = labels - start
            inside = tf.logical_and(local >= 0, local < size)
            picked = tf.gather(piece, tf.where(inside, local, 0), axis=-1, batch_dims=labels.shape.rank)
            targets.append(tf.where(inside, picked, tf.zeros_like(picked)))
        start += size
    return tf.math.log(tf.add_n(sums)) + shift - tf.add_n(targets)


def split_logits_loss(loss: Any) -> Any:
    """``loss`` with its cross-entropy computed on split logits (:func:`sparse_categorical_crossentropy`) when it is a
    ``keras.losses.SparseCategoricalCrossentropy`` on logits (a copy; its configuration, and so a saved model's, is
    Keras' own); any other loss as it is. A structure of losses (one per output) is mapped."""
    import keras

    if isinstance(loss, (list, tuple)):
        return type(loss)(split_logits_loss(item) for item in loss)
    if isinstance(loss, dict):
        return {key: split_logits_loss(item) for key, item in loss.items()}
    if type(loss) is keras.losses.SparseCategoricalCrossentropy and loss.from_logits and loss.ignore_class is None:
        copy = keras.losses.SparseCategoricalCrossentropy.from_config(loss.get_config())
        copy.fn = sparse_categorical_crossentropy
        return copy
    return loss


def is_split(model: Any) -> bool:
    """Whether some weight of ``model`` is split over devices (``tensor_parallel``)."""
    return any(hasattr(v, _PARTS) for v in model.weights)


def _parts(variable: Any) -> list[Any] | None:
    """A split Keras variable's parts (Keras variables); None for None."""
    if variable is None:
        return None
    return getattr(variable, _PARTS)


def _keras_part(whole: Any, k: int, part: Any) -> Any:
    """A Keras variable over ``part`` (an existing TensorFlow variable), marked as part ``k`` of ``whole``."""
    import keras
    import tensorflow as tf

    def existing(next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        del next_creator, kwargs
        return part

    def unused(shape: Any, dtype: Any = None) -> None:  # the creator above returns ``part`` without calling it
        del shape, dtype

    with tf.variable_creator_scope(existing):
        variable = keras.Variable(
            unused, shape=part.shape, dtype=part.dtype.name, trainable=whole.trainable, name=f"{whole.name}_part{k}"
        )
    setattr(variable, _PART, (whole, k))
    return variable
