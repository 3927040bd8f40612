"""The epoch iterator: which batches an epoch takes, through the backend's distributed iterator, and the counters.

Keras' rules, owned here so that the loop in :mod:`paraml.loop.training` only asks "how many steps next?" and "run
them":

- An epoch is ``source.steps`` batches when that is known (``steps_per_epoch`` or the data's length), else it ends
  with the data.
- When the caller gave ``steps_per_epoch`` (``source.continues``), one iterator runs on across epochs and a new pass
  over the data starts only when the old one is exhausted (an epoch that reaches the end of the data stops there, as
  in ``model.fit``); otherwise every epoch is one pass.
- Arrays without ``steps_per_epoch`` make one iterator for all epochs (a distributed iterator costs ~0.1 s).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import tensorflow as tf

from paraml.backends.base import Backend
from paraml.loop.batches import GlobalBatches

__all__ = ["EpochIterator"]

T = TypeVar("T")


class EpochIterator:
    """The batches of one ``fit`` (or evaluate/predict) over a :class:`GlobalBatches`, and where it stands.

    ``step`` is the number of batches of the current epoch done; ``steps_per_execution`` bounds how many one
    execution (one ``tf.function`` call) takes.
    """

    def __init__(self, backend: Backend, source: GlobalBatches, steps_per_execution: int = 1) -> None:
        self.backend = backend
        self.source = source
        self.steps_per_execution = steps_per_execution
        self.iterator: Iterator[Any] | None = None
        self.step = 0  # batches of the current epoch done
        self._pass = 0  # which pass over the data the iterator is in
        self._seen = 0  # batches taken from the current pass

    def _open(self, *args: Any, **kwargs: Any) -> None:
        self.iterator = iter(self.backend.distribute(self.source.dataset(*args, **kwargs)))

    def start(self, epoch: int, stop_epoch: int = 1, skip: int = 0, resumed: bool = False) -> None:
        """Open the iterator for ``epoch`` after ``skip`` batches of it (``stop_epoch``: where training ends).

        ``resumed``: a run restored from a checkpoint. A user's dataset that makes a new pass every epoch reshuffles
        at every new iterator (``shuffle(reshuffle_each_iteration=True)``): the run that was stopped had made
        ``epoch`` iterators before this one, so as many are made (and dropped, unread) first.
        """
        source = self.source
        self.step = skip
        if resumed and source.kind == "dataset" and not source.continues:  # (a generator would be read)
            for _ in range(epoch):
                iter(source.dataset(epoch))
        if source.continues:
            self._pass, self._seen = self.position(epoch, skip)
            self._open(self._pass, skip=self._seen)
        elif source.spans_epochs:
            self._open(epoch, stop_epoch, skip=skip)
        else:
            self._open(epoch, skip=skip)

    def position(self, epoch: int, step: int) -> tuple[int, int]:
        """Where batch ``step`` of ``epoch`` falls among the passes over the data: (pass, batches into it).

        Keras' rule when ``steps_per_epoch`` is given: an epoch takes ``steps`` batches, or fewer if the pass ends
        first; a new pass starts at the next epoch. Data of unknown length is one pass.
        """
        steps, length = self.source.steps or 0, self.source.num_batches
        if length is None:
            return 0, epoch * steps + step
        passes, seen = 0, 0
        for _ in range(epoch):
            seen += min(steps, length - seen)
            if seen >= length:
                passes, seen = passes + 1, 0
        return passes, seen + step

    def next_epoch(self, epoch: int) -> None:
        """Prepare the iterator for ``epoch`` (after the previous one ended)."""
        source = self.source
        self.step = 0
        if source.continues:
            if self.iterator is None or (source.num_batches is not None and self._seen >= source.num_batches):
                self._pass, self._seen = self._pass + 1, 0
                self._open(self._pass)
        elif not source.spans_epochs:
            self._open(epoch)

    def remaining(self) -> int | None:
        """How many batches the epoch may still take (None: until the data ends)."""
        left = None if self.source.steps is None else self.source.steps - self.step
        if self.source.continues and self.source.num_batches is not None:
            in_pass = self.source.num_batches - self._seen
            left = in_pass if left is None else min(left, in_pass)
        return left

    def next_size(self) -> int:
        """How many steps the next execution runs: up to ``steps_per_execution``; 0 when the epoch is complete."""
        left = self.remaining()
        if left is None:
            return 1  # data of unknown length: one step at a time, so its end is found on time
        return max(0, min(self.steps_per_execution, left))

    def run(self, steps: int, execution: Callable[[Iterator[Any]], T]) -> T | None:
        """``execution(iterator)`` for the next ``steps`` batches, counted as done; None when the data has ended."""
        try:
            result = execution(self.iterator)
        except tf.errors.OutOfRangeError:
            if self.source.continues:  # the next epoch starts a new pass
                self.iterator = None
            return None
        self.step += steps
        self._seen += steps
        return result
