"""Memory estimates for Keras models and human-readable byte sizes.

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
  estimated as the sum over layers of the bytes of each layer's output with
  the batch dimension set to ``batch_size``.  It is not multiplied by any
  factor: temporary buffers inside a layer and the backward pass's own
  intermediates are not counted.

Example:
    >>> parse_size("1.5 KiB"), format_bytes(1536)
    (1536, '1.50 KiB')
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .partition import LayerCost

__all__ = [
    "MemoryEstimate",
    "estimate_memory",
    "format_bytes",
    "layer_costs",
    "optimizer_slots_per_param",
    "parse_size",
]

# ----------------------------------------------------------------------------- sizes

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_ACCEPTED_UNITS = "B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024)"
_SIZE_RE = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")
_IEC = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def parse_size(value: int | str) -> int:
    """Convert a size such as ``"2GiB"`` or ``"1.5GB"`` to a number of bytes.

    Ints are taken as bytes.  Strings are a number, optional spaces and an
    optional case-insensitive unit: ``B``, ``KB``/``MB``/``GB``/``TB`` (SI,
    powers of 1000) or ``KiB``/``MiB``/``GiB``/``TiB`` (IEC, powers of 1024).
    Fractional results are rounded to the nearest byte; a plain byte count
    must be a whole number.

    Raises:
        ValueError: for negative sizes, unknown units or unparsable input.

    Example:
        >>> parse_size("2GiB"), parse_size("1.5GB"), parse_size("100kB"), parse_size(1024)
        (2147483648, 1500000000, 100000, 1024)
    """
    if isinstance(value, bool):
        raise ValueError(f"size must be an int number of bytes or a string, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0 bytes, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(
            f"size must be an int number of bytes or a string such as '2GiB', got {value!r}; "
            f"accepted units: {_ACCEPTED_UNITS}"
        )
    match = _SIZE_RE.match(value)
    if match is None:
        raise ValueError(
            f"cannot parse size {value!r}; expected a number and an optional unit, "
            f"e.g. '512MiB' or '1.5GB'; accepted units: {_ACCEPTED_UNITS}"
        )
    number, unit = match.groups()
    multiplier = _UNITS.get(unit.lower() if unit else "b")
    if multiplier is None:
        raise ValueError(f"unknown unit {unit!r} in size {value!r}; accepted units: {_ACCEPTED_UNITS}")
    amount = Fraction(number) * multiplier
    if amount < 0:
        raise ValueError(f"size must be >= 0 bytes, got {value!r}")
    if multiplier == 1 and amount.denominator != 1:
        raise ValueError(f"size {value!r} is not a whole number of bytes")
    return math.floor(amount + Fraction(1, 2))


def format_bytes(n: int) -> str:
    """Format a byte count with IEC units and two decimals.

    Example:
        >>> [format_bytes(x) for x in (0, 512, 1536, 2 * 1024**3)]
        ['0 B', '512 B', '1.50 KiB', '2.00 GiB']
    """
    n = int(n)
    if n < 0:
        return "-" + format_bytes(-n)
    if n < 1024:
        return f"{n} B"
    unit = 0
    value = float(n)
    while value >= 1024 and unit < len(_IEC) - 1:
        value /= 1024
        unit += 1
    if round(value, 2) >= 1024 and unit < len(_IEC) - 1:  # e.g. 1023.999 KiB -> 1.00 MiB
        value /= 1024
        unit += 1
    return f"{value:.2f} {_IEC[unit]}"


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
        total = sum(_nbytes(v) for v in fresh.variables if len(v.shape) > 0)
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

_DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


def _dtype_size(dtype: Any) -> int:
    name = str(getattr(dtype, "name", dtype))
    if name in _DTYPE_SIZES:
        return _DTYPE_SIZES[name]
    if name.startswith("float8"):
        return 1
    import numpy as np

    try:
        return int(np.dtype(name).itemsize)
    except TypeError:
        return 4


def _nbytes(variable: Any) -> int:
    return math.prod(int(d) for d in variable.shape) * _dtype_size(variable.dtype)


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
    """(bytes of the layer's output(s) for ``batch_size``, had unknown dims); None if unknown."""
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
        total += elements * _dtype_size(tensor.dtype)
    return total, unknown_dims


def _layer_table(model: Any, batch_size: int) -> tuple[list[tuple[str, int, int]], list[str]]:
    import keras

    rows = []
    no_output: list[str] = []
    unknown: list[str] = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        params = sum(_nbytes(v) for v in _unique(layer.weights))
        activation, had_unknown = _output_bytes(layer, batch_size)
        if activation is None:
            no_output.append(layer.name)
            activation = 0
        if had_unknown:
            unknown.append(layer.name)
        rows.append((layer.name, params, activation))
    notes = []
    if no_output:
        notes.append(
            "activations unknown (counted as 0) for layers without a symbolic output, "
            "as in subclassed models: " + ", ".join(no_output[:8]) + (" ..." if len(no_output) > 8 else "")
        )
    if unknown:
        notes.append(
            "non-batch dimensions of unknown size were counted as 1 for: "
            + ", ".join(unknown[:8])
            + (" ..." if len(unknown) > 8 else "")
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
    parameters = sum(_nbytes(v) for v in all_vars)
    gradients = sum(_nbytes(v) for v in trainable)
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
    """Per-layer :class:`paraml.partition.LayerCost` in ``model.layers`` order.

    Input layers are skipped.  ``param_bytes`` counts all of a layer's variables
    (trainable and not); ``activation_bytes`` is its output for ``batch_size``
    (0 when the layer has no symbolic output, as in subclassed models).

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
