"""Compiling a model for paraml's loop: Keras' own ``compile`` with the optimizer made under the backend, and XLA.

>>> check_compile_names("mse", ["mae"], None)
>>> check_compile_names("mse", ["acuracy"], None)
Traceback (most recent call last):
...
ValueError: unknown metric 'acuracy': Could not interpret metric identifier: acuracy
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from .backends.base import Backend
from .optimizers import fresh_optimizer

__all__ = ["Compiled", "check_compile_names", "compile_model", "decide_xla"]

#: Metric names Keras resolves from the loss and the output (not through ``keras.metrics.get``).
_KERAS_SPECIAL_METRICS = ("accuracy", "acc", "crossentropy", "ce")


def check_compile_names(loss: Any, metrics: Any, weighted_metrics: Any) -> None:
    """Raise ``ValueError`` for a loss or metric name Keras does not know (Keras itself only notices at the first step).

    ``loss`` and the metrics may be nested as ``compile`` takes them (lists per output, dicts by output name).
    """
    for item in tf.nest.flatten(loss):
        if isinstance(item, str):
            try:
                keras.losses.get(item)
            except (ValueError, TypeError) as error:
                raise ValueError(f"unknown loss {item!r}: {error}") from None
    for item in tf.nest.flatten([metrics, weighted_metrics]):
        if isinstance(item, str) and item not in _KERAS_SPECIAL_METRICS:
            try:
                keras.metrics.get(item)
            except (ValueError, TypeError) as error:
                raise ValueError(f"unknown metric {item!r}: {error}") from None


@dataclass(frozen=True)
class Compiled:
    """What compiling decided: the gradient accumulation the loop runs, and whether (and why) XLA is on."""

    accumulation_steps: int | None
    xla: bool
    xla_reason: str


def compile_model(
    backend: Backend, model: keras.Model, compile_args: dict[str, Any], jit_compile: bool | str
) -> Compiled:
    """Create the optimizer under the backend's scope and compile ``model`` as ``model.compile`` does.

    Keras accumulates gradients inside ``apply_gradients`` with a ``cond`` that breaks under tf.distribute (a
    ``merge_call`` in the ``cond``): the optimizer is re-created without it and the loop accumulates instead, with
    the same rule (``Compiled.accumulation_steps``).
    """
    _check_layers(backend, model)
    with backend.scope():
        optimizer = fresh_optimizer(compile_args["optimizer"])
        accumulation = optimizer.gradient_accumulation_steps
        if accumulation:
            config = {**optimizer.get_config(), "gradient_accumulation_steps": None}
            optimizer = optimizer.__class__.from_config(config)
        if compile_args["auto_scale_loss"] and model.dtype_policy.name == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)  # as compile would, but under the strategy
        problem = backend.capabilities.loss_scaling_problem
        if problem is not None and isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                f"strategy {backend.name!r} cannot step Keras' LossScaleOptimizer (mixed_float16): {problem}. "
                "Use 'mirrored', or the mixed_bfloat16 policy (no loss scaling), or build(..., "
                "auto_scale_loss=False)"
            )
        optimizer.build(model.trainable_variables)
    with backend.metrics_scope():
        model.compile(**{**compile_args, "optimizer": optimizer})
    xla, reason = decide_xla(jit_compile, backend, model)
    return Compiled(accumulation, xla, reason)


def decide_xla(jit_compile: bool | str, backend: Backend, model: keras.Model) -> tuple[bool, str]:
    """Whether the replicas' step runs under XLA for ``jit_compile`` (True, False, "auto"), and why in words.

    ``True`` with a backend or a layer that cannot is a ``ValueError``; ``"auto"`` follows Keras' rule (accelerators
    only) where nothing prevents it.
    """
    if jit_compile is False:
        return False, "jit_compile=False: no XLA"
    problem = backend.capabilities.xla_problem
    if problem is None:
        blocked = [layer.name for layer in _all_layers(model) if not getattr(layer, "supports_jit", True)]
        if blocked:
            problem = f"layer {blocked[0]!r} does not support XLA (supports_jit=False)"
    if jit_compile is True:
        if problem is not None:
            raise ValueError(f"jit_compile=True cannot be used: {problem}; use jit_compile=False or 'auto'")
        return True, "jit_compile=True: each replica's forward pass, loss and gradients run under XLA"
    if problem is None and not all("GPU" in d for d in backend.topology.devices):
        problem = "the devices are CPUs (Keras' rule: XLA only on accelerators)"
    if problem is None:
        return True, "jit_compile='auto': XLA on, the model and the backend support it"
    return False, f"jit_compile='auto': XLA off, {problem}"


def _check_layers(backend: Backend, model: keras.Model) -> None:
    """Refuse, by name, a layer the backend cannot run (before anything is compiled or trained)."""
    problem = backend.capabilities.grouped_convolution_problem
    grouped = [layer.name for layer in _all_layers(model) if (getattr(layer, "groups", 1) or 1) > 1]
    if problem is not None and grouped:
        raise ValueError(
            f"strategy {backend.name!r} cannot train layer {grouped[0]!r}, a grouped convolution: {problem}. Use "
            "'mirrored' (variables on every device) or 'single'"
        )


def _all_layers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """``layer`` and every layer nested in it (through ``layers`` of models and attributes of layers)."""
    found: list[keras.layers.Layer] = []
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
