"""Checkpoints that survive crashes and move between backends.

Layout of a checkpoint directory::

    DIR/latest          the name of the newest complete checkpoint (replaced atomically)
    DIR/ckpt-000003/    one complete checkpoint in TensorFlow's own format (``tf.train.Checkpoint``; never pickle)

A save writes a new ``ckpt-N`` under a temporary name, renames it into place and only then points ``latest`` at it
(write-then-rename, both atomic on POSIX). A crash at any moment leaves the previous checkpoint readable.

In a cluster of several workers the checkpoint is sharded (:mod:`paraml.loop.shards`): each worker writes the tensors
it owns into its own shard of the folder, in parallel, and the chief adds a small index before the rename; no worker
gathers another's optimizer state, and a restore reads from each shard only what this worker holds.

Variables are stored by their position in ``model.weights`` and ``optimizer.variables``, not by name: Keras numbers
auto-named layers per process, and every backend builds the same model from the same ``model_fn``, so positions are
what stays the same across backends and processes. Alongside: the epoch and step reached and the shuffling seed.

:class:`Checkpointing` is what ``fit(checkpoint_dir=...)`` does with them, in one place: resume from the newest
checkpoint (every worker agreeing on which), save at each epoch's end, every N steps and where training stops, and
turn SIGTERM/SIGINT into a stop at the next step (:class:`paraml.loop.preemption.PreemptionGuard`).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf

from paraml.backends.base import Techniques
from paraml.checks import check_int
from paraml.cluster.elastic import PROGRESS_ENV, REACHED_ENV, RESIZE_ENV
from paraml.internals import optimizer_variable_list
from paraml.loop.compiling import extra_optimizers
from paraml.loop.preemption import Preempted, PreemptionGuard
from paraml.loop.shards import ShardIndex, Workers, owners, read_index, shard_folder, wait_for_shards, write_mark

if TYPE_CHECKING:  # pragma: no cover
    from paraml.loop.training import Trainer

__all__ = [
    "CheckpointState",
    "CheckpointSummary",
    "CheckpointWriter",
    "Checkpointing",
    "Workers",
    "check_writable",
    "inspect_checkpoint",
    "latest_checkpoint",
    "restore_checkpoint",
    "save_checkpoint",
    "workers_of",
]

_LATEST = "latest"
_PREFIX = "ckpt"  # file prefix inside a checkpoint folder


@dataclass(frozen=True)
class CheckpointState:
    """Where training stood when a checkpoint was written: epochs completed, steps into the next epoch, seed."""

    epoch: int
    step: int
    seed: int


def _seed_states(model: keras.Model) -> list[Any]:
    """The states of the model's random-seed generators (Dropout's, a GAN's noise), which are not among its weights."""
    return [v for v in model.variables if v.path.endswith("seed_generator_state")]


def _held(variable: Any) -> bool:
    """Whether this process holds the value of ``variable`` (a model's weight): under ``shard_parameters=True``
    across workers, another worker's weight is a zero-size placeholder here (its Keras variable keeps the whole
    shape)."""
    return tuple(variable.value.shape) == tuple(variable.shape)


def _trackables(model: keras.Model, optimizer: keras.optimizers.Optimizer, state: Sequence[Any]) -> dict[str, Any]:
    """What a checkpoint holds, by key; ``state`` is the optimizer's variables as saved or restored (None: another
    worker's slot, :mod:`paraml.parallelism.zero`). Another worker's weight is left out as such a slot is."""
    tracked: dict[str, Any] = {f"model_{i:05d}": v.value for i, v in enumerate(model.weights) if _held(v)}
    # Without them, a resumed run would draw the random numbers of its first steps again.
    tracked.update({f"seed_{i:05d}": v.value for i, v in enumerate(_seed_states(model))})
    tracked.update({f"optimizer_{i:05d}": v for i, v in enumerate(state) if v is not None})
    # Other optimizers of the model (a GAN's d_optimizer and g_optimizer) create their variables at their first
    # update, after a resume has read the checkpoint: their list of variables (a TensorFlow trackable list) is saved,
    # so that a restore fills each variable, by position, when it is created.
    for name, extra in extra_optimizers(model).items():
        tracked[f"extra_{name}"] = optimizer_variable_list(extra) or [v.value for v in extra.variables]
    return tracked


def _whole_state(optimizer: keras.optimizers.Optimizer, techniques: Techniques | None) -> list[Any]:
    """The optimizer's variables as a checkpoint stores them: as the plan's techniques say (every slot whole, even
    where sharded or split), else as they are."""
    if techniques is not None:
        return techniques.optimizer_state(optimizer)
    return [v.value for v in optimizer.variables]


def _restorable_state(
    optimizer: keras.optimizers.Optimizer, techniques: Techniques | None
) -> list[tuple[Any | None, tuple[int, ...]]]:
    """Each saved optimizer variable as a restore fills it (None: another worker's slot) and its whole shape."""
    if techniques is not None:
        return techniques.restorable_state(optimizer)
    return [(v.value, tuple(v.shape)) for v in optimizer.variables]


def _names(
    model: keras.Model, optimizer: keras.optimizers.Optimizer, techniques: Techniques | None
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """checkpoint key -> (the variable's path in this model, its shape), for error messages."""
    named = {f"model_{i:05d}": (v.path, tuple(v.shape)) for i, v in enumerate(model.weights)}
    state = _restorable_state(optimizer, techniques)  # whole, even where sharded or split
    paths = [v.path for v in optimizer.variables] if len(state) == len(optimizer.variables) else None
    named.update(
        {
            f"optimizer_{i:05d}": (paths[i] if paths else getattr(value, "name", f"variable {i}"), shape)
            for i, (value, shape) in enumerate(state)
        }
    )
    return named


def _layout(techniques: Techniques | None) -> str:
    """What wrote a checkpoint: the plan's ``describe()`` (empty without one)."""
    return techniques.plan.describe() if techniques is not None else ""


def _next_name(directory: Path) -> str:
    numbers = [int(p.name.split("-")[1]) for p in directory.glob(f"{_PREFIX}-*") if p.name.split("-")[1].isdigit()]
    return f"{_PREFIX}-{max(numbers, default=0) + 1:06d}"


def _write_atomic(path: Path, text: str) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(handle, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def save_checkpoint(
    directory: str | os.PathLike[str],
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    state: CheckpointState,
    *,
    keep: int | None = None,
    write: bool = True,
    techniques: Techniques | None = None,
    workers: Workers | None = None,
) -> Path:
    """Write a new checkpoint into ``directory`` atomically and return its folder.

    ``techniques`` (``backend.techniques``) say how the optimizer's state is stored whole where the plan shards or
    splits it; without them it is stored as it is.

    ``keep`` keeps only the newest K checkpoints. ``workers`` of more than one: every worker calls this together and
    writes its shard (:mod:`paraml.loop.shards`). Otherwise ``write=False`` writes to a temporary folder that is
    deleted at once.
    """
    return CheckpointWriter().save(
        directory, model, optimizer, state, keep=keep, write=write, techniques=techniques, workers=workers
    )


class CheckpointWriter:
    """Writes checkpoints (:func:`save_checkpoint`), in the background when ``asynchronous``.

    A background save copies the state to host memory before :meth:`save` returns (TensorFlow's asynchronous
    checkpoint, ``CheckpointOptions(experimental_enable_async_checkpoint=True)``), so training may change the
    variables at once; a thread then waits for TensorFlow's write and makes it visible as a synchronous save does
    (fsync, rename, ``latest``). The next save and :meth:`wait` wait for it, and raise what it raised. A crash
    before the rename leaves only a staging folder, which the next save deletes: the previous checkpoint is whole.
    """

    def __init__(self, asynchronous: bool = False) -> None:
        self.asynchronous = asynchronous
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(
        self,
        directory: str | os.PathLike[str],
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer,
        state: CheckpointState,
        *,
        keep: int | None = None,
        write: bool = True,
        techniques: Techniques | None = None,
        asynchronous: bool | None = None,
        workers: Workers | None = None,
    ) -> Path:
        """Save as :func:`save_checkpoint` does; in the background unless ``asynchronous`` (default: the writer's)
        is False. Returns the folder the checkpoint has (or will have, once written)."""
        check_int("keep", keep, none_ok=True)
        self.wait()  # one write at a time: the numbering and `latest` follow the order of the saves
        background = self.asynchronous if asynchronous is None else asynchronous
        options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True) if background else None
        if workers is not None and workers.count > 1:
            return self._save_shard(Path(directory), model, optimizer, state, keep, techniques, options, workers)
        checkpoint = tf.train.Checkpoint(
            **_trackables(model, optimizer, _whole_state(optimizer, techniques)),
            progress=tf.Variable(np.array([state.epoch, state.step, state.seed], np.int64), trainable=False),
            optimizer_class=tf.Variable(type(optimizer).__name__, trainable=False),
            # what wrote it, for `paraml checkpoint inspect` (a restore reads the tensors by position, on any layout)
            layout=tf.Variable(_layout(techniques), trainable=False),
        )
        if not write:
            scratch = Path(tempfile.mkdtemp(prefix="paraml-worker-ckpt-"))
            checkpoint.write(str(scratch / _PREFIX), options=options)
            self._finish(checkpoint, background, lambda: shutil.rmtree(scratch, ignore_errors=True))
            return scratch
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f".{_PREFIX}-*"):  # a save that crashed half-way left its staging folder
            shutil.rmtree(stale, ignore_errors=True)
        name = _next_name(root)
        staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}."))
        checkpoint.write(str(staging / _PREFIX), options=options)
        self._finish(checkpoint, background, lambda: _make_visible(root, staging, name, keep))
        return root / name

    def _save_shard(
        self,
        root: Path,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer,
        state: CheckpointState,
        keep: int | None,
        techniques: Techniques | None,
        options: tf.train.CheckpointOptions | None,
        workers: Workers,
    ) -> Path:
        """This worker's shard of a sharded checkpoint (every worker calls it together): the tensors it owns
        (:func:`paraml.loop.shards.owners`), its optimizer slots as they are (no gather); the chief then writes the
        index and makes the folder visible once every shard is marked complete."""
        chief = workers.index == 0
        restorable = _restorable_state(optimizer, techniques)  # None: a slot another worker holds
        tracked = _trackables(model, optimizer, [value for value, _ in restorable])
        extras = sorted(k for k in tracked if k.startswith("extra_"))  # lists restored as they are made: the chief's
        shapes = {k: tuple(v.shape) for k, v in tracked.items() if k not in extras}
        shapes.update({f"model_{i:05d}": tuple(v.shape) for i, v in enumerate(model.weights)})  # whole, held or not
        shapes.update({f"optimizer_{i:05d}": shape for i, (_, shape) in enumerate(restorable)})
        keys = sorted(shapes)
        held = workers.gather(tf.constant([int(key in tracked) for key in keys], tf.int32)).numpy().astype(bool)
        writer = owners(held, [int(np.prod(shapes[k], dtype=np.int64)) for k in keys])
        mine = [k for k, w in zip(keys, writer) if w == workers.index] + (extras if chief else [])

        name, staging = self._agree_on_staging(root, workers)
        shard = shard_folder(staging, workers.index)
        shard.mkdir()
        checkpoint = tf.train.Checkpoint(**{k: tracked[k] for k in mine})
        checkpoint.write(str(shard / _PREFIX), options=options)
        listing = {k: (shapes[k], tf.as_dtype(tracked[k].dtype).name) for k in mine if k not in extras}
        metadata = {
            "progress": [state.epoch, state.step, state.seed],
            "optimizer_class": type(optimizer).__name__,
            "layout": _layout(techniques),
            "extra": extras,
        }

        def complete() -> None:
            write_mark(staging, workers.index, listing)
            if chief:
                wait_for_shards(staging, workers.count, metadata)
                (staging / "token").unlink()
                _make_visible(root, staging, name, keep)

        self._finish(checkpoint, options is not None, complete)
        return root / name

    @staticmethod
    def _agree_on_staging(root: Path, workers: Workers) -> tuple[str, Path]:
        """The checkpoint's name and staging folder, the chief's, on every worker; refused (on every worker alike)
        when a worker does not see the folder the chief made: the workers must share ``root``'s storage."""
        chief = workers.index == 0
        root.mkdir(parents=True, exist_ok=True)
        number, token = 0, 0
        if chief:
            for stale in root.glob(f".{_PREFIX}-*"):  # a save that crashed half-way left its staging folder
                shutil.rmtree(stale, ignore_errors=True)
            number, token = int(_next_name(root).split("-")[1]), int.from_bytes(os.urandom(6), "big")
            made = root / f".{_PREFIX}-{number:06d}.staging"
            made.mkdir()
            _write_atomic(made / "token", str(token))
        number, token = (int(v) for v in workers.gather(tf.constant([number, token], tf.int64)).numpy()[0])
        name = f"{_PREFIX}-{number:06d}"
        staging = root / f".{name}.staging"
        sees = (staging / "token").is_file() and (staging / "token").read_text() == str(token)
        seen = workers.gather(tf.constant(int(sees), tf.int32)).numpy().astype(bool)
        if not seen.all():
            raise RuntimeError(
                f"checkpoint_dir {str(root)!r} must be on storage every worker sees: worker(s) "
                f"{[int(w) for w in np.flatnonzero(~seen)]} do not see the folder the chief made there ({staging.name})"
            )
        return name, staging

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        """Wait for the background save; when the block raised, say (not raise) what the save raised."""
        try:
            self.wait()
        except RuntimeError as failed:
            if kind is None:
                raise
            print(f"paraml: {failed}", file=sys.stderr, flush=True)

    def wait(self) -> None:
        """Wait for the background save, if any; raise what it raised."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"a checkpoint written in the background failed: {error}") from error

    def _finish(self, checkpoint: tf.train.Checkpoint, background: bool, then: Callable[[], None]) -> None:
        if not background:
            then()
            return

        def complete() -> None:
            try:
                checkpoint.sync()  # TensorFlow's own write thread is done
                then()
            except BaseException as error:  # handed to the next save or wait, in the training thread
                self._error = error

        self._pending = threading.Thread(target=complete, name="paraml-checkpoint", daemon=False)
        self._pending.start()


def _make_visible(root: Path, staging: Path, name: str, keep: int | None) -> None:
    """Flush a written checkpoint, rename it into place, point ``latest`` at it, and drop all but the newest
    ``keep``."""
    for file in staging.iterdir():  # flush the data before the rename makes it visible (shards: by their writers)
        if file.is_dir():
            continue
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    os.rename(staging, root / name)
    _write_atomic(root / _LATEST, name + "\n")
    if keep is not None:
        complete = sorted(p for p in root.glob(f"{_PREFIX}-*") if p.is_dir())
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint folder in ``directory``, or None if it holds none."""
    root = Path(directory)
    pointer = root / _LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if name and (root / name).is_dir():
            return root / name
    return None


def _resolve(path: str | os.PathLike[str]) -> Path:
    """A checkpoint folder from a checkpoint directory (via ``latest``) or a checkpoint folder itself."""
    given = Path(path)
    if not given.exists():
        raise FileNotFoundError(f"no checkpoint at {str(given)!r}: the path does not exist")
    if (given / f"{_PREFIX}.index").is_file() or read_index(given) is not None:
        return given
    found = latest_checkpoint(given)
    if found is None:
        raise FileNotFoundError(f"no checkpoint at {str(given)!r}: it holds no complete checkpoint ('latest' missing)")
    return found


@dataclass(frozen=True)
class CheckpointSummary:
    """What a checkpoint holds (:func:`inspect_checkpoint`): where training stood, the optimizer, the layout that
    wrote it (its plan's ``describe()``; empty for a checkpoint written without one) and every tensor stored.

    Attributes:
        tensors: ``(key, shape, dtype, bytes)`` of each stored tensor: ``model_NNNNN`` (the model's weights by
            position), ``optimizer_NNNNN`` (its optimizer's variables, each whole), ``seed_NNNNN``, ``extra_...``.
    """

    folder: Path
    state: CheckpointState
    optimizer_class: str
    layout: str
    tensors: tuple[tuple[str, tuple[int, ...], str, int], ...]
    shards: int = 1

    def describe(self) -> str:
        """The summary in words: one line each for where training stood, the optimizer and the bytes by kind, then
        the layout that wrote it."""
        kinds: dict[str, list[int]] = {}
        for key, _, _, nbytes in self.tensors:
            kinds.setdefault(key.split("_")[0], []).append(nbytes)
        from paraml.planning.sizes import format_bytes

        total = sum(sum(sizes) for sizes in kinds.values())
        lines = [
            f"checkpoint {self.folder}",
            f"epochs done {self.state.epoch}, steps into the next {self.state.step}, shuffling seed {self.state.seed}",
            f"optimizer {self.optimizer_class or 'unknown'}",
            f"{len(self.tensors)} tensors, {format_bytes(total)}"
            + (f" in {self.shards} shards, one per worker" if self.shards > 1 else "")
            + ": "
            + ", ".join(f"{kind} {len(sizes)} ({format_bytes(sum(sizes))})" for kind, sizes in sorted(kinds.items())),
            "written by: " + (self.layout.replace("\n", "\n  ") if self.layout else "(no layout recorded)"),
        ]
        return "\n".join(lines)


def inspect_checkpoint(path: str | os.PathLike[str]) -> CheckpointSummary:
    """What the checkpoint at ``path`` (a checkpoint folder, or a directory whose ``latest`` names one) holds,
    read from its index without building a model.

    Raises:
        FileNotFoundError: naming a path that does not exist or holds no complete checkpoint.
        ValueError: for a truncated or corrupt checkpoint.
    """
    folder = _resolve(path)
    index = read_index(folder)
    if index is not None:
        epoch, step, seed = (int(v) for v in index.metadata["progress"])
        tensors = tuple(
            (key, shape, dtype, int(np.prod(shape, dtype=np.int64)) * tf.as_dtype(dtype).size)
            for key, (_, shape, dtype) in sorted(index.tensors.items())
        )
        return CheckpointSummary(
            folder,
            CheckpointState(epoch, step, seed),
            str(index.metadata.get("optimizer_class", "")),
            str(index.metadata.get("layout", "")),
            tensors,
            shards=int(index.metadata.get("shards", 1)),
        )
    prefix = str(folder / _PREFIX)
    try:
        reader = tf.train.load_checkpoint(prefix)
        shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    except (tf.errors.OpError, ValueError, IndexError) as error:
        raise ValueError(f"checkpoint {str(folder)!r} is corrupt or truncated: {error}") from None
    suffix = "/.ATTRIBUTES/VARIABLE_VALUE"

    def text(key: str) -> str:
        if key + suffix not in shapes:
            return ""
        value = reader.get_tensor(key + suffix)
        return value.decode() if isinstance(value, bytes) else str(value)

    epoch, step, seed = (int(v) for v in reader.get_tensor("progress" + suffix))
    tensors = tuple(
        (
            key[: -len(suffix)],
            tuple(shapes[key]),
            dtypes[key].name,
            int(np.prod(shapes[key], dtype=np.int64)) * dtypes[key].size,
        )
        for key in sorted(shapes)
        if key.endswith(suffix) and key[: -len(suffix)] not in ("progress", "optimizer_class", "layout", "save_counter")
    )
    return CheckpointSummary(
        folder, CheckpointState(epoch, step, seed), text("optimizer_class"), text("layout"), tensors
    )


def restore_checkpoint(
    path: str | os.PathLike[str],
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    techniques: Techniques | None = None,
) -> CheckpointState:
    """Load weights and optimizer state from ``path`` into ``model``/``optimizer``; return where training stood.

    Raises ``FileNotFoundError`` naming a path that does not exist, ``ValueError`` naming the first variable whose
    shape differs (a checkpoint of another model), and ``ValueError`` for a truncated or corrupt checkpoint. The files
    are only read, never changed.
    """
    folder = _resolve(path)
    index = read_index(folder)
    prefix = str(folder / _PREFIX)
    if index is not None:
        _check_shards(index)
        stored = {key: shape for key, (_, shape, _) in index.tensors.items()}
        saved_class: str | None = str(index.metadata.get("optimizer_class", ""))
    else:
        stored, saved_class = _stored(folder, prefix)
    if saved_class and saved_class != type(optimizer).__name__:
        raise ValueError(
            f"checkpoint {str(folder)!r} was written with the optimizer {saved_class}, this model uses "
            f"{type(optimizer).__name__}: build with the same optimizer to resume (its state and learning rate "
            "are restored), or load only the weights with model.set_weights"
        )
    expected = _names(model, optimizer, techniques)
    _check_same_model(folder, stored, expected, len(model.weights))
    # A checkpoint written before paraml saved seed states has none: those keep their values.
    state = [variable for variable, _ in _restorable_state(optimizer, techniques)]
    if not _same_optimizer_state(stored, expected):
        # Another compile's optimizer (the model compiled again with other layers trainable, as to fine-tune): the
        # weights are this model's, the optimizer's state is not; it stays as it is, as Keras' load_weights skips it.
        held = sum(_is_optimizer_key(k) for k in stored)
        warnings.warn(
            f"checkpoint {str(folder)!r} holds {held} optimizer variables, this optimizer has {len(state)}: it was "
            "written under another compile (other layers trainable). Its weights are restored; the optimizer keeps "
            "its own state (a fresh one after a compile)",
            stacklevel=3,
        )
        state = []
    tracked = {
        k: v for k, v in _trackables(model, optimizer, state).items() if not k.startswith("seed_") or k in stored
    }
    try:
        if index is not None:
            return _restore_shards(index, tracked)
        progress = tf.Variable(np.zeros(3, np.int64), trainable=False)
        checkpoint = tf.train.Checkpoint(**tracked, progress=progress)
        # optimizer_class was checked above; it is not a variable of this model, so it is not restored
        # (expect_partial: TensorFlow would otherwise warn about it, twice, when the status is deleted). Variables of
        # other optimizers not created yet are restored when they are (the status stays with them).
        checkpoint.read(prefix).assert_existing_objects_matched().expect_partial()
    except (tf.errors.OpError, AssertionError, IndexError, ValueError) as error:
        raise ValueError(f"checkpoint {str(folder)!r} is corrupt or truncated: {error}") from None
    epoch, step, seed = (int(v) for v in progress.numpy())
    return CheckpointState(epoch, step, seed)


def _stored(folder: Path, prefix: str) -> tuple[dict[str, tuple[int, ...]], str | None]:
    """A single-file checkpoint's tensors (key -> shape) and the optimizer class it names (None: an old one)."""
    try:
        listed = dict(tf.train.list_variables(prefix))
        stored = {key.split("/")[0]: tuple(shape) for key, shape in listed.items() if "/.ATTRIBUTES/" in key}
        if "optimizer_class" not in stored:
            return stored, None
        saved_class = tf.train.load_checkpoint(prefix).get_tensor("optimizer_class/.ATTRIBUTES/VARIABLE_VALUE")
    except (tf.errors.OpError, ValueError, IndexError) as error:
        raise ValueError(f"checkpoint {str(folder)!r} is corrupt or truncated: {error}") from None
    return stored, saved_class.decode() if isinstance(saved_class, bytes) else str(saved_class)


def _same_optimizer_state(stored: dict[str, tuple[int, ...]], expected: dict[str, tuple[str, tuple[int, ...]]]) -> bool:
    """Whether the checkpoint's optimizer variables are this optimizer's: as many, each of the same shape."""
    saved = {k: shape for k, shape in stored.items() if _is_optimizer_key(k)}
    wanted = {k: shape for k, (_, shape) in expected.items() if _is_optimizer_key(k)}
    return saved == wanted


def _is_optimizer_key(key: str) -> bool:
    """Whether ``key`` is one of the optimizer's variables (``optimizer_00003``; not ``optimizer_class``)."""
    return key.startswith("optimizer_") and key[len("optimizer_") :].isdigit()


def _check_same_model(
    folder: Path, stored: dict[str, tuple[int, ...]], expected: dict[str, tuple[str, tuple[int, ...]]], weights: int
) -> None:
    """Refuse a checkpoint of another model (of ``weights`` variables), naming the first variable missing or of
    another shape (``expected``: :func:`_names`). Its optimizer's state may be another compile's."""
    for key, (variable_path, shape) in expected.items():
        if _is_optimizer_key(key):
            continue
        if key not in stored:
            raise ValueError(
                f"checkpoint {str(folder)!r} is of a different model: it has no value for {variable_path!r} "
                f"(variable {key}); it holds {sum(k.startswith('model_') for k in stored)} model variables, this model "
                f"has {weights}"
            )
        if stored[key] != shape:
            raise ValueError(
                f"checkpoint {str(folder)!r} is of a different model: variable {variable_path!r} has shape {shape} "
                f"here but {stored[key]} in the checkpoint"
            )
    extra = sorted(k for k in stored if k.startswith("model_") and k not in expected)
    if extra:
        raise ValueError(
            f"checkpoint {str(folder)!r} is of a different model: it holds {len(extra)} more model variables than "
            f"this model has ({weights})"
        )


def _check_shards(index: ShardIndex) -> None:
    """Refuse a sharded checkpoint with a worker's shard missing (copied without it, or written where the workers do
    not share storage), naming the shard: any number of workers can read it, but only whole."""
    count = int(index.metadata.get("shards", 0))
    missing = [w for w in range(count) if not (shard_folder(index.folder, w) / f"{_PREFIX}.index").is_file()]
    if missing:
        names = ", ".join(shard_folder(index.folder, w).name for w in missing)
        raise ValueError(
            f"checkpoint {str(index.folder)!r} was written by {count} workers but {names} (the tensors of worker "
            f"{', '.join(map(str, missing))}) is missing: restore from where every worker's shard is (storage all "
            "workers share), or from an earlier checkpoint"
        )


def _restore_shards(index: ShardIndex, tracked: dict[str, Any]) -> CheckpointState:
    """Fill ``tracked`` from a sharded checkpoint, reading from each shard only the tensors this worker holds (the
    other optimizers' lists from the chief's, filled as their variables are made)."""
    by_shard: dict[int, dict[str, Any]] = {}
    for key, value in tracked.items():
        shard = 0 if key.startswith("extra_") else index.tensors[key][0]
        by_shard.setdefault(shard, {})[key] = value
    for shard, values in sorted(by_shard.items()):
        prefix = str(shard_folder(index.folder, shard) / _PREFIX)
        tf.train.Checkpoint(**values).read(prefix).assert_existing_objects_matched().expect_partial()
    epoch, step, seed = (int(v) for v in index.metadata["progress"])
    return CheckpointState(epoch, step, seed)


def check_writable(directory: str | os.PathLike[str]) -> None:
    """Fail before training when the checkpoint directory cannot be written (nothing in it is touched)."""
    path = Path(directory)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        where = "is a file" if existing == path else f"is inside {str(existing)!r}, which is a file"
        raise NotADirectoryError(f"checkpoint_dir {str(path)!r} {where}: give a directory (it is created if missing)")
    if existing.exists() and not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"checkpoint_dir {str(path)!r} is not writable (checked {str(existing)!r})")


def workers_of(backend: Any) -> Workers:
    """The workers of ``backend``'s run (its topology, and its ``across_workers`` collective)."""
    topology = backend.topology
    return Workers(topology.worker_index, topology.num_workers, backend.across_workers)


class Checkpointing:
    """The checkpoints of one ``fit(checkpoint_dir=...)``: resume, agree, save on progress, stop on a signal.

    ``every`` saves every N steps too (on the same grid of steps after a resume), ``keep`` keeps the newest K. The
    object is the loop's ``on_progress`` hook (:data:`paraml.loop.training.ProgressHook`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every: int | None,
        keep: int | None,
        trainer: Trainer,
        seed: int,
        asynchronous: bool = False,
        steps_per_epoch: int | None = None,
    ) -> None:
        check_int("checkpoint_every", every, none_ok=True)
        check_int("keep", keep, none_ok=True)
        check_writable(directory)
        self.directory = directory
        self.every, self.keep = every, keep
        self.backend, self.model, self.optimizer = trainer.backend, trainer.model, trainer.optimizer
        self.seed = seed
        self.guard = PreemptionGuard()
        self.writer = CheckpointWriter(asynchronous)
        self.steps_per_epoch = steps_per_epoch
        self._last_step = 0
        # Under `paraml launch`, the chief says how far it got (the next run's resize line counts the steps lost).
        self._progress = os.environ.get(PROGRESS_ENV) if self.backend.topology.is_chief else None

    def resume(self, initial_epoch: int, epochs: int) -> CheckpointState | None:
        """Restore the newest checkpoint, if any, into the model and optimizer; every worker must find the same.

        Returns where training stands when that is past ``initial_epoch`` (its seed decides the data order), else
        None; says on stdout where it resumed (or that the ``epochs`` are already done).
        """
        found = latest_checkpoint(self.directory)
        techniques = self.backend.techniques
        state = restore_checkpoint(found, self.model, self.optimizer, techniques) if found is not None else None
        # Workers resuming at different points would hang in the collectives: fail instead.
        position = -1 if state is None else state.epoch * 1_000_000_000 + state.step
        values = sorted({int(v) for v in self.backend.across_workers(tf.constant(position, tf.int64)).numpy()})
        if len(values) > 1:
            raise RuntimeError(
                f"the workers disagree on where to resume from {str(self.directory)!r}: {values} (-1: no checkpoint; "
                "epoch * 1e9 + step). checkpoint_dir must be on storage every worker sees (the chief writes it)"
            )
        if self.backend.topology.is_chief and os.environ.get(RESIZE_ENV):
            print(f"paraml: {self._resize_line(found, state)}", flush=True)
        if state is None or not (state.epoch > initial_epoch or (state.epoch == initial_epoch and state.step)):
            return None
        if state.epoch >= epochs:
            print(f"paraml: already finished: {state.epoch} epochs done (checkpoint {found})", flush=True)
        else:
            print(f"paraml: resumed from {found} at epoch {state.epoch}, step {state.step}", flush=True)
        self.seed = state.seed
        if self.every:
            self._last_step = state.step - state.step % self.every
        return state

    def _resize_line(self, found: Path | None, state: CheckpointState | None) -> str:
        """What a resized run says once: what changed, the new layout, the checkpoint it resumes from, the steps
        lost (those the last run's chief had done past that checkpoint)."""
        plan = self.backend.techniques.plan
        workers = self.backend.topology.num_workers
        layout = f"{workers} worker{'s' if workers > 1 else ''}, {plan.layout}"
        layout += f", ZeRO-{plan.zero_stage}" if plan.zero_stage else ""
        where = "no checkpoint: training starts over"
        if found is not None and state is not None:
            where = f"resumed from {found.name} at epoch {state.epoch}, step {state.step}"
        reached = [int(v) for v in os.environ.get(REACHED_ENV, "").split()]
        lost = "steps lost unknown (the last run's chief recorded none)"
        if len(reached) == 2:
            lost = f"the last run reached epoch {reached[0]}, step {reached[1]}"
            if self.steps_per_epoch:
                done = (state.epoch * self.steps_per_epoch + state.step) if state is not None else 0
                count = reached[0] * self.steps_per_epoch + reached[1] - done
                lost = f"{count} step{'' if count == 1 else 's'} lost ({lost})"
        return f"resized ({os.environ[RESIZE_ENV]}); layout: {layout}; {where}; {lost}"

    def _record(self, epoch: int, step: int) -> None:
        """Write where training stands to the launcher's progress file (a few bytes, no sync: the launcher reads it
        once every worker is gone)."""
        if self._progress:
            Path(self._progress).write_text(f"{epoch} {step}\n")

    def save(self, epoch: int, step: int, asynchronous: bool | None = None) -> Path:
        """Save where training stands (``epoch`` epochs done, ``step`` steps into the next); in the background when
        the run asked for it and ``asynchronous`` is not False."""
        return self.writer.save(
            self.directory,
            self.model,
            self.optimizer,
            CheckpointState(epoch, step, self.seed),
            keep=self.keep,
            write=self.backend.topology.is_chief,
            techniques=self.backend.techniques,
            asynchronous=asynchronous,
            workers=workers_of(self.backend),
        )

    def __call__(self, epoch: int, steps_done: int, event: str) -> None:
        """The loop's progress: save at an epoch's end, where training stopped, and every ``every`` steps."""
        self._record(epoch + 1 if event == "epoch_end" else epoch, 0 if event == "epoch_end" else steps_done)
        if event == "epoch_end":
            self.save(epoch + 1, 0)
            self._last_step = 0
        elif event == "stopped":  # a signal or a callback stopped training: written before fit returns or exits
            self.save(epoch, steps_done, asynchronous=False)
            self._last_step = steps_done
        elif self.every is not None and steps_done - self._last_step >= self.every:
            self.save(epoch, steps_done)
            self._last_step = steps_done

    def _chiefs_latest(self) -> Path | None:
        """The newest checkpoint as the chief sees it, the same on every worker (the others may read the folder
        before the chief's last save is visible to them)."""
        found = latest_checkpoint(self.directory) if self.backend.topology.is_chief else None
        number = int(found.name.split("-")[1]) if found is not None else -1
        chief = int(self.backend.across_workers(tf.constant(number, tf.int64)).numpy()[0])  # worker 0's row
        return None if chief < 0 else Path(self.directory) / f"{_PREFIX}-{chief:06d}"

    @contextmanager
    def stop_on_signal(self) -> Iterator[Any]:
        """Inside the block, SIGTERM/SIGINT ask training to stop at the next step; yields the loop's poll."""
        with self.guard:
            yield lambda: self.guard.requested

    def preempted(self, epochs_done: int) -> Preempted:
        """The exception that ends a preempted run (after the save), announced on stderr as a worker's last word."""
        if not self.guard.requested:  # another worker was signalled: this one stops with it
            self.guard.request()
        error = self.guard.exception(checkpoint=self._chiefs_latest(), epoch=epochs_done)
        print(f"paraml: {error}", file=sys.stderr, flush=True)
        return error
