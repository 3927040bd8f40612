"""ZeRO's collectives in buckets (option ``bucket_bytes``): the gradients' all-reduce and the return of the updated
values, a bucket at a time.

Reduced all at once, the gradients of a step are packed into one buffer as large as all of them, and the reduced
copy is as large again; the updated values gathered back from their owners at once are a third. With ZeRO-1 these
transients, not the state, hold a replica's peak: halving Adam's slots over 2 workers saved nothing measurable.
DeepSpeed bounds them with ``reduce_bucket_size`` and ``allgather_bucket_size``, FSDP with ``limit_all_gathers``.
Here the tensors go in buckets of at most ``bucket_bytes`` each (a variable larger than the default bucket goes
alone), the last variables first (the backward pass makes their gradients first), and each bucket's collective
waits for the one before: one bucket is in flight beyond the tensors themselves.

Importing this module is cheap; TensorFlow is imported when a collective is built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "check_bucket_bytes",
    "plan_bucket_bytes",
    "all_gather_in_buckets",
    "all_reduce_in_buckets",
    "bucket_size",
    "buckets",
    "in_flight_bytes",
    "publish_in_buckets",
    "stage_bucket_bytes",
]

#: The bucket when ``bucket_bytes`` is not given (PyTorch DDP's ``bucket_cap_mb`` is 25 MB): widened to the largest
#: variable, which a gather moves whole.
DEFAULT_BUCKET_BYTES = 4 * 2**20


def check_bucket_bytes(bucket_bytes: Any, stage: int) -> None:
    """Refuse, before anything is built, a ``bucket_bytes`` that is not a positive whole number of bytes, or one given
    without a ZeRO stage (``stage`` 0), whose collectives it sizes."""
    if bucket_bytes is None:
        return
    bucket_size(bucket_bytes, 0, option="")
    if not stage:
        raise ValueError(
            f"bucket_bytes={bucket_bytes} sizes the collectives of shard_optimizer, shard_gradients and "
            "shard_parameters: set one of them True, or leave bucket_bytes out"
        )


def plan_bucket_bytes(variables: Sequence[Any], stage: int, bucket_bytes: Any) -> int:
    """The bucket a plan of ZeRO ``stage`` uses for a model's trainable ``variables`` (Keras variables), 0 without a
    stage: :func:`stage_bucket_bytes` of those that have a copy per replica (the ones returned whole)."""
    copied = [v.value for v in variables if hasattr(v.value, "values")]  # a strategy's copy per replica
    return stage_bucket_bytes(stage, [_nbytes(v) for v in copied], bucket_bytes)


def stage_bucket_bytes(stage: int, returned_bytes: Sequence[int], bucket_bytes: Any) -> int:
    """The bucket of ZeRO ``stage`` (0 without one): :func:`bucket_size` against the largest of ``returned_bytes``,
    the bytes of each variable returned whole from its owner."""
    if not stage:
        return 0
    from paraml.planning.plan import zero_option

    return bucket_size(bucket_bytes, max(returned_bytes, default=0), option=zero_option(stage))


def bucket_size(bucket_bytes: Any, largest_variable_bytes: int, *, option: str) -> int:
    """The bucket in bytes for ``bucket_bytes`` (None: :data:`DEFAULT_BUCKET_BYTES`, at least the largest variable).

    Raises:
        ValueError: for a ``bucket_bytes`` that is not a positive whole number of bytes, or one smaller than
            ``largest_variable_bytes`` (the return of the updated values moves each variable whole); ``option`` names
            the sharding that needs it.
    """
    if bucket_bytes is None:
        return max(DEFAULT_BUCKET_BYTES, largest_variable_bytes)
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive whole number of bytes, got {bucket_bytes!r}")
    if bucket_bytes < largest_variable_bytes:
        raise ValueError(
            f"bucket_bytes={bucket_bytes} is smaller than the largest variable ({largest_variable_bytes} bytes), "
            f"which {option}=True returns from its owner whole: use bucket_bytes >= {largest_variable_bytes} or "
            "leave it out"
        )
    return bucket_bytes


def in_flight_bytes(stage: int, replicas: int, bucket_bytes: int, owned_bytes: int, gradient_bytes: int) -> int:
    """What one replica of ZeRO ``stage`` (over ``replicas``) holds for the step's collectives beyond its state, its
    whole gradients and its activations (:func:`paraml.memory.estimate_memory` counts it as ``collectives``); a
    replica's bucket holds at most what it owns (``owned_bytes``, the most any owner has), a bucket of gradients at
    most all of them (``gradient_bytes``):

    - stage 1: its gradients are summed bucket by bucket in place of themselves; a round of the return of the updated
      values holds its own bucket and the replicas' buckets gathered: ``replicas + 1`` buckets;
    - stage 2: that round, and an all-to-all round of the gradients (a bucket sent, one received);
    - stage 3: the parameters are gathered where their unit runs (counted with the parameters) and, across workers,
      the gradients reach their owners reduced by that gather's backward pass: one bucket.

    Checked against each worker's allocator peak under ``paraml launch -n 2`` (tests/test_buckets.py; the guide's
    table has a second model).

    >>> [in_flight_bytes(stage, 2, 4, 100, 200) for stage in (1, 2, 3)], in_flight_bytes(1, 2, 4, 1, 2)
    ([12, 20, 4], 3)
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3 (shard_optimizer, shard_gradients, shard_parameters), got {stage!r}")
    gradients = min(bucket_bytes, gradient_bytes)  # a bucket of gradients
    returned = (replicas + 1) * min(bucket_bytes, owned_bytes)
    return {1: returned, 2: returned + 2 * gradients, 3: gradients}[stage]


def buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """The indices of ``sizes`` (bytes) in order, grouped into runs of at most ``bucket_bytes`` (one larger alone).

    >>> buckets([4, 4, 4, 10, 1], 8)
    [[0, 1], [2], [3], [4]]
    """
    grouped: list[list[int]] = []
    held = 0
    for i, size in enumerate(sizes):
        if grouped and held + size <= bucket_bytes:
            grouped[-1].append(i)
            held += size
        else:
            grouped.append([i])
            held = size
    return grouped


def _nbytes(tensor: Any) -> int:
    import tensorflow as tf

    return int(tf.TensorShape(tensor.shape).num_elements() or 0) * tensor.dtype.size


def all_reduce_in_buckets(context: Any, grads: Sequence[Any], bucket_bytes: int) -> list[Any]:
    """``grads`` (this replica's, in a replica context) summed over the replicas, bucket after bucket, the last first;
    each bucket's all-reduce starts when the one before has finished."""
    import tensorflow as tf

    order = list(reversed(range(len(grads))))
    reduced: list[Any] = [None] * len(grads)
    previous: list[Any] = []
    for bucket in buckets([_nbytes(grads[i]) for i in order], bucket_bytes):
        indices = [order[j] for j in bucket]
        with tf.control_dependencies(previous):
            inputs = [tf.identity(grads[i]) for i in indices]
        outputs = context.all_reduce(tf.distribute.ReduceOp.SUM, inputs)
        for i, value in zip(indices, outputs):
            reduced[i] = value
        previous = list(outputs)
    return reduced


def all_gather_in_buckets(
    strategy: Any,
    parts: Sequence[Sequence[tuple[int, tuple[int, ...]]]],
    read: Callable[[int, int], Any],
    dtype: Any,
    bucket_bytes: int,
    use: Callable[[int, Any], Any],
) -> None:
    """Every replica's tensors, whole on every replica, handed to ``use(key, value)`` (which returns the op that
    consumes it, as an assignment). ``parts[r]`` names (key, shape) of what replica ``r`` (global index) holds;
    ``read(r, key)`` reads one of this worker's.

    One all-gather per round: round k gathers the k-th bucket of each replica (its tensors, largest first, flattened,
    concatenated, padded to the round's longest) and waits for what ``use`` returned of the round before, so a round
    holds at most replicas x one bucket beyond the variables (one gather of everything would hold the whole state
    again). ``bucket_bytes=0``: one tensor per replica a round.
    """
    import tensorflow as tf

    def size(shape: tuple[int, ...]) -> int:
        return int(tf.TensorShape(shape).num_elements())

    itemsize = tf.as_dtype(dtype).size
    ordered = [sorted(part, key=lambda item: -size(item[1])) for part in parts]  # alike sizes meet: little padding
    grouped = [
        [[part[j] for j in bucket] for bucket in buckets([size(shape) * itemsize for _, shape in part], bucket_bytes)]
        for part in ordered
    ]
    previous: list[Any] = []
    for k in range(max((len(part) for part in grouped), default=0)):
        held = [part[k] if k < len(part) else [] for part in grouped]
        longest = max(sum(size(shape) for _, shape in bucket) for bucket in held)

        def padded(context: Any, held: Any = held, longest: int = longest, previous: Any = previous) -> Any:
            bucket = held[context.replica_id_in_sync_group]
            with tf.control_dependencies(previous):
                flats = [tf.reshape(read(context.replica_id_in_sync_group, key), [-1]) for key, _ in bucket]
            flat = tf.concat(flats, 0) if len(flats) > 1 else flats[0] if flats else tf.zeros([0], dtype)
            short = longest - sum(size(shape) for _, shape in bucket)
            return tf.pad(flat, [[0, short]]) if short else flat

        gathered = strategy.gather(strategy.experimental_distribute_values_from_function(padded), axis=0)
        done = []
        for r, bucket in enumerate(held):
            start = r * longest
            for key, shape in bucket:
                done.append(use(key, tf.reshape(gathered[start : start + size(shape)], shape)))
                start += size(shape)
        previous = [op for op in done if op is not None]


def publish_in_buckets(
    distribution: Any,
    devices: Sequence[str],
    first: int,
    replicas: int,
    num_workers: int,
    updated: list[Any],
    bucket_bytes: int,
) -> None:
    """Each of ``updated`` (a copied variable and the owner replica, global, whose copy holds its new value) made equal
    on every replica, a bucket at a time (:mod:`paraml.parallelism.buckets`): on one machine an assignment of the
    owner's copy to the others (a broadcast), across workers an all-gather of what each replica owns per dtype."""
    import tensorflow as tf

    def assign(var: Any, value: Any, skip: int | None = None, copy: bool = False) -> Any:
        done = []
        for r, c in enumerate(var.values):
            if r != skip:
                with tf.device(c.device):
                    # A variable assigned a tensor it alone holds keeps that buffer: a slice of a gathered bucket would
                    # keep the whole bucket alive (measured: 31 MiB more per worker at 2 workers, 6x1024 MLP).
                    done.append(c.assign(tf.raw_ops.DeepCopy(x=value) if copy else value))
        return tf.group(done)

    if num_workers == 1:
        previous: list[Any] = []
        for bucket in buckets([_nbytes(var) for var, _ in updated], bucket_bytes):
            done = []
            for var, owner in (updated[i] for i in bucket):
                with tf.device(devices[owner]), tf.control_dependencies(previous):
                    value = tf.identity(var.values[owner])
                done.append(assign(var, value, skip=owner))
            previous = done
        return
    for dtype in sorted({var.dtype for var, _ in updated}, key=str):
        parts = [
            [(i, tuple(var.shape)) for i, (var, o) in enumerate(updated) if o == r and var.dtype == dtype]
            for r in range(replicas)
        ]
        all_gather_in_buckets(
            distribution,
            parts,
            lambda r, i: updated[i][0].values[r - first],
            dtype,
            bucket_bytes,
            lambda i, value: assign(updated[i][0], value, copy=True),
        )
