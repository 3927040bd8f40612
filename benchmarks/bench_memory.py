"""Estimated vs measured training memory, with and without ``remat``; and what recompute costs in step time.

The estimate is :func:`paraml.estimate_memory` (``sample=`` the batch, so sequence lengths are the real ones). The
measurement is the allocator's peak of one training step under ``Parallel("single")`` with Adam, one configuration
per fresh process (``--one``): the process builds the model, runs one step, resets the allocator's peak
(``tf.config.experimental.reset_memory_stats``) and reads ``get_memory_info("CPU:0")["peak"]`` after one more step.

On CPU the allocator counts only allocations of 256 KiB or more, so each workload's tensors are made larger than
that (an LSTM of 256 units at batch 256, not 64): the estimate counts every tensor, as a GPU's allocator would.

Step times (``--time``) are measured in one process with the variants interleaved
(:func:`paraml.bench.harness.interleave`) and reported as the median of per-window ratios.

Pipelines (``--pipelines``): the MLP at batch 16384 under ``model_parallel`` on 2 simulated devices with 8 and 16
micro-batches, ``schedule="gpipe"`` vs ``"1f1b"``: the peak of each (fresh process), and 1F1B's step time over
GPipe's at 8 micro-batches.

Models: ``mlp`` (16 Dense layers of 512 with GELU, batch 8192), ``gpt2`` and ``bert`` (keras_hub backbones, 4
layers, hidden 256, sequence 128, batch 16, with an LM head / a classifier), ``gpt2big`` (the same GPT-2 with a
32000-token vocabulary, batch 8: the logits and the loss's softmax-sized buffer outweigh the weights), ``gpt2dict``
(the same GPT-2 under the user's own head, its inputs a dict of unnamed ``keras.Input``), ``cnn``
(``keras.applications`` MobileNetV2, 96x96, batch 32), ``resnet50`` (``keras.applications`` ResNet50, 96x96, batch
32) and ``lstm`` (Embedding, two LSTMs of 256 units, sequence 100, batch 256).

Predict growth (``--predict-growth [VOCABULARY]``): in a fresh process with 2 simulated devices, GPT-2 (4 layers,
hidden 256, sequence 128, batch 8, a 32000-token LM head unless given) under ``Parallel("model_parallel",
devices=2, tensor_parallel=2)`` runs ``predict`` four times; the allocator's ``current`` bytes after the first and
after the fourth call tell whether eager calls of a split model keep anything (a cache of logits or their slices
would add a batch's logits, 131 MB, per call).

    .venv/bin/python benchmarks/bench_memory.py [--models mlp gpt2 ...] [--time mlp gpt2] [--windows 5] [--json PATH]
    .venv/bin/python benchmarks/bench_memory.py --predict-growth [32000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MODELS = ("mlp", "gpt2", "gpt2big", "gpt2dict", "bert", "cnn", "resnet50", "lstm")
TIMED = ("mlp", "gpt2")
#: The large vocabulary of ``gpt2big`` (and of ``--predict-growth``).
VOCABULARY_BIG = 32000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--time", nargs="*", choices=MODELS, default=list(TIMED), help="models to time (remat vs not)")
    parser.add_argument("--windows", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--pipelines", action="store_true", help="also compare schedule='1f1b' with 'gpipe'")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "REMAT"), help=argparse.SUPPRESS)
    parser.add_argument("--one-pipeline", nargs=2, metavar=("SCHEDULE", "MICRO_BATCHES"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--predict-growth",
        nargs="?",
        type=int,
        const=VOCABULARY_BIG,
        metavar="VOCABULARY",
        help="only measure how much the allocator's current bytes grow over 4 predict calls of a tensor_parallel=2 "
        f"GPT-2 (vocabulary {VOCABULARY_BIG} unless given), in a fresh process",
    )
    parser.add_argument("--one-predict", type=int, metavar="VOCABULARY", help=argparse.SUPPRESS)
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    return parser.parse_args(argv)


def workload(name: str):  # noqa: ANN201  (keras objects: imported late)
    """(model_fn, x, y, batch_size) for ``name``; the loss is sparse categorical cross-entropy from logits."""
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    if name == "mlp":

        def mlp() -> keras.Model:
            layers = [keras.layers.Dense(512, activation="gelu") for _ in range(16)]
            return keras.Sequential([keras.Input((512,)), *layers, keras.layers.Dense(10)])

        return mlp, rng.normal(size=(8192, 512)).astype("float32"), rng.integers(0, 10, 8192), 8192
    if name == "cnn":

        def cnn() -> keras.Model:
            return keras.applications.MobileNetV2(
                input_shape=(96, 96, 3), weights=None, classes=10, classifier_activation=None
            )

        return cnn, rng.normal(size=(32, 96, 96, 3)).astype("float32"), rng.integers(0, 10, 32), 32
    if name == "resnet50":

        def resnet50() -> keras.Model:
            return keras.applications.ResNet50(
                weights=None, input_shape=(96, 96, 3), classes=10, classifier_activation=None
            )

        return resnet50, rng.normal(size=(32, 96, 96, 3)).astype("float32"), rng.integers(0, 10, 32), 32
    if name == "lstm":

        def lstm() -> keras.Model:
            layers = [keras.layers.Embedding(1000, 64), keras.layers.LSTM(256, return_sequences=True)]
            layers += [keras.layers.LSTM(256), keras.layers.Dense(10)]
            return keras.Sequential([keras.Input((100,), dtype="int32"), *layers])

        return lstm, rng.integers(1, 1000, (256, 100)).astype("int32"), rng.integers(0, 10, 256), 256
    import keras_hub

    vocabulary, rows = (VOCABULARY_BIG, 8) if name == "gpt2big" else (1000, 16)
    tokens = rng.integers(1, vocabulary, (rows, 128)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    config = {"vocabulary_size": vocabulary, "num_layers": 4, "num_heads": 4, "hidden_dim": 256}
    config.update(intermediate_dim=1024, max_sequence_length=128, dropout=0.0)
    if name in ("gpt2", "gpt2big"):

        def gpt2() -> keras.Model:
            backbone = keras_hub.models.GPT2Backbone(**config)
            return keras.Model(backbone.input, keras.layers.Dense(vocabulary, name="lm_head")(backbone.output))

        return gpt2, x, tokens, rows
    if name == "gpt2dict":

        def gpt2dict() -> keras.Model:  # the user's own head over the backbone, a keras.Input per key of a dict
            backbone = keras_hub.models.GPT2Backbone(**config)
            inputs = {key: keras.Input((None,), dtype="int32") for key in ("token_ids", "padding_mask")}
            return keras.Model(inputs, keras.layers.Dense(1000, name="lm_head")(backbone(inputs)))

        return gpt2dict, x, tokens, 16

    def bert() -> keras.Model:
        backbone = keras_hub.models.BertBackbone(**config)
        return keras.Model(backbone.input, keras.layers.Dense(2, name="classifier")(backbone.output["pooled_output"]))

    return bert, dict(x, segment_ids=np.zeros_like(tokens)), rng.integers(0, 2, 16), 16


def _parallel(name: str, remat: bool, pipeline: tuple[str, int] | None = None):  # noqa: ANN202
    import keras

    from paraml import Parallel

    model_fn, x, y, batch = workload(name)
    if pipeline is None:
        par = Parallel("single", seed=0, remat=remat)
    else:
        import numpy as np

        x, y, batch = np.concatenate([x, x]), np.concatenate([y, y]), 2 * batch
        par = Parallel("model_parallel", devices=2, seed=0, schedule=pipeline[0], micro_batches=pipeline[1])
    par.build(model_fn, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    par.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=1, verbose=0)  # traced and built before measuring
    return par, x, y, batch


def one(name: str, remat: bool, pipeline: tuple[str, int] | None = None) -> dict[str, float]:
    """This process: one configuration's allocator peak for one training step (after a warm-up step)."""
    import tensorflow as tf

    if pipeline is not None:
        from paraml import simulate_devices

        simulate_devices(2)
    par, x, y, batch = _parallel(name, remat, pipeline)
    tf.config.experimental.reset_memory_stats("CPU:0")
    history = par.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=1, verbose=0)
    return {
        "peak_mb": tf.config.experimental.get_memory_info("CPU:0")["peak"] / 1e6,
        "loss": history.history["loss"][0],
    }


def predict_growth(vocabulary: int, calls: int = 4) -> dict[str, float]:
    """This process (2 simulated devices, nothing else run before): the allocator's current bytes after the first
    and after the last of ``calls`` ``predict`` calls of GPT-2 (4 layers, hidden 256, sequence 128, batch 8) with a
    ``vocabulary``-token LM head under ``Parallel("model_parallel", devices=2, tensor_parallel=2)``."""
    import keras
    import keras_hub
    import numpy as np
    import tensorflow as tf

    from paraml import Parallel, simulate_devices

    simulate_devices(2)
    tokens = np.random.default_rng(0).integers(1, vocabulary, (8, 128)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    config = {"vocabulary_size": vocabulary, "num_layers": 4, "num_heads": 4, "hidden_dim": 256}
    config.update(intermediate_dim=1024, max_sequence_length=128, dropout=0.0)

    def gpt2() -> keras.Model:
        backbone = keras_hub.models.GPT2Backbone(**config)
        return keras.Model(backbone.input, keras.layers.Dense(vocabulary, name="lm_head")(backbone.output))

    par = Parallel("model_parallel", devices=2, tensor_parallel=2, seed=0)
    par.build(gpt2, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    built = tf.config.experimental.get_memory_info("CPU:0")["current"] / 1e6
    current = []
    for _ in range(calls):
        par.predict(x, batch_size=8)
        current.append(tf.config.experimental.get_memory_info("CPU:0")["current"] / 1e6)
    return {
        "vocabulary": vocabulary,
        "built_mb": built,
        "first_mb": current[0],
        "last_mb": current[-1],
        "growth_mb": current[-1] - current[0],
        "logits_mb": 8 * 128 * vocabulary * 4 / 1e6,
    }


def measured(*arguments: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, __file__, *arguments], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_time_ratio(variants: dict[str, tuple[bool, tuple[str, int] | None]], windows: int) -> float:
    """The second variant's step time over the first's (``label: (model, remat, pipeline)``), variants interleaved
    in this process."""
    from paraml.bench.harness import interleave, paired

    fits = {}
    for label, (model, remat, pipeline) in variants.items():
        par, x, y, batch = _parallel(model, remat, pipeline)
        fits[label] = lambda p=par, x=x, y=y, b=batch: (
            p.fit(x, y, batch_size=b, epochs=1, steps_per_epoch=2, verbose=0) and None
        )  # a window's wall time is what interleave records
    times = interleave(fits, windows)
    first, second = fits
    return paired(times[second]["wall_s"], times[first]["wall_s"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1] == "1")))
        return 0
    if args.one_predict:
        print(json.dumps(predict_growth(args.one_predict)))
        return 0
    if args.predict_growth:
        growth = measured("--one-predict", str(args.predict_growth))
        print(
            f"tensor_parallel=2 GPT-2, vocabulary {growth['vocabulary']}: {growth['built_mb']:.1f} MB held after "
            f"build, {growth['first_mb']:.1f} MB after the first predict, {growth['last_mb']:.1f} MB after the "
            f"fourth: growth {growth['growth_mb']:+.1f} MB (one batch's logits: {growth['logits_mb']:.0f} MB)"
        )
        from paraml.bench.harness import write_json

        write_json({"predict_growth": growth}, args.json, echo=False)
        return 0
    if args.one_pipeline:
        from paraml import simulate_devices

        simulate_devices(2)
        print(json.dumps(one("mlp", False, (args.one_pipeline[0], int(args.one_pipeline[1])))))
        return 0
    from paraml import estimate_memory, simulate_devices
    from paraml.bench.harness import environment, format_table, write_json

    if args.pipelines:
        simulate_devices(2)  # before TensorFlow starts: the pipelines' step times are measured in this process

    record: dict[str, object] = {"environment": environment(), "models": {}}
    rows = []
    for name in args.models:
        model_fn, x, _, batch = workload(name)
        entry: dict[str, float] = {}
        for remat in (False, True):
            key = "remat" if remat else "plain"
            estimate = estimate_memory(model_fn, batch_size=batch, optimizer="adam", remat=remat, sample=x)
            peak = measured("--one", name, str(int(remat)))
            entry[f"{key}_estimate_mb"] = estimate.total / 1e6
            entry[f"{key}_measured_mb"] = peak["peak_mb"]
            entry[f"{key}_ratio"] = estimate.total / 1e6 / peak["peak_mb"]
            entry[f"{key}_loss"] = peak["loss"]
        entry["remat_peak_ratio"] = entry["remat_measured_mb"] / entry["plain_measured_mb"]
        if name in args.time:
            variants = {"plain": (name, False, None), "remat": (name, True, None)}
            entry["remat_step_time_ratio"] = step_time_ratio(variants, args.windows)
        record["models"][name] = entry  # type: ignore[index]
        rows.append(
            [
                name,
                f"{entry['plain_estimate_mb']:.0f}",
                f"{entry['plain_measured_mb']:.0f}",
                f"{entry['plain_ratio']:.2f}",
                f"{entry['remat_estimate_mb']:.0f}",
                f"{entry['remat_measured_mb']:.0f}",
                f"{entry['remat_ratio']:.2f}",
                f"{entry['remat_peak_ratio']:.2f}",
                f"{entry['remat_step_time_ratio']:.2f}" if "remat_step_time_ratio" in entry else "-",
            ]
        )
        print(f"{name}: done", file=sys.stderr, flush=True)
    header = ["model", "est. MB", "peak MB", "est/peak", "remat est.", "remat peak", "est/peak", "remat/plain", "time"]
    print(format_table(rows, header, markdown=True))
    if args.pipelines:
        pipes = []
        for micro_batches in (8, 16):
            peaks = {kind: measured("--one-pipeline", kind, str(micro_batches)) for kind in ("gpipe", "1f1b")}
            ratio = peaks["1f1b"]["peak_mb"] / peaks["gpipe"]["peak_mb"]
            record[f"pipeline_{micro_batches}"] = {**{k: v["peak_mb"] for k, v in peaks.items()}, "ratio": ratio}
            pipes.append([str(micro_batches), f"{peaks['gpipe']['peak_mb']:.0f}", f"{peaks['1f1b']['peak_mb']:.0f}"])
            pipes[-1] += [f"{ratio:.2f}", f"{abs(peaks['gpipe']['loss'] - peaks['1f1b']['loss']):.1e}"]
        variants = {"gpipe": ("mlp", False, ("gpipe", 8)), "1f1b": ("mlp", False, ("1f1b", 8))}
        record["pipeline_step_time_ratio"] = step_time_ratio(variants, args.windows)
        print(format_table(pipes, ["micro-batches", "gpipe peak MB", "1f1b peak MB", "ratio", "|loss diff|"]))
        print(f"1f1b step time / gpipe's (8 micro-batches): {record['pipeline_step_time_ratio']:.2f}")
    write_json(record, args.json, echo=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
