"""Small real data sets shipped inside the package, so demos and tests never download anything."""

from __future__ import annotations

import gzip
from importlib import resources

import numpy as np

__all__ = ["load_digits"]


def load_digits(
    test_fraction: float = 0.2, seed: int = 0
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The UCI optical handwritten digits (1,797 8x8 images, labels 0..9; CC BY 4.0, see ``paraml/data/README.md``).

    Returns ``(x_train, y_train), (x_test, y_test)``: images as float32 in [0, 1] with shape ``(n, 8, 8, 1)`` and
    int32 labels, split by a seeded shuffle (the same split for the same seed).

    >>> (x_train, y_train), (x_test, y_test) = load_digits()
    >>> x_train.shape, x_test.shape
    ((1438, 8, 8, 1), (359, 8, 8, 1))
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be between 0 and 1, got {test_fraction!r}")
    with resources.files("paraml").joinpath("data/digits.csv.gz").open("rb") as raw, gzip.open(raw, "rt") as text:
        table = np.loadtxt(text, delimiter=",", dtype=np.float32)
    images = (table[:, :64] / 16.0).reshape(-1, 8, 8, 1).astype(np.float32)
    labels = table[:, 64].astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_test = round(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return (images[train], labels[train]), (images[test], labels[test])
