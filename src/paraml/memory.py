"""Memory estimates for Keras models.

Importing this module is cheap: Keras and TensorFlow are imported lazily,
inside the functions that need them.

What :func:`estimate_memory` counts (all exact except activations):

* **parameters**: bytes of every distinct model variable, trainable or not
  (number of elements times dtype size);
* **gradients**: bytes of the trainable variables (one gradient each);
* **optimizer slots**: bytes of the slot variables a fresh copy of the
  optimizer creates when built on the model's trainable variables (momenta,
  velocities, factored second moments, EMA copies, gradient accumulators...);
  scalar bookkeeping variables (``iteration``, ``learning_rate``, ...) are
  ignored;
* **activations**: the forward activations kept for the backward pass,
  estimated as the sum over the model's units (its layers, nested models
  descended into) of the bytes of each unit's outputs, measured by calling the
  model once on a small batch (:func:`observe_units`) and scaled to
  ``batch_size`` rows.  It is not multiplied by any factor: temporary buffers
  inside a layer and the backward pass's own intermediates are not counted.

"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .sizes import dtype_size, format_bytes, nbytes

if TYPE_CHECKING:  # pragma: no cover
    from .partition import LayerCost

__all__ = [
    "PROBE_ROWS",
    "MemoryEstimate",
    "Observation",
    "Unit",
    "estimate_memory",
    "layer_costs",
    "model_units",
    "observe_units",
    "optimizer_slots_per_param",
    "probe_inputs",
]

# ------------------------------------------------------------------------ optimizers

# Slots per parameter for each Keras 3 optimizer with its default arguments, as
# counted on a 2-D float32 variable (a Dense kernel).  Keys are lower-case class
# names without "_"/"-".  tests/test_memory.py checks every entry against Keras.
_DEFAULT_SLOTS: dict[str, int] = {
    "adadelta": 2,  # accumulated_grad, accumulated_delta_var
    "adafactor": 1,  # velocity (+ a row and a column vector for matrices)
    "adagrad": 1,  # accumulator
    "adam": 2,  # momentum, velocity (+ velocity_hat if amsgrad)
    "adamax": 2,  # momentum, norm
    "adamw": 2,  # momentum, velocity (+ velocity_hat if amsgrad)
    "ftrl": 2,  # accumulator, linear
    "lamb": 2,  # momentum, velocity
    "lion": 1,  # momentum
    "muon": 1,  # momentum for matrices; other ranks/embeddings use AdamW (2)
    "nadam": 2,  # momentum, velocity (+ a scalar u_product)
    "rmsprop": 1,  # velocity (+ momentum if momentum > 0, + average_gradient if centered)
    "schedulefreeadamw": 2,  # momentum, velocity
    "sgd": 0,  # (+ momentum if momentum > 0)
}

_CLASS_NAMES: dict[str, str] = {
    "adadelta": "Adadelta",
    "adafactor": "Adafactor",
    "adagrad": "Adagrad",
    "adam": "Adam",
    "adamax": "Adamax",
    "adamw": "AdamW",
    "ftrl": "Ftrl",
    "lamb": "Lamb",
    "lion": "Lion",
    "muon": "Muon",
    "nadam": "Nadam",
    "rmsprop": "RMSprop",
    "schedulefreeadamw": "ScheduleFreeAdamW",
    "sgd": "SGD",
}

_PROBE_SHAPE = (16, 16)


def _normalise_name(name: str) -> str:
    return name.strip().lower().replace("_", "").replace("-", "")


def _fresh_optimizer(optimizer: Any) -> Any:
    """A new, unbuilt optimizer equivalent to ``optimizer`` (an instance or identifier)."""
    import keras

    if isinstance(optimizer, str):
        key = _normalise_name(optimizer)
        if key in _CLASS_NAMES:
            return getattr(keras.optimizers, _CLASS_NAMES[key])()
        try:
            return keras.optimizers.get(optimizer)
        except ValueError as err:
            raise ValueError(
                f"unknown optimizer {optimizer!r}; known names: {', '.join(sorted(_CLASS_NAMES))}, "
                "or pass a keras.optimizers.Optimizer instance"
            ) from err
    if isinstance(optimizer, keras.optimizers.Optimizer):
        # from_config works for custom classes too; keras.optimizers.deserialize
        # does not (and in Keras 3.15 returns the string "Lamb" for a Lamb config).
        try:
            fresh = type(optimizer).from_config(optimizer.get_config())
        except Exception:
            fresh = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
        if not isinstance(fresh, keras.optimizers.Optimizer):
            raise TypeError(f"could not re-create optimizer {optimizer!r} from its config")
        return fresh
    try:
        return keras.optimizers.get(optimizer)
    except ValueError as err:
        raise ValueError(
            f"cannot interpret {optimizer!r} as an optimizer; pass a name such as 'adam' "
            "or a keras.optimizers.Optimizer instance"
        ) from err


def _variable_strategy(variables: list[Any]) -> Any:
    """The tf.distribute strategy owning ``variables``, if any."""
    for v in variables:
        strategy = getattr(getattr(v, "value", None), "distribute_strategy", None)
        if strategy is not None:
            return strategy
    return None


def _slot_bytes(optimizer: Any, variables: list[Any]) -> int:
    """Bytes of the non-scalar variables a fresh ``optimizer`` creates for ``variables``."""
    import contextlib

    strategy = _variable_strategy(variables)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:  # a Keras optimizer must be created under the variables' strategy
        fresh = _fresh_optimizer(optimizer)
        fresh.build(variables)
        total = sum(nbytes(v) for v in fresh.variables if len(v.shape) > 0)
    del fresh
    return total


def optimizer_slots_per_param(optimizer: Any) -> int:
    """Number of slot variables a Keras optimizer keeps per parameter.

    For a name (``"adam"``, ``"SGD"``, ``"rmsprop"``...) the default
    configuration is looked up in a table without importing Keras.  For an
    optimizer instance, or an unknown identifier, a fresh copy is built on a
    16x16 float32 probe variable and its non-scalar variables are counted, so
    options such as ``amsgrad``, ``momentum``, ``centered``, ``use_ema`` and
    ``gradient_accumulation_steps`` are taken into account.  Shape-dependent
    optimizers (Adafactor, Muon) are reported for a matrix; use
    :func:`estimate_memory` for exact bytes.

    Verified table (Keras 3.15): Adam 2 (3 with amsgrad), AdamW 2 (3 with
    amsgrad), Adamax 2, Nadam 2, Lamb 2, Lion 1, Adagrad 1, RMSprop 1 (+1 with
    momentum, +1 if centered), SGD 0 (1 with momentum), Adadelta 2, Ftrl 2,
    Adafactor 1, Muon 1, ScheduleFreeAdamW 2; +1 for ``use_ema=True`` and +1
    for ``gradient_accumulation_steps``.

    Raises:
        ValueError: if the identifier is not a known optimizer.

    Example:
        >>> optimizer_slots_per_param("adam"), optimizer_slots_per_param("sgd")
        (2, 0)
        >>> import keras
        >>> optimizer_slots_per_param(keras.optimizers.SGD(momentum=0.9))
        1
    """
    if isinstance(optimizer, str):
        key = _normalise_name(optimizer)
        if key in _DEFAULT_SLOTS:
            return _DEFAULT_SLOTS[key]
    import keras
    import numpy as np

    probe = keras.Variable(np.zeros(_PROBE_SHAPE, dtype="float32"), name="probe_kernel")
    slot_elements = _slot_bytes(optimizer, [probe]) // 4
    return round(slot_elements / math.prod(_PROBE_SHAPE))


# -------------------------------------------------------------------------- estimates

def _unique(variables: Any) -> list[Any]:
    seen: set[int] = set()
    out = []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


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

    @property
    def total(self) -> int:
        """Sum of parameters, gradients, optimizer slots and activations.

        Example:
            >>> MemoryEstimate(1, 2, 3, 4, batch_size=8).total
            10
        """
        return self.parameters + self.gradients + self.optimizer_slots + self.activations

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


def _resolve_model(model: Any) -> Any:
    import keras

    if not isinstance(model, keras.Model) and callable(model):
        model = model()
    if not isinstance(model, keras.Model):
        raise ValueError(f"expected a keras.Model or a zero-argument callable returning one, got {model!r}")
    if not model.built:
        raise ValueError(
            f"model {model.name!r} is not built; start it with keras.Input(...) or call "
            "model.build(input_shape) before estimating its memory"
        )
    return model


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")


def _output_bytes(layer: Any, batch_size: int) -> tuple[int | None, bool]:
    """(bytes of the layer's symbolic output(s) for ``batch_size``, had unknown dims); None if unknown."""
    import keras

    try:
        output = layer.output
    except (AttributeError, ValueError):
        return None, False
    total = 0
    unknown_dims = False
    for tensor in keras.tree.flatten(output):
        shape = getattr(tensor, "shape", None)
        if shape is None:
            continue
        elements = 1
        for axis, dim in enumerate(shape):
            if dim is None:
                if axis == 0:
                    dim = batch_size
                else:
                    unknown_dims = True
                    dim = 1
            elements *= int(dim)
        total += elements * dtype_size(tensor.dtype)
    return total, unknown_dims


# ------------------------------------------------------------------ observed units

#: Rows of the batch a model is called on to observe its units (:func:`observe_units`).
PROBE_ROWS = 2
#: Sizes tried, in order, for the non-batch dimensions a model leaves unknown (a sequence length, an image side).
PROBE_DIMS = (8, 1, 32)


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
        """``output_bytes`` (measured for ``rows`` rows) scaled to ``batch_size`` rows."""
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


def _shape_bytes(value: Any) -> int:
    total = 0
    for tensor in _flatten(value):
        shape, dtype = getattr(tensor, "shape", None), getattr(tensor, "dtype", None)
        if shape is None or dtype is None:
            continue
        elements = 1
        for dim in shape:
            elements *= int(dim) if dim is not None else 1
        total += elements * dtype_size(dtype)
    return total


def _flatten(value: Any) -> list[Any]:
    import keras

    return [v for v in keras.tree.flatten(value) if v is not None]


def probe_inputs(model: Any, rows: int = PROBE_ROWS, unknown: int = PROBE_DIMS[0]) -> tuple[Any, bool]:
    """A batch of ones of ``rows`` rows that ``model`` accepts, and whether some non-batch dimension was unknown.

    Functional and Sequential models give their inputs' shapes, dtypes and names (several inputs as a dict keyed by
    input name); other models the input shape they were built with (``get_build_config()``), as float32. Unknown
    non-batch dimensions get the size ``unknown``.

    Raises:
        ValueError: for a model that tells neither its inputs nor the shape it was built with.
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
        return np.ones(dims, dtype=str(getattr(dtype, "name", dtype)))

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
            self.output_bytes[index] += _shape_bytes(outputs)
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
    params = [sum(nbytes(v) for v in _unique(layer.weights)) for _, layer in units]
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


def _layer_table(model: Any, batch_size: int) -> tuple[list[tuple[str, int, int]], list[str]]:
    """One row ``(unit, param bytes, activation bytes)`` per unit, measured from one observed call of the model."""
    observation = observe_units(model)
    notes = []
    if observation.problem:
        rows = []
        no_output = []
        for unit in observation.units:
            activation, _ = _output_bytes(unit.layer, batch_size)
            if activation is None:
                no_output.append(unit.name)
            rows.append((unit.name, unit.param_bytes, activation or 0))
        notes.append(f"{observation.problem}: units in declaration order")
        if no_output:
            notes.append(
                "activations unknown (counted as 0) for: "
                + ", ".join(no_output[:8])
                + (" ..." if len(no_output) > 8 else "")
            )
        return rows, notes
    rows = [(u.name, u.param_bytes, u.activation_bytes(observation.rows, batch_size)) for u in observation.units]
    if observation.probe_dims is not None:
        notes.append(
            f"activations measured with the model's unknown non-batch dimensions (sequence length, image size) set "
            f"to {observation.probe_dims}"
        )
    return rows, notes


def estimate_memory(
    model: Any | Callable[[], Any],
    *,
    batch_size: int = 32,
    optimizer: Any = "adam",
    exact_slots: bool = True,
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

    Raises:
        ValueError: for an unbuilt model, a bad batch size or an unknown optimizer.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        >>> est = estimate_memory(model, batch_size=2, optimizer="adam")
        >>> est.parameters, est.gradients, est.optimizer_slots, est.activations
        (60, 60, 120, 24)
    """
    _check_batch_size(batch_size)
    model = _resolve_model(model)
    all_vars = _unique(model.weights)
    trainable = _unique(model.trainable_variables)
    parameters = sum(nbytes(v) for v in all_vars)
    gradients = sum(nbytes(v) for v in trainable)
    notes: list[str] = []
    slots: int | None = None
    if exact_slots and trainable:
        try:
            slots = _slot_bytes(optimizer, trainable)
        except ValueError:
            raise
        except Exception as err:  # e.g. a custom optimizer that cannot be copied
            notes.append(f"optimizer slots estimated from slots per parameter ({type(err).__name__}: {err})")
    if slots is None:
        slots = gradients * optimizer_slots_per_param(optimizer) if trainable else 0
    rows, layer_notes = _layer_table(model, batch_size)
    notes.extend(layer_notes)
    return MemoryEstimate(
        parameters=parameters,
        gradients=gradients,
        optimizer_slots=slots,
        activations=sum(a for _, _, a in rows),
        batch_size=batch_size,
        per_layer=tuple(rows),
        note="; ".join(notes),
    )


def layer_costs(model: Any | Callable[[], Any], *, batch_size: int) -> list[LayerCost]:
    """Per-unit :class:`paraml.partition.LayerCost`, in the order one call of the model runs its units.

    The units are those of :func:`model_units` (nested models are descended into; a layer called twice is one
    unit), ordered and measured by :func:`observe_units`. ``param_bytes`` counts all of a unit's variables
    (trainable and not) once; ``activation_bytes`` is the bytes of its outputs over all its calls, scaled to
    ``batch_size`` rows.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")])
        >>> layer_costs(model, batch_size=2)
        [LayerCost(name='d', param_bytes=60, activation_bytes=24)]
    """
    from .partition import LayerCost

    _check_batch_size(batch_size)
    model = _resolve_model(model)
    rows, _ = _layer_table(model, batch_size)
    return [LayerCost(name, params, activation) for name, params, activation in rows]
