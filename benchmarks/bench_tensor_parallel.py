"""Tensor parallelism: the cross-device reductions per transformer block in the traced training step, the parameter
bytes per device, and the step time of ``model_parallel`` with ``tensor_parallel=2`` against ``single``.

The model is a keras_hub ``GPT2CausalLM`` (random init; ``--layers`` blocks of hidden ``--hidden``, 8 heads,
feed-forward 4x, vocabulary ``--vocab``, sequence 128). Megatron-LM's layout needs 2 reductions per block forward
(after the attention's output projection and after the feed-forward's second layer) and 2 backward (the gradients
of the block's two inputs that fan out to both devices); the benchmark counts, in the graph of one traced training
step, the additions whose inputs come from more than one device, by block and by direction.

The LM head's logits (``--vocab`` wide) are what a split saves most on: with Keras' cross-entropy object
(``SparseCategoricalCrossentropy(from_logits=True)``) paraml computes the loss on each device's slice of the logits
and never joins them; a loss function that calls ``keras.losses.sparse_categorical_crossentropy`` itself joins them
first. ``--logits`` measures both, one fresh process each: each device's allocator peak of one training step
(``get_memory_info(device)["peak"]``, reset after a first step). On GPUs each device has its own allocator, and the
first device's peak is where the joined logits (and their gradient) would sit. On logical CPUs every device reports
the one allocator they share: the total bytes of both variants are about the same (the slices add up to the whole),
so the figures there only say that splitting the loss costs no extra memory in all.

Timing is :mod:`paraml.bench.harness`'s: both variants built and warmed up in this process, windows interleaved, the
ratio the median of per-round step-time ratios. The devices are 2 GPUs when the machine has them, else 2 logical
CPUs; on logical CPUs both share this machine's cores, so the ratio says what splitting costs here (two half-size
matrix products instead of one, the copies between devices), not what two GPUs would gain.

    .venv/bin/python benchmarks/bench_tensor_parallel.py [--windows 5] [--steps 10] [--logits] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from paraml.bench.harness import int_at_least  # noqa: E402  (imports no TensorFlow)


def count_reductions(par: object, x: object, y: object, loss: object) -> dict[str, Counter]:
    """The additions with inputs from more than one device in one traced training step of ``par.model``, counted by
    (block, direction): the block from the op's name (``transformer_layer_N``, else ``other``), the direction
    ``backward`` for the gradient's ops."""
    import tensorflow as tf

    model = par.model  # type: ignore[attr-defined]
    variables = par.trained_variables  # type: ignore[attr-defined]

    @tf.function(autograph=False)
    def step(x: object, y: object) -> object:
        value = tf.reduce_mean(loss(y, model(x, training=True)))  # type: ignore[operator]
        return tf.gradients(value, variables)  # as paraml's step: each gradient op on its forward op's device

    graph = step.get_concrete_function(x, y).graph

    def forward_op(op: tf.Operation) -> tf.Operation:
        """The op ``op`` is colocated with (a gradient op's forward op), or ``op``."""
        for group in op.colocation_groups():
            name = group.decode()[len("loc:@") :]
            if name != op.name:
                return forward_op(graph.get_operation_by_name(name))
        return op

    def device(op: tf.Operation) -> str:
        """Where ``op`` runs: its device, or that of the op it is colocated with."""
        return op.device or forward_op(op).device

    found: dict[str, Counter] = {"forward": Counter(), "backward": Counter()}
    for op in graph.get_operations():
        if op.type not in ("AddN", "AddV2", "Add"):
            continue
        devices = {device(i.op) for i in op.inputs} - {""}
        if len(devices) < 2:
            continue
        direction = "backward" if op.name.startswith("gradients") else "forward"
        block = re.search(r"transformer_layer_\d+", forward_op(op).name)
        found[direction][block.group(0) if block else "other"] += 1
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    positive = int_at_least(1)
    parser.add_argument("--windows", type=positive, default=5, help="timed rounds (default 5)")
    parser.add_argument("--steps", type=positive, default=10, help="timed steps per window (default 10)")
    parser.add_argument("--layers", type=positive, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--hidden", type=positive, default=256, help="hidden size (default 256)")
    parser.add_argument("--vocab", type=positive, default=8192, help="vocabulary (default 8192)")
    parser.add_argument("--batch-size", type=positive, default=16, help="global batch (default 16)")
    parser.add_argument("--logits", action="store_true", help="also the step's peak, logits joined vs in slices")
    parser.add_argument("--one", choices=("joined", "slices"), help=argparse.SUPPRESS)  # a --logits child process
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    args = parser.parse_args(argv)

    from paraml import ensure_devices

    ensure_devices(2)  # 2 GPUs when the machine has them, else 2 logical CPUs
    import keras
    import keras_hub
    import numpy as np

    from paraml import Parallel
    from paraml.bench.harness import (
        Spec,
        Workload,
        environment,
        format_table,
        measure,
        paired,
        progress_printer,
        write_json,
    )

    sequence = 128

    def model_fn() -> keras.Model:
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=args.vocab,
            num_layers=args.layers,
            num_heads=8,
            hidden_dim=args.hidden,
            intermediate_dim=4 * args.hidden,
            max_sequence_length=sequence,
            dropout=0.0,
        )
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)

    def token_loss(y_true: object, y_pred: object) -> object:
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True), axis=-1)

    rows = (args.steps + 1) * args.batch_size
    rng = np.random.default_rng(0)
    ids = rng.integers(0, args.vocab, (rows, sequence)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    y = np.roll(ids, -1, axis=1)

    if args.one:  # one configuration in this fresh process: the allocator's peak of one training step
        import tensorflow as tf

        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True) if args.one == "slices" else token_loss
        par = Parallel("model_parallel", devices=2, tensor_parallel=2, seed=0)
        par.build(model_fn, optimizer="sgd", loss=loss)
        one = {k: v[: args.batch_size] for k, v in x.items()}, y[: args.batch_size]
        par.fit(*one, batch_size=args.batch_size, epochs=1, verbose=0)
        devices = [d.split("device:")[-1] for d in par.devices]
        for device in devices:
            tf.config.experimental.reset_memory_stats(device)
        par.fit(*one, batch_size=args.batch_size, epochs=1, verbose=0)
        print(json.dumps({d: tf.config.experimental.get_memory_info(d)["peak"] for d in devices}))
        return 0

    par = Parallel("model_parallel", devices=2, tensor_parallel=2, seed=0)
    par.build(model_fn, optimizer="sgd", loss=token_loss)
    batch = {k: v[: args.batch_size] for k, v in x.items()}
    reductions = count_reductions(par, batch, y[: args.batch_size], token_loss)
    memory = par.memory_by_device()
    total = sum(b["parameters"] for b in memory.values())
    print("cross-device reductions in one traced training step (tensor_parallel=2):")
    blocks = sorted(set(reductions["forward"]) | set(reductions["backward"]))
    print(
        format_table(
            [[b, str(reductions["forward"][b]), str(reductions["backward"][b])] for b in blocks],
            ["where", "forward", "backward"],
        )
    )
    print("parameter bytes per device:")
    print(
        format_table(
            [[d, f"{b['parameters']:,}", f"{b['parameters'] / total:.2f}"] for d, b in memory.items()],
            ["device", "bytes", "share"],
        )
    )

    work = Workload(model_fn, x, y, steps_per_call=args.steps + 1, batch_size=args.batch_size, loss=token_loss)
    plan = [(Spec("single", 1), work), (Spec("model_parallel", 2, options={"tensor_parallel": 2}, tag="tp2"), work)]
    results, _ = measure(plan, args.windows, progress=progress_printer("bench"))
    single, split = results
    ratio = paired(split.windows_ms["step_ms"], single.windows_ms["step_ms"])
    print(
        format_table(
            [[r.label, f"{r.samples_per_s:,.1f}", f"{r.step_ms:.1f}"] for r in results],
            ["variant", "samples/s", "step ms"],
        )
    )
    print(f"step time tensor_parallel=2 / single: {ratio:.2f}")
    peaks = {}
    if args.logits:
        for kind in ("joined", "slices"):
            command = [sys.executable, __file__, "--one", kind, "--batch-size", str(args.batch_size)]
            command += ["--layers", str(args.layers), "--hidden", str(args.hidden), "--vocab", str(args.vocab)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            peaks[kind] = json.loads(done.stdout.strip().splitlines()[-1])
        logits = args.batch_size * sequence * args.vocab * 4
        print(f"one training step's allocator peak per device (one batch of logits: {logits / 2**20:.1f} MiB):")
        rows = [[d, f"{peaks['joined'][d] / 2**20:.1f}", f"{peaks['slices'][d] / 2**20:.1f}"] for d in peaks["joined"]]
        print(format_table(rows, ["device", "logits joined, MiB", "logits in slices, MiB"]))
    record = {
        "environment": environment(),
        "reductions": {k: dict(v) for k, v in reductions.items()},
        "parameter_bytes": {d: b["parameters"] for d, b in memory.items()},
        "results": [r.__dict__ for r in results],
        "ratios": {"tp2_step_time_vs_single": ratio},
        "logits_peak_bytes": peaks,
    }
    write_json(record, args.json, echo=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
