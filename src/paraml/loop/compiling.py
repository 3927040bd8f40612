"""Compiling a model for paraml's loop: Keras' own ``compile`` with the optimizer made under the backend, and XLA.

>>> check_compile_names("mse", ["mae"], None)
>>> check_compile_names("mse", ["acuracy"], None)
Traceback (most recent call last):
...
ValueError: unknown metric 'acuracy': Could not interpret metric identifier: acuracy
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from paraml.backends.base import Backend
from paraml.checks import did_you_mean
from paraml.planning.observe import nested_layers
from paraml.planning.optimizers import fresh_optimizer

__all__ = ["Compiled", "check_compile_names", "compile_model", "decide_xla", "extra_optimizers", "overrides"]

#: The step methods a model may override; paraml runs the model's own (per replica, as Keras' ``fit`` does).
STEP_METHODS = ("train_step", "test_step", "predict_step")

#: ``Parallel.build``'s compile arguments and their defaults (those of ``keras.Model.compile``, except ``loss``).
DEFAULT_BUILD_ARGUMENTS: Mapping[str, Any] = {
    "optimizer": "rmsprop",
    "loss": None,
    "loss_weights": None,
    "metrics": None,
    "weighted_metrics": None,
    "auto_scale_loss": True,
}

#: Arguments of ``keras.Model.compile`` that are options of ``Parallel`` (or refused) rather than of ``build``.
PARALLEL_OPTIONS = ("run_eagerly", "steps_per_execution", "jit_compile")

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


def overrides(model: keras.Model, method: str) -> bool:
    """Whether ``model``'s class defines its own ``method`` (a class outside Keras, keras_hub's tasks included)."""
    for klass in type(model).__mro__:
        if method in vars(klass):
            return not klass.__module__.startswith("keras.")
    return False


def extra_optimizers(model: keras.Model) -> dict[str, keras.optimizers.Optimizer]:
    """The optimizers a model holds besides ``model.optimizer``, by attribute name (a GAN's ``d_optimizer``...)."""
    found: dict[str, keras.optimizers.Optimizer] = {}
    for name, value in sorted(vars(model).items()):
        if isinstance(value, keras.optimizers.Optimizer) and value is not model.optimizer:
            if not any(value is seen for seen in found.values()):
                found[name.lstrip("_")] = value
    return found


def compile_model(
    backend: Backend, model: keras.Model, compile_args: dict[str, Any], jit_compile: bool | str
) -> Compiled:
    """Create the optimizer under the backend's scope and compile ``model`` as ``model.compile`` does.

    Keras accumulates gradients inside ``apply_gradients`` with a ``cond`` that breaks under tf.distribute (a
    ``merge_call`` in the ``cond``): the optimizer is re-created without it and the loop accumulates instead, with
    the same rule (``Compiled.accumulation_steps``).

    A model whose own ``compile`` takes no ``optimizer`` (a GAN's ``compile(d_optimizer=, g_optimizer=,
    loss_fn=)``) gets the arguments its ``compile`` names, with every optimizer among them re-created under the
    backend's scope (a Keras optimizer keeps the strategy it was created under).
    """
    _check_layers(backend, model)
    own_train_step = overrides(model, "train_step")
    problem = backend.capabilities.own_train_step_problem
    if own_train_step and problem is not None:
        raise ValueError(f"{type(model).__name__} has its own train_step, which {backend.name!r} cannot run: {problem}")
    arguments = _arguments_for(model, compile_args)
    if "optimizer" in arguments:
        accumulation = _compile_keras(backend, model, arguments)
    else:  # its own compile: optimizers re-created under the backend's scope, the rest as given
        accumulation = None
        with backend.scope():
            arguments = {
                k: fresh_optimizer(v) if isinstance(v, keras.optimizers.Optimizer) else v for k, v in arguments.items()
            }
        with backend.metrics_scope():
            model.compile(**arguments)
    if accumulation and own_train_step:
        raise ValueError(
            f"{type(model).__name__} has its own train_step, which applies the gradients itself: paraml cannot "
            f"accumulate them (gradient_accumulation_steps={accumulation}); accumulate inside the train_step, or "
            "remove gradient_accumulation_steps"
        )
    if own_train_step and jit_compile is True:
        raise ValueError(
            f"jit_compile=True cannot be used: {type(model).__name__} has its own train_step, whose optimizer update "
            "is a sync point XLA cannot compile under tf.distribute; use jit_compile=False or 'auto'"
        )
    if own_train_step:
        return Compiled(accumulation, False, "XLA off: the model's own train_step runs as written")
    xla, reason = decide_xla(jit_compile, backend, model)
    return Compiled(accumulation, xla, reason)


def _compile_keras(backend: Backend, model: keras.Model, compile_args: dict[str, Any]) -> int | None:
    """``model.compile`` with the optimizer made under the backend's scope; the gradient accumulation steps."""
    with backend.scope():
        optimizer = fresh_optimizer(compile_args["optimizer"])
        accumulation = optimizer.gradient_accumulation_steps
        if accumulation:
            config = {**optimizer.get_config(), "gradient_accumulation_steps": None}
            optimizer = optimizer.__class__.from_config(config)
        techniques = backend.techniques  # the plan's, applied to the model: sharded slots, a split weight's parts
        optimizer = techniques.prepare_optimizer(optimizer, model, backend.topology)
        if compile_args.get("auto_scale_loss", True) and model.dtype_policy.name == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)  # as compile would, but under the strategy
        problem = backend.capabilities.loss_scaling_problem
        if problem is not None and isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                f"strategy {backend.name!r} cannot step Keras' LossScaleOptimizer (mixed_float16): {problem}. "
                "Use 'mirrored', or the mixed_bfloat16 policy (no loss scaling), or build(..., "
                "auto_scale_loss=False)"
            )
        techniques.build_optimizer(optimizer, model)
    loss = techniques.prepare_loss(compile_args.get("loss"))  # split logits' cross-entropy on the slices
    with backend.metrics_scope():
        model.compile(**{**compile_args, "optimizer": optimizer, "loss": loss})
    return accumulation


def _arguments_for(model: keras.Model, compile_args: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of ``build`` that ``model.compile`` takes: a default it does not take is left out, anything
    else it does not take is a ``TypeError`` naming what it takes."""
    accepted = inspect.signature(model.compile).parameters
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    arguments = {}
    for name, value in compile_args.items():
        if open_ended or name in accepted:
            arguments[name] = value
        elif name not in DEFAULT_BUILD_ARGUMENTS or not _is_default(name, value):
            takes = [k for k in accepted if k not in PARALLEL_OPTIONS]
            raise TypeError(
                f"build() got an unexpected keyword argument {name!r}{did_you_mean(name, takes)}: "
                f"{type(model).__name__}.compile() takes {', '.join(takes)}"
            )
    return arguments


def _is_default(name: str, value: Any) -> bool:
    default = DEFAULT_BUILD_ARGUMENTS[name]
    return value is default or (isinstance(value, type(default)) and value == default)


def decide_xla(jit_compile: bool | str, backend: Backend, model: keras.Model) -> tuple[bool, str]:
    """Whether the replicas' step runs under XLA for ``jit_compile`` (True, False, "auto"), and why in words.

    ``True`` with a backend or a layer that cannot is a ``ValueError``; ``"auto"`` follows Keras' rule (accelerators
    only) where nothing prevents it.
    """
    if jit_compile is False:
        return False, "jit_compile=False: no XLA"
    problem = backend.capabilities.xla_problem
    if problem is None:
        blocked = [layer.name for layer in nested_layers(model) if not getattr(layer, "supports_jit", True)]
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
    grouped = [layer.name for layer in nested_layers(model) if (getattr(layer, "groups", 1) or 1) > 1]
    if problem is not None and grouped:
        raise ValueError(
            f"strategy {backend.name!r} cannot train layer {grouped[0]!r}, a grouped convolution: {problem}. Use "
            "'mirrored' (variables on every device) or 'single'"
        )
