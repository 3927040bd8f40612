"""The split layers' computation (:class:`SplitLayers`): each split layer's ``call`` computes on its parts, each
part on its device, and its output's slices are joined where a consumer needs the whole tensor.

A rows-split layer and the cross-entropy take a joined tensor's slices without the join (:func:`slices_of`); a
join nothing reads is never computed.

Under mixed precision (``mixed_bfloat16``, ``mixed_float16``) the one reduction of a rows-split layer or of a
heads-split attention's output projection is made in float32, as Megatron-LM reduces: each partial product is computed
in float32 from the layer's 16-bit operands (exact in float32, as one device's 16-bit matmul multiplies and
accumulates them), the partials are added in float32 and the sum is rounded once to the layer's compute dtype; the bias
and the activation then follow in that dtype, as in Keras' ``Dense``/``EinsumDense``. The result is one device's up to
the order of the additions; partials rounded to 16 bits before the sum would each add their own round-off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from paraml.parallelism.experts import bank_of_parts
from paraml.parallelism.tensor_parallel.splits import TensorPlan, _attention_projections, _leaf_layers
from paraml.parallelism.tensor_parallel.weights import SplitWeights

__all__ = ["GRAPH_SLICES", "SplitLayers", "slices_of"]


def _product(layer: Any, x: Any, kernel: Any) -> Any:
    """``x`` times ``kernel`` (a part of ``layer``'s) as ``layer`` computes it."""
    import keras

    if hasattr(layer, "equation"):
        return keras.ops.einsum(layer.equation, x, kernel)
    return keras.ops.matmul(x, kernel)


#: Float dtypes whose partial products are computed and added in float32 (:func:`_partial`).
_HALF = ("bfloat16", "float16")


def _partial(layer: Any, x: Any, kernel: Any) -> tuple[Any, str]:
    """One partial product of a split reduction, ``x`` times ``kernel`` (a part of ``layer``'s), and the dtype the
    unsplit layer's product has (Keras' matmul of the same operands). In a 16-bit float dtype the product is computed
    in float32 from the operands (the cast is exact), so the partials add up unrounded (:func:`_summed`)."""
    import keras

    dtype = keras.backend.result_type(x.dtype, kernel.dtype)
    if dtype in _HALF:
        x, kernel = keras.ops.cast(x, "float32"), keras.ops.cast(kernel, "float32")
    return _product(layer, x, kernel), dtype


def _summed(partials: list[Any], dtype: str) -> Any:
    """The one reduction of a split layer: the partial products (:func:`_partial`, float32 under mixed precision)
    added, the sum rounded once to ``dtype``, the unsplit layer's product dtype."""
    import keras
    import tensorflow as tf

    return keras.ops.cast(tf.add_n(partials), dtype)


class SplitLayers:
    """Makes the split layers of a built model compute on their parts: each split layer's ``call`` (the instance
    attribute, the public method) replaced by its split computation.

    ``weights`` are the model's split variables and their parts; ``devices(layer)`` gives the devices of the layer's
    parts for the replica being traced, in part order.
    """

    def __init__(self, plan: TensorPlan, weights: SplitWeights, devices: Callable[[Any], Sequence[str]]) -> None:
        self.plan = plan
        self.weights = weights
        self.devices = devices
        self._shard: int | None = None  # the part being traced inside a heads-split attention layer

    def attach(self, model: Any) -> None:
        """Wrap the split layers' calls of ``model`` (the model :attr:`weights` was made for)."""
        import keras

        for layer in _leaf_layers(model):
            kind = self.plan.kinds.get(id(layer))
            if kind == "heads":
                self._heads(layer)
            elif kind == "columns":
                self._columns(layer)
            elif kind == "rows":
                self._rows(layer)
            elif kind == "vocab":
                self._vocab(layer, isinstance(layer, keras.layers.Embedding) and hasattr(layer, "tie_weights"))
            elif kind == "experts":
                self._experts(layer)

    def _split(self, x: Any, sizes: list[int], axis: int) -> list[Any]:
        import tensorflow as tf

        pieces = slices_of(x, axis)
        if pieces is not None and [int(p.shape[axis]) for p in pieces] == sizes:
            return pieces
        return tf.split(x, sizes, axis=axis)

    def _columns(self, layer: Any) -> None:
        import keras

        kernel, bias = self.weights.parts(layer.kernel), self.weights.parts(layer.bias)

        def call(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            del args, kwargs
            import tensorflow as tf

            pieces = []
            for k, device in enumerate(self.devices(layer)):
                with tf.device(device):
                    y = _product(layer, inputs, kernel[k].value)
                    if bias is not None:
                        y = keras.ops.add(y, bias[k].value)
                    pieces.append(layer.activation(y) if layer.activation is not None else y)
            return _joined(pieces, axis=-1)

        layer.call = call

    def _rows(self, layer: Any) -> None:
        import keras

        kernel = self.weights.parts(layer.kernel)
        sizes = [int(p.shape[0]) for p in kernel]

        def call(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            del args, kwargs
            import tensorflow as tf

            pieces = self._split(inputs, sizes, axis=-1)
            partial = []
            for k, device in enumerate(self.devices(layer)):
                with tf.device(device):
                    product, dtype = _partial(layer, pieces[k], kernel[k].value)
                    partial.append(product)
            y = _summed(partial, dtype)  # the one reduction
            if layer.bias is not None:
                y = keras.ops.add(y, layer.bias.value)
            return layer.activation(y) if layer.activation is not None else y

        layer.call = call

    def _heads(self, layer: Any) -> None:
        import keras

        projections = _attention_projections(layer, self.plan.tensor)
        assert projections is not None
        original = layer.call
        out = projections[-1][0]
        product: dict[str, str] = {}  # the output projection's product dtype, as its traced part saw it

        def call(*args: Any, **kwargs: Any) -> Any:
            import tensorflow as tf

            if kwargs.get("cache") is not None:  # generation with a whole key/value cache: the projections join
                return original(*args, **kwargs)
            results = []
            for k, device in enumerate(self.devices(layer)):
                previous, self._shard = self._shard, k
                try:
                    with tf.device(device):
                        results.append(original(*args, **kwargs))
                finally:
                    self._shard = previous
            first = [r[0] if isinstance(r, tuple) else r for r in results]
            y = _summed(first, product["dtype"])  # the one reduction
            if out.bias is not None:
                y = keras.ops.add(y, out.bias.value)
            if out.activation is not None:
                y = out.activation(y)
            if not isinstance(results[0], tuple):
                return y
            # return_attention_scores: (batch, heads, ...) scores, joined by heads
            return (y, *(tf.concat([r[i] for r in results], axis=1) for i in range(1, len(results[0]))))

        layer.call = call
        for dense, _, side in projections:
            self._projection(layer, dense, side, product)

    def _projection(self, attention: Any, dense: Any, side: str, product: dict[str, str]) -> None:
        """An attention layer's projection: in the traced part ``k`` (:meth:`_heads`), its heads' slice (the output
        projection's partial product, its dtype put in ``product``); outside one (a cached generation step), the whole
        computation from the parts."""
        import keras
        import tensorflow as tf

        kernel, bias = self.weights.parts(dense.kernel), self.weights.parts(dense.bias) if side == "in" else None
        inputs_spec, rest = dense.equation.split(",")
        kernel_spec, output_spec = rest.split("->")
        heads = kernel_spec[1] if side == "in" else kernel_spec[0]
        heads_axis = output_spec.index(heads) if side == "in" else inputs_spec.index(heads)
        sizes = [int(p.shape[1 if side == "in" else 0]) for p in kernel]

        def one(inputs: Any, k: int) -> Any:
            if side == "out":  # a partial product, added in :meth:`_heads` or below
                y, product["dtype"] = _partial(dense, inputs, kernel[k].value)
                return y
            y = keras.ops.einsum(dense.equation, inputs, kernel[k].value)
            if bias is not None:
                y = keras.ops.add(y, bias[k].value)
            if dense.activation is not None:
                y = dense.activation(y)
            return y

        def call(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            del args, kwargs
            if self._shard is not None:
                return one(inputs, self._shard)
            devices = self.devices(attention)
            if side == "in":
                pieces = []
                for k, device in enumerate(devices):
                    with tf.device(device):
                        pieces.append(one(inputs, k))
                return _joined(pieces, axis=heads_axis)
            pieces = self._split(inputs, sizes, axis=heads_axis)
            partial = []
            for k, device in enumerate(devices):
                with tf.device(device):
                    partial.append(one(pieces[k], k))
            y = _summed(partial, product["dtype"])  # the one reduction
            if dense.bias is not None:
                y = keras.ops.add(y, dense.bias.value)
            return dense.activation(y) if dense.activation is not None else y

        dense.call = call

    def _experts(self, bank: Any) -> None:
        """An expert bank (:mod:`paraml.parallelism.experts`): each device computes its experts, on every token,
        with a bank of the same class over its parts; the outputs are joined on the experts axis."""
        parts = [self.weights.parts(v) for v in bank.weights]
        banks = [
            bank_of_parts(bank, [kernel[k].value for kernel in parts], f"{bank.name}_part{k}")
            for k in range(len(parts[0]))
        ]

        def call(*args: Any, **kwargs: Any) -> Any:
            import tensorflow as tf

            pieces = []
            for k, device in enumerate(self.devices(bank)):
                with tf.device(device):
                    pieces.append(banks[k](*args, **kwargs))
            return _joined(pieces, axis=0)

        bank.call = call

    def _vocab(self, layer: Any, reversible: bool) -> None:
        import keras
        import tensorflow as tf

        table = self.weights.parts(layer.embeddings)
        sizes = [int(p.shape[0]) for p in table]
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        reverse_parts = self.weights.parts(getattr(layer, "reverse_embeddings", None)) if reversible else None

        def lookup(inputs: Any) -> Any:
            ids = inputs if inputs.dtype in ("int32", "int64") else keras.ops.cast(inputs, "int32")
            pieces = []
            for k, device in enumerate(self.devices(layer)):
                with tf.device(device):
                    local = ids - tf.cast(starts[k], ids.dtype)
                    inside = tf.logical_and(local >= 0, local < sizes[k])
                    rows = tf.gather(table[k].value, tf.where(inside, local, tf.zeros_like(local)))
                    pieces.append(rows * tf.cast(inside, rows.dtype)[..., None])
            # the one reduction, exact in any dtype (one piece is non-zero at each position), then cast as Keras does
            return keras.ops.cast(tf.add_n(pieces), layer.compute_dtype)

        def logits(inputs: Any) -> Any:
            pieces = []
            for k, device in enumerate(self.devices(layer)):
                with tf.device(device):
                    kernel = keras.ops.transpose(table[k].value) if layer.tie_weights else reverse_parts[k].value
                    x = inputs
                    if layer.reverse_dtype is not None:
                        x, kernel = keras.ops.cast(x, layer.reverse_dtype), keras.ops.cast(kernel, layer.reverse_dtype)
                    y = keras.ops.matmul(x, kernel)
                    if layer.logit_soft_cap is not None:
                        y = keras.ops.multiply(keras.ops.tanh(y / layer.logit_soft_cap), layer.logit_soft_cap)
                    pieces.append(y)
            return _joined(pieces, axis=-1)

        def call(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            reverse = kwargs.get("reverse", args[0] if args else False)
            return logits(inputs) if reversible and reverse else lookup(inputs)

        layer.call = call


#: The attribute of a traced graph holding its joined tensors' slices: ``id(joined) -> (joined, slices, axis)``. A
#: split layer's output is joined for the consumers that need it whole; a rows-split layer or the cross-entropy takes
#: the slices without the join (TensorFlow then never computes the join: nothing reads it). The entries live with the
#: graph they were traced in and go with it; an eager call keeps none (its slices are freed with the call).
GRAPH_SLICES = "paraml_split_slices"


def _joined(pieces: list[Any], axis: int) -> Any:
    """A split layer's slices of its output joined along ``axis``; in a traced graph, the slices kept for
    :func:`slices_of`."""
    import tensorflow as tf

    whole = tf.concat(pieces, axis=axis)
    if not tf.executing_eagerly():
        graph = whole.graph  # a graph has slots, no __dict__: the attribute is set, not found in vars()
        if getattr(graph, GRAPH_SLICES, None) is None:
            setattr(graph, GRAPH_SLICES, {})
        getattr(graph, GRAPH_SLICES)[id(whole)] = (whole, pieces, axis)
    return whole


def slices_of(x: Any, axis: int = -1) -> list[Any] | None:
    """The slices a split layer joined along ``axis`` into ``x`` (or into the tensor ``x`` is a cast of: a loss casts
    its input), each on its device; None for any other tensor, and for any eager one."""
    import tensorflow as tf

    if tf.executing_eagerly():
        return None
    graph = getattr(x, "graph", None)
    entry = (getattr(graph, GRAPH_SLICES, None) or {}).get(id(x))
    rank = getattr(getattr(x, "shape", None), "rank", None)
    if entry is not None and entry[0] is x and rank and entry[2] % rank == axis % rank:
        return entry[1]
    op = getattr(x, "op", None)
    if op is not None and op.type == "Cast" and not tf.executing_eagerly():
        inner = slices_of(op.inputs[0], axis)
        if inner is not None:
            cast = []
            for piece in inner:
                with tf.device(piece.device):
                    cast.append(tf.cast(piece, x.dtype))
            return cast
    return None
