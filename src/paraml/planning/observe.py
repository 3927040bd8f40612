"""Model introspection for staging: a model's units, the order one call runs them, and their memory costs.

A **unit** is a layer that is not itself a ``keras.Model`` (:func:`model_units`): nested models are descended into,
input layers are left out and a layer reachable twice is one unit. :func:`observe_units` traces one training step of
the model (forward and gradient) on two small batches (:func:`probe_inputs`) with every unit's ``call`` wrapped. That
gives the pipeline order and, per unit, its **activations**: the bytes of the tensors its forward pass creates that the
gradient reads, i.e. what the step keeps alive for the backward pass (the tensors are counted in the traced graph; a
``while`` loop's per-step accumulators by their length after one run). Two batch sizes separate bytes that grow with
the batch from bytes that do not (:class:`RowBytes`). :func:`unit_costs` turns an :class:`Observation` into the
:class:`paraml.planning.partition.LayerCost` list the planners take, and :func:`observation_notes` says what the
numbers rest
on.

Importing this module is cheap: Keras and TensorFlow are imported inside the functions that need them.

Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh", name="d")])
    >>> unit_costs(observe_units(model), batch_size=2)  # tanh's gradient reads its output: 2 x 3 float32
    [LayerCost(name='d', param_bytes=60, activation_bytes=24)]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

from paraml.checks import check_int
from paraml.internals import tensor_list_element_dtype, while_body_graph
from paraml.planning.partition import LayerCost
from paraml.planning.schedules import Schedule
from paraml.planning.sizes import dtype_size, nbytes

__all__ = [
    "HostModel",
    "Observation",
    "PROBE_DIMS",
    "PROBE_ROWS",
    "RowBytes",
    "StageHolding",
    "Unit",
    "build_on_host",
    "model_units",
    "nested_layers",
    "observation_notes",
    "observe_units",
    "probe_inputs",
    "unit_costs",
    "variable_bytes",
]

#: Rows of the two batches a model's training step is traced on to measure its units (:func:`observe_units`).
PROBE_ROWS = (2, 4)
#: Sizes tried, in order, for the non-batch dimensions a model leaves unknown (a sequence length, an image side).
PROBE_DIMS = (8, 1, 32)

#: Units named at most in the note listing units whose activations are unknown.
_MAX_NAMES_IN_NOTES = 8

#: Ops whose outputs are not activations: the batch itself (counted apart), constants and reads of variables.
_NOT_ACTIVATIONS = frozenset({"Placeholder", "Const", "ReadVariableOp", "VarHandleOp"})
#: Ops that read only a tensor's shape and dtype: they run as soon as the tensor exists, so they keep nothing alive.
_SHAPE_READERS = frozenset({"Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike"})
#: Ops whose outputs are their inputs' buffers under other names or shapes (IdentityN: output i is input i).
_ALIASES = frozenset({"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims"})


@dataclass(frozen=True)
class RowBytes:
    """Bytes that grow linearly with the batch: ``constant + per_row * rows``.

    Fitted on two measurements (:meth:`fit`): what grows with the batch (a layer's output) and what does not (a
    causal mask, a copy of a recurrent kernel per time step) are told apart.

    Example:
        >>> RowBytes.fit((2, 4), (120, 200)).at(10)
        440
    """

    constant: float = 0.0
    per_row: float = 0.0

    @classmethod
    def fit(cls, rows: tuple[int, int], values: tuple[int, int]) -> RowBytes:
        """The line through ``(rows[0], values[0])`` and ``(rows[1], values[1])``."""
        per_row = (values[1] - values[0]) / (rows[1] - rows[0])
        return cls(values[0] - per_row * rows[0], per_row)

    def at(self, rows: int) -> int:
        """Bytes for ``rows`` rows (never below 0)."""
        return max(0, round(self.constant + self.per_row * rows))

    def __add__(self, other: RowBytes) -> RowBytes:
        return RowBytes(self.constant + other.constant, self.per_row + other.per_row)


@dataclass(frozen=True)
class Unit:
    """One unit of computation of a model: a layer that is not itself a model, as one call of the model ran it.

    Attributes:
        name: A name unique within the model (the layer's name, prefixed by its parent model's if it is not unique).
        layer: The ``keras.layers.Layer``.
        param_bytes: Bytes of the layer's variables (trainable or not), counted once however often it is called.
        calls: How many times the observed call of the model called the layer.
        activations: Bytes the unit's forward pass keeps for the backward pass, over all its calls (see
            :func:`observe_units`); its outputs' bytes when the gradient could not be traced, 0 when the layer was
            not called.
        recomputed: The same with the unit recomputed in the backward pass (``remat``; then it keeps about its
            inputs), or None when that was not measured.
    """

    name: str
    layer: Any
    param_bytes: int
    calls: int = 0
    activations: RowBytes = RowBytes()
    recomputed: RowBytes | None = None

    def activation_bytes(self, batch_size: int, remat: bool = False) -> int:
        """Activation bytes for ``batch_size`` rows, with the unit recomputed if ``remat`` (and that was measured).

        Example:
            >>> Unit("d", None, param_bytes=60, calls=1, activations=RowBytes(0, 12)).activation_bytes(5)
            60
        """
        measured = self.recomputed if remat and self.recomputed is not None else self.activations
        return measured.at(batch_size)


@dataclass(frozen=True)
class Observation:
    """The units of a model in the order one call of the model ran them, and their costs (see :func:`observe_units`).

    Attributes:
        units: Every unit: first those the call ran, in the order of their first call, then those it never called.
        batch: Bytes of the model's inputs (the batch itself).
        outputs: Bytes of the model's outputs (at the start of the backward pass their gradient, as large, is alive).
        loss: Bytes the loss's own forward keeps for its gradient (sparse cross-entropy's softmax-sized backprop,
            a squared error's difference: about one more output-sized buffer; its scalars left out), or 0 when the
            step was traced without the loss (``loss_problem``).
        problem: Why the model could not be called (then ``units`` are in declaration order), or ``""``.
        probe_dims: The size given to non-batch dimensions the model leaves unknown, or None if there were none.
        gradient_problem: Why the gradient could not be traced (then activations are the units' outputs), or ``""``.
        loss_problem: Why the step was traced without the loss (the gradient of the outputs alone), or ``""``.
    """

    units: tuple[Unit, ...]
    batch: RowBytes = RowBytes()
    outputs: RowBytes = RowBytes()
    problem: str = ""
    probe_dims: int | None = None
    gradient_problem: str = ""
    loss: RowBytes = RowBytes()
    loss_problem: str = ""

    @property
    def remat_measured(self) -> bool:
        """Whether the units' activations with recompute were measured (``observe_units(..., recompute=...)``)."""
        return any(u.recomputed is not None for u in self.units)

    def activation_bytes(self, batch_size: int, remat: bool = False, gradient_bytes: int = 0) -> int:
        """Activation bytes at the peak of one training step for ``batch_size`` rows, when the step also holds
        ``gradient_bytes`` of gradients at its end (counted apart by the caller).

        Without ``remat``: the batch, every unit's activations and the outputs (at the start of the backward pass,
        everything the forward kept is alive, with the outputs' gradient as large as they are). The loss's own buffers
        (:attr:`loss`) are alive at the end of the forward pass, before any gradient exists, and freed by the first
        ops of the backward pass: they add only what they exceed ``gradient_bytes`` by (the peak is the larger of
        the two moments). For a large vocabulary they do: a cross-entropy's softmax-sized buffer is as large as the
        logits.

        With ``remat``: the batch, the units' recomputed activations (their inputs), and the larger of the outputs
        with the loss's buffers (the end of the forward pass) and the largest unit's own activations (the unit being
        recomputed; the outputs are freed by then). The backward pass frees each unit's inputs as it makes the
        unit's gradients, so that sum and the gradients are not alive at once either: it adds only what it exceeds
        ``gradient_bytes`` by.

        Example:
            >>> units = (Unit("d", None, 60, 1, RowBytes(0, 12)),)
            >>> obs = Observation(units, batch=RowBytes(0, 16), outputs=RowBytes(0, 8), loss=RowBytes(0, 8))
            >>> obs.activation_bytes(10), obs.activation_bytes(10, gradient_bytes=60)  # 360 + the loss's 80 - 60
            (440, 380)
        """
        batch, outputs, loss = self.batch.at(batch_size), self.outputs.at(batch_size), self.loss.at(batch_size)
        if remat and self.remat_measured:
            kept = sum(u.activation_bytes(batch_size, remat) for u in self.units)
            largest = max((u.activations.at(batch_size) for u in self.units), default=0)
            return max(0, batch + kept + max(outputs + loss, largest) - gradient_bytes)
        held = batch + sum(u.activation_bytes(batch_size) for u in self.units) + outputs
        return held + max(0, loss - gradient_bytes)


def variable_bytes(variables: Iterable[Any]) -> int:
    """Bytes of the distinct variables among ``variables``: a variable listed twice (a shared layer) counts once.

    Example:
        >>> import keras, numpy as np
        >>> kernel = keras.Variable(np.zeros((4, 3), "float32"))
        >>> variable_bytes([kernel, kernel])
        48
    """
    seen: set[int] = set()
    total = 0
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            total += nbytes(v)
    return total


def model_units(model: Any) -> list[tuple[str, Any]]:
    """``(unique name, layer)`` of every unit of ``model``, in declaration order.

    A unit is a layer that is not a ``keras.Model``: nested models (a backbone inside a task, a Sequential inside a
    functional model) are descended into, so their layers are units of their own. Input layers carry no computation
    and are left out; a layer reachable twice (a tied embedding used by a backbone and by its task) is listed once.

    Example:
        >>> import keras
        >>> inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a")], name="inner")
        >>> outer = keras.Sequential([keras.Input((4,)), inner, keras.layers.Dense(2, name="b")])
        >>> [name for name, _ in model_units(outer)]
        ['a', 'b']
    """
    import keras

    found: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def walk(parent: Any, prefix: str) -> None:
        for layer in parent.layers:
            if id(layer) in seen or isinstance(layer, keras.layers.InputLayer):
                continue
            seen.add(id(layer))
            if isinstance(layer, keras.Model):
                walk(layer, f"{prefix}{layer.name}/")
            else:
                found.append((f"{prefix}{layer.name}", layer))

    walk(model, "")
    short = [path.rsplit("/", 1)[-1] for path, _ in found]
    counts: dict[str, int] = {}
    for name in short:
        counts[name] = counts.get(name, 0) + 1
    names, used = [], set()
    for (path, _), name in zip(found, short):
        unique = name if counts[name] == 1 else path
        candidate, k = unique, 1
        while candidate in used:
            k += 1
            candidate = f"{unique}#{k}"
        used.add(candidate)
        names.append(candidate)
    return [(name, layer) for name, (_, layer) in zip(names, found)]


def nested_layers(layer: Any) -> list[Any]:
    """``layer`` and every layer nested in it (through ``layers`` of models and attributes of layers), each once."""
    import keras

    found: list[Any] = []
    stack = [layer]
    while stack:
        current = stack.pop()
        if any(current is seen for seen in found):
            continue
        found.append(current)
        children = list(getattr(current, "layers", []) or [])
        children += [v for v in vars(current).values() if isinstance(v, keras.layers.Layer)]
        stack.extend(children)
    return found


def _tensor_bytes(value: Any, rows: int = 1) -> int:
    """Bytes of the tensors in the structure ``value``, concrete or symbolic.

    An unknown batch dimension (axis 0 of a symbolic tensor) counts ``rows``; another unknown dimension counts 1.
    Leaves without a shape and a dtype (None, Python scalars) count nothing.
    """
    import keras

    total = 0
    for tensor in keras.tree.flatten(value):
        shape, dtype = getattr(tensor, "shape", None), getattr(tensor, "dtype", None)
        if shape is None or dtype is None:
            continue
        elements = 1
        for axis, dim in enumerate(shape):
            elements *= int(dim) if dim is not None else (rows if axis == 0 else 1)
        total += elements * dtype_size(dtype)
    return total


def _symbolic_output_bytes(layer: Any, batch_size: int) -> int | None:
    """Bytes of ``layer``'s symbolic output(s) for ``batch_size`` rows; None when the layer has no symbolic output."""
    try:
        output = layer.output
    except (AttributeError, ValueError):
        return None
    return _tensor_bytes(output, batch_size)


def probe_inputs(model: Any, rows: int = PROBE_ROWS[0], unknown: int = PROBE_DIMS[0]) -> tuple[Any, bool]:
    """A batch of ones of ``rows`` rows that ``model`` accepts, and whether some non-batch dimension was unknown.

    Functional and Sequential models give their inputs' shapes and dtypes, in the structure the model was made with
    (a dict keyed as its inputs dict, whatever its tensors are named; nested lists); other models the input shape
    they were built with (``get_build_config()``), as float32. Unknown non-batch dimensions get the size
    ``unknown``.

    Raises:
        ValueError: for a model that tells neither its inputs nor the shape it was built with.

    Example:
        >>> import keras
        >>> x, had_unknown = probe_inputs(keras.Sequential([keras.Input((None, 3)), keras.layers.Dense(1)]))
        >>> x.shape, had_unknown
        ((2, 8, 3), True)
    """
    import numpy as np

    had_unknown = False

    def ones(shape: Any, dtype: Any = "float32") -> Any:
        nonlocal had_unknown
        dims = []
        for axis, dim in enumerate(shape):
            if axis == 0:
                dims.append(rows)
            elif dim is None:
                had_unknown = True
                dims.append(unknown)
            else:
                dims.append(int(dim))
        name = str(getattr(dtype, "name", dtype))
        if name == "string":  # a StringLookup's input: text, not ones
            return np.full(dims, "1", dtype=object)
        return np.ones(dims, dtype=name)

    import keras

    try:  # the structure the model was made with: a dict keyed as its inputs dict is, nested lists...
        structure = model.input
    except (AttributeError, ValueError):  # a Sequential not yet called, a subclassed model
        structure = None
    leaves = keras.tree.flatten(structure) if structure is not None else []
    if leaves and all(isinstance(leaf, keras.KerasTensor) for leaf in leaves):
        return keras.tree.map_structure(lambda t: ones(t.shape, t.dtype), structure), had_unknown
    inputs = None
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        inputs = None
    if inputs:
        if len(inputs) == 1:
            return ones(inputs[0].shape, inputs[0].dtype), had_unknown
        return {t.name: ones(t.shape, t.dtype) for t in inputs}, had_unknown
    shape = (model.get_build_config() or {}).get("input_shape")
    if shape is None:
        raise ValueError(
            f"cannot call model {model.name!r} on a probe batch: it has no symbolic inputs and no recorded input "
            "shape (build it with model.build(input_shape) or by calling it on a batch)"
        )

    def is_shape(s: Any) -> bool:
        return isinstance(s, (tuple, list)) and all(d is None or isinstance(d, int) for d in s)

    if is_shape(shape):
        return ones(shape), had_unknown
    if isinstance(shape, dict):
        return {k: ones(s) for k, s in shape.items()}, had_unknown
    return [ones(s) for s in shape], had_unknown


class _CallRecorder:
    """Wraps the ``call`` of every unit (an instance attribute, removed again by :meth:`restore`) to see it run: the
    order of first calls, how often each unit ran, its outputs, and the graph ops each call created."""

    def __init__(self, units: list[tuple[str, Any]]) -> None:
        self.units = units
        self.order: list[int] = []
        self.calls = [0] * len(units)
        self.outputs: list[tuple[int, Any]] = []  # (unit index, its outputs) per call
        self.spans: list[tuple[int, int, int]] = []  # (unit index, its first op, the op after its last) per call
        self.saved: list[tuple[Any, Any]] = []
        for index, (_, layer) in enumerate(units):
            own = vars(layer).get("call")  # a call already wrapped (a staged model): put it back afterwards
            self.saved.append((layer, own))
            layer.call = self._wrap(index, layer.call)

    def _wrap(self, index: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.calls[index] == 0:
                self.order.append(index)
            self.calls[index] += 1
            start = _ops_so_far()
            outputs = original(*args, **kwargs)
            self.spans.append((index, start, _ops_so_far()))
            self.outputs.append((index, outputs))
            return outputs

        return call

    def owners(self, num_ops: int) -> list[int]:
        """The unit each of the first ``num_ops`` graph ops belongs to: the innermost call that created it; an op
        created between units (a keras op of a functional model) belongs to the unit before it."""
        owner: list[int | None] = [None] * num_ops
        for index, start, end in sorted(self.spans, key=lambda span: span[1]):  # a nested call overrides its caller
            owner[start:end] = [index] * (min(end, num_ops) - start)
        current = next((o for o in owner if o is not None), 0)
        filled = []
        for o in owner:
            current = current if o is None else o
            filled.append(current)
        return filled

    def restore(self) -> None:
        for layer, own in self.saved:
            if own is None:
                del layer.call
            else:
                layer.call = own


def _ops_so_far() -> int:
    import tensorflow as tf

    return len(tf.compat.v1.get_default_graph().get_operations())


def _accumulated_dtype(handle: Any) -> Any:
    """The element dtype of the TensorList ``handle`` (a ``while`` loop's accumulator of one tensor per step), or
    None when it is not counted: each step pushes the same buffer (a variable's value, a tensor from outside the
    loop), or this TensorFlow does not tell."""
    try:
        body = while_body_graph(handle.op)
        if body is not None:
            pushed = body.outputs[handle.value_index].op
            if pushed.type == "TensorListPushBack":
                element = pushed.inputs[1]
                while element.op.type == "Identity":
                    element = element.op.inputs[0]
                captured = {id(t) for t in body.internal_captures}
                if element.op.type == "ReadVariableOp" or id(element) in captured:
                    return None
        return tensor_list_element_dtype(handle)
    except Exception:  # another TensorFlow without this graph or handle data: the accumulator is not counted
        return None


@dataclass
class _Measured:
    """What :func:`_measure_step` measured: the units' order of first calls, their calls, their activations, the
    bytes of the batch and of the model's outputs, and what the loss's own ops keep for the gradient."""

    order: list[int]
    calls: list[int]
    activations: list[RowBytes]
    batch: RowBytes
    outputs: RowBytes
    loss: RowBytes = RowBytes()


def _kept_for_backward(forward: list[Any], backward: list[Any], owner: list[int]) -> list[tuple[Any, int]]:
    """The tensors ops of ``forward`` made that ops of ``backward`` read, each once, with the unit that made it
    (``owner`` of the op): through aliases to the buffer's maker, leaving out the batch, constants, variables' values
    and what only a shape reader reads."""
    import tensorflow as tf

    position = {op.name: j for j, op in enumerate(forward)}
    kept: dict[str, tuple[Any, int]] = {}
    for op in backward:
        if op.type in _SHAPE_READERS:
            continue
        for tensor in op.inputs:
            while tensor.op.type in _ALIASES:
                tensor = tensor.op.inputs[tensor.value_index if tensor.op.type == "IdentityN" else 0]
            j = position.get(tensor.op.name)
            if j is None or tensor.op.type in _NOT_ACTIVATIONS or tensor.dtype in (tf.resource, tf.string):
                continue
            kept[tensor.name] = (tensor, owner[j])
    return list(kept.values())


def _is_sparse(loss: Any) -> bool:
    """Whether ``loss`` takes integer class ids as targets (one axis fewer than the outputs), by its name."""
    name = getattr(loss, "name", None) or getattr(loss, "__name__", None) or type(loss).__name__
    return "sparse" in str(name).lower()


def _per_output(loss: Any, outputs: Any, model: Any) -> list[Any]:
    """The loss of each output of ``flatten(outputs)``: one loss for all, a list in the outputs' order, or a dict
    keyed as a dict of outputs (or by the model's output names); None where none is given (the default loss)."""
    import tensorflow as tf

    flat = tf.nest.flatten(outputs)
    if isinstance(loss, dict):
        names = sorted(outputs) if isinstance(outputs, dict) else list(getattr(model, "output_names", None) or [])
        if len(names) != len(flat):
            raise ValueError(f"a loss dict ({sorted(loss)}) needs named outputs; this model's are not named")
        return [loss.get(name) for name in names]
    if isinstance(loss, (list, tuple)):
        if len(loss) != len(flat):
            raise ValueError(f"{len(loss)} losses given for {len(flat)} outputs")
        return list(loss)
    return [loss] * len(flat)


def zero_targets(model: Any, loss: Any, outputs: Any) -> Any:
    """Targets of zeros for ``outputs`` (arrays, in their structure) that ``loss`` accepts: class ids (int32, the
    outputs' shape without its last axis) for a sparse loss, and for the default loss of an output with a class axis
    (as :func:`observe_units` takes it); zeros shaped like the output otherwise. What a step costs, not what it
    learns: the values mean nothing.

    Example:
        >>> import numpy as np
        >>> [t.shape for t in zero_targets(None, ["sparse_categorical_crossentropy", "mse"], [np.ones((2, 5))] * 2)]
        [(2,), (2, 5)]
    """
    import keras
    import numpy as np
    import tensorflow as tf

    flat = [np.asarray(o) for o in tf.nest.flatten(outputs)]
    targets = []
    for output, function in zip(flat, _per_output(loss, outputs, model)):
        if isinstance(function, (str, dict)):
            function = keras.losses.get(function)
        logits = output.ndim >= 2 and output.shape[-1] != 1
        sparse = logits if function is None else _is_sparse(function)
        targets.append(np.zeros(output.shape[:-1], "int32") if sparse else np.zeros_like(output))
    return tf.nest.pack_sequence_as(outputs, targets)


def _traced_loss(model: Any, loss: Any, outputs: Any, targets: Any) -> Any:
    """The scalar loss of one training step on ``outputs``, as the training step computes it (see
    :func:`observe_units`): each floating output's loss (given, or the default) against ``targets`` or zero targets
    of the loss's kind, averaged, plus the model's own losses (``add_loss``, regularizers)."""
    import keras
    import tensorflow as tf

    flat = tf.nest.flatten(outputs)
    given = tf.nest.flatten(targets) if targets is not None else [None] * len(flat)
    if len(given) != len(flat):
        raise ValueError(f"{len(given)} targets given for {len(flat)} outputs")
    terms = []
    for output, function, target in zip(flat, _per_output(loss, outputs, model), given):
        if not output.dtype.is_floating:
            continue
        if function is None:  # the default: class logits when there is a class axis, a regression otherwise
            logits = output.shape.rank is not None and output.shape.rank >= 2 and output.shape[-1] != 1
            function = (
                keras.losses.SparseCategoricalCrossentropy(from_logits=True)
                if logits
                else keras.losses.MeanSquaredError()
            )
        elif isinstance(function, (str, dict)):
            function = keras.losses.get(function)
        if target is None:
            sparse = _is_sparse(function)
            target = tf.zeros(tf.shape(output)[:-1], tf.int32) if sparse else tf.zeros_like(output)
        terms.append(tf.reduce_mean(tf.cast(function(target, output), tf.float32)))
    terms += [tf.reduce_sum(tf.cast(extra, tf.float32)) for extra in model.losses]
    if not terms:
        raise ValueError("the model has no floating output to take a loss of")
    return tf.add_n(terms)


@dataclass(frozen=True)
class _Objective:
    """The loss a step is traced with (:func:`observe_units`' ``loss``) and the targets of each probe batch (None:
    zero targets of the loss's kind)."""

    loss: Any = None
    targets: list[Any] | None = None


def _measure_step(
    model: Any, units: list[tuple[str, Any]], batches: list[Any], gradient: bool, objective: _Objective | None = None
) -> _Measured:
    """Trace one training step of ``model`` (its gradient w.r.t. the trainable variables, if ``gradient``) with every
    unit's call recorded, run it on each of ``batches`` (:data:`PROBE_ROWS` rows), and fit each unit's bytes.

    A unit's activations are the bytes of the tensors its calls created in the forward pass that an op of the
    gradient reads: what the step keeps alive between the two passes. Without ``gradient``, its outputs' bytes. With
    an ``objective``, the gradient is that of the loss (:func:`_traced_loss`) and the tensors the loss's own ops keep
    are counted apart (``_Measured.loss``); without, the gradient of the outputs alone. The step is traced once with
    an unknown batch dimension and its byte counts are computed when it runs, so one trace serves both batches (a
    model that needs a known batch size is traced per batch). The model's variables are as they were afterwards.
    """
    import tensorflow as tf

    recorder = _CallRecorder(units)
    loss_unit = len(units)  # the loss's ops are counted in a slot of their own, after the units'

    def unit_bytes(tensor: Any) -> Any:
        return tf.cast(tf.size(tensor), tf.int64) * tensor.dtype.size

    def step(inputs: Any, *targets: Any) -> tuple[Any, Any]:
        graph = tf.compat.v1.get_default_graph()
        with tf.GradientTape() as tape:
            outputs = model(inputs, training=True)
            model_ops = len(graph.get_operations())
            if objective is not None:
                loss = _traced_loss(model, objective.loss, outputs, targets[0] if targets else None)
        forward = graph.get_operations()
        counted: list[list[Any]] = [[] for _ in range(loss_unit + 1)]
        if gradient:
            if objective is not None:
                tape.gradient(loss, model.trainable_variables)
            else:
                targets_ = [t for t in tf.nest.flatten(outputs) if t.dtype.is_floating]
                tape.gradient(targets_, model.trainable_variables, output_gradients=[tf.ones_like(t) for t in targets_])
            backward = graph.get_operations()[len(forward) :]
            owner = recorder.owners(model_ops) + [loss_unit] * (len(forward) - model_ops)
            for tensor, unit in _kept_for_backward(forward, backward, owner):
                if unit == loss_unit and tensor.shape.rank == 0:
                    continue  # the loss's reductions: a few bytes, left out so that the loss's figure is its buffers
                if tensor.dtype == tf.variant:  # a while loop's accumulator: one element per step
                    dtype = _accumulated_dtype(tensor)
                    if dtype is not None:
                        stacked = tf.raw_ops.TensorListStack(input_handle=tensor, element_shape=-1, element_dtype=dtype)
                        counted[unit].append(unit_bytes(stacked))
                else:
                    counted[unit].append(unit_bytes(tensor))
        else:
            for unit, tensors in recorder.outputs:
                counted[unit] += [unit_bytes(t) for t in tf.nest.flatten(tensors) if hasattr(t, "dtype")]
        zero = tf.constant(0, tf.int64)
        per_unit = tf.stack([tf.add_n(c) if c else zero for c in counted])
        out = [unit_bytes(t) for t in tf.nest.flatten(outputs) if hasattr(t, "dtype")]
        return per_unit, tf.add_n(out) if out else zero

    def spec(array: Any) -> Any:
        return tf.TensorSpec((None, *array.shape[1:]), tf.convert_to_tensor(array[:1]).dtype)

    targets = objective.targets if objective is not None and objective.targets is not None else None
    arguments = [(x,) if targets is None else (x, y) for x, y in zip(batches, targets or batches)]
    state = list(model.non_trainable_variables)  # moving statistics, random-seed states: the step moves them
    saved = [v.numpy() for v in state]
    calls: list[int] = []
    try:
        try:
            signature = [tf.nest.map_structure(spec, a) for a in arguments[0]]
            function = tf.function(step, input_signature=signature, autograph=False)
            results = [function(*arguments[0])]
        except Exception:  # a model that needs to know its batch size: trace it per batch
            recorder.restore()
            recorder = _CallRecorder(units)
            function = tf.function(step, autograph=False)
            results = [function(*arguments[0])]
        calls = list(recorder.calls)  # those of the first trace
        results += [function(*a) for a in arguments[1:]]
    finally:
        recorder.restore()
        for variable, value in zip(state, saved):
            variable.assign(value)
    per_unit = [r[0].numpy().tolist() for r in results]
    return _Measured(
        recorder.order,
        calls,
        [_fit([p[i] for p in per_unit]) for i in range(len(units))],
        _fit([_tensor_bytes(x) for x in batches]),
        _fit([int(r[1]) for r in results]),
        _fit([p[loss_unit] for p in per_unit]),
    )


def repeat_rows(batch: Any, rows: int) -> Any:
    """``rows`` rows of ``batch`` (a structure of arrays), its rows repeated as needed.

    Example:
        >>> import numpy as np
        >>> repeat_rows({"x": np.arange(3)}, 5)["x"].tolist()
        [0, 1, 2, 0, 1]
    """
    import numpy as np
    import tensorflow as tf

    def rows_of(array: Any) -> Any:
        array = np.asarray(array)
        return np.take(array, np.arange(rows) % len(array), axis=0)

    return tf.nest.map_structure(rows_of, batch)


def _probe_rows(batch: Any) -> list[Any]:
    """Batches of :data:`PROBE_ROWS` rows taken from ``batch`` (its rows repeated as needed)."""
    return [repeat_rows(batch, rows) for rows in PROBE_ROWS]


def _probe_batches(model: Any, sample: Any, unknown: int) -> tuple[list[Any], bool]:
    """The probe batches of :data:`PROBE_ROWS` rows: rows of ``sample`` (repeated as needed) or batches of ones."""
    if sample is None:
        probes = [probe_inputs(model, rows, unknown) for rows in PROBE_ROWS]
        return [x for x, _ in probes], probes[0][1]
    return _probe_rows(sample), False


def observe_units(
    model: Any,
    *,
    sample: Any = None,
    recompute: Callable[[Any], AbstractContextManager[Any]] | None = None,
    loss: Any = None,
    targets: Any = None,
) -> Observation:
    """Trace one training step of ``model`` on two small batches and measure its units (see the module docstring).

    The model runs its own ``call`` (``training=True``) in a ``tf.function``, so whatever Keras can run is observed:
    layers with several tensor and keyword arguments, keras ops between layers (counted with the unit before them),
    nested models, subclassed models, recurrent layers. Each unit's ``call`` is wrapped for the duration of the
    trace only, and the variables the step moves (moving statistics, random-seed states) are put back.

    Args:
        model: A built ``keras.Model``.
        sample: A batch of the model's inputs (any number of rows; arrays, or a dict or list of them) whose shapes,
            dtypes and values the probe batches take. Without it, batches of ones, with unknown non-batch
            dimensions (a sequence length) tried at each size of :data:`PROBE_DIMS`: give a sample whenever the
            sequence length or image size matters.
        recompute: Also measure each unit's activations when it is recomputed in the backward pass: the context
            under which the model's units recompute (:func:`paraml.parallelism.remat.recomputing`, given by the caller).
        loss: The loss the training step takes of the outputs, as given to ``compile``: a name (``"mse"``), a
            ``keras.losses.Loss``, a function ``(y_true, y_pred)``, or a list (in the outputs' order) or dict (keyed
            as the outputs) of those. None (default): sparse categorical cross-entropy from logits for an output with
            a class axis (rank 2 or more, last dimension above 1: a classifier's or LM head's logits), mean squared
            error for any other. Its own buffers count (:attr:`Observation.loss`): a cross-entropy keeps a
            softmax-sized tensor for its gradient, as large as the logits, which matters for a large vocabulary.
        targets: A batch of targets for ``sample`` (same rows; arrays, or a list or dict of them as the outputs).
            None: zero targets of each loss's kind (integer class ids for a loss named ``sparse...``, else zeros
            shaped as the output); the bytes do not depend on their values.

    When the model cannot be called, the units come in declaration order with no activations and ``problem`` says
    why; when its gradient cannot be traced, the activations are the units' outputs and ``gradient_problem`` says
    why; when the loss cannot be taken of the outputs (a loss that does not fit them), the gradient is that of the
    outputs alone, the loss's buffers are not counted and ``loss_problem`` says why.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu", name="d")])
        >>> obs = observe_units(model)
        >>> [(u.name, u.param_bytes, u.activation_bytes(batch_size=5)) for u in obs.units]  # relu keeps its output
        [('d', 60, 60)]
    """
    units = model_units(model)
    params = [variable_bytes(layer.weights) for _, layer in units]
    objective = _Objective(loss, None if targets is None else _probe_rows(targets))
    problems: list[str] = []
    for unknown in PROBE_DIMS if sample is None else (PROBE_DIMS[0],):
        try:
            batches, had_unknown = _probe_batches(model, sample, unknown)
        except ValueError as error:
            problems.append(str(error))
            break
        gradient_problem = loss_problem = ""
        traced: _Objective | None = objective
        try:
            try:
                measured = _measure_step(model, units, batches, gradient=True, objective=objective)
            except Exception as error:  # a loss that does not fit the outputs: the gradient of the outputs alone
                loss_problem, traced = _first_line(error), None
                try:
                    measured = _measure_step(model, units, batches, gradient=True)
                except Exception as error:  # e.g. an output with no gradient: the units' outputs stand in
                    gradient_problem = _first_line(error)
                    measured = _measure_step(model, units, batches, gradient=False)
        except Exception as error:  # any failure of the user's model on a probe batch: fall back, say why
            problems.append(_first_line(error))
            if not had_unknown:
                break  # other sizes for unknown dimensions cannot help
            continue
        recomputed: list[RowBytes | None] = [None] * len(units)
        if recompute is not None and not gradient_problem:
            with recompute(model):
                recomputed = list(_measure_step(model, units, batches, gradient=True, objective=traced).activations)
        order = measured.order + [i for i in range(len(units)) if measured.calls[i] == 0]
        observed = tuple(
            Unit(units[i][0], units[i][1], params[i], measured.calls[i], measured.activations[i], recomputed[i])
            for i in order
        )
        return Observation(
            observed,
            batch=measured.batch,
            outputs=measured.outputs,
            probe_dims=unknown if had_unknown else None,
            gradient_problem=gradient_problem,
            loss=measured.loss,
            loss_problem=loss_problem,
        )
    problem = "; ".join(dict.fromkeys(problems))
    return Observation(
        tuple(Unit(name, layer, p) for (name, layer), p in zip(units, params)),
        problem=f"model {model.name!r} could not be called on a probe batch ({problem})",
    )


def _fit(values: list[int]) -> RowBytes:
    return RowBytes.fit(PROBE_ROWS, (values[0], values[1]))


def _first_line(error: Exception) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def unit_costs(observation: Observation, batch_size: int, *, remat: bool = False) -> list[LayerCost]:
    """One :class:`paraml.planning.partition.LayerCost` per unit of ``observation``, in its (pipeline) order.

    ``param_bytes`` counts all of a unit's variables (trainable and not) once; ``activation_bytes`` is what its
    forward keeps for the backward pass (recomputed if ``remat`` and that was measured), for ``batch_size`` rows.
    When the model could not be called (``observation.problem``), a unit's activations are those of its symbolic
    output (a functional model's layers have one) for ``batch_size`` rows, or 0 when it has none
    (:func:`observation_notes` names those units).

    Raises:
        ValueError: if ``batch_size`` is not an int >= 1.

    Example:
        >>> import keras
        >>> relu = keras.layers.Dense(3, activation="relu", name="d")
        >>> model = keras.Sequential([keras.Input((4,)), relu, keras.layers.Dense(1, name="o")])
        >>> [(c.name, c.activation_bytes) for c in unit_costs(observe_units(model), batch_size=10)]
        [('d', 120), ('o', 0)]
    """
    batch_size = check_int("batch_size", batch_size)
    if observation.problem:
        return [
            LayerCost(u.name, u.param_bytes, _symbolic_output_bytes(u.layer, batch_size) or 0)
            for u in observation.units
        ]
    return [LayerCost(u.name, u.param_bytes, u.activation_bytes(batch_size, remat)) for u in observation.units]


def observation_notes(observation: Observation) -> list[str]:
    """Caveats of the costs :func:`unit_costs` derives from ``observation``, one sentence each ([] when none).

    They say that the model could not be called (the units are then in declaration order, and those without a
    symbolic output have unknown activations, counted as 0), that its gradient could not be traced, or the size
    the model's unknown non-batch dimensions were given for the probe.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((None, 4)), keras.layers.Dense(2)])
        >>> (note,) = observation_notes(observe_units(model))
        >>> note.endswith("(sequence length, image size) set to 8; pass a sample batch for the real ones")
        True
    """
    notes = []
    if observation.problem:
        notes.append(f"{observation.problem}: units in declaration order")
        unknown = [u.name for u in observation.units if _symbolic_output_bytes(u.layer, 1) is None]
        if unknown:
            more = " ..." if len(unknown) > _MAX_NAMES_IN_NOTES else ""
            notes.append(f"activations unknown (counted as 0) for: {', '.join(unknown[:_MAX_NAMES_IN_NOTES])}{more}")
    if observation.loss_problem:
        notes.append(
            f"the loss could not be taken of the outputs ({observation.loss_problem}): the gradient is that of the "
            "outputs alone and the loss's own buffers are not counted (pass the loss the model trains with)"
        )
    if observation.gradient_problem:
        notes.append(
            f"the gradient could not be traced ({observation.gradient_problem}): activations are the units' outputs"
        )
    if observation.probe_dims is not None:
        notes.append(
            "activations measured with the model's unknown non-batch dimensions (sequence length, image size) set "
            f"to {observation.probe_dims}; pass a sample batch for the real ones"
        )
    return notes


@dataclass
class HostModel:
    """A model built on the host CPU by :func:`build_on_host`, to be measured before it is built where it belongs.

    Attributes:
        model: What ``model_fn`` returned (not necessarily a built ``keras.Model``: the caller checks).
        created: Every variable created while ``model_fn`` ran, in creation order.
    """

    model: Any
    created: list[Any]
    _observed: dict[tuple[int, bool, int, int], Observation] = field(default_factory=dict, init=False, repr=False)

    def observe(
        self,
        *,
        sample: Any = None,
        recompute: Callable[[Any], AbstractContextManager[Any]] | None = None,
        loss: Any = None,
        targets: Any = None,
    ) -> Observation:
        """:func:`observe_units` of the model, called on the host CPU (once per ``sample``, ``recompute``, ``loss``
        and ``targets``: later calls return the same).

        Raises:
            ValueError: if calling the model created variables: ``model_fn`` must return a model with all its weights.
        """
        key = (id(sample), recompute is not None, id(loss), id(targets))
        if key not in self._observed:
            import tensorflow as tf

            before = len(self.model.weights)
            with tf.device("/device:CPU:0"):
                observation = observe_units(self.model, sample=sample, recompute=recompute, loss=loss, targets=targets)
            if len(self.model.weights) != before:
                raise ValueError(
                    f"model {self.model.name!r} created variables when it was first called: model_fn must return a "
                    "model with all its weights (call it on a batch, or model.build(input_shape), inside model_fn)"
                )
            self._observed[key] = observation
        return self._observed[key]


def build_on_host(model_fn: Callable[[], Any]) -> HostModel:
    """Call ``model_fn`` with its variables on the host CPU, recording every variable it creates, in order.

    A model too big for one accelerator can still be built and measured there; a backend that places the variables
    itself builds the model again and matches the second build's variables to the recorded ones by position.

    Example:
        >>> import keras
        >>> host = build_on_host(lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")]))
        >>> [tuple(v.shape) for v in host.created], [u.name for u in host.observe().units]
        ([(4, 3), (3,)], ['d'])
    """
    import tensorflow as tf

    created: list[Any] = []

    def record(next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        variable = next_creator(**kwargs)
        created.append(variable)
        return variable

    with tf.device("/device:CPU:0"), tf.variable_creator_scope(record):
        model = model_fn()
    return HostModel(model, created)


@dataclass(frozen=True)
class StageHolding:
    """What the stages of a pipeline hold at their peak, per unit and per stage, under a schedule (the figures the
    balanced planner balances and ``plan.stages`` report).

    Attributes:
        rows: Rows of the largest micro-batch.
        in_flight: Per stage, the most micro-batches whose activations it holds at once, read from the schedule's
            timeline (:meth:`paraml.planning.schedules.Schedule.held`: GPipe all of them, 1F1B ``min(K, S - s)``).
        costs: Per unit, its bytes for one micro-batch (with ``remat``: what it keeps when recomputed, and as
            ``recompute_bytes`` its own activations, rebuilt for a moment in the backward pass).
        output_bytes: One micro-batch's model outputs and the loss' buffers, held by the last stage: the outputs
            and a buffer like them (the gradient of a cross-entropy or a squared error is the size of the logits).
        batch_bytes: The whole batch, which the process holds besides the stages.
    """

    rows: int
    in_flight: tuple[int, ...]
    costs: list[LayerCost]
    output_bytes: int
    batch_bytes: int

    @classmethod
    def of(cls, observation: Observation, schedule: Schedule, batch_size: int, remat: bool = False) -> StageHolding:
        """The holding of ``observation``'s units under ``schedule`` for a batch of ``batch_size`` rows."""
        rows = schedule.micro_batch_rows(batch_size)
        costs = unit_costs(observation, rows, remat=remat)
        if remat and observation.remat_measured:
            own = {u.name: u.activations.at(rows) for u in observation.units}
            costs = [replace(c, recompute_bytes=own[c.name]) for c in costs]
        # The loss reads the outputs and keeps buffers for its gradient (softmax minus the labels, the error of a
        # squared loss) until the last stage's backward pass has read them: traced with the step where it could be,
        # else taken as one more buffer of the outputs' size.
        loss = observation.loss.at(rows) if not observation.loss_problem else observation.outputs.at(rows)
        outputs = observation.outputs.at(rows) + loss if not observation.problem else 0
        return cls(rows, tuple(schedule.held(batch_size)), costs, outputs, observation.batch.at(batch_size))
