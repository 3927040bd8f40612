"""``model_parallel`` with ``expert_parallel=E``: keras_hub's mixture-of-experts models (Mixtral, Qwen3-MoE) with each
layer's experts split over E devices, trained as plain Keras trains them."""

import functools

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from conftest import logits_loss, small_mlp
from keras_hub.src.models.mixtral.mixtral_decoder import MixtralMoeExperts
from keras_hub.src.models.qwen3_moe.qwen3_moe_decoder import Qwen3MoeExperts
from keras_hub.src.models.qwen_moe.qwen_moe_decoder import QwenMoeExperts

from paraml import Parallel, estimate_memory
from paraml.memory import variable_bytes_by_device
from paraml.parallelism.experts import EXPERT_BANKS, bank_of_parts, is_expert_bank

VOCABULARY, SEQUENCE, EXPERTS = 100, 8, 4


#: What the two tiny configs share: 2 blocks of hidden 32, grouped-query attention, 4 experts, top-2 routing.
TINY = dict(
    vocabulary_size=VOCABULARY,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=64,
    num_experts=EXPERTS,
    top_k=2,
)


def mixtral():
    backbone = keras_hub.models.MixtralBackbone(**TINY, sliding_window=SEQUENCE, router_aux_loss_coef=0.02)
    return keras_hub.models.MixtralCausalLM(backbone=backbone, preprocessor=None)


def qwen3_moe():
    backbone = keras_hub.models.Qwen3MoeBackbone(
        **TINY,
        moe_intermediate_dim=16,
        head_dim=8,
        norm_top_k_prob=True,
        router_aux_loss_coefficient=0.01,
        sliding_window_size=SEQUENCE,
    )
    return keras_hub.models.Qwen3MoeCausalLM(backbone=backbone, preprocessor=None)


MODELS = {"mixtral": mixtral, "qwen3_moe": qwen3_moe}


def token_data(rows=40):
    """Token ids with padding at the end of some rows (the auxiliary loss is a mean over the real tokens only), each
    labelled with the next id; 40 rows in batches of 16: a short last batch."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCABULARY, (rows, SEQUENCE)).astype("int32")
    mask = np.ones_like(ids)
    mask[::3, -3:] = 0
    return {"token_ids": ids, "padding_mask": mask}, np.roll(ids, -1, axis=1)


def initial_weights(name):
    keras.utils.set_random_seed(0)
    return MODELS[name]().get_weights()


def auxiliary_loss(model, x):
    """The auxiliary load-balancing losses the model adds in a training call on ``x`` (one per MoE layer)."""
    model(x, training=True)
    return [float(loss) for loss in model.losses]


@functools.cache
def keras_fit(name, replicas=1):
    """Plain Keras ``fit`` (under ``MirroredStrategy(replicas)`` for replicas > 1) from :func:`initial_weights`:
    Adam, 2 epochs. Returns the losses, the weights and the auxiliary losses after training."""
    x, y = token_data()
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"][:replicas]) if replicas > 1 else None
    with strategy.scope() if strategy else tf.device("CPU:0"):
        model = MODELS[name]()
        model.set_weights(initial_weights(name))
        model.compile(optimizer=keras.optimizers.Adam(0.001), loss=logits_loss())
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return history.history["loss"], model.get_weights(), auxiliary_loss(model, {k: v[:16] for k, v in x.items()})


def expert_parallel(name, **options):
    par = Parallel("model_parallel", seed=0, **options)
    par.build(MODELS[name], optimizer=keras.optimizers.Adam(0.001), loss=logits_loss())
    par.model.set_weights(initial_weights(name))
    return par


def assert_trains_as(par, name, replicas=1):
    x, y = token_data()
    history = par.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    losses, weights, aux = keras_fit(name, replicas)
    np.testing.assert_allclose(history.history["loss"], losses, rtol=1e-4)
    for a, b in zip(par.model.get_weights(), weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    got = auxiliary_loss(par.model, {k: v[:16] for k, v in x.items()})
    assert len(got) == 2 and min(got) > 0
    np.testing.assert_allclose(got, aux, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.slow
def test_experts_over_two_devices_train_as_keras_fit(name):
    par = expert_parallel(name, devices=2, expert_parallel=2)
    assert_trains_as(par, name)
    layout = par.backend.topology.layout
    assert (layout.data, layout.stages, layout.tensor, layout.experts) == (1, 1, 1, 2)
    assert str(layout) == "1 data replica x 1 stage x 2 expert shards"
    text = par.describe()
    assert "expert_parallel=2: 2 layer(s) split" in text and "by experts" in text


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.slow
def test_copies_of_expert_parallel_layers_train_as_keras_fit_under_the_same_strategy(name):
    # Each replica adds the auxiliary loss of its own tokens, as under Keras' MirroredStrategy: the loss is a product
    # of two means over the tokens, so two halves' mean is not the whole batch's (the per-replica effect of BatchNorm).
    par = expert_parallel(name, devices=4, expert_parallel=2, data_parallel=2)
    assert par.num_replicas == 2
    assert_trains_as(par, name, replicas=2)


@pytest.mark.slow
def test_experts_sharing_the_tensor_parallel_devices_train_as_keras_fit():
    # Megatron-core's folding: the experts split over the same 2 devices as the layers tensor_parallel splits
    par = expert_parallel("mixtral", devices=2, expert_parallel=2, tensor_parallel=2)
    kinds = {s.kind for s in par.plan.splits.splits}
    assert {"experts", "columns", "vocab"} <= kinds
    assert "tensor_parallel=2, expert_parallel=2" in par.describe()
    assert str(par.backend.topology.layout) == "1 data replica x 1 stage x 2 tensor shards (which share the experts)"
    assert_trains_as(par, "mixtral")


@pytest.mark.slow
def test_two_stages_each_splitting_its_experts_train_as_keras_fit():
    par = expert_parallel("qwen3_moe", devices=4, expert_parallel=2)
    layout = par.backend.topology.layout
    assert (layout.stages, layout.experts) == (2, 2)
    groups = {  # the devices each bank's parts live on: its stage's two
        tuple(p.device.split("device:")[-1] for p in bank.weights[0].value.parts)
        for bank in par.model._flatten_layers()
        if "experts" in bank.name and hasattr(bank, "num_experts") and bank.weights
    }
    assert groups == {("CPU:0", "CPU:1"), ("CPU:2", "CPU:3")}
    assert_trains_as(par, "qwen3_moe")


def test_each_device_holds_its_share_of_the_experts_and_their_optimizer_state():
    par = expert_parallel("mixtral", devices=2, expert_parallel=2)
    x, y = token_data()
    par.fit(x, y, batch_size=16, epochs=1, verbose=0)
    banks = [layer for layer in par.model._flatten_layers() if is_expert_bank(layer)]
    assert len(banks) == 2
    expert_bytes = sum(np.asarray(v).nbytes for bank in banks for v in bank.weights)
    on_device = {}  # where each part of each expert kernel lives, and its bytes
    for bank in banks:
        for v in bank.weights:
            for part in v.value.parts:
                assert part.shape[0] == EXPERTS // 2
                device = part.device.split("device:")[-1]
                on_device[device] = on_device.get(device, 0) + part.numpy().nbytes
    assert on_device == {"CPU:0": expert_bytes // 2, "CPU:1": expert_bytes // 2}
    held = par.memory_by_device()
    assert {d: b["parameters"] for d, b in held.items()} == variable_bytes_by_device(par.model.weights)
    second = held["/device:CPU:1"]
    assert second["parameters"] == expert_bytes // 2  # the second device holds only experts
    assert second["optimizer"] == 2 * expert_bytes // 2  # and Adam's two slots for each, beside them
    whole = estimate_memory(mixtral, batch_size=16, optimizer="adam")
    estimate = estimate_memory(mixtral, batch_size=16, optimizer="adam", expert_parallel=2)
    assert estimate.parameters == held["/device:CPU:0"]["parameters"] == whole.parameters - expert_bytes // 2
    assert "expert-parallel" in estimate.note


def test_each_bank_class_computes_its_experts_from_its_parts():
    # bank_of_parts builds a bank of the same class over parts of the kernels (the constructor and build that
    # EXPERT_BANKS names): its outputs are those of its experts in the whole bank
    assert len(EXPERT_BANKS) == 3
    x = tf.random.stateless_normal((5, 8), seed=(1, 2))
    for kind in (MixtralMoeExperts, QwenMoeExperts, Qwen3MoeExperts):
        bank = kind(num_experts=EXPERTS, hidden_dim=8, intermediate_dim=12)
        bank.build((5, 8))
        assert is_expert_bank(bank)
        whole = bank(x)
        assert whole.shape[0] == EXPERTS
        halves = [[tf.Variable(v.numpy()[k * 2 : k * 2 + 2]) for v in bank.weights] for k in range(2)]
        parts = [bank_of_parts(bank, variables, f"part{k}") for k, variables in enumerate(halves)]
        assert [[v.value for v in part.weights] for part in parts] == halves  # the parts themselves, no copies
        np.testing.assert_allclose(tf.concat([part(x) for part in parts], 0), whole, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_a_checkpoint_written_under_expert_parallel_continues_under_single(tmp_path):
    x, y = token_data()
    par = expert_parallel("mixtral", devices=2, expert_parallel=2)
    par.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    par.save(tmp_path / "checkpoints")
    single = Parallel("single", seed=5)
    single.build(mixtral, optimizer=keras.optimizers.Adam(0.001), loss=logits_loss())
    assert single.restore(tmp_path / "checkpoints").epoch == 1
    resumed = single.fit(x, y, batch_size=16, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
    losses, weights, _ = keras_fit("mixtral")  # two epochs without a stop
    np.testing.assert_allclose(resumed.history["loss"], losses[1:], rtol=1e-4)
    for a, b in zip(single.model.get_weights(), weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "model_fn, options, message",
    [
        (mixtral, {"devices": 3, "expert_parallel": 3}, r"expert_parallel=3 does not divide the 4 experts .* \[2, 4\]"),
        (small_mlp, {"devices": 2, "expert_parallel": 2}, r"expert_parallel=2, but model .* no mixture-of-experts"),
        (
            mixtral,
            {"devices": 2, "expert_parallel": 2, "device_memory": "10KB"},
            r"needs .* its experts split over them \(expert_parallel=2\).* use a larger expert_parallel",
        ),
    ],
    ids=["experts not divided", "no experts", "too large"],
)
def test_bad_expert_parallel_fails_at_build_naming_the_value(model_fn, options, message):
    with pytest.raises(ValueError, match=message):
        Parallel("model_parallel", **options).build(model_fn, optimizer="adam", loss=logits_loss())


@pytest.mark.parametrize(
    "strategy, options, message",
    [
        ("model_parallel", {"devices": 4, "tensor_parallel": 2, "expert_parallel": 4}, r"must be equal"),
        ("model_parallel", {"devices": 2, "expert_parallel": 0}, r"expert_parallel"),
        ("model_parallel", {"devices": 3, "expert_parallel": 2}, r"devices=3 is not .* expert_parallel=2"),
        ("mirrored", {"expert_parallel": 2}, r"expert_parallel.*only 'model_parallel'"),
    ],
)
def test_bad_expert_parallel_settings_fail_at_construction(strategy, options, message):
    with pytest.raises(ValueError, match=message):
        Parallel(strategy, **options)
