"""Many models at once, one model per device: :func:`fit_many` runs a queue of :class:`Job` s on a pool of devices.

Hyper-parameter sweeps, ensembles and cross-validation folds train many *independent* models. Data parallelism
would split each model over every device and pay an all-reduce per step; here each model gets exactly one device
and there is no communication at all, so N devices train N models at a time. Jobs beyond the number of devices wait
in a queue and start as devices become free; a job that fails (its ``model_fn`` raises, its loss becomes NaN) is
reported as failed and the others go on.

>>> import numpy as np, keras
>>> from paraml.many import Job, fit_many
>>> x, y = np.random.rand(64, 4).astype("float32"), np.random.rand(64, 1).astype("float32")
>>> def model_fn():
...     return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
>>> jobs = [Job(f"lr={lr}", model_fn, {"optimizer": keras.optimizers.SGD(lr), "loss": "mse"}, (x, y),
...             {"batch_size": 16, "epochs": 2}) for lr in (0.01, 0.1)]
>>> results = fit_many(jobs, verbose=0)
>>> [(name, r.ok) for name, r in results.items()]
[('lr=0.01', True), ('lr=0.1', True)]

Why threads in one process, each pinned to its device, rather than one process per device:

- **Shared input data.** Every job reads the same numpy arrays from the same memory; processes would each load or
  receive a copy.
- **No pickling.** ``model_fn``, data callables and results (including the trained model) stay ordinary Python
  objects: lambdas and closures work, and nothing is serialised across a process boundary.
- **The GIL is not the bottleneck.** TensorFlow releases the GIL while its kernels run, and each job's steps are
  compiled ``tf.function`` s, so one thread's matmuls run while another thread prepares its next step.
- **Placement is exact.** Each job is built with ``Parallel("single", devices=[device])`` (a
  ``tf.distribute.OneDeviceStrategy``) inside ``tf.device(device)``: its variables, optimizer slots and compute all
  live on that one device (check with ``v.value.device``).

Two pieces of global state need care. Keras draws the seeds of initializers (and of layers such as ``Dropout``)
from Python's ``random``, which is process-wide: two threads building at once would interleave those draws. So each
job's model is built (short) by ``Parallel("single", devices=[device], seed=job.seed).build`` under a module lock,
while fitting (long) runs concurrently. That build also sets TensorFlow's global seed; paraml's own shuffling is
stateless (seeded by the job's seed and the epoch alone) and its step holds no unseeded random op, so a job's
batches, dropout masks and final weights are the same alone or among others. Data callables
(``Job(data=callable)``) run outside the lock: give them their own generator (``np.random.default_rng(seed)``)
rather than NumPy's global one, and seed any ``tf.data`` shuffle they make (``shuffle(..., seed=...)``); a
``model_fn`` should not draw TensorFlow random numbers without a seed.

**The process variant, on GPUs.** Where jobs need isolation (a job that can crash the process or leak memory,
different TensorFlow settings per job, or more than one process's worth of Python work), start one process per GPU
and let each see only its GPU: ``CUDA_VISIBLE_DEVICES=0 python train.py --job a &`` and
``CUDA_VISIBLE_DEVICES=1 python train.py --job b &`` (or a ``multiprocessing`` pool with the ``"spawn"`` start method
whose initializer sets ``os.environ["CUDA_VISIBLE_DEVICES"]`` before importing TensorFlow). Each process then calls
its device ``GPU:0``; ``model_fn`` and the data must be importable or picklable, and results come back as files or
pickled weights rather than live models.

**Simulated CPUs.** Logical CPUs made by :func:`paraml.simulate_devices` share one thread pool: two
jobs on two logical CPUs compete for the same cores, so running them at once helps only as far as one job alone left
cores idle. ``tf.config.threading.set_intra_op_parallelism_threads(1)`` at program start brings the simulation
closer to "one core per device". On real GPUs each device has its own compute and the speed-up approaches the
number of devices for jobs that keep a GPU busy.
"""

from __future__ import annotations

import inspect
import math
import queue
import sys
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import keras
import tensorflow as tf

from paraml.checks import check_int, check_named
from paraml.devices import canonical_device, resolve_devices
from paraml.parallel import Parallel

__all__ = ["Job", "JobResult", "fit_many"]

#: Held while a job's model is built: Keras' seeding is process-global (see the module docstring).
_BUILD_LOCK = threading.Lock()

#: Keys ``Job.compile`` may hold: the keyword arguments of :meth:`paraml.Parallel.build`.
COMPILE_KEYS = tuple(p for p in inspect.signature(Parallel.build).parameters if p not in ("self", "model_fn"))
#: Keys ``Job.fit`` may hold: the keyword arguments of :meth:`paraml.Parallel.fit` (``verbose`` is forced to 0).
FIT_KEYS = tuple(p for p in inspect.signature(Parallel.fit).parameters if p not in ("self", "x", "y"))

Data = tuple[Any, ...]


def _check_data(value: Any, where: str) -> tuple[Any, ...]:
    """``value`` as ``(x, y)`` or ``(x, y, x_val, y_val)``; ``where`` names the field in errors."""
    if not isinstance(value, (tuple, list)):
        raise TypeError(
            f"{where} must be a tuple (x, y) or (x, y, x_val, y_val), or a zero-argument function returning one; "
            f"got {type(value).__name__}"
        )
    if len(value) not in (2, 4):
        raise ValueError(f"{where} must be (x, y) or (x, y, x_val, y_val), got a tuple of {len(value)} items")
    return tuple(value)


def default_seed(name: str) -> int:
    """The seed of a job that gives none: a stable hash of its name (the same in every process and run).

    >>> default_seed("a") == default_seed("a") != default_seed("b")
    True
    """
    return zlib.crc32(name.encode("utf-8")) & 0x7FFFFFFF


@dataclass
class Job:
    """One model to train: how to build it, compile it, what to fit it on, and what to evaluate it on.

    - ``name``: unique within a :func:`fit_many` call; the key of its result.
    - ``model_fn``: a zero-argument function returning a built ``keras.Model`` (start it with ``keras.Input``). It is
      called on the job's device, so its variables live there.
    - ``compile``: keyword arguments of :meth:`paraml.Parallel.build`: ``optimizer``, ``loss``, ``metrics``.
    - ``data``: ``(x, y)`` or ``(x, y, x_val, y_val)`` (the latter fits with ``validation_data``), or a zero-argument
      function returning such a tuple, called in the job's worker when the job starts (data made lazily).
    - ``fit``: keyword arguments of :meth:`paraml.Parallel.fit` (``batch_size``, ``epochs``, ``callbacks``, ...);
      ``verbose`` is forced to 0. Jobs run at the same time: give each job its own callback instances.
    - ``seed``: initial weights and shuffling; default a stable hash of ``name``, so jobs differ and runs repeat.
    - ``evaluate``: an optional ``(x, y)`` evaluated after training; its results become ``JobResult.metrics``.

    >>> import numpy as np, keras
    >>> job = Job(
    ...     "small",
    ...     lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
    ...     compile={"optimizer": "adam", "loss": "mse"},
    ...     data=(np.zeros((8, 4), "float32"), np.zeros((8, 1), "float32")),
    ...     fit={"batch_size": 4, "epochs": 1},
    ... )
    >>> job.seed == default_seed("small")
    True
    """

    name: str
    model_fn: Callable[[], keras.Model]
    compile: Mapping[str, Any]
    data: Data | Callable[[], Data]
    fit: Mapping[str, Any] = field(default_factory=dict)
    seed: int | None = None
    evaluate: tuple[Any, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"Job.name must be a non-empty string, got {self.name!r}")
        if not self.name.strip():
            raise ValueError(f"Job.name must be a non-empty string, got {self.name!r}")
        label = f"Job {self.name!r}"
        if not callable(self.model_fn) or isinstance(self.model_fn, keras.layers.Layer):
            raise TypeError(
                f"{label}: model_fn must be a zero-argument function returning a keras.Model, got {self.model_fn!r} "
                "(pass the function that builds the model, not the model, so it is built on the job's device)"
            )
        for attr, allowed in (("compile", COMPILE_KEYS), ("fit", FIT_KEYS + ("verbose",))):
            value = getattr(self, attr)
            if not isinstance(value, Mapping):
                raise TypeError(f"{label}: {attr} must be a mapping of keyword arguments, got {type(value).__name__}")
            unknown = sorted(str(k) for k in value if k not in allowed)
            if unknown:
                raise ValueError(f"{label}: unknown {attr} argument {unknown[0]!r}; valid: {', '.join(allowed)}")
            setattr(self, attr, dict(value))
        if "loss" not in self.compile:
            raise ValueError(f"{label}: compile needs a 'loss', e.g. compile={{'optimizer': 'adam', 'loss': 'mse'}}")
        if not callable(self.data):
            self.data = _check_data(self.data, f"{label}: data")
            if len(self.data) == 4 and "validation_data" in self.fit:
                raise ValueError(f"{label}: data has (x_val, y_val) and fit has validation_data; give only one")
        if self.seed is None:
            self.seed = default_seed(self.name)
        elif isinstance(self.seed, bool) or not isinstance(self.seed, int):  # a TypeError, as for the other fields
            raise TypeError(f"{label}: seed must be an int or None, got {self.seed!r}")
        if self.evaluate is not None:
            if not isinstance(self.evaluate, (tuple, list)) or len(self.evaluate) != 2:
                raise ValueError(f"{label}: evaluate must be None or a tuple (x, y), got {self.evaluate!r}")
            self.evaluate = tuple(self.evaluate)

    def resolve_data(self) -> tuple[Any, ...]:
        """The job's ``(x, y)`` or ``(x, y, x_val, y_val)``, calling ``data`` if it is a function.

        >>> Job("j", lambda: None, {"loss": "mse"}, lambda: ([1.0], [2.0])).resolve_data()
        ([1.0], [2.0])
        """
        if not callable(self.data):
            return tuple(self.data)
        data = _check_data(self.data(), f"Job {self.name!r}: data()")
        if len(data) == 4 and "validation_data" in self.fit:
            raise ValueError(f"Job {self.name!r}: data() returned (x_val, y_val) and fit has validation_data")
        return data


@dataclass(frozen=True)
class JobResult:
    """What became of one :class:`Job`.

    - ``device``: the canonical device the job ran on (``None`` if it never started).
    - ``history``: ``History.history`` of the fit, ``{"loss": [per epoch], ...}`` as floats.
    - ``metrics``: the ``evaluate`` results if the job had ``evaluate``, else the last epoch's logs.
    - ``seconds``: wall time of the job (data, build, fit, evaluate).
    - ``error``: ``"ExceptionType: message"`` if the job failed, else ``None``; ``ok`` is ``error is None``.
    - ``model``: the trained model (left out of ``repr`` and ``==``), ``None`` if building failed.
    - ``devices``: every device of the job (``device`` is the first): several under ``devices_per_job``.

    >>> r = JobResult("a", "/device:CPU:0", {"loss": [0.5, 0.25]}, {"loss": 0.25}, 1.5, None)
    >>> r.ok, r.metrics["loss"]
    (True, 0.25)
    >>> JobResult("b", None, {}, {}, 0.0, "ValueError: bad").ok
    False
    """

    name: str
    device: str | None
    history: dict[str, list[float]]
    metrics: dict[str, float]
    seconds: float
    error: str | None = None
    model: keras.Model | None = field(default=None, repr=False, compare=False)
    devices: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True if the job trained (and evaluated) without error."""
        return self.error is None


class _QuietTerminateOnNaN(keras.callbacks.TerminateOnNaN):
    """``TerminateOnNaN`` without its print to ``sys.stdout`` (fit_many reports through ``out``, under ``verbose``)."""

    def on_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            self.model.stop_training = True


class _StopWhenSet(keras.callbacks.Callback):
    """Stops training at the next batch once ``event`` is set (fit_many interrupted)."""

    def __init__(self, event: threading.Event) -> None:
        super().__init__()
        self.event = event

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self.event.is_set():
            self.model.stop_training = True


def _format_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _run_job(job: Job, group: tuple[str, ...], stop: threading.Event) -> JobResult:
    """Build, fit and evaluate ``job`` on the devices of ``group`` (one: ``single``; several: a ``model_parallel``
    pipeline over them); never raises (a failure becomes ``JobResult.error``)."""
    device = group[0]
    start = time.perf_counter()
    model: keras.Model | None = None
    history: dict[str, list[float]] = {}
    metrics: dict[str, float] = {}
    error: str | None = None
    try:
        data = job.resolve_data()
        if len(group) == 1:
            par = Parallel("single", devices=[device], seed=job.seed)
        else:
            par = Parallel("model_parallel", devices=list(group), seed=job.seed)
        with _BUILD_LOCK, tf.device(device):  # the generators Keras draws initial weights from are process-global
            model = par.build(job.model_fn, **job.compile)
        fit_kwargs = dict(job.fit)
        fit_kwargs["verbose"] = 0
        callbacks = list(fit_kwargs.pop("callbacks", None) or ())
        callbacks += [_QuietTerminateOnNaN(), _StopWhenSet(stop)]
        if len(data) == 4:
            fit_kwargs["validation_data"] = (data[2], data[3])
        with tf.device(device):
            fitted = par.fit(data[0], data[1], callbacks=callbacks, **fit_kwargs)
        history = {str(k): [float(v) for v in values] for k, values in fitted.history.items()}
        losses = history.get("loss", [])
        if losses and not math.isfinite(losses[-1]):
            what = "NaN" if math.isnan(losses[-1]) else "inf"
            epoch = int(fit_kwargs.get("initial_epoch", 0)) + len(losses)
            raise FloatingPointError(f"loss became {what} at epoch {epoch}")
        if stop.is_set():
            raise RuntimeError("fit_many was interrupted before this job finished")
        if job.evaluate is not None:
            with tf.device(device):
                evaluated = par.evaluate(job.evaluate[0], job.evaluate[1], batch_size=fit_kwargs.get("batch_size", 32))
            metrics = {str(k): float(v) for k, v in evaluated.items()}
        else:
            metrics = {k: values[-1] for k, values in history.items() if values}
    except Exception as caught:  # a job's failure must not stop the others
        error = _format_error(caught)
    return JobResult(job.name, device, history, metrics, time.perf_counter() - start, error, model, group)


def _summary(metrics: Mapping[str, float]) -> str:
    ordered = sorted(metrics.items(), key=lambda item: item[0] != "loss")  # loss first, then as logged
    return ", ".join(f"{name} {value:.4g}" for name, value in ordered) or "no metrics"


def fit_many(
    jobs: Sequence[Job],
    devices: None | int | str | Sequence[str] = None,
    *,
    devices_per_job: int = 1,
    verbose: int = 1,
    out: TextIO | None = None,
) -> dict[str, JobResult]:
    """Train every job, one model per device, as many at once as there are devices; return results by name.

    ``devices`` takes what :class:`paraml.Parallel` takes (``None``: every local GPU, else every logical CPU; an
    int: the first N; or names). One worker thread per device takes jobs from a queue in the given order, so with
    more jobs than devices the rest wait and start as devices become free. Each job runs on exactly one device,
    built with ``Parallel("single", devices=[device], seed=job.seed)`` (see the module docstring).
    A job that raises, or whose loss becomes NaN or inf (training stops at that batch), gets a result with
    ``error`` set; the others go on. The returned dict is ordered like ``jobs``. ``devices_per_job=k`` gives each
    job k devices (consecutive ones) and trains it as a ``model_parallel`` pipeline over them, for models too big for
    one device: the layout of many pipelines side by side. With ``verbose`` (default), one
    line per start and end goes to ``out`` (default ``sys.stdout``). Building sets the global seeds, as
    ``Parallel(seed=...).build`` does.

    >>> import numpy as np, keras
    >>> x = np.random.rand(32, 3).astype("float32")
    >>> def model_fn():
    ...     return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> jobs = [Job("a", model_fn, {"loss": "mse"}, (x, x[:, :1]), {"epochs": 2}),
    ...         Job("nan", model_fn, {"loss": "mse"}, (x, np.full((32, 1), np.nan, "float32")))]
    >>> results = fit_many(jobs, devices=1, verbose=0)
    >>> results["a"].ok, len(results["a"].history["loss"]), results["a"].device
    (True, 2, '/device:CPU:0')
    >>> results["nan"].error
    'FloatingPointError: loss became NaN at epoch 1'
    """
    if isinstance(jobs, Job):
        raise TypeError("fit_many takes a sequence of Job, got a single Job: pass [job]")
    jobs = check_named(jobs, Job, "fit_many's list of jobs")
    check_int("verbose", verbose, low=0)
    stream = out if out is not None else sys.stdout
    check_int("devices_per_job", devices_per_job)
    found = [canonical_device(d) for d in resolve_devices(devices)]
    if len(found) < devices_per_job:
        raise ValueError(
            f"devices_per_job={devices_per_job} needs at least that many devices, got {len(found)}: {found}"
        )
    groups = [tuple(found[i : i + devices_per_job]) for i in range(0, len(found), devices_per_job)]
    pool = [g for g in groups if len(g) == devices_per_job][: len(jobs)]  # leftover devices stay idle

    pending: queue.Queue[tuple[int, Job]] = queue.Queue()
    for item in enumerate(jobs):
        pending.put(item)
    results: list[JobResult | None] = [None] * len(jobs)
    lock = threading.Lock()  # guards the counters, the results and the output
    stop = threading.Event()
    counts = {"running": 0, "queued": len(jobs)}

    def say(line: str) -> None:
        if verbose:
            print(f"[fit_many] {line}", file=stream, flush=True)

    def work(group: tuple[str, ...]) -> None:
        device = ", ".join(group)
        while not stop.is_set():
            with lock:
                try:
                    index, job = pending.get_nowait()
                except queue.Empty:
                    return
                counts["running"] += 1
                counts["queued"] -= 1
                say(
                    f"job {job.name!r} started on {device} "
                    f"({counts['running']}/{len(pool)} running, {counts['queued']} queued)"
                )
            result = _run_job(job, group, stop)
            with lock:
                counts["running"] -= 1
                results[index] = result
                verb, outcome = ("finished", _summary(result.metrics)) if result.ok else ("failed", result.error)
                say(f"job {job.name!r} {verb} on {device} in {result.seconds:.1f}s: {outcome}")

    crashes: list[BaseException] = []
    policy = keras.config.dtype_policy()  # Keras keeps it per thread: carry the caller's into the workers

    def worker(group: tuple[str, ...]) -> None:
        try:
            keras.config.set_dtype_policy(policy)
            work(group)
        except BaseException as error:  # fit_many's own failure (e.g. writing to `out`), not a job's: stop all
            crashes.append(error)
            stop.set()

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(g,), name=f"fit_many {g[0]}", daemon=True) for g in pool]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=0.2)  # a timed join keeps Ctrl-C responsive
    except KeyboardInterrupt:
        stop.set()  # queued jobs never start; running ones stop at their next batch
        for thread in threads:
            thread.join()
        raise
    if crashes:
        raise crashes[0]
    done = [r for r in results if r is not None]
    failed = sum(not r.ok for r in done)
    say(
        f"{len(done)} job(s) on {len(pool) * devices_per_job} device(s) in {time.perf_counter() - start:.1f}s: "
        f"{len(done) - failed} ok, {failed} failed"
    )
    return {job.name: result for job, result in zip(jobs, results) if result is not None}
