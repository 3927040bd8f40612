"""Optimizers: the one way paraml re-creates an optimizer, and the bytes of the slot variables it keeps.

:func:`fresh_optimizer` turns what a user passes as ``optimizer=`` (a name, a config dict or an instance) into a new,
unbuilt Keras optimizer; :func:`slot_bytes` counts the bytes of the slot variables (momenta, velocities...) such an
optimizer creates for given variables; :func:`optimizer_slots_per_param` gives the slots per parameter, from a table
for a name and by building a copy on a probe variable otherwise.

Importing this module is cheap: Keras and TensorFlow are imported inside the functions that need them.

Example:
    >>> optimizer_slots_per_param("adam"), optimizer_slots_per_param("SGD")
    (2, 0)
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from paraml.internals import copy_weight_decay_exclusions
from paraml.planning.sizes import nbytes

if TYPE_CHECKING:  # pragma: no cover
    import keras

__all__ = ["fresh_optimizer", "optimizer_slots_per_param", "slot_bytes"]

# Every Keras 3 optimizer paraml knows by name: the lower-case class name without "_"/"-", the Keras class name, and
# the slot variables per parameter with the default arguments, as counted on a 2-D float32 variable (a Dense kernel).
# tests/test_memory.py checks every slot count against Keras.
_OPTIMIZERS: dict[str, tuple[str, int]] = {
    "adadelta": ("Adadelta", 2),  # accumulated_grad, accumulated_delta_var
    "adafactor": ("Adafactor", 1),  # velocity (+ a row and a column vector for matrices)
    "adagrad": ("Adagrad", 1),  # accumulator
    "adam": ("Adam", 2),  # momentum, velocity (+ velocity_hat if amsgrad)
    "adamax": ("Adamax", 2),  # momentum, norm
    "adamw": ("AdamW", 2),  # momentum, velocity (+ velocity_hat if amsgrad)
    "ftrl": ("Ftrl", 2),  # accumulator, linear
    "lamb": ("Lamb", 2),  # momentum, velocity
    "lion": ("Lion", 1),  # momentum
    "muon": ("Muon", 1),  # momentum for matrices; other ranks/embeddings use AdamW (2)
    "nadam": ("Nadam", 2),  # momentum, velocity (+ a scalar u_product)
    "rmsprop": ("RMSprop", 1),  # velocity (+ momentum if momentum > 0, + average_gradient if centered)
    "schedulefreeadamw": ("ScheduleFreeAdamW", 2),  # momentum, velocity
    "sgd": ("SGD", 0),  # (+ momentum if momentum > 0)
}

#: Shape of the float32 variable a copy of an optimizer is built on to count its slots per parameter.
_PROBE_SHAPE = (16, 16)


def _key(name: str) -> str:
    """``name`` as a key of the optimizer table: lower case, without spaces, ``_`` or ``-``."""
    return name.strip().lower().replace("_", "").replace("-", "")


def _unknown(identifier: Any, error: Exception | None = None) -> ValueError:
    detail = f" ({type(error).__name__}: {error})" if isinstance(identifier, dict) and error is not None else ""
    return ValueError(
        f"unknown optimizer {identifier!r}{detail}; known names: {', '.join(sorted(_OPTIMIZERS))}, "
        "or pass a config dict or a keras.optimizers.Optimizer instance"
    )


def fresh_optimizer(identifier: Any) -> keras.optimizers.Optimizer:
    """A new, unbuilt optimizer for ``identifier``: a name, a config dict or an optimizer instance.

    * a **name** is looked up in paraml's table, ignoring case, ``_`` and ``-`` (``"adam"``, ``"RMSprop"``,
      ``"schedule_free_adamw"``); other names (an optimizer registered with Keras) go to
      ``keras.optimizers.get``;
    * a **config dict** (``{"class_name": "Adam", "config": {...}}``, as ``keras.optimizers.serialize`` gives) is
      deserialized; the caller's dict is not modified;
    * an **instance** is re-created from its config (``type(opt).from_config(opt.get_config())``, which works for
      custom classes too, falling back to ``keras.optimizers.serialize``/``deserialize``). Its state, if any, is not
      carried over and the instance itself is left untouched.

    Call it inside the scope the optimizer's variables belong to: a Keras optimizer remembers the
    ``tf.distribute`` strategy it was created under.

    Raises:
        ValueError: for an identifier that names or describes no optimizer (the message starts with
            ``unknown optimizer <identifier>`` and lists the known names), or a config dict Keras refuses.
        TypeError: for an instance that cannot be re-created from its config.

    Example:
        >>> fresh_optimizer("adam").__class__.__name__
        'Adam'
        >>> import keras
        >>> opt = keras.optimizers.SGD(learning_rate=0.5, momentum=0.9)
        >>> again = fresh_optimizer(opt)
        >>> again is opt, type(again).__name__, float(again.learning_rate), again.momentum
        (False, 'SGD', 0.5, 0.9)
        >>> fresh_optimizer("adamz")
        Traceback (most recent call last):
        ...
        ValueError: unknown optimizer 'adamz'; known names: adadelta, adafactor, ...
    """
    import keras

    if isinstance(identifier, keras.optimizers.Optimizer):
        # from_config works for custom classes too; keras.optimizers.deserialize does not (and in Keras 3.15 it
        # returns the string "Lamb" for a Lamb config).
        try:
            fresh = type(identifier).from_config(identifier.get_config())
        except Exception:
            fresh = keras.optimizers.deserialize(keras.optimizers.serialize(identifier))
        if not isinstance(fresh, keras.optimizers.Optimizer):
            raise TypeError(f"could not re-create optimizer {identifier!r} from its config")
        copy_weight_decay_exclusions(identifier, fresh)  # not in the config
        return fresh
    known, config = None, {}
    if isinstance(identifier, str):
        known = _OPTIMIZERS.get(_key(identifier))
    elif isinstance(identifier, dict) and isinstance(identifier.get("class_name"), str):
        known = _OPTIMIZERS.get(_key(identifier["class_name"]))
        config = copy.deepcopy(identifier.get("config") or {})
    if known is not None and hasattr(keras.optimizers, known[0]):
        cls = getattr(keras.optimizers, known[0])
        try:
            return cls.from_config(config) if config else cls()
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"invalid config for keras.optimizers.{known[0]} in {identifier!r} ({type(error).__name__}: {error})"
            ) from error
    if not isinstance(identifier, (str, dict)):
        raise _unknown(identifier)
    try:
        # keras.optimizers.get lower-cases the class name in a dict it is given: give it a copy
        fresh = keras.optimizers.get(copy.deepcopy(identifier))
    except (TypeError, ValueError, KeyError) as error:
        raise _unknown(identifier, error) from error
    if not isinstance(fresh, keras.optimizers.Optimizer):
        raise _unknown(identifier)
    return fresh


def _variable_strategy(variables: Sequence[Any]) -> Any:
    """The ``tf.distribute`` strategy owning ``variables``, if any."""
    for v in variables:
        strategy = getattr(getattr(v, "value", None), "distribute_strategy", None)
        if strategy is not None:
            return strategy
    return None


def slot_bytes(optimizer: Any, variables: Sequence[Any]) -> int:
    """Bytes of the slot variables a fresh copy of ``optimizer`` creates when built on ``variables``.

    ``optimizer`` is anything :func:`fresh_optimizer` takes; it is not modified. The copy is created under the
    strategy that owns ``variables`` (if any), built, measured and dropped, so the slots are allocated for a moment.
    Scalar bookkeeping variables (``iteration``, ``learning_rate``...) are not counted; the slots follow the
    variables' dtypes.

    Raises:
        ValueError: for an unknown optimizer (see :func:`fresh_optimizer`).

    Example:
        >>> import keras, numpy as np
        >>> kernel = keras.Variable(np.zeros((4, 3), "float32"))
        >>> slot_bytes("adam", [kernel])  # momentum and velocity: 2 * 12 float32
        96
    """
    strategy = _variable_strategy(variables)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:  # a Keras optimizer must be created under its variables' strategy
        fresh = fresh_optimizer(optimizer)
        fresh.build(list(variables))
        total = sum(nbytes(v) for v in fresh.variables if len(v.shape) > 0)
    del fresh
    return total


def optimizer_slots_per_param(optimizer: Any) -> int:
    """Number of slot variables a Keras optimizer keeps per parameter.

    For a name (``"adam"``, ``"SGD"``, ``"rmsprop"``...) the default configuration is looked up in a table without
    importing Keras. For an optimizer instance, a config dict or another name, a fresh copy is built on a 16x16
    float32 probe variable and its slot bytes are counted (:func:`slot_bytes`), so options such as ``amsgrad``,
    ``momentum``, ``centered``, ``use_ema`` and ``gradient_accumulation_steps`` are taken into account.
    Shape-dependent optimizers (Adafactor, Muon) are reported for a matrix; use
    :func:`paraml.memory.estimate_memory` for exact bytes.

    Verified table (Keras 3.15): Adam 2 (3 with amsgrad), AdamW 2 (3 with amsgrad), Adamax 2, Nadam 2, Lamb 2,
    Lion 1, Adagrad 1, RMSprop 1 (+1 with momentum, +1 if centered), SGD 0 (1 with momentum), Adadelta 2, Ftrl 2,
    Adafactor 1, Muon 1, ScheduleFreeAdamW 2; +1 for ``use_ema=True`` and +1 for ``gradient_accumulation_steps``.

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
        known = _OPTIMIZERS.get(_key(optimizer))
        if known is not None:
            return known[1]
    import keras
    import numpy as np

    probe = keras.Variable(np.zeros(_PROBE_SHAPE, dtype="float32"), name="probe_kernel")
    slot_elements = slot_bytes(optimizer, [probe]) // 4
    return round(slot_elements / math.prod(_PROBE_SHAPE))
