"""Model introspection for staging: a model's units, the order one call runs them, and their memory costs.

A **unit** is a layer that is not itself a ``keras.Model`` (:func:`model_units`): nested models are descended into,
input layers are left out and a layer reachable twice is one unit. :func:`observe_units` calls the model once on a
small batch of ones (:func:`probe_inputs`) with every unit's ``call`` wrapped, which gives the pipeline order and the
bytes of each unit's outputs. :func:`unit_costs` turns an :class:`Observation` into the
:class:`paraml.partition.LayerCost` list the planners take, and :func:`observation_notes` says what the numbers rest
on.

Importing this module is cheap: Keras and TensorFlow are imported inside the functions that need them.

Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")])
    >>> unit_costs(observe_units(model), batch_size=2)
    [LayerCost(name='d', param_bytes=60, activation_bytes=24)]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .checks import check_int
from .partition import LayerCost
from .sizes import dtype_size, nbytes

__all__ = [
    "PROBE_DIMS",
    "PROBE_ROWS",
    "HostModel",
    "Observation",
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

#: Rows of the batch a model is called on to observe its units (:func:`observe_units`).
PROBE_ROWS = 2
#: Sizes tried, in order, for the non-batch dimensions a model leaves unknown (a sequence length, an image side).
PROBE_DIMS = (8, 1, 32)

#: Units named at most in the note listing units whose activations are unknown.
_MAX_NAMES_IN_NOTES = 8


@dataclass(frozen=True)
class Unit:
    """One unit of computation of a model: a layer that is not itself a model, as one call of the model ran it.

    Attributes:
        name: A name unique within the model (the layer's name, prefixed by its parent model's if it is not unique).
        layer: The ``keras.layers.Layer``.
        param_bytes: Bytes of the layer's variables (trainable or not), counted once however often it is called.
        output_bytes: Bytes of the layer's outputs over all its calls in the observed call, for
            ``Observation.rows`` rows (0 when the layer was not called, or the call could not be observed).
        calls: How many times the observed call of the model called the layer.
    """

    name: str
    layer: Any
    param_bytes: int
    output_bytes: int
    calls: int

    def activation_bytes(self, rows: int, batch_size: int) -> int:
        """``output_bytes`` (measured for ``rows`` rows) scaled to ``batch_size`` rows.

        Example:
            >>> Unit("d", None, param_bytes=60, output_bytes=24, calls=1).activation_bytes(2, batch_size=5)
            60
        """
        return round(self.output_bytes * batch_size / rows) if rows else 0


@dataclass(frozen=True)
class Observation:
    """The units of a model in the order one call of the model ran them (see :func:`observe_units`).

    Attributes:
        units: Every unit: first those the call ran, in the order of their first call, then those it never called.
        rows: Rows of the batch the model was called on.
        problem: Why the model could not be called (then ``units`` are in declaration order), or ``""``.
        probe_dims: The size given to non-batch dimensions the model leaves unknown, or None if there were none.
    """

    units: tuple[Unit, ...]
    rows: int
    problem: str = ""
    probe_dims: int | None = None


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


def probe_inputs(model: Any, rows: int = PROBE_ROWS, unknown: int = PROBE_DIMS[0]) -> tuple[Any, bool]:
    """A batch of ones of ``rows`` rows that ``model`` accepts, and whether some non-batch dimension was unknown.

    Functional and Sequential models give their inputs' shapes, dtypes and names (several inputs as a dict keyed by
    input name); other models the input shape they were built with (``get_build_config()``), as float32. Unknown
    non-batch dimensions get the size ``unknown``.

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
    """Wraps the ``call`` of every unit (an instance attribute, removed again by :meth:`restore`) to see it run."""

    def __init__(self, units: list[tuple[str, Any]]) -> None:
        self.units = units
        self.order: list[int] = []
        self.calls = [0] * len(units)
        self.output_bytes = [0] * len(units)
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
            outputs = original(*args, **kwargs)
            self.output_bytes[index] += _tensor_bytes(outputs)
            return outputs

        return call

    def restore(self) -> None:
        for layer, own in self.saved:
            if own is None:
                del layer.call
            else:
                layer.call = own


def observe_units(model: Any, *, rows: int = PROBE_ROWS) -> Observation:
    """Call ``model`` once on a small batch of ones and record which units ran, in which order, with what outputs.

    The model runs its own ``call`` (``training=False``), so whatever Keras can run is observed: layers with several
    tensor and keyword arguments, keras ops between layers, nested models, subclassed models. Each unit's ``call`` is
    wrapped for the duration of that one call only. When the model cannot be called on a probe batch (see
    :func:`probe_inputs`), the units come in declaration order with no outputs, and ``problem`` says why.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")])
        >>> obs = observe_units(model)
        >>> [(u.name, u.param_bytes, u.activation_bytes(obs.rows, batch_size=5)) for u in obs.units]
        [('d', 60, 60)]
    """
    units = model_units(model)
    params = [variable_bytes(layer.weights) for _, layer in units]
    problems: list[str] = []
    for unknown in PROBE_DIMS:
        try:
            x, had_unknown = probe_inputs(model, rows, unknown)
        except ValueError as error:
            problems.append(str(error))
            break
        recorder = _CallRecorder(units)
        try:
            model(x, training=False)
        except Exception as error:  # any failure of the user's model on a batch of ones: fall back, say why
            problems.append(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            if not had_unknown:
                break  # other sizes for unknown dimensions cannot help
            continue
        finally:
            recorder.restore()
        order = recorder.order + [i for i in range(len(units)) if recorder.calls[i] == 0]
        observed = tuple(
            Unit(units[i][0], units[i][1], params[i], recorder.output_bytes[i], recorder.calls[i]) for i in order
        )
        return Observation(observed, rows, "", unknown if had_unknown else None)
    problem = "; ".join(dict.fromkeys(problems))
    return Observation(
        tuple(Unit(name, layer, p, 0, 0) for (name, layer), p in zip(units, params)),
        rows,
        f"model {model.name!r} could not be called on a probe batch ({problem})",
    )


def unit_costs(observation: Observation, batch_size: int) -> list[LayerCost]:
    """One :class:`paraml.partition.LayerCost` per unit of ``observation``, in its (pipeline) order.

    ``param_bytes`` counts all of a unit's variables (trainable and not) once; ``activation_bytes`` is the bytes of
    its outputs over all its calls, scaled to ``batch_size`` rows. When the model could not be called
    (``observation.problem``), a unit's activations are those of its symbolic output (a functional model's layers
    have one) for ``batch_size`` rows, or 0 when it has none (:func:`observation_notes` names those units).

    Raises:
        ValueError: if ``batch_size`` is not an int >= 1.

    Example:
        >>> import keras
        >>> layers = [keras.Input((4,)), keras.layers.Dense(3, name="d"), keras.layers.Dense(1, name="o")]
        >>> model = keras.Sequential(layers)
        >>> [(c.name, c.activation_bytes) for c in unit_costs(observe_units(model), batch_size=10)]
        [('d', 120), ('o', 40)]
    """
    batch_size = check_int("batch_size", batch_size)
    if observation.problem:
        return [
            LayerCost(u.name, u.param_bytes, _symbolic_output_bytes(u.layer, batch_size) or 0)
            for u in observation.units
        ]
    return [
        LayerCost(u.name, u.param_bytes, u.activation_bytes(observation.rows, batch_size)) for u in observation.units
    ]


def observation_notes(observation: Observation) -> list[str]:
    """Caveats of the costs :func:`unit_costs` derives from ``observation``, one sentence each ([] when none).

    They say that the model could not be called (the units are then in declaration order, and those without a
    symbolic output have unknown activations, counted as 0), or the size the model's unknown non-batch dimensions
    were given for the probe call.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((None, 4)), keras.layers.Dense(2)])
        >>> print(*observation_notes(observe_units(model)))
        activations measured with the model's unknown non-batch dimensions (sequence length, image size) set to 8
    """
    notes = []
    if observation.problem:
        notes.append(f"{observation.problem}: units in declaration order")
        unknown = [u.name for u in observation.units if _symbolic_output_bytes(u.layer, 1) is None]
        if unknown:
            more = " ..." if len(unknown) > _MAX_NAMES_IN_NOTES else ""
            notes.append(f"activations unknown (counted as 0) for: {', '.join(unknown[:_MAX_NAMES_IN_NOTES])}{more}")
    if observation.probe_dims is not None:
        notes.append(
            "activations measured with the model's unknown non-batch dimensions (sequence length, image size) set "
            f"to {observation.probe_dims}"
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
    _observation: Observation | None = field(default=None, init=False, repr=False)

    def observe(self) -> Observation:
        """:func:`observe_units` of the model, called on the host CPU (once: later calls return the same).

        Raises:
            ValueError: if calling the model created variables: ``model_fn`` must return a model with all its weights.
        """
        if self._observation is None:
            import tensorflow as tf

            before = len(self.model.weights)
            with tf.device("/device:CPU:0"):
                observation = observe_units(self.model)
            if len(self.model.weights) != before:
                raise ValueError(
                    f"model {self.model.name!r} created variables when it was first called: model_fn must return a "
                    "model with all its weights (call it on a batch, or model.build(input_shape), inside model_fn)"
                )
            self._observation = observation
        return self._observation


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
