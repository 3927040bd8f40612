"""The ``paraml`` command: a thin argparse front over the library (demo, devices, estimate, launch, bench)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _demo(ns: argparse.Namespace) -> int:
    from .demo import run_demo

    results = run_demo(num_devices=ns.devices, epochs=ns.epochs, batch_size=ns.batch_size)
    worst = min(r.accuracy for r in results)
    return 0 if worst >= ns.min_accuracy else 1


def _devices(ns: argparse.Namespace) -> int:
    from .devices import describe_devices, simulate_devices
    from .sizes import format_bytes

    if ns.simulate:
        simulate_devices(ns.simulate)
    print(f"{'device':<20}{'type':<6}{'memory':>12}")
    for info in describe_devices():
        memory = format_bytes(info.memory_bytes) if info.memory_bytes else "unknown"
        print(f"{info.name:<20}{info.device_type:<6}{memory:>12}")
    return 0


def load_object(spec: str) -> object:
    """``"package.module:function"`` or ``"path/to/file.py:function"`` -> that object (``estimate``, ``bench``)."""
    import importlib
    import importlib.util
    from pathlib import Path

    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(
            f"expected MODULE:FUNCTION (e.g. mypkg.models:make_model or models.py:make_model), got {spec!r}"
        )
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise FileNotFoundError(f"no file {module_name!r} (from {spec!r})")
        loader = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(f"cannot import {module_name!r} (from {spec!r}): {error}") from None
    if not hasattr(module, attribute):
        raise ValueError(f"{module_name!r} has no {attribute!r} (from {spec!r})")
    return getattr(module, attribute)


def _estimate(ns: argparse.Namespace) -> int:
    from .memory import estimate_memory

    model_fn = load_object(ns.model)
    if not callable(model_fn):
        raise ValueError(f"{ns.model!r} is not a function that builds a model")
    print(estimate_memory(model_fn, batch_size=ns.batch_size, optimizer=ns.optimizer))
    return 0


def _launch(ns: argparse.Namespace) -> int:
    from . import launch

    return launch.run_from_args(ns)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``paraml`` command."""
    parser = argparse.ArgumentParser(prog="paraml", description="Multi-device training on TensorFlow/Keras 3.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train on the shipped digits data under every backend")
    demo.add_argument("--devices", type=int, default=2, help="devices to simulate and use (default 2)")
    demo.add_argument("--epochs", type=int, default=20)
    demo.add_argument("--batch-size", type=int, default=64)
    demo.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 if any backend ends below this")
    demo.set_defaults(run=_demo)

    devices = commands.add_parser("devices", help="list local devices and their memory")
    devices.add_argument("--simulate", type=int, default=0, help="split the machine into N logical devices first")
    devices.set_defaults(run=_devices)

    estimate = commands.add_parser(
        "estimate", help="estimate a model's training memory (like accelerate estimate-memory)"
    )
    estimate.add_argument("model", help="MODULE:FUNCTION or FILE.py:FUNCTION that returns a keras.Model")
    estimate.add_argument("--batch-size", type=int, default=32)
    estimate.add_argument("--optimizer", default="adam")
    estimate.set_defaults(run=_estimate)

    from . import bench, launch

    benchmark = commands.add_parser("bench", help="compare the backends side by side on this machine")
    bench.add_arguments(benchmark)
    benchmark.set_defaults(run=bench.run_from_args)

    launcher = commands.add_parser("launch", help="run a script on N local workers (multi_worker)")
    launch.add_arguments(launcher)
    launcher.set_defaults(run=_launch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``paraml`` and ``python -m paraml``; returns the exit code."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return int(ns.run(ns))
    except (ValueError, RuntimeError, FileNotFoundError) as error:
        print(f"paraml {ns.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
