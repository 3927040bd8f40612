"""A split weight and its parts: :class:`WholeVariable` (the whole face a split Keras variable keeps) and
:class:`SplitWeights` (which variables of a model are split, their parts, and the optimizer slots made for the parts).

What is split is kept here, by the applied plan, not as attributes set on Keras' variables: the step, the optimizer
and checkpoints ask the :class:`SplitWeights` of the model (``backend.techniques``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from paraml.internals import VARIABLE_VALUE_KEY, trackable_base

__all__ = ["SplitWeights", "WholeVariable"]


class _Whole:
    """The base :func:`WholeVariable`'s class (made on first use, with TensorFlow) carries, for ``isinstance``."""


@functools.cache
def _whole_class() -> type:
    """:class:`WholeVariable`'s implementation, made (and its tensor conversion registered) once, on first use."""
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


def is_whole(value: Any) -> bool:
    """Whether ``value`` (a Keras variable's ``value``) is a :class:`WholeVariable`."""
    return isinstance(value, _Whole)


class SplitWeights:
    """The split variables of one model (those whose value is a :class:`WholeVariable`), each part as a Keras
    variable, and the optimizer slots made for the parts.

    Entries hold the objects they are keyed by (``id`` is unique while its object lives), and live as long as the
    applied plan that made them.
    """

    def __init__(self, model: Any) -> None:
        self._parts: dict[int, tuple[Any, list[Any]]] = {}  # id(split variable) -> (it, its parts)
        self._part_of: dict[int, tuple[Any, Any, int]] = {}  # id(part) -> (part, split variable, index)
        self._slot_of: dict[int, tuple[Any, Any, int, int]] = {}  # id(slot) -> (slot, split variable, index, ordinal)
        for v in model.weights:
            if is_whole(v.value) and id(v) not in self._parts:
                parts = [_keras_part(v, k, p) for k, p in enumerate(v.value.parts)]
                self._parts[id(v)] = (v, parts)
                self._part_of.update({id(p): (p, v, k) for k, p in enumerate(parts)})

    def __len__(self) -> int:
        return len(self._parts)

    def parts(self, variable: Any) -> list[Any] | None:
        """A split Keras variable's parts (Keras variables, in part order); None for None.

        Raises:
            KeyError: for a variable that is not split in this model.
        """
        if variable is None:
            return None
        entry = self._parts.get(id(variable))
        if entry is None or entry[0] is not variable:
            raise KeyError(f"{variable.path} is not a split variable of this model")
        return entry[1]

    def trained_variables(self, model: Any) -> list[Any]:
        """``model.trainable_variables`` with each split variable replaced by its parts: what the gradient is taken
        with respect to and what the optimizer updates (each part's slots on the part's device)."""
        return self.with_parts(model.trainable_variables)

    def with_parts(self, variables: Sequence[Any]) -> list[Any]:
        """``variables`` with each split variable replaced by its parts."""
        found = []
        for v in variables:
            entry = self._parts.get(id(v))
            found.extend(entry[1] if entry is not None and entry[0] is v else (v,))
        return found

    def record_slots(self, optimizer: Any) -> None:
        """Record each slot ``optimizer`` creates for a part (a Keras optimizer creates a slot from its variable,
        ``add_variable_from_reference``), so that :meth:`saved_state` joins a variable's slots into one. The slots of
        an optimizer recorded before (a compile again replaced it) are forgotten."""
        self._slot_of.clear()
        for target in (optimizer, getattr(optimizer, "inner_optimizer", None)):
            if target is None or "add_variable_from_reference" in vars(target):
                continue
            original = target.add_variable_from_reference
            made: dict[int, int] = {}  # id(part) -> slots made for it so far

            def add_variable_from_reference(
                reference: Any,
                *args: Any,
                original: Callable[..., Any] = original,
                made: dict[int, int] = made,
                **kwargs: Any,
            ) -> Any:
                slot = original(reference, *args, **kwargs)
                entry = self._part_of.get(id(reference))
                if entry is not None and entry[0] is reference:
                    ordinal = made.get(id(reference), 0)
                    made[id(reference)] = ordinal + 1
                    self._slot_of[id(slot)] = (slot, entry[1], entry[2], ordinal)
                return slot

            target.add_variable_from_reference = add_variable_from_reference

    def saved_state(self, variables: Sequence[Any]) -> list[Any]:
        """``variables`` (an optimizer's, Keras variables) as a checkpoint holds them: each split variable's slots
        joined into one :class:`WholeVariable` at the first part's position, the other parts' slots left out, so the
        list is the one a model whose variables are whole has. Other variables: their value."""
        tags = []
        for v in variables:
            entry = self._slot_of.get(id(v))
            tags.append(entry[1:] if entry is not None and entry[0] is v else None)
        joined: dict[tuple[int, int], list[tuple[int, Any]]] = {}
        for v, tag in zip(variables, tags):
            if tag is not None:
                joined.setdefault((id(tag[0]), tag[2]), []).append((tag[1], v.value))
        state = []
        for v, tag in zip(variables, tags):
            if tag is None:
                state.append(v.value)
            elif tag[1] == 0:
                parts = [value for _, value in sorted(joined[(id(tag[0]), tag[2])], key=lambda item: item[0])]
                state.append(WholeVariable(parts, tag[0].value.axis, v.name))
        return state


def _keras_part(whole: Any, k: int, part: Any) -> Any:
    """A Keras variable over ``part`` (an existing TensorFlow variable), part ``k`` of ``whole``."""
    import keras
    import tensorflow as tf

    def existing(next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        del next_creator, kwargs
        return part

    def unused(shape: Any, dtype: Any = None) -> None:  # the creator above returns ``part`` without calling it
        del shape, dtype

    with tf.variable_creator_scope(existing):
        return keras.Variable(
            unused, shape=part.shape, dtype=part.dtype.name, trainable=whole.trainable, name=f"{whole.name}_part{k}"
        )
