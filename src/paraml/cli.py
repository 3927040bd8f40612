"""The ``paraml`` command: a thin argparse front over the library (demo, devices, estimate, launch, cluster, bench,
checkpoint)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from contextlib import nullcontext

from paraml.bench.loading import load_object
from paraml.checks import did_you_mean
from paraml.cluster.logs import filtered_stderr

__all__ = ["COMMANDS", "main"]

#: The subcommands of ``paraml``, in the order ``--help`` lists them.
COMMANDS = ("demo", "env", "devices", "estimate", "bench", "launch", "cluster", "checkpoint")


def _demo(ns: argparse.Namespace) -> int:
    from paraml.demo import run_demo

    results = run_demo(num_devices=ns.devices, epochs=ns.epochs, batch_size=ns.batch_size)
    worst = min(r.accuracy for r in results)
    return 0 if worst >= ns.min_accuracy else 1


def _devices(ns: argparse.Namespace) -> int:
    from paraml.devices import simulate_devices

    if ns.simulate:
        simulate_devices(ns.simulate)
    print(_device_table())
    return 0


def _device_table() -> str:
    """The local devices with their memory, then, without a GPU, why TensorFlow sees none."""
    from paraml.devices import describe_devices, no_gpu_reason
    from paraml.planning.sizes import format_bytes

    infos = describe_devices()
    lines = [f"{'device':<20}{'type':<6}{'memory':>12}"]
    for info in infos:
        memory = format_bytes(info.memory_bytes) if info.memory_bytes else "unknown"
        lines.append(f"{info.name:<20}{info.device_type:<6}{memory:>12}")
    if not any(info.device_type == "GPU" for info in infos):
        lines.append(no_gpu_reason())
    return "\n".join(lines)


#: Environment variables that say how a process was started (cluster, devices, logging): ``paraml env`` shows them.
_ENV_PREFIXES = ("TF_", "PARAML_", "CUDA_", "SLURM_", "OMPI_COMM_WORLD_", "PMI_", "PET_", "SM_", "KERAS_")
_ENV_NAMES = ("CLUSTER_SPEC", "JOB_COMPLETION_INDEX", "XLA_FLAGS")


def _env(ns: argparse.Namespace) -> int:
    import importlib.metadata
    import os
    import platform

    from paraml import __version__

    print(f"paraml {__version__}")
    print(f"python {platform.python_version()} ({sys.executable}) on {platform.platform()}, {os.cpu_count()} cores")
    for package in ("tensorflow", "keras", "numpy", "keras-hub", "tensorboard"):
        try:
            print(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            print(f"{package} not installed")
    shown = sorted(k for k in os.environ if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES)
    print("environment: " + (", ".join(f"{k}={os.environ[k]}" for k in shown) if shown else "no cluster variables"))
    print(_device_table())
    return 0


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _estimate(ns: argparse.Namespace) -> int:
    from paraml.memory import estimate_memory

    model_fn = load_object(ns.model)
    if not callable(model_fn):
        raise ValueError(f"{ns.model!r} is not a function that builds a model")
    model, sample = model_fn(), None
    if ns.sample is not None:
        make_sample = load_object(ns.sample)
        sample = make_sample() if callable(make_sample) else make_sample
    elif ns.seq_len is not None:  # the model's inputs with every unknown non-batch dimension set to it
        from paraml.planning.observe import probe_inputs

        sample = probe_inputs(model, rows=2, unknown=ns.seq_len)[0]
    print(
        estimate_memory(
            model,
            batch_size=ns.batch_size,
            optimizer=ns.optimizer,
            remat=ns.remat,
            optimizer_shards=ns.optimizer_shards,
            zero_stage=ns.zero_stage,
            tensor_parallel=ns.tensor_parallel,
            sample=sample,
            bucket_bytes=ns.bucket_bytes,
        )
    )
    return 0


def _launch(ns: argparse.Namespace) -> int:
    from paraml.cluster import launch

    return launch.run_from_args(ns)


def _cluster(ns: argparse.Namespace) -> int:
    """What ``multi_worker`` would read here, without TensorFlow and without exchanging addresses."""
    from paraml.cluster.detect import detect_cluster, no_cluster_message

    cluster = detect_cluster()
    if cluster is None:
        print(f"no cluster: this process would train alone. {no_cluster_message()}")
        return 0
    print(cluster.describe())
    return 0


def _checkpoint(ns: argparse.Namespace) -> int:
    """``paraml checkpoint inspect DIR``: what a checkpoint holds, before a resume."""
    from paraml.loop.checkpoint import inspect_checkpoint

    print(inspect_checkpoint(ns.path).describe())
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``paraml`` command."""
    from paraml import __version__

    parser = argparse.ArgumentParser(prog="paraml", description="Multi-device training on TensorFlow/Keras 3.")
    parser.add_argument("--version", action="version", version=f"paraml {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train on the shipped digits data under every backend")
    demo.add_argument("--devices", type=int, default=2, help="devices to simulate and use (default 2)")
    demo.add_argument("--epochs", type=int, default=20)
    demo.add_argument("--batch-size", type=int, default=64)
    demo.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 if any backend ends below this")
    demo.set_defaults(run=_demo)

    env = commands.add_parser("env", help="versions, devices and cluster variables (for a bug report)")
    env.set_defaults(run=_env)

    devices = commands.add_parser("devices", help="list local devices and their memory")
    devices.add_argument("--simulate", type=int, default=0, help="split the machine into N logical devices first")
    devices.set_defaults(run=_devices)

    estimate = commands.add_parser(
        "estimate", help="estimate a model's training memory (like accelerate estimate-memory)"
    )
    estimate.add_argument("model", help="MODULE:FUNCTION or FILE.py:FUNCTION that returns a keras.Model")
    estimate.add_argument("--batch-size", type=int, default=32)
    estimate.add_argument("--optimizer", default="adam")
    estimate.add_argument("--remat", action="store_true", help="the estimate with activations recomputed (remat=True)")
    estimate.add_argument(
        "--optimizer-shards", type=int, default=1, metavar="N", help="optimizer state sharded over N devices"
    )
    estimate.add_argument(
        "--zero-stage",
        type=int,
        choices=(1, 2, 3),
        default=1,
        help="with --optimizer-shards: 2 also the gradients, 3 also the parameters (shard_parameters)",
    )
    estimate.add_argument(
        "--bucket-bytes",
        type=_positive,
        metavar="B",
        help="with --optimizer-shards: the bucket of ZeRO's collectives (Parallel's bucket_bytes; default 4 MiB)",
    )
    estimate.add_argument(
        "--tensor-parallel", type=int, default=1, metavar="T", help="layers split over T devices (per device)"
    )
    shape = estimate.add_mutually_exclusive_group()
    shape.add_argument(
        "--seq-len",
        type=_positive,
        metavar="N",
        help="size of every unknown non-batch input dimension (a sequence length, an image side); default 8",
    )
    shape.add_argument(
        "--sample",
        metavar="MODULE:NAME",
        help="a batch of the model's inputs (or a function returning one) whose shapes the estimate measures",
    )
    estimate.set_defaults(run=_estimate)

    from paraml.bench import command as bench
    from paraml.cluster import launch

    benchmark = commands.add_parser("bench", help="compare the backends side by side on this machine")
    bench.add_arguments(benchmark)
    benchmark.set_defaults(run=bench.run_from_args)

    launcher = commands.add_parser("launch", help="run a script on N workers per machine (multi_worker)")
    launch.add_arguments(launcher)
    launcher.set_defaults(run=_launch)

    cluster = commands.add_parser(
        "cluster", help="the cluster this process is in (scheduler, variables read, workers, index), no training"
    )
    cluster.set_defaults(run=_cluster)

    checkpoint = commands.add_parser("checkpoint", help="what a checkpoint holds (inspect DIR)")
    actions = checkpoint.add_subparsers(dest="action", required=True)
    inspect = actions.add_parser("inspect", help="step, epoch, optimizer, the layout that wrote it, tensors and bytes")
    inspect.add_argument("path", help="a checkpoint directory (its newest checkpoint) or one checkpoint folder")
    checkpoint.set_defaults(run=_checkpoint)
    assert tuple(commands.choices) == COMMANDS
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``paraml`` and ``python -m paraml``; returns the exit code."""
    parser = build_parser()
    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-") and args[0] not in COMMANDS:
        hint = did_you_mean(args[0], COMMANDS)
        print(f"paraml: unknown command {args[0]!r}{hint}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    ns = parser.parse_args(args)
    # The launcher filters its workers' lines itself; every other command runs with TensorFlow's logging left out.
    quiet = nullcontext() if ns.command == "launch" else filtered_stderr()
    try:
        with quiet:
            return int(ns.run(ns))
    except (ValueError, RuntimeError, FileNotFoundError) as error:
        print(f"paraml {ns.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
