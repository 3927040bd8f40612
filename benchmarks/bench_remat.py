"""What ``remat=True`` saves and costs: the allocator's peak of one training step, and the step time, with and without.

Each memory figure comes from a fresh process (``--one``) that builds the model, runs one warm-up step, resets the
allocator's peak and reads ``tf.config.experimental.get_memory_info("CPU:0")["peak"]`` after one more step: one
configuration per process, so no figure carries another's buffers. Step times are measured in one process with the
variants interleaved (:func:`paraml.benchmark.interleave`), and reported as the median of per-window ratios.

Models: ``mlp`` (16 Dense layers of 512 with GELU, batch 8192: the issue's example) and ``gpt2`` (a keras_hub
``GPT2Backbone``, 4 layers, hidden 256, sequence 128, batch 16, with an LM head), both with Adam, on one device.

    .venv/bin/python benchmarks/bench_remat.py [--models mlp gpt2] [--windows 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MODELS = ("mlp", "gpt2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--windows", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "REMAT"), help=argparse.SUPPRESS)
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    return parser.parse_args(argv)


def workload(name: str):  # noqa: ANN201  (keras objects: imported late)
    """(model_fn, x, y, loss, batch_size) for ``name``."""
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    if name == "mlp":

        def model_fn() -> keras.Model:
            layers = [keras.layers.Dense(512, activation="gelu") for _ in range(16)]
            return keras.Sequential([keras.Input((512,)), *layers, keras.layers.Dense(10)])

        x = rng.normal(size=(8192, 512)).astype("float32")
        y = rng.integers(0, 10, 8192)
        return model_fn, x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=True), 8192

    import keras_hub

    def gpt2_fn() -> keras.Model:
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=1000,
            num_layers=4,
            num_heads=4,
            hidden_dim=256,
            intermediate_dim=1024,
            max_sequence_length=128,
            dropout=0.0,
        )
        return keras.Model(backbone.input, keras.layers.Dense(1000, name="lm_head")(backbone.output))

    tokens = rng.integers(1, 1000, (16, 128)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    return gpt2_fn, x, tokens, keras.losses.SparseCategoricalCrossentropy(from_logits=True), 16


def one(name: str, remat: bool) -> dict[str, float]:
    """This process: one configuration's allocator peak for one training step (after a warm-up step)."""
    import tensorflow as tf

    from paraml import Parallel

    model_fn, x, y, loss, batch = workload(name)
    par = Parallel("single", seed=0, remat=remat)
    par.build(model_fn, optimizer="adam", loss=loss)
    par.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=1, verbose=0)
    tf.config.experimental.reset_memory_stats("CPU:0")
    history = par.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=1, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return {"peak_mb": peak / 1e6, "loss": history.history["loss"][0]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1] == "1")))
        return 0
    from paraml.benchmark import environment, format_table, interleave, paired, write_json

    record: dict[str, object] = {"environment": environment(), "models": {}}
    rows = []
    for name in args.models:
        peaks = {}
        for remat in (False, True):
            done = subprocess.run(
                [sys.executable, __file__, "--one", name, str(int(remat))], capture_output=True, text=True, check=True
            )
            peaks[remat] = json.loads(done.stdout.strip().splitlines()[-1])
        from paraml import Parallel

        model_fn, x, y, loss, batch = workload(name)
        fits = {}
        for remat in (False, True):
            par = Parallel("single", seed=0, remat=remat)
            par.build(model_fn, optimizer="adam", loss=loss)
            par.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=1, verbose=0)  # traced before timing
            fits[f"remat={remat}"] = lambda p=par, x=x, y=y, b=batch: (
                p.fit(x, y, batch_size=b, epochs=1, steps_per_epoch=2, verbose=0) and None
            )  # a window's wall time is what interleave records
        times = interleave(fits, args.windows)
        slower = paired(times["remat=True"]["wall_s"], times["remat=False"]["wall_s"])
        ratio = peaks[True]["peak_mb"] / peaks[False]["peak_mb"]
        rows.append(
            [
                name,
                f"{peaks[False]['peak_mb']:.0f}",
                f"{peaks[True]['peak_mb']:.0f}",
                f"{ratio:.2f}",
                f"{slower:.2f}",
                f"{abs(peaks[True]['loss'] - peaks[False]['loss']):.1e}",
            ]
        )
        record["models"][name] = {
            "peak_mb": peaks[False]["peak_mb"],
            "remat_peak_mb": peaks[True]["peak_mb"],
            "peak_ratio": ratio,
            "step_time_ratio": slower,
        }
    header = ["model", "peak MB", "remat peak MB", "peak ratio", "step time ratio", "|loss diff|"]
    print(format_table(rows, header))
    write_json(record, args.json, echo=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
