"""Tensor parallelism: one layer's weights split over ``tensor_parallel=T`` devices (Megatron-LM's splits).

``model_parallel`` places whole layers on stages; here the large layers of each stage are split over the stage's T
devices, each device holding and computing its slice:

- **columns** (a ``Dense``, or an ``EinsumDense`` computing as one, whose output feeds another, or one that feeds
  nothing splittable): the kernel's output columns and the bias are split; each device computes its slice of the
  output (activation included).
- **rows** (the ``Dense`` a columns-split one feeds): the kernel's input rows are split; each device multiplies the
  slice of the input its partner computed, and the partial products are added once (one reduction), then the bias
  and the activation. A column-then-row pair (a transformer's feed-forward block) exchanges nothing in between.
- **heads** (``keras.layers.MultiHeadAttention`` and subclasses, as keras_hub's GPT-2 and BERT attention, and the
  classes of :data:`ATTENTION_CLASSES`, as Llama's grouped-query attention): query, key, value (and gate)
  projections split by heads, the output projection by heads' rows; each device runs the attention of its
  heads, and the partial outputs are added once, then the output bias.
- **vocab** (``Embedding``, keras_hub's ``ReversibleEmbedding``): the table's rows split; each device looks up the
  ids in its range (zeros elsewhere) and the lookups are added once. A reversible embedding's reverse call (the tied
  LM head) gives each device its slice of the logits.

Layers with weights that fit none of these (normalisations, convolutions, position embeddings) stay whole on the
stage's first device. A split layer's slices of the output are joined (concatenated) where a consumer needs the
whole tensor; a rows-split layer takes its partner's slices without joining them, and so does the cross-entropy of
split logits (:func:`sparse_categorical_crossentropy`, put into Keras' ``SparseCategoricalCrossentropy`` by
:func:`split_logits_loss`): :func:`slices_of` finds the slices of a joined tensor, and a join nothing reads is never
computed.

**The model's public face stays whole.** A split variable is a Keras variable whose value is a
:class:`WholeVariable`: a view over the parts (plain TensorFlow variables on their devices) that reads as their
concatenation, assigns by splitting, saves as one whole tensor in TensorFlow checkpoints and converts to numpy whole.
So ``get_weights``, ``set_weights``, ``predict``, ``model.save``/``load_model`` and paraml's checkpoints see whole
tensors, and a checkpoint moves between any backend and any T. The training step differentiates with respect to the
parts (:meth:`SplitWeights.trained_variables`, read through ``backend.techniques``), and the optimizer keeps each
part's slots on the part's device; a checkpoint joins them (:meth:`SplitWeights.saved_state`). Which variables are
split is kept by the applied plan (:class:`SplitWeights`), never as attributes on Keras' objects.

One concern per file, as Megatron-core's ``tensor_parallel``:

- ``splits``: which layers split how (:func:`plan_splits`, :class:`TensorPlan`);
- ``weights``: a split weight's whole face and its parts (:class:`WholeVariable`, :class:`SplitWeights`);
- ``layers``: the split layers' computation (:class:`SplitLayers`, :func:`slices_of`);
- ``cross_entropy``: the loss on split logits (:func:`sparse_categorical_crossentropy`, :func:`split_logits_loss`).

Importing this package is cheap: Keras and TensorFlow are imported inside the functions that need them.
"""

from paraml.parallelism.tensor_parallel.cross_entropy import sparse_categorical_crossentropy, split_logits_loss
from paraml.parallelism.tensor_parallel.layers import SplitLayers, slices_of
from paraml.parallelism.tensor_parallel.splits import ATTENTION_CLASSES, KINDS, LayerSplit, TensorPlan, plan_splits
from paraml.parallelism.tensor_parallel.weights import SplitWeights, WholeVariable
from paraml.planning.footprint import part_sizes

__all__ = [
    "ATTENTION_CLASSES",
    "KINDS",
    "LayerSplit",
    "SplitLayers",
    "SplitWeights",
    "TensorPlan",
    "WholeVariable",
    "part_sizes",
    "plan_splits",
    "slices_of",
    "sparse_categorical_crossentropy",
    "split_logits_loss",
]
