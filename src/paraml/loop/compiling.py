"""Compiling a model for paraml's loop: Keras' own ``compile`` with the optimizer made under the backend, and XLA.

>>> check_compile_names("mse", ["mae"], None)
>>> check_compile_names("mse", ["acuracy"], None)
Traceback (most recent call last):
...
ValueError: unknown metric 'acuracy': Could not interpret metric identifier: acuracy
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from paraml.backends.base import Backend
from paraml.checks import check_int, did_you_mean
from paraml.internals import state_unlocked, untracked
from paraml.planning.observe import nested_layers
from paraml.planning.optimizers import fresh_optimizer

__all__ = [
    "MODEL_DEFAULT",
    "NOT_EAGER",
    "Compiled",
    "changed_trainable",
    "check_compile_names",
    "check_loss",
    "compile_again_arguments",
    "compile_default",
    "compile_model",
    "decide_xla",
    "extra_optimizers",
    "given_arguments",
    "overrides",
    "route_compile",
    "trainable_state",
]

#: The step methods a model may override; paraml runs the model's own (per replica, as Keras' ``fit`` does).
STEP_METHODS = ("train_step", "test_step", "predict_step")


class _ModelDefault:
    """The value of a ``Parallel.build`` argument the caller did not give."""

    def __repr__(self) -> str:
        return "<the model's compile default>"


#: The default of ``Parallel.build``'s compile arguments: not given, so the model's own ``compile`` default applies
#: (Keras' for a plain model, a keras_hub task's ``"auto"`` for a task), as in ``model.compile(...)`` without it.
MODEL_DEFAULT: Any = _ModelDefault()

#: Arguments of ``keras.Model.compile`` that are options of ``Parallel`` (or refused) rather than of ``build``.
PARALLEL_OPTIONS = ("run_eagerly", "steps_per_execution", "jit_compile")

#: Why ``run_eagerly`` is refused (in ``build`` and in a compile again).
NOT_EAGER = (
    "run_eagerly is not supported: paraml's loop runs in tf.function on every backend; to debug a model eagerly, "
    "use plain keras model.compile(run_eagerly=True).fit(...)"
)

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


def given_arguments(**arguments: Any) -> dict[str, Any]:
    """The arguments the caller gave (those not :data:`MODEL_DEFAULT`), a lone metric name as a list as Keras takes
    it.

    >>> given_arguments(optimizer="adam", loss=MODEL_DEFAULT, metrics="mae", weighted_metrics=None)
    {'optimizer': 'adam', 'metrics': ['mae'], 'weighted_metrics': None}
    """
    given = {name: value for name, value in arguments.items() if value is not MODEL_DEFAULT}
    for name in ("metrics", "weighted_metrics"):
        if isinstance(given.get(name), str):
            given[name] = [given[name]]
    return given


def compile_again_arguments(
    model: keras.Model, previous: Mapping[str, Any], arguments: dict[str, Any], steps: int, jit_compile: bool | str
) -> tuple[dict[str, Any], int, bool | str]:
    """A compile again's arguments for ``model`` checked as ``build`` checks them: those for its ``compile``, and the
    ``steps_per_execution`` and ``jit_compile`` it runs with (``steps`` and ``jit_compile`` unless given).

    What it leaves out follows Keras' rule: no ``loss`` keeps the ``previous`` loss (and its ``loss_weights``); no
    ``metrics`` and no ``weighted_metrics`` keep the previous metrics.
    """
    options = {name: arguments.pop(name) for name in PARALLEL_OPTIONS if name in arguments}
    if options.pop("run_eagerly", False):
        raise TypeError(NOT_EAGER)
    steps = check_int("steps_per_execution", options.get("steps_per_execution", steps))
    jit_compile = options.get("jit_compile", jit_compile)
    if jit_compile not in (True, False, "auto"):
        raise ValueError(f"jit_compile must be True, False or 'auto', got {jit_compile!r}")
    given = given_arguments(**arguments)
    kept: dict[str, Any] = {}
    if "loss" not in given:
        kept.update({k: previous[k] for k in ("loss", "loss_weights") if k in previous})
    if "metrics" not in given and "weighted_metrics" not in given:
        kept.update({k: previous[k] for k in ("metrics", "weighted_metrics") if k in previous})
    given.update(kept)
    check_compile_names(given.get("loss"), given.get("metrics"), given.get("weighted_metrics"))
    check_loss(model, given)
    return given, steps, jit_compile


def check_loss(model: keras.Model, compile_args: Mapping[str, Any]) -> None:
    """Refuse a compile without a loss where the model needs one (no own ``train_step``, no loss its compile picks)."""
    if compile_args.get("loss", compile_default(model, "loss")) is None and not overrides(model, "train_step"):
        raise ValueError(
            "loss is required, e.g. loss='sparse_categorical_crossentropy' (or one per output); only a model "
            "with its own train_step, or whose own compile picks a loss (a keras_hub task), trains without one"
        )


def route_compile(model: keras.Model, compile_again: Callable[[dict[str, Any]], None]) -> None:
    """Make ``model.compile(...)`` (this instance's) call ``compile_again(arguments)`` with the arguments given, by
    name, instead of Keras' own: a second compile (the fine-tuning guide's, after ``base.trainable = True``) then
    creates its optimizer under the backend and the step is traced again, as ``par.compile(...)`` does."""
    keras_compile = _keras_compile(model)
    signature = inspect.signature(keras_compile)

    def compile(*args: Any, **kwargs: Any) -> None:
        bound = signature.bind(*args, **kwargs)
        arguments: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = signature.parameters[name].kind
            arguments.update(value if kind is inspect.Parameter.VAR_KEYWORD else {name: value})
        compile_again(arguments)

    # inspect.signature(model.compile) and help() stay the model's own; _keras_compile finds Keras' again
    compile.__signature__ = signature  # type: ignore[attr-defined]
    compile.__doc__ = keras_compile.__doc__
    compile.keras_compile = keras_compile  # type: ignore[attr-defined]
    model.compile = compile  # the public method, on this instance (as a stage's call is)


def _keras_compile(model: keras.Model) -> Callable[..., Any]:
    """The model's own ``compile`` (its class's), also once :func:`route_compile` has routed ``model.compile``."""
    routed = model.compile
    return routed.keras_compile if inspect.isfunction(routed) and hasattr(routed, "keras_compile") else routed


def trainable_state(model: keras.Model) -> dict[int, tuple[Any, bool]]:
    """Each layer of ``model`` (nested ones included) and its ``trainable`` flag, by id: what a compile saw."""
    return {id(layer): (layer, bool(layer.trainable)) for layer in nested_layers(model)}


def changed_trainable(model: keras.Model, compiled: dict[int, tuple[Any, bool]]) -> list[str]:
    """The names of the layers whose ``trainable`` flag differs from ``compiled`` (:func:`trainable_state`), outermost
    first: a layer inside one already named is left out (setting ``base.trainable`` sets its layers' too)."""
    changed = [
        layer
        for key, (layer, trainable) in trainable_state(model).items()
        if key not in compiled or compiled[key][1] != trainable
    ]
    inner = {id(sub) for layer in changed for sub in nested_layers(layer) if sub is not layer}
    return [layer.name for layer in changed if id(layer) not in inner]


def compile_default(model: keras.Model, name: str) -> Any:
    """The default of argument ``name`` of ``model.compile`` (Keras' own where the model's compile passes it on
    through ``**kwargs``); ``inspect.Parameter.empty`` when it takes no such argument or it has no default."""
    for compile_method in (_keras_compile(model), keras.Model.compile):
        parameters = inspect.signature(compile_method).parameters
        if name in parameters:
            return parameters[name].default
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            break
    return inspect.Parameter.empty


def compile_model(backend: Backend, model: keras.Model, given: dict[str, Any], jit_compile: bool | str) -> Compiled:
    """Create the optimizer under the backend's scope and compile ``model`` as ``model.compile(**given)`` does.

    ``given`` holds only the arguments the caller gave: the model's own ``compile`` keeps its defaults for the others
    (a keras_hub task's default optimizer, loss and ``weighted_metrics``), as in Keras. Its optimizer and loss, when
    not given, are the ones its ``compile`` picks.

    Keras accumulates gradients inside ``apply_gradients`` with a ``cond`` that breaks under tf.distribute (a
    ``merge_call`` in the ``cond``): the optimizer is re-created without it and the loop accumulates instead, with
    the same rule (``Compiled.accumulation_steps``).

    A model whose own ``compile`` takes no ``optimizer`` (a GAN's ``compile(d_optimizer=, g_optimizer=,
    loss_fn=)``) gets the arguments given, with every optimizer among them re-created under the backend's scope (a
    Keras optimizer keeps the strategy it was created under). A model's own ``compile`` may create state (loss
    trackers, layers) although the model is built already: in Keras it runs before ``fit`` builds the model.
    """
    _check_layers(backend, model)
    own_train_step = overrides(model, "train_step")
    problem = backend.capabilities.own_train_step_problem
    if own_train_step and problem is not None:
        raise ValueError(f"{type(model).__name__} has its own train_step, which {backend.name!r} cannot run: {problem}")
    arguments = _arguments_for(model, given)
    if _takes(model, "optimizer"):
        accumulation = _compile_keras(backend, model, arguments)
    else:  # its own compile: optimizers re-created under the backend's scope, the rest as given
        accumulation = None
        with backend.scope():
            arguments = {
                k: fresh_optimizer(v) if isinstance(v, keras.optimizers.Optimizer) else v for k, v in arguments.items()
            }
        _call_compile(backend, model, arguments)
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


def _call_compile(backend: Backend, model: keras.Model, arguments: dict[str, Any]) -> None:
    """``model.compile(**arguments)`` where metric variables belong; state its own compile creates is the model's
    although the model is built (Keras compiles before ``fit`` builds, and locks a built model's state)."""
    with backend.metrics_scope(), state_unlocked(model):
        _keras_compile(model)(**arguments)


def _chosen_by_model(backend: Backend, model: keras.Model, given: dict[str, Any]) -> tuple[Any, Any]:
    """The optimizer and loss of ``model.compile(**given)``: the given ones, else those its compile picks (Keras'
    ``"rmsprop"``, a keras_hub task's ``"auto"``), found by compiling once without tracking what it creates."""
    if "optimizer" in given and "loss" in given:
        return given["optimizer"], given["loss"]
    with backend.metrics_scope(), untracked():  # the real compile follows: nothing of this one stays tracked
        _keras_compile(model)(**given)
    optimizer = given.get("optimizer", model.optimizer)
    if "optimizer" not in given and isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer  # Keras' own wrapping (mixed_float16): paraml wraps it under the backend
    return optimizer, given.get("loss", getattr(model, "loss", None))


def _compile_keras(backend: Backend, model: keras.Model, given: dict[str, Any]) -> int | None:
    """``model.compile`` with the optimizer made under the backend's scope; the gradient accumulation steps."""
    chosen_optimizer, chosen_loss = _chosen_by_model(backend, model, given)
    with backend.scope():
        optimizer = fresh_optimizer(chosen_optimizer)
        accumulation = optimizer.gradient_accumulation_steps
        if accumulation:
            config = {**optimizer.get_config(), "gradient_accumulation_steps": None}
            optimizer = optimizer.__class__.from_config(config)
        techniques = backend.techniques  # the plan's, applied to the model: sharded slots, a split weight's parts
        optimizer = techniques.prepare_optimizer(optimizer, model, backend.topology)
        if given.get("auto_scale_loss", True) and model.dtype_policy.name == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)  # as compile would, but under the strategy
        problem = backend.capabilities.loss_scaling_problem
        if problem is not None and isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                f"strategy {backend.name!r} cannot step Keras' LossScaleOptimizer (mixed_float16): {problem}. "
                "Use 'mirrored', or the mixed_bfloat16 policy (no loss scaling), or build(..., "
                "auto_scale_loss=False)"
            )
        techniques.build_optimizer(optimizer, model)
    arguments = {**given, "optimizer": optimizer}
    if _takes(model, "loss"):
        arguments["loss"] = techniques.prepare_loss(chosen_loss)  # split logits' cross-entropy on the slices
    _call_compile(backend, model, arguments)
    return accumulation


def _takes(model: keras.Model, name: str) -> bool:
    """Whether ``model.compile`` takes argument ``name`` (by name, or through ``**kwargs``)."""
    parameters = inspect.signature(model.compile).parameters
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _arguments_for(model: keras.Model, given: Mapping[str, Any]) -> dict[str, Any]:
    """The given arguments, each one ``model.compile`` takes; one it does not take is a ``TypeError`` naming what it
    takes (as Keras raises for ``model.compile(...)``)."""
    for name in given:
        if not _takes(model, name):
            accepted = inspect.signature(model.compile).parameters
            takes = [k for k in accepted if k not in PARALLEL_OPTIONS]
            raise TypeError(
                f"build() got an unexpected keyword argument {name!r}{did_you_mean(name, takes)}: "
                f"{type(model).__name__}.compile() takes {', '.join(takes)}"
            )
    return dict(given)


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
